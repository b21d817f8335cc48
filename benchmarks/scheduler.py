# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Scheduler-side cost: vLLM's real ``KVCacheManager`` under two workloads.

One process measures one workload in one mode, patched or unpatched:

    python -m benchmarks.scheduler --workload replay --dcp 16 --mode patched

and prints one JSON document as its last line. A patched process first times,
right after ``import vllm`` (before any other vLLM module loads), what vLLM's
plugin loader does: import ``vllm_dcp_geometry.plugin`` and call
``register()``; the patches then apply as vLLM's modules import.

Only the manager's own calls are timed (``new_step_starts``,
``get_computed_blocks``, ``allocate_slots``, ``free``), in thread CPU time
(the headline) and wall-clock time; building requests, hashing prompts and
the pool are not. The manager is timed the way vLLM's engine core runs it:
after set-up the GC heap is frozen (``vllm.utils.gc_utils.freeze_gc_heap``,
as ``EngineCore.__init__`` does), so collections do not walk the long-lived
set-up objects; each repeat is also run with the heap unfrozen, and that
figure is reported beside the headline. Each process keeps, per setting, the
repeat with the least CPU time (the one least disturbed by other work on the
machine). ``--profile`` adds one cProfile'd repeat and reports how much of it
ran in this plugin's code. The workloads are in ``scheduler_workloads``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.scheduler_workloads import (
    MANY_DECODE_STEPS,
    MANY_MAX_MODEL_LEN,
    MANY_MIN_PROMPT,
    MANY_PREFIXES,
    MANY_REQUESTS,
    MODES,
    REPLAY_STEP_TOKENS,
    REPLAY_TOKENS,
    WORKLOADS,
    Setup,
    Timer,
    build_manager,
    make_many_requests,
    many_request_lengths,
    many_request_tokens,
    run_many_once,
    run_replay_once,
    workload_topology,
)

__all__ = [
    "MANY_DECODE_STEPS",
    "MANY_MAX_MODEL_LEN",
    "MANY_MIN_PROMPT",
    "MANY_PREFIXES",
    "MANY_REQUESTS",
    "REPLAY_STEP_TOKENS",
    "REPLAY_TOKENS",
    "many_request_lengths",
    "many_request_tokens",
    "measure",
]


_ADDRESS = re.compile(r"at 0x[0-9a-fA-F]+")


def _profile_once(run: Callable[[], Any]) -> dict[str, Any]:
    """One more repeat under cProfile: where the time goes, and how much of
    it is this plugin's own code."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    stats = pstats.Stats(profiler)
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(tottime for (_, _, tottime, _, _) in entries.values())
    plugin = {
        f"{Path(f).name}:{line}({name})": tottime * 1e3
        for (f, line, name), (_, _, tottime, _, _) in entries.items()
        if "vllm_dcp_geometry" in f
    }
    top = sorted(entries.items(), key=lambda item: item[1][2], reverse=True)[:15]
    # What ran, outside this plugin: (function, calls) over the whole repeat.
    # Equal digests on both sides mean the same vLLM code ran the same number
    # of times, patched or not.
    # A builtin's name can carry its object's address ("__new__ of type
    # object at 0x7f..."), which differs between processes: not what ran.
    calls = sorted(
        (f"{Path(f).name}:{line}({_ADDRESS.sub('at 0x', name)})", n)
        for (f, line, name), (_, n, _, _, _) in entries.items()
        if "vllm_dcp_geometry" not in f
    )
    digest = hashlib.sha256(json.dumps(calls).encode()).hexdigest()[:16]
    return {
        "vllm_calls": sum(n for _, n in calls),
        "vllm_calls_digest": digest,
        "profiled_ms": total * 1e3,
        "plugin_code_ms": sum(plugin.values()),
        "plugin_functions_ms": dict(sorted(plugin.items(), key=lambda i: -i[1])),
        "top_tottime": [
            {
                "function": f"{Path(f).name}:{line}({name})",
                "calls": calls,
                "tottime_ms": tottime * 1e3,
                "cumtime_ms": cumtime * 1e3,
            }
            for (f, line, name), (_, calls, tottime, cumtime, _) in top
        ],
    }


def _summary(timer: Timer, steps: int) -> dict[str, Any]:
    allocations = timer.calls["allocate_slots"]
    cpu_ns = sum(timer.cpu_ns.values())
    wall_ns = sum(timer.wall_ns.values())
    return {
        "us_per_allocation": cpu_ns / allocations / 1e3,
        "wall_us_per_allocation": wall_ns / allocations / 1e3,
        "manager_cpu_ns": cpu_ns,
        "manager_wall_ns": wall_ns,
        "allocations": allocations,
        "scheduler_steps": steps,
        "cpu_ns_by_call": timer.cpu_ns,
        "wall_ns_by_call": timer.wall_ns,
        "calls": timer.calls,
        "prefix_hit_tokens": timer.hit_tokens,
    }


def _run_once(workload: str, setup: Setup, prompts: list[list[int]]) -> dict:
    """One timed repeat from fresh requests (created after any freeze, as
    requests reach a running engine)."""
    timer = Timer()
    requests = make_many_requests(setup, prompts) if prompts else []
    gc.collect()
    if workload == "replay":
        steps = run_replay_once(setup, timer)
    else:
        steps = run_many_once(setup, requests, timer)
    return _summary(timer, steps)


def _timed_repeats(
    workload: str, setup: Setup, prompts: list[list[int]], repeats: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(frozen, unfrozen) runs, alternated within each repeat."""
    from vllm.utils.gc_utils import freeze_gc_heap

    frozen, unfrozen = [], []
    for _ in range(repeats):
        # The set-up (manager, pool, prompts) is what a serving engine has
        # when EngineCore.__init__ freezes its heap.
        freeze_gc_heap()
        frozen.append(_run_once(workload, setup, prompts))
        gc.unfreeze()
        unfrozen.append(_run_once(workload, setup, prompts))
    return frozen, unfrozen


