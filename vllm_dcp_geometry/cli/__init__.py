# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The ``vllm-dcp-geometry`` command (also ``python -m vllm_dcp_geometry``).

- ``profiles``: list the built-in topologies.
- ``plan``: per-group DCP geometry and block-table cost, against vLLM 0.33.0.
- ``replay``: drive vLLM's real KV-cache manager through one long request with
  no model weights, checking ownership, widths and addressability each step.
- ``simulate``: vLLM's real scheduler feeding every DCP rank's block tables,
  checking slot mappings and local lengths of every group at every step.

Exit status: 0 clean, 1 a replay or simulation found a violation, 2 bad input. Every bad
input (a flag, a topology file, a layout vLLM or the contract forbids, a size
beyond what vLLM can represent) is one line on standard error naming the
flag, field or group and the allowed range: a command raises ``CliError`` or
any ``DcpGeometryError`` and ``main`` reports it (``report_bad_input``).
vLLM is imported only inside the commands that need it, with third-party
import noise hidden unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from vllm_dcp_geometry.cli._noise import third_party_noise_hidden
from vllm_dcp_geometry.cli.runs import UNPATCHED_FLAG
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.topology import (
    DEFAULT_PROFILE,
    Topology,
    load_profile,
    load_topology_file,
    profile_names,
)
from vllm_dcp_geometry.topology.limits import (
    MODEL_LEN_RANGE,
    POSITIVE_INT32,
    REPLAY_POOL_PAGES_RANGE,
    REPLAY_TOKENS_RANGE,
    IntRange,
    show,
)

PROG = "vllm-dcp-geometry"
EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


VLLM_MODULES = (
    "vllm.config",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.request",
    "vllm.sampling_params",
    "vllm.v1.worker.block_table",
)
"""The vLLM modules the commands use, imported up front with the import noise
hidden (see ``cli._noise``)."""


