# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the commands share once their flags are parsed.

Every command that needs vLLM starts it here (``prepare_vllm``: the plugin
registered, vLLM imported with third-party import noise hidden) and reports
the versions it ran (``versions``). The commands that run vLLM (``replay``,
``simulate``) also share their defaults (the replay length and step) and the
inputs no replay can take, their start (vLLM patched, or unpatched in the
fresh process of another run's baseline), the progress bar, the unpatched
baseline itself (the same command in a fresh interpreter that never
registers the plugin) and their end (receipt, output, exit status).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.common.flags import UNPATCHED_FLAG
from vllm_dcp_geometry.tooling.cli.common.noise import third_party_noise_hidden
from vllm_dcp_geometry.tooling.cli.common.receipts import write_receipt
from vllm_dcp_geometry.tooling.cli.common.status import (
    EXIT_OK,
    EXIT_VIOLATION,
    CliError,
)
from vllm_dcp_geometry.tooling.topology import DEFAULT_PROFILE, Topology, TopologyError
from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1

VLLM_MODULES = (
    "vllm.config",
    "vllm.v1.kv_cache_interface",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.request",
    "vllm.sampling_params",
)
"""The vLLM modules the commands use, imported up front with the import noise
hidden (see ``noise``)."""

MODEL_RUNNER_V1_MODULES = ("vllm.v1.worker.block_table",)
"""Also imported up front where the release has Model Runner V1 (0.33.0; 0.34.0
removed these modules)."""


def vllm_modules() -> tuple[str, ...]:
    """What ``prepare_vllm`` imports on the installed release."""
    if has_model_runner_v1():
        return VLLM_MODULES + MODEL_RUNNER_V1_MODULES
    return VLLM_MODULES


def prepare_vllm(args: argparse.Namespace, *, patched: bool) -> None:
    """Register the plugin (when ``patched``) and import vLLM, hiding
    third-party import noise unless ``--verbose``."""
    verbose = getattr(args, "verbose", False)
    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with third_party_noise_hidden(enabled=not verbose):
        if patched:
            import vllm_dcp_geometry

            vllm_dcp_geometry.register()
        for name in vllm_modules():
            importlib.import_module(name)


def versions() -> dict[str, Any]:
    """The vLLM and plugin versions every report carries."""
    from vllm_dcp_geometry._version import installed_vllm_version, plugin_version

    return {
        "vllm_version": installed_vllm_version(),
        "plugin_version": plugin_version(),
    }


def emit(document: dict[str, Any], as_json: bool, text: str) -> None:
    """Print the report (``--json``) or its text."""
    if as_json:
        print(json.dumps(document, sort_keys=False))
    else:
        print(text)


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


def check_replay_inputs(topology: Topology, tokens: int, step_tokens: int) -> None:
    """Reject a replay vLLM could never schedule, before building anything
    (``replay``, and ``simulate``'s replay workload)."""
    for label, value in (("tokens", tokens), ("step tokens", step_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"replay {label} must be a positive integer")
    if tokens > topology.max_model_len:
        raise TopologyError(
            f"replay of {tokens:,} tokens exceeds max_model_len="
            f"{topology.max_model_len:,}; raise --max-model-len or lower --tokens"
        )
    if topology.mamba_cache_mode == "align":
        for group in topology.groups:
            if group.kind == "mamba" and step_tokens % group.block_size:
                raise TopologyError(
                    f"group {group.name!r}: in Mamba align mode prefill chunks "
                    f"end on recurrent block boundaries, so --step-tokens "
                    f"({step_tokens}) must be a multiple of B={group.block_size}"
                )


def start_vllm(args: argparse.Namespace) -> bool:
    """Import vLLM for the run, patched unless this process is another run's
    unpatched baseline; returns whether it is."""
    unpatched = bool(getattr(args, "unpatched_baseline", False))
    prepare_vllm(args, patched=not unpatched)
    if unpatched and vllm_objects.is_vllm_patched():
        raise CliError(
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
    """``command`` on vLLM as installed, in a fresh interpreter that
    never registers the plugin, with ``topology`` and ``flags`` (``(flag,
    value)``; a None value is left out); its JSON report."""
    from vllm_dcp_geometry.tooling.fresh_process import (
        FreshProcessError,
        run_fresh_python,
    )

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
    if args.receipt is not None:
        write_receipt(args.receipt, command, args.argv, report)
        if not args.json:
            text += f"\nreceipt written to {args.receipt}"
    emit(report, args.json, text.lstrip("\n"))
    return EXIT_OK if report["ok"] else EXIT_VIOLATION
