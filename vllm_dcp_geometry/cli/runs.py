# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the commands that run vLLM (``replay``, ``simulate``) share.

Their defaults (the replay length and step), their start (vLLM imported
patched, or unpatched in the fresh process of another run's baseline), the
progress bar, the unpatched baseline itself (the same command in a fresh
interpreter that never registers the plugin) and their end (receipt, output,
exit status).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.topology import DEFAULT_PROFILE, Topology

UNPATCHED_FLAG = "--unpatched-baseline"
"""The hidden flag of the fresh process that runs another run's baseline."""


def replay_tokens(topology: Topology, tokens: int | None) -> int:
    """The replay length: ``tokens`` (``--tokens``), else the profile's, else
    ``max_model_len``."""
    return tokens or topology.replay_tokens or topology.max_model_len


def replay_step_tokens(topology: Topology, step_tokens: int | None) -> int:
    """The replay's tokens per step: ``step_tokens`` (``--step-tokens``),
    else the profile's, else the cache block size."""
    return (
        step_tokens
        or topology.replay_step_tokens
        or topology.scheduler_cache_block_size
    )


def start_vllm(args: argparse.Namespace) -> bool:
    """Import vLLM for the run, patched unless this process is another run's
    unpatched baseline; returns whether it is."""
    from vllm_dcp_geometry import cli
    from vllm_dcp_geometry.cli import _vllm

    unpatched = bool(getattr(args, "unpatched_baseline", False))
    cli._prepare_vllm(args, patched=not unpatched)
    if unpatched and _vllm.is_vllm_patched():
        raise cli.CliError(
            "the unpatched baseline found the plugin already installed in this "
            "process (is VLLM_PLUGINS set, or something calling register()?)"
        )
    return unpatched


def source_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Where the run's topology came from, for its report's ``inputs``."""
    return {
        "profile": None if args.topology else (args.profile or DEFAULT_PROFILE),
        "topology_file": args.topology,
    }


def progress_bar(total: int, description: str, enabled: bool) -> Any:
    """A tqdm bar on standard error, shown only where it is a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc=description,
        file=sys.stderr,
        # None: only where stderr is a terminal (no bar in logs and pipes).
        disable=None if enabled else True,
        leave=False,
    )


def show_before_baseline(text: str, as_json: bool) -> str:
    """Print the patched run's text before the (slow) baseline starts; the
    text still to print."""
    if as_json:
        return text
    print(text, flush=True)
    print(
        "running the baseline on unpatched vLLM in a fresh process ...",
        file=sys.stderr,
        flush=True,
    )
    return ""


def run_unpatched(
    command: str,
    topology: Topology,
    flags: Sequence[tuple[str, Any]],
) -> dict[str, Any]:
    """``command`` on vLLM 0.33.0 as installed, in a fresh interpreter that
    never registers the plugin, with ``topology`` and ``flags`` (``(flag,
    value)``; a None value is left out); its JSON report."""
    from vllm_dcp_geometry._fresh_process import FreshProcessError, run_fresh_python
    from vllm_dcp_geometry.cli import CliError

    with tempfile.TemporaryDirectory(prefix="vllm-dcp-geometry-") as tmp:
        path = os.path.join(tmp, "topology.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(topology.to_dict(), fh)
        argv = ["-m", "vllm_dcp_geometry", command, "--topology", path]
        for flag, value in flags:
            if value is not None:
                argv += [flag, str(value)]
        argv += ["--json", "--no-progress", UNPATCHED_FLAG]
        env = {}
        if "VLLM_LOGGING_LEVEL" not in os.environ:
            env["VLLM_LOGGING_LEVEL"] = "ERROR"
        try:
            baseline = run_fresh_python(
                argv, patched=False, env=env, ok_returncodes=(0, 1)
            )
        except FreshProcessError as exc:
            raise CliError(f"the unpatched baseline {command} failed: {exc}") from exc
    baseline["source"] = topology.source
    return baseline


def finish(
    args: argparse.Namespace, command: str, report: dict[str, Any], text: str
) -> int:
    """Write the receipt (``--receipt``), print the report (``--json``) or
    ``text``; the exit status: 0 clean, 1 a violation found."""
    from vllm_dcp_geometry import cli

    if args.receipt is not None:
        from vllm_dcp_geometry.cli.receipts import write_receipt

        write_receipt(args.receipt, command, args.argv, report)
        if not args.json:
            text += f"\nreceipt written to {args.receipt}"
    cli._emit(report, args.json, text.lstrip("\n"))
    return cli.EXIT_OK if report["ok"] else cli.EXIT_VIOLATION
