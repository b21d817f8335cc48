# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The flags several commands take, and the topology they name.

``add_topology_args``: the topology and layout flags of ``plan``, ``replay``,
``simulate`` and ``ranks``, ``vllm serve``'s ``--additional-config`` among
them; ``load_topology``: the topology those flags name (and
``--emit-topology`` writes). ``add_run_args``: the flags of the commands that
run vLLM (``replay``, ``simulate``). ``int_flag``, ``output_file`` and
``json_object_flag`` are the argparse types they use (a command's own flags
use them too).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    Topology,
    apply_additional_config,
    load_profile,
    load_topology_file,
    write_topology_file,
)
from vllm_dcp_geometry.tooling.topology.limits import (
    MODEL_LEN_RANGE,
    POSITIVE_INT32,
    REPLAY_POOL_PAGES_RANGE,
    REPLAY_TOKENS_RANGE,
    IntRange,
    TopologyError,
    show,
)
from vllm_dcp_geometry.tooling.topology.writing import check_topology_path

UNPATCHED_FLAG = "--unpatched-baseline"
"""The hidden flag of the fresh process that runs another run's baseline."""


def int_flag(allowed: IntRange) -> Callable[[str], int]:
    """An argparse type: an integer (``1,000`` and ``1_000`` read as 1000) in
    ``allowed``."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace(",", "").replace("_", ""))
        except ValueError:
            value = None
        if value is None or not allowed.low <= value <= allowed.high:
            raise argparse.ArgumentTypeError(
                f"must be {allowed.describe()}, got {show(text)}"
            )
        return value

    return parse


def output_file(text: str) -> str:
    """An argparse type: a file the command can create or replace."""
    if not text:
        raise argparse.ArgumentTypeError("needs a file name, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{show(text)} is a directory")
    parent = os.path.dirname(text) or "."
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(
            f"the directory {show(parent)} of {show(text)} does not exist"
        )
    return text


def json_object_flag(
    flag: str, *, optional: bool = False
) -> Callable[[str], dict[str, Any] | None]:
    """An argparse type: a JSON object, read with ``json.loads`` as ``vllm
    serve`` reads ``flag`` (``optional``: ``''`` and ``'None'`` are no value,
    as for ``--speculative-config``)."""

    def parse(text: str) -> dict[str, Any] | None:
        if optional and text in ("", "None"):
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise argparse.ArgumentTypeError(
                f"not valid JSON ({exc}): {show(text)}; it takes a JSON object, "
                f"as vllm serve reads {flag}"
            ) from exc
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(
                f"takes a JSON object, as vllm serve reads {flag}, got {show(value)}"
            )
        return value

    return parse


def topology_file(text: str) -> str:
    """An argparse type: a ``.toml`` or ``.json`` file to write."""
    try:
        return check_topology_path(output_file(text))
    except TopologyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    """``--profile``/``--topology``, the layout overrides, ``vllm serve``'s
    ``--additional-config`` and ``--emit-topology``."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--profile",
        "-p",
        help=f"built-in profile (default {DEFAULT_PROFILE}; see 'profiles')",
    )
    source.add_argument(
        "--topology", "-t", metavar="FILE", help="topology file (.toml or .json)"
    )
    source.add_argument(
        "--model",
        metavar="DIR",
        help="the operator's model directory (its config.json): the groups "
        "vLLM's model code builds for it, with any other vllm serve flags "
        "(also as '-- vllm serve DIR ...')",
    )
    layout = parser.add_argument_group("layout overrides")
    positive = int_flag(POSITIVE_INT32)
    layout.add_argument("--dcp", type=positive, help="DCP world size D")
    layout.add_argument("--tp", type=positive, help="tensor-parallel size")
    layout.add_argument("--max-model-len", type=int_flag(MODEL_LEN_RANGE))
    layout.add_argument("--max-num-seqs", type=positive)
    layout.add_argument(
        "--interleave", type=positive, help="cp_kv_cache_interleave_size I"
    )
    layout.add_argument(
        "--additional-config",
        metavar="JSON",
        type=json_object_flag("--additional-config"),
        help="vllm serve's flag: its 'dcp_geometry' section (per-layer K, "
        "partial_collectives) applied to the topology as start-up applies it",
    )
    parser.add_argument(
        "--emit-topology",
        metavar="FILE",
        type=topology_file,
        help="write the topology (after the flags above) as a .toml or .json "
        "topology file",
    )


