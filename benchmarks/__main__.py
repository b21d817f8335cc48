# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``python -m benchmarks``: what the contract costs against unpatched vLLM.

Sections (``--only`` picks some):

- ``scheduler``: vLLM's real ``KVCacheManager`` under the replay workload
  (1,000,000 tokens, default profile, DCP16) and a 64-request prefix-caching
  workload at DCP1 and DCP16, patched vs unpatched, each measurement in its
  own fresh process, over ``--pairs`` pairs (9; which side runs first
  alternates by pair).
  Headline: thread CPU time inside the manager per ``allocate_slots`` call
  with the GC heap frozen after set-up (as vLLM's engine core runs), and the
  per-pair patched/unpatched ratio (median, min-max); the same ratio with the
  heap unfrozen beside it.
- ``startup``: ``register()`` right after ``import vllm`` (timed in every
  patched scheduler process, or in its own processes without ``scheduler``)
  and ``import vllm_dcp_geometry`` in a fresh interpreter without vLLM.
- ``memory``: block-table bytes per rank for every built-in profile (the
  contract's layout, the exact minimum, one width for all groups) and KV
  capacity for a 100 GiB budget per rank.

The orchestrator imports nothing from vLLM; it byte-compiles this package
and the plugin first (as ``pip install`` does), prints a short table and
writes the full results as JSON (``report``: the table and the required
shape of the document).
"""

from __future__ import annotations

import argparse
import compileall
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    RESULTS_DIR,
    load_average,
    machine_info,
    pair_summary,
    run_child,
    versions,
)
from benchmarks.report import TARGETS, format_table, validate_results

SECTIONS = ("scheduler", "startup", "memory")
SCHEMA_VERSION = 1


# (workload, DCP, repeats per process in a full run)
SCHEDULER_CONFIGS: tuple[tuple[str, int, int], ...] = (
    ("replay", 16, 5),
    ("many", 1, 4),
    ("many", 16, 4),
)
IMPORT_SAMPLES = 7
REGISTER_SAMPLES = 5

_IMPORT_SNIPPET = """
import json, sys, time
start = time.perf_counter()
import vllm_dcp_geometry
elapsed = time.perf_counter() - start
heavy = sorted(m for m in ("vllm", "torch", "triton", "numpy") if m in sys.modules)
print(json.dumps({"import_ms": elapsed * 1e3, "heavy_modules_loaded": heavy}))
"""

_REGISTER_SNIPPET = """
import json, sys
from benchmarks.scheduler import _time_register
out = _time_register(True)
out.pop("_applied_ns", None)
print(json.dumps(out))
"""


# Sections ------------------------------------------------------------------------


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _measure_pairs(
    pairs: int,
    quick: bool,
    configs: Sequence[tuple[str, int, int]],
    profile: bool,
    log: Callable[[str], None],
) -> dict[tuple[str, int], dict[str, list[dict[str, Any]]]]:
    """Every measurement process, unpatched and patched per pair; which runs
    first alternates by pair, so neither side always meets a machine the
    other has just warmed (or loaded)."""
    samples: dict[tuple[str, int], dict[str, list[dict[str, Any]]]] = {
        (w, d): {"unpatched": [], "patched": []} for w, d, _ in configs
    }
    for pair in range(pairs):
        for workload, dcp, repeats in configs:
            modes = ("unpatched", "patched")
            for mode in modes if pair % 2 == 0 else modes[::-1]:
                log(f"  pair {pair + 1}/{pairs}: {workload} DCP{dcp} {mode}")
                argv = ["-m", "benchmarks.scheduler", "--workload", workload]
                argv += ["--dcp", str(dcp), "--mode", mode]
                argv += ["--repeats", str(1 if quick else repeats)]
                if profile and pair == 0:
                    argv.append("--profile")
                result = run_child(argv, patched=mode == "patched")
                samples[(workload, dcp)][mode].append(result)
    return samples


def _ratios(runs: dict[str, list[dict[str, Any]]], key: str) -> dict[str, float]:
    """Medians of ``key`` on both sides and the per-pair ratio, by name."""
    summary = pair_summary(
        [r[key] for r in runs["unpatched"]], [r[key] for r in runs["patched"]]
    )
    return {
        "unpatched_us": summary["unpatched_median"],
        "patched_us": summary["patched_median"],
        "ratio_median": summary["ratio_median"],
        "ratio_min": summary["ratio_min"],
        "ratio_max": summary["ratio_max"],
    }


def _add_profiles(row: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> None:
    """The first pair ran one more repeat under cProfile on each side: how
    much of the patched loop is this plugin's own code."""
    profiles = {
        mode: runs[mode][0]["cprofile"]
        for mode in ("unpatched", "patched")
        if runs[mode][0].get("cprofile")
    }
    if profiles:
        row["cprofile_first_pair"] = profiles
        patched_profile = profiles.get("patched")
        if patched_profile:
            row["plugin_code_ms_in_profiled_repeat"] = patched_profile["plugin_code_ms"]
            row["profiled_repeat_ms"] = patched_profile["profiled_ms"]
        if len(profiles) == 2:
            row["same_vllm_calls"] = (
                profiles["patched"]["vllm_calls_digest"]
                == profiles["unpatched"]["vllm_calls_digest"]
            )
    for mode in ("unpatched", "patched"):
        for run in runs[mode]:
            run.pop("cprofile", None)


def _scheduler_row(
    workload: str, dcp: int, runs: dict[str, list[dict[str, Any]]], pairs: int
) -> dict[str, Any]:
    first = runs["patched"][0]
    cpu = _ratios(runs, "us_per_allocation")
    row: dict[str, Any] = {
        "workload": workload,
        "profile": first["profile"],
        "dcp": dcp,
        "prefix_caching": first["prefix_caching"],
        "max_model_len": first["max_model_len"],
        "allocations": first["best"]["allocations"],
        "scheduler_steps": first["best"]["scheduler_steps"],
        "prefix_hit_tokens": first["best"]["prefix_hit_tokens"],
        "scheduler_block_size": first["scheduler_block_size"],
        "hash_block_size": first["hash_block_size"],
        "pairs": pairs,
        "repeats_per_process": first["repeats"],
        "metric": "thread CPU us inside the manager per allocate_slots call",
        "gc": first["gc"],
        **cpu,
        "wall": _ratios(runs, "wall_us_per_allocation"),
        "unfrozen": _ratios(runs, "unfrozen_us_per_allocation"),
        "target_ratio": TARGETS["scheduler_ratio"],
        "within_target": cpu["ratio_median"] <= TARGETS["scheduler_ratio"],
        "processes": runs,
    }
    _add_profiles(row, runs)
    return row


def scheduler_section(
    *,
    pairs: int,
    quick: bool,
    configs: Sequence[tuple[str, int, int]] = SCHEDULER_CONFIGS,
    profile: bool = True,
    log: Callable[[str], None] = _progress,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, list[float]]]:
    """Rows per workload, start-up samples (patched) and patch-apply samples."""
    samples = _measure_pairs(pairs, quick, configs, profile, log)
    register_ms: list[dict[str, Any]] = []
    applied: dict[str, list[float]] = {}
    # Pair order: every patched process's start-up, as it was measured.
    for pair in range(pairs):
        for workload, dcp, _ in configs:
            startup = samples[(workload, dcp)]["patched"][pair]["startup"]
            register_ms.append(startup)
            for name, ms in startup["patches_applied_ms"].items():
                applied.setdefault(name, []).append(ms)
    rows = [
        _scheduler_row(workload, dcp, samples[(workload, dcp)], pairs)
        for workload, dcp, _ in configs
    ]
    return rows, register_ms, applied


def startup_section(
    register_samples: list[dict[str, Any]],
    applied: dict[str, list[float]],
    *,
    quick: bool,
    log: Callable[[str], None] = _progress,
) -> dict[str, Any]:
    imports = []
    for i in range(2 if quick else IMPORT_SAMPLES):
        log(f"  import vllm_dcp_geometry without vLLM {i + 1}")
        imports.append(run_child(["-c", _IMPORT_SNIPPET], patched=False))
    heavy = sorted({m for s in imports for m in s["heavy_modules_loaded"]})
    source = "patched scheduler processes"
    if not register_samples:
        source = "dedicated processes"
        for i in range(1 if quick else REGISTER_SAMPLES):
            log(f"  register() after import vllm {i + 1}")
            out = run_child(["-c", _REGISTER_SNIPPET], patched=True)
            register_samples.append(out)
    import_ms = statistics.median(s["import_ms"] for s in imports)
    register_ms = statistics.median(s["register_ms"] for s in register_samples)
    return {
        "register_ms": register_ms,
        "register_ms_samples": [s["register_ms"] for s in register_samples],
        "entry_point_load_ms": statistics.median(
            s["entry_point_load_ms"] for s in register_samples
        ),
        "register_call_ms": statistics.median(
            s["register_call_ms"] for s in register_samples
        ),
        "import_vllm_s": statistics.median(
            s["import_vllm_s"] for s in register_samples
        ),
        "register_source": source,
        "register_target_ms": TARGETS["register_ms"],
        "register_within_target": register_ms <= TARGETS["register_ms"],
        "import_ms": import_ms,
        "import_ms_samples": [s["import_ms"] for s in imports],
        "import_target_ms": TARGETS["import_ms"],
        "import_within_target": import_ms <= TARGETS["import_ms"],
        "import_loads_heavy_modules": heavy,
        "patches_applied_ms_median": {
            name: statistics.median(v) for name, v in sorted(applied.items())
        },
        "note": (
            "register_ms: wall time, right after `import vllm` in a fresh "
            "process, of what vLLM's plugin loader does: import "
            "vllm_dcp_geometry.plugin (the entry point) and call register(), "
            "which installs import hooks and applies patches for vLLM modules "
            "already loaded. patches_applied_ms: each patch module's apply() "
            "when its vLLM module is imported later (scheduler side)."
        ),
    }


def memory_section(log: Callable[[str], None] = _progress) -> dict[str, Any]:
    log("  block-table memory and KV capacity (one patched process)")
    return run_child(["-m", "benchmarks.memory"], patched=True)


def default_output(quick: bool) -> Path:
    if quick:
        return Path(tempfile.gettempdir()) / "vllm-dcp-geometry-benchmarks-quick.json"
    return RESULTS_DIR / f"{datetime.date.today().isoformat()}-cpu.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="What the DCP geometry contract costs against unpatched vLLM.",
    )
    parser.add_argument(
        "--pairs", type=int, default=9, help="unpatched/patched process pairs"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 pair, 1 repeat per process, written to a temp file",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections ({', '.join(SECTIONS)})",
    )
    parser.add_argument("--output", type=Path, help="results JSON path")
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the cProfile'd repeat in the first pair's processes",
    )
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    pairs = 1 if args.quick else args.pairs
    if pairs < 1:
        parser.error("--pairs must be positive")
    output = args.output or default_output(args.quick)

    started = time.time()
    # Measure what an installed package runs: bytecode, not source (pip
    # byte-compiles on install; without it every import recompiles).
    for package in ("vllm_dcp_geometry", "benchmarks"):
        compileall.compile_dir(REPO_ROOT / package, quiet=1)
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "date": datetime.date.today().isoformat(),
        **versions(),
        "machine": machine_info(),
        "load_average_start": load_average(),
        "sections": sections,
        "quick": args.quick,
        "targets": TARGETS,
        "command": "python -m benchmarks " + " ".join(argv or sys.argv[1:]),
    }
    register_samples: list[dict[str, Any]] = []
    applied: dict[str, list[float]] = {}
    if "scheduler" in sections:
        _progress(f"scheduler: {pairs} pair(s) of fresh processes")
        doc["scheduler"], register_samples, applied = scheduler_section(
            pairs=pairs, quick=args.quick, profile=not args.no_profile
        )
    if "startup" in sections:
        _progress("startup")
        doc["startup"] = startup_section(register_samples, applied, quick=args.quick)
    if "memory" in sections:
        _progress("memory")
        doc.update(memory_section())
    doc["load_average_end"] = load_average()
    doc["elapsed_s"] = round(time.time() - started, 1)
    problems = validate_results(doc)
    if problems:
        raise SystemExit("malformed results: " + "; ".join(problems))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(format_table(doc))
    print(f"\nfull results: {output} ({doc['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