def measure(
    workload: str, dcp: int, repeats: int, *, profile: bool = False
) -> dict[str, Any]:
    """Run ``workload`` ``repeats`` times in this process; JSON-ready result."""
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    patched = _vllm.is_vllm_patched()
    topology = workload_topology(workload, dcp)
    if workload == "replay":
        setup = build_manager(
            topology, caching=False, lengths=[REPLAY_TOKENS], patched=patched
        )
        prompts: list[list[int]] = []
    else:
        lengths = [
            n + MANY_DECODE_STEPS for n in many_request_lengths(topology.max_model_len)
        ]
        setup = build_manager(topology, caching=True, lengths=lengths, patched=patched)
        prompts = many_request_tokens(topology.max_model_len)
    runs, unfrozen = _timed_repeats(workload, setup, prompts, repeats)
    best = min(runs, key=lambda r: r["manager_cpu_ns"])
    best_unfrozen = min(unfrozen, key=lambda r: r["manager_cpu_ns"])
    profiled = None
    if profile:
        if workload == "replay":
            profiled = _profile_once(lambda: run_replay_once(setup, Timer()))
        else:
            requests = make_many_requests(setup, prompts)
            profiled = _profile_once(lambda: run_many_once(setup, requests, Timer()))
    return {
        "workload": workload,
        "profile": topology.name,
        "dcp": dcp,
        "mode": "patched" if patched else "unpatched",
        "prefix_caching": workload == "many",
        "max_model_len": topology.max_model_len,
        "scheduler_block_size": setup.scheduler_block_size,
        "hash_block_size": setup.hash_block_size,
        "num_pages": setup.num_pages,
        "repeats": repeats,
        "gc": "heap frozen after set-up (freeze_gc_heap), as vLLM's engine core",
        "us_per_allocation": best["us_per_allocation"],
        "wall_us_per_allocation": best["wall_us_per_allocation"],
        "unfrozen_us_per_allocation": best_unfrozen["us_per_allocation"],
        "unfrozen_wall_us_per_allocation": best_unfrozen["wall_us_per_allocation"],
        "best": best,
        "best_unfrozen": best_unfrozen,
        "runs_us_per_allocation": [r["us_per_allocation"] for r in runs],
        "unfrozen_runs_us_per_allocation": [r["us_per_allocation"] for r in unfrozen],
        "cprofile": profiled,
    }


def _time_register(patched: bool) -> dict[str, Any]:
    """``import vllm``, then (patched) what vLLM's plugin loader does: import
    the entry point's module and call ``register()``; each step timed."""
    start = time.perf_counter()
    import vllm  # noqa: F401

    import_vllm_s = time.perf_counter() - start
    out: dict[str, Any] = {"import_vllm_s": import_vllm_s}
    if not patched:
        return out
    start = time.perf_counter()
    from vllm_dcp_geometry import plugin

    load_ms = (time.perf_counter() - start) * 1e3
    # Our own instrumentation (not vLLM's): time each patch module as it
    # applies, which happens when its vLLM module is imported later on.
    applied_ns: dict[str, int] = {}
    apply = plugin._apply_patch

    def timed_apply(name: str, patch: Any, upstream: Any) -> None:
        begin = time.perf_counter_ns()
        apply(name, patch, upstream)
        applied_ns[name] = time.perf_counter_ns() - begin

    plugin._apply_patch = timed_apply  # type: ignore[assignment]
    start = time.perf_counter()
    plugin.register()
    call_ms = (time.perf_counter() - start) * 1e3
    out["entry_point_load_ms"] = load_ms
    out["register_call_ms"] = call_ms
    out["register_ms"] = load_ms + call_ms
    out["_applied_ns"] = applied_ns
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler")
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--dcp", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile", action="store_true", help="add one cProfile'd repeat"
    )
    args = parser.parse_args(argv)
    patched = args.mode == "patched"
    if not patched and os.environ.get("VLLM_PLUGINS") != "":
        parser.error("unpatched runs need VLLM_PLUGINS='' (no plugin may load)")
    startup = _time_register(patched)
    applied = startup.pop("_applied_ns", {})
    result = measure(args.workload, args.dcp, args.repeats, profile=args.profile)
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    if _vllm.is_vllm_patched() != patched:
        raise RuntimeError(f"a {args.mode} run found vLLM in the other state")
    result["startup"] = startup
    if patched:
        result["startup"]["patches_applied_ms"] = {
            name.rsplit(".", 1)[-1]: ns / 1e6 for name, ns in applied.items()
        }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
