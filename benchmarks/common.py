# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Shared by the benchmark entry points: fresh child processes, the machine,
versions and pair statistics. Imports nothing from vLLM."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.fresh_process import FreshProcessError, run_fresh_python

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


class ChildError(RuntimeError):
    """A measurement process failed."""


def _child_env() -> dict[str, str]:
    env = {
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
    }
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        env["VLLM_LOGGING_LEVEL"] = "ERROR"
    return env


def run_child(
    argv: Sequence[str],
    *,
    patched: bool,
    timeout: float = 900,
    extra_env: dict[str, str] | None = None,
) -> Any:
    """Run ``python argv...`` in a fresh interpreter; return its last JSON line.

    Unpatched children get ``VLLM_PLUGINS=""``, so nothing loads the plugin
    (``vllm_dcp_geometry.tooling.fresh_process``, the one runner of fresh processes).
    """
    try:
        return run_fresh_python(
            argv,
            patched=patched,
            env={**_child_env(), **(extra_env or {})},
            cwd=str(REPO_ROOT),
            timeout=timeout,
            stderr_tail=3000,
        )
    except FreshProcessError as exc:
        raise ChildError(
            f"{' '.join(argv)} failed ({exc.returncode}):\n{exc.stderr}"
        ) from exc


# Machine and versions ------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_count": os.cpu_count(),
        "usable_cores": cores,
        "cpu_model": _cpu_model(),
        "ram_bytes": _ram_bytes(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def versions() -> dict[str, Any]:
    from importlib import metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {
        "vllm_version": version("vllm"),
        "plugin_version": version("vllm-dcp-geometry"),
        "torch_version": version("torch"),
    }


# Statistics ----------------------------------------------------------------------


def pair_summary(
    unpatched: Sequence[float], patched: Sequence[float]
) -> dict[str, float]:
    """Medians of both sides and the per-pair patched/unpatched ratio."""
    if len(unpatched) != len(patched) or not patched:
        raise ValueError("need the same positive number of samples on both sides")
    ratios = [p / u for p, u in zip(patched, unpatched, strict=True)]
    return {
        "unpatched_median": statistics.median(unpatched),
        "patched_median": statistics.median(patched),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