class CliError(Exception):
    """Bad input the command reports and exits 2 on."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


def _int_flag(allowed: IntRange) -> Callable[[str], int]:
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


def _output_file(text: str) -> str:
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


def _add_topology_args(parser: argparse.ArgumentParser) -> None:
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
    positive = _int_flag(POSITIVE_INT32)
    layout.add_argument("--dcp", type=positive, help="DCP world size D")
    layout.add_argument("--tp", type=positive, help="tensor-parallel size")
    layout.add_argument("--max-model-len", type=_int_flag(MODEL_LEN_RANGE))
    layout.add_argument("--max-num-seqs", type=positive)
    layout.add_argument(
        "--interleave", type=positive, help="cp_kv_cache_interleave_size I"
    )


def _load(args: argparse.Namespace) -> Topology:
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


def _prepare_vllm(args: argparse.Namespace, *, patched: bool) -> None:
    """Register the plugin (when ``patched``) and import vLLM, hiding
    third-party import noise unless ``--verbose``."""
    verbose = getattr(args, "verbose", False)
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with third_party_noise_hidden(enabled=not verbose):
        if patched:
            import vllm_dcp_geometry

            vllm_dcp_geometry.register()
        for name in VLLM_MODULES:
            importlib.import_module(name)


def versions() -> dict[str, Any]:
    from vllm_dcp_geometry._version import installed_vllm_version, plugin_version

    return {
        "vllm_version": installed_vllm_version(),
        "plugin_version": plugin_version(),
    }


def _emit(document: dict[str, Any], as_json: bool, text: str) -> None:
    if as_json:
        print(json.dumps(document, sort_keys=False))
    else:
        print(text)


# Commands -------------------------------------------------------------------------


def cmd_profiles(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for name in profile_names():
        topology = load_profile(name)
        rows.append(
            {
                "name": name,
                "default": name == DEFAULT_PROFILE,
                "groups": len(topology.groups),
                "layers": topology.num_layers,
                "draft_layers": sum(len(g.layers) for g in topology.groups if g.draft),
                "tp": topology.tensor_parallel_size,
                "dcp": topology.decode_context_parallel_size,
                "max_model_len": topology.max_model_len,
                "description": topology.description,
            }
        )
    if args.json:
        print(json.dumps({"profiles": rows}))
        return EXIT_OK
    for row in rows:
        mark = " (default)" if row["default"] else ""
        print(f"{row['name']}{mark}")
        print(
            f"    {row['groups']} groups, {row['layers'] - row['draft_layers']} "
            f"layers + {row['draft_layers']} draft, TP{row['tp']}/"
            f"DCP{row['dcp']}, max_model_len {row['max_model_len']:,}"
        )
        if row["description"]:
            print(f"    {row['description']}")
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    from vllm_dcp_geometry.cli import capacity, plan, plan_output

    topology = _load(args)
    _prepare_vllm(args, patched=True)
    capacity.check_topology_capacity(topology)
    document = plan.build_plan(topology, args.attention_backend)
    document.update(versions())
    _emit(document, args.json, plan_output.format_plan(document))
    refusal = plan.first_refusal(document)
    # A group start-up would refuse: the same one-line error, exit 2.
    return EXIT_OK if refusal is None else report_bad_input(refusal)


def cmd_replay(args: argparse.Namespace) -> int:
    from vllm_dcp_geometry.cli import replay, runs

    topology = _load(args)
    tokens = runs.replay_tokens(topology, args.tokens)
    step_tokens = runs.replay_step_tokens(topology, args.step_tokens)
    replay.check_replay_inputs(topology, tokens, step_tokens)
    unpatched = runs.start_vllm(args)
    from vllm_dcp_geometry.cli import capacity

    capacity.check_replay_capacity(
        topology, tokens=tokens, step_tokens=step_tokens, num_pages=args.num_pages
    )
    report = replay.run_replay(
        topology,
        tokens=tokens,
        step_tokens=step_tokens,
        num_pages=args.num_pages,
        progress=not args.no_progress,
    )
    report.update(versions())
    report["inputs"] = {
        **runs.source_inputs(args),
        "tokens": tokens,
        "step_tokens": step_tokens,
        "num_pages": args.num_pages,
        "enable_prefix_caching": False,
        "topology": topology.to_dict(),
    }
    text = replay.format_replay(report)
    if args.baseline and not unpatched:
        text = runs.show_before_baseline(text, args.json)
        baseline = runs.run_unpatched(
            "replay",
            topology,
            [
                ("--tokens", tokens),
                ("--step-tokens", step_tokens),
                ("--num-pages", args.num_pages),
            ],
        )
        diffs = replay.compare_replays(report, baseline)
        report["baseline"] = baseline
        report["divergence"] = diffs
        text += replay.format_baseline(baseline, diffs)
    return runs.finish(args, "replay", report, text)


def cmd_simulate(args: argparse.Namespace) -> int:
    from vllm_dcp_geometry.cli import simulate_command

    return simulate_command.command(args)


# Entry point -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Per-cache DCP KV-cache geometry for vLLM: plan and replay.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("profiles", help="list the built-in topologies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser(
        "plan",
        help="per-group shard count, widths and block-table bytes vs vLLM 0.33.0",
    )
    _add_topology_args(p)
    p.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="vLLM attention backend for the groups of its kind (MLA or not); "
        "default: vLLM's first choice on SM90 (FLASH_ATTN_MLA, FLASH_ATTN)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "replay",
        help="drive vLLM's KV-cache manager through one long request, no weights",
    )
    _add_topology_args(p)
    _add_run_args(
        p,
        tokens="request length (default: the profile's, else max_model_len)",
        step_tokens="tokens per scheduler step (default: the profile's, else "
        "the cache block size)",
        num_pages="pool size in pages (default: one max-length request + null page)",
        baseline="also replay on unpatched vLLM (fresh process) and compare",
    )
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser(
        "simulate",
        help="vLLM's scheduler feeding every DCP rank's block tables, checked "
        "each step, no weights",
    )
    _add_topology_args(p)
    _add_run_args(
        p,
        tokens="replay length (default: the profile's, else max_model_len)",
        step_tokens="the scheduler's token budget per step (max_num_batched_tokens)",
        num_pages="pool size in pages (default: replay, one max-length request "
        "+ null page; mixed, small enough to preempt)",
        baseline="also simulate on unpatched vLLM (fresh process)",
    )
    from vllm_dcp_geometry.cli import simulate_command

    simulate_command.add_arguments(p, _int_flag)
    p.set_defaults(func=cmd_simulate)
    _add_common_flags(parser, sub)
    return parser


def _add_run_args(
    parser: argparse.ArgumentParser,
    *,
    tokens: str,
    step_tokens: str,
    num_pages: str,
    baseline: str,
) -> None:
    """The flags of the commands that run vLLM (``replay``, ``simulate``)."""
    parser.add_argument("--tokens", type=_int_flag(REPLAY_TOKENS_RANGE), help=tokens)
    parser.add_argument(
        "--step-tokens", type=_int_flag(POSITIVE_INT32), help=step_tokens
    )
    parser.add_argument(
        "--num-pages", type=_int_flag(REPLAY_POOL_PAGES_RANGE), help=num_pages
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--receipt", metavar="FILE", type=_output_file, help="write a JSON receipt"
    )
    parser.add_argument("--baseline", action="store_true", help=baseline)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(UNPATCHED_FLAG, action="store_true", help=argparse.SUPPRESS)


def _add_common_flags(parser: argparse.ArgumentParser, sub: Any) -> None:
    """Flags every command takes, before or after its name."""
    verbose = "show the third-party import output (torch, vLLM) hidden by default"
    parser.add_argument("--verbose", "-v", action="store_true", help=verbose)
    for command in sub.choices.values():
        # SUPPRESS: a command that is not given the flag keeps the top level's.
        command.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            default=argparse.SUPPRESS,
            help=verbose,
        )


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    """What a command raises for input it cannot run: exit 2, one line."""
    from vllm_dcp_geometry._patching import UpstreamChangedError

    errors: tuple[type[BaseException], ...] = (
        CliError,
        DcpGeometryError,
        UpstreamChangedError,
    )
    try:
        from vllm_dcp_geometry.plugin import VllmVersionError
    except Exception:  # pragma: no cover - the plugin import itself failed
        return errors
    return (*errors, VllmVersionError)


def report_bad_input(error: BaseException | str) -> int:
    """Print ``error`` as one line on standard error; the exit status for
    bad input."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return int(args.func(args))
    except SystemExit as exc:  # argparse's --help
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not our failure.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, _bad_input_errors()):
            return report_bad_input(exc)
        raise
