# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The flags several commands take, and the topology they name.

``add_topology_args``: the topology and layout flags of ``plan``, ``replay``
and ``simulate``; ``load_topology``: the topology those flags name.
``add_run_args``: the flags of the commands that run vLLM (``replay``,
``simulate``). ``int_flag`` and ``output_file`` are the argparse types they
use (a command's own flags use them too).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    Topology,
    load_profile,
    load_topology_file,
)
from vllm_dcp_geometry.tooling.topology.limits import (
    MODEL_LEN_RANGE,
    POSITIVE_INT32,
    REPLAY_POOL_PAGES_RANGE,
    REPLAY_TOKENS_RANGE,
    IntRange,
    show,
)

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


def add_topology_args(parser: argparse.ArgumentParser) -> None:
    """``--profile``/``--topology`` and the layout overrides."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--profile",
        "-p",
        help=f"built-in profile (default {DEFAULT_PROFILE}; see 'profiles')",
    )
    source.add_argument(
        "--topology", "-t", metavar="FILE", help="topology file (.toml or .json)"
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


def load_topology(args: argparse.Namespace) -> Topology:
    """The topology the parsed ``add_topology_args`` flags name."""
    if args.topology:
        topology = load_topology_file(args.topology)
    else:
        topology = load_profile(args.profile or DEFAULT_PROFILE)
    return topology.with_layout(
        dcp=args.dcp,
        tp=args.tp,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        interleave=args.interleave,
    )


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