def load_topology(args: argparse.Namespace) -> Topology:
    """The topology the parsed ``add_topology_args`` flags name: the file or
    profile, its layout overridden, then ``--additional-config``'s
    ``dcp_geometry`` section applied (for the final D, as at start-up);
    written to ``--emit-topology``'s file when given."""
    serve_flags = model_serve_flags(args)
    if serve_flags is not None:
        from vllm_dcp_geometry.tooling.serve.deployment import model_topology

        topology = model_topology(serve_flags)
        emit = getattr(args, "emit_topology", None)
        if emit:
            write_topology_file(topology, emit)
        return topology
    if getattr(args, "serve_flags", None):
        raise TopologyError(
            f"unrecognized arguments: {' '.join(args.serve_flags)} (vllm serve "
            "flags need --model DIR or '-- vllm serve DIR ...')"
        )
    if args.topology:
        topology = load_topology_file(args.topology)
    else:
        topology = load_profile(args.profile or DEFAULT_PROFILE)
    topology = topology.with_layout(
        dcp=args.dcp,
        tp=args.tp,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        interleave=args.interleave,
    )
    additional_config = getattr(args, "additional_config", None)
    if additional_config:
        topology = apply_additional_config(topology, additional_config)
    emit = getattr(args, "emit_topology", None)
    if emit:
        write_topology_file(topology, emit)
    return topology


SERVE_ALIASES = (
    ("tp", "--tensor-parallel-size"),
    ("dcp", "--decode-context-parallel-size"),
    ("interleave", "--cp-kv-cache-interleave-size"),
    ("max_model_len", "--max-model-len"),
    ("max_num_seqs", "--max-num-seqs"),
    ("attention_backend", "--attention-backend"),
)
"""This tool's layout flags and the ``vllm serve`` flags they stand for."""

JSON_SERVE_FLAGS = (
    ("additional_config", "--additional-config"),
    ("speculative_config", "--speculative-config"),
)


def model_serve_flags(args: argparse.Namespace) -> list[str] | None:
    """The ``vllm serve`` flags of a ``--model`` (or ``-- vllm serve ...``)
    run: the model, this tool's layout flags as vLLM's, then the serve flags
    given as they were; None for a topology or profile run."""
    model = getattr(args, "model", None)
    extra = list(getattr(args, "serve_flags", None) or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    from vllm_dcp_geometry.tooling.serve.serve_line import strip_serve_prefix

    pasted = extra != strip_serve_prefix(extra)
    if model is None and not pasted:
        return None
    flags = ["--model", model] if model is not None else []
    for attribute, flag in SERVE_ALIASES:
        value = getattr(args, attribute, None)
        if value is not None:
            flags += [flag, str(value)]
    for attribute, flag in JSON_SERVE_FLAGS:
        value = getattr(args, attribute, None)
        if value is not None:
            flags += [flag, json.dumps(value)]
    return [*flags, *strip_serve_prefix(extra)]


def add_run_args(
    parser: argparse.ArgumentParser,
    *,
    tokens: str,
    step_tokens: str,
    num_pages: str,
    baseline: str,
) -> None:
    """The flags of the commands that run vLLM (``replay``, ``simulate``)."""
    parser.add_argument("--tokens", type=int_flag(REPLAY_TOKENS_RANGE), help=tokens)
    parser.add_argument(
        "--step-tokens", type=int_flag(POSITIVE_INT32), help=step_tokens
    )
    parser.add_argument(
        "--num-pages", type=int_flag(REPLAY_POOL_PAGES_RANGE), help=num_pages
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--receipt", metavar="FILE", type=output_file, help="write a JSON receipt"
    )
    parser.add_argument("--baseline", action="store_true", help=baseline)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(UNPATCHED_FLAG, action="store_true", help=argparse.SUPPRESS)
