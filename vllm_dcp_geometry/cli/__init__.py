# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The ``vllm-dcp-geometry`` command (also ``python -m vllm_dcp_geometry``).

- ``profiles``: list the built-in topologies.
- ``plan``: per-group DCP geometry and block-table cost, against vLLM 0.33.0.
- ``replay``: drive vLLM's real KV-cache manager through one long request with
  no model weights, checking ownership, widths and addressability each step.

Exit status: 0 clean, 1 a replay found a violation, 2 bad input.
vLLM is imported only inside the commands that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.topology import (
    DEFAULT_PROFILE,
    Topology,
    load_profile,
    load_topology_file,
    profile_names,
)

PROG = "vllm-dcp-geometry"
EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2


class CliError(Exception):
    """Bad input the command reports and exits 2 on."""


def _positive(text: str) -> int:
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


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
    layout.add_argument("--dcp", type=_positive, help="DCP world size D")
    layout.add_argument("--tp", type=_positive, help="tensor-parallel size")
    layout.add_argument("--max-model-len", type=_positive)
    layout.add_argument("--max-num-seqs", type=_positive)
    layout.add_argument(
        "--interleave", type=_positive, help="cp_kv_cache_interleave_size I"
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


def _prepare_vllm(*, patched: bool) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if patched:
        import vllm_dcp_geometry

        vllm_dcp_geometry.register()


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
    from vllm_dcp_geometry.cli import plan

    topology = _load(args)
    _prepare_vllm(patched=True)
    document = plan.build_plan(topology)
    document.update(versions())
    _emit(document, args.json, plan.format_plan(document))
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from vllm_dcp_geometry.cli import replay

    topology = _load(args)
    tokens = args.tokens or topology.replay_tokens or topology.max_model_len
    step_tokens = (
        args.step_tokens
        or topology.replay_step_tokens
        or topology.scheduler_cache_block_size
    )
    replay.check_replay_inputs(topology, tokens, step_tokens)
    unpatched = getattr(args, "unpatched_baseline", False)
    _prepare_vllm(patched=not unpatched)
    from vllm_dcp_geometry.cli import _vllm

    if unpatched and _vllm.is_vllm_patched():
        raise CliError(
            "the unpatched baseline found the plugin already installed in this "
            "process (is VLLM_PLUGINS set, or something calling register()?)"
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
        "profile": None if args.topology else (args.profile or DEFAULT_PROFILE),
        "topology_file": args.topology,
        "tokens": tokens,
        "step_tokens": step_tokens,
        "num_pages": args.num_pages,
        "enable_prefix_caching": False,
        "topology": topology.to_dict(),
    }
    text = replay.format_replay(report)
    if args.baseline and not unpatched:
        if not args.json:
            print(text, flush=True)
            text = ""
            print(
                "running the baseline on unpatched vLLM in a fresh process ...",
                file=sys.stderr,
                flush=True,
            )
        baseline = replay.run_unpatched_baseline(
            topology, tokens=tokens, step_tokens=step_tokens, num_pages=args.num_pages
        )
        diffs = replay.compare_replays(report, baseline)
        report["baseline"] = baseline
        report["divergence"] = diffs
        text += replay.format_baseline(baseline, diffs)
    if args.receipt:
        receipt = {
            "receipt": "vllm-dcp-geometry replay",
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "argv": [PROG, *args.argv],
            "python": platform.python_version(),
            "platform": platform.platform(),
            **report,
        }
        try:
            with open(args.receipt, "w", encoding="utf-8") as fh:
                json.dump(receipt, fh, indent=2)
                fh.write("\n")
        except OSError as exc:
            raise CliError(f"cannot write receipt {args.receipt}: {exc}") from exc
        if not args.json:
            text += f"\nreceipt written to {args.receipt}"
    _emit(report, args.json, text.lstrip("\n"))
    return EXIT_OK if report["ok"] else EXIT_VIOLATION


# Entry point -----------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "replay",
        help="drive vLLM's KV-cache manager through one long request, no weights",
    )
    _add_topology_args(p)
    p.add_argument(
        "--tokens",
        type=_positive,
        help="request length (default: the profile's, else max_model_len)",
    )
    p.add_argument(
        "--step-tokens",
        type=_positive,
        help="tokens per scheduler step (default: the profile's, else the "
        "cache block size)",
    )
    p.add_argument(
        "--num-pages",
        type=_positive,
        help="pool size in pages (default: one max-length request + null page)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--receipt", metavar="FILE", help="write a JSON receipt")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also replay on unpatched vLLM (fresh process) and compare",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--unpatched-baseline", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_replay)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    args.argv = argv
    try:
        return int(args.func(args))
    except (CliError, DcpGeometryError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not our failure.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        from vllm_dcp_geometry._patching import UpstreamChangedError

        try:
            from vllm_dcp_geometry.plugin import VllmVersionError
        except Exception:  # pragma: no cover - plugin import itself failed
            VllmVersionError = UpstreamChangedError  # type: ignore[misc,assignment]
        if isinstance(exc, (UpstreamChangedError, VllmVersionError)):
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
