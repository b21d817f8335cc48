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
the pool are not. Each process runs its workload ``repeats`` times and keeps
the repeat with the least CPU time (the one least disturbed by other work on
the machine). ``--profile`` adds one cProfile'd repeat and reports how much of
it ran in this plugin's code.

Workloads, both on the default profile ``kimi-k3-tp16-dcp16`` (4 sharded MLA
groups, 12 Mamba align groups with B = 768, 1 replicated draft group):

- ``replay``: one 1,000,000-token request in 768-token chunked-prefill steps,
  prefix caching off (what ``vllm-dcp-geometry replay`` drives, without its
  per-step checks).
- ``many``: 64 concurrent requests of 8K-128K tokens (max_model_len 131,072),
  a quarter each behind one of three shared prefixes or none, prefix caching
  on, a 16,384-token step budget (chunks on scheduler-block boundaries, as
  vLLM's Mamba-align scheduler cuts them), then 16 decode steps, then free.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("replay", "many")
MODES = ("patched", "unpatched")
PROFILE = "kimi-k3-tp16-dcp16"

REPLAY_TOKENS = 1_000_000
REPLAY_STEP_TOKENS = 768

MANY_REQUESTS = 64
MANY_MAX_MODEL_LEN = 131_072
MANY_MIN_PROMPT = 8_192
MANY_STEP_BUDGET = 16_384
MANY_DECODE_STEPS = 16
MANY_PREFIXES = (0, 6_144, 12_288, 24_576)
"""Shared-prefix lengths; request i shares prefix ``i % 4`` (0: none)."""
MANY_SEED = 20_260_529


@dataclass
class Timer:
    """Time spent inside the manager, per kind of call: thread CPU time
    (the headline: other jobs on a shared machine do not inflate it) and
    wall-clock time."""

    cpu_ns: dict[str, int] = field(default_factory=dict)
    wall_ns: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    hit_tokens: int = 0
    """Prompt tokens served from the prefix cache (not a time)."""

    def start(self) -> tuple[int, int]:
        return time.thread_time_ns(), time.perf_counter_ns()

    def stop(self, name: str, started: tuple[int, int]) -> None:
        wall = time.perf_counter_ns()
        cpu = time.thread_time_ns()
        self.cpu_ns[name] = self.cpu_ns.get(name, 0) + cpu - started[0]
        self.wall_ns[name] = self.wall_ns.get(name, 0) + wall - started[1]
        self.calls[name] = self.calls.get(name, 0) + 1


def workload_topology(workload: str, dcp: int) -> Any:
    """The profile with the workload's layout applied."""
    from vllm_dcp_geometry.topology import load_profile

    topology = load_profile(PROFILE)
    if workload == "replay":
        return topology.with_layout(dcp=dcp)
    return topology.with_layout(
        dcp=dcp, max_model_len=MANY_MAX_MODEL_LEN, max_num_seqs=MANY_REQUESTS
    )


@dataclass
class Setup:
    manager: Any
    scheduler_block_size: int
    hash_block_size: int
    num_pages: int


def build_manager(
    topology: Any, *, caching: bool, lengths: list[int], patched: bool
) -> Setup:
    """vLLM's ``KVCacheManager`` for ``topology`` with a pool that holds one
    request of each length in ``lengths`` at once (by vLLM's own per-request
    rule, plus a page per group of headroom)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    from vllm_dcp_geometry.cli import _vllm

    config = _vllm.sizing_config(topology, enable_prefix_caching=caching)
    specs = [_vllm.build_spec(g, topology, patched=patched) for g in topology.groups]
    num_pages = 1  # the null page
    for length in lengths:
        sized = _vllm.sizing_config(topology.with_layout(max_model_len=length))
        num_pages += sum(_vllm.pages_per_request(s, sized) for s in specs)
        num_pages += len(specs)
    kv_cache_config = _vllm.build_kv_cache_config(topology, specs, num_pages)
    sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
    manager = KVCacheManager(
        kv_cache_config,
        max_model_len=topology.max_model_len,
        scheduler_block_size=sched_block,
        hash_block_size=hash_block,
        enable_caching=caching,
        dcp_world_size=topology.decode_context_parallel_size,
        pcp_world_size=1,
    )
    return Setup(manager, sched_block, hash_block, num_pages)


def _request(request_id: str, tokens: list[int], block_hasher: Any = None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=MANY_DECODE_STEPS + 1),
        pooling_params=None,
        block_hasher=block_hasher,
    )


def run_replay_once(setup: Setup, timer: Timer) -> int:
    """One 1M-token request, chunked prefill, caching off; returns steps."""
    manager = setup.manager
    request = _request("replay", [0] * REPLAY_TOKENS)
    computed = steps = 0
    while computed < REPLAY_TOKENS:
        chunk = min(REPLAY_STEP_TOKENS, REPLAY_TOKENS - computed)
        start = timer.start()
        manager.new_step_starts()
        blocks = manager.allocate_slots(request, chunk)
        timer.stop("allocate_slots", start)
        if blocks is None:
            raise RuntimeError(f"replay ran out of pages at {computed:,} tokens")
        computed += chunk
        request.num_computed_tokens = computed
        steps += 1
    start = timer.start()
    manager.free(request)
    timer.stop("free", start)
    return steps


def many_request_lengths(max_model_len: int = MANY_MAX_MODEL_LEN) -> list[int]:
    """Deterministic prompt lengths in [8K, max_model_len - decode tokens]."""
    import numpy as np

    rng = np.random.default_rng(MANY_SEED)
    # Leave room for the decode tokens inside max_model_len.
    longest = max_model_len - MANY_DECODE_STEPS - 1
    return rng.integers(MANY_MIN_PROMPT, longest, MANY_REQUESTS, endpoint=True).tolist()


def many_request_tokens(max_model_len: int = MANY_MAX_MODEL_LEN) -> list[list[int]]:
    """Deterministic prompts; request ``i`` starts with shared prefix ``i % 4``."""
    import numpy as np

    rng = np.random.default_rng(MANY_SEED + 1)
    prefixes = [rng.integers(1, 150_000, length).tolist() for length in MANY_PREFIXES]
    prompts = []
    for i, length in enumerate(many_request_lengths(max_model_len)):
        # A short prompt shares the first half of its prefix only.
        prefix = prefixes[i % len(prefixes)][: length // 2]
        tail = rng.integers(1, 150_000, length - len(prefix)).tolist()
        prompts.append(prefix + tail)
    return prompts


def _chunk(remaining: int, budget: int, align: int) -> int:
    # vLLM's Mamba-align scheduler ends every non-final chunk on a block
    # boundary of the scheduler block size.
    if remaining <= budget:
        return remaining
    return budget // align * align


def make_many_requests(setup: Setup, prompts: list[list[int]]) -> list[Any]:
    """Fresh requests with vLLM's block hasher (hashing happens here)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(setup.hash_block_size, hash_fn)
    return [_request(f"r{i}", list(p), hasher) for i, p in enumerate(prompts)]


def run_many_once(setup: Setup, requests: list[Any], timer: Timer) -> int:
    """Admit, prefill, decode and free every request; returns scheduler steps."""
    from vllm.v1.request import RequestStatus

    manager = setup.manager
    align = setup.scheduler_block_size
    waiting = deque(requests)
    prefilling: list[Any] = []
    decoding: list[Any] = []
    steps = 0
    while waiting or prefilling:
        steps += 1
        budget = MANY_STEP_BUDGET
        start = timer.start()
        manager.new_step_starts()
        timer.stop("new_step_starts", start)
        for request in list(prefilling):
            remaining = request.num_prompt_tokens - request.num_computed_tokens
            chunk = _chunk(remaining, budget, align)
            if chunk == 0:
                break
            start = timer.start()
            blocks = manager.allocate_slots(request, chunk)
            timer.stop("allocate_slots", start)
            if blocks is None:
                raise RuntimeError(f"{request.request_id}: pool exhausted")
            request.num_computed_tokens += chunk
            budget -= chunk
            if request.num_computed_tokens == request.num_prompt_tokens:
                prefilling.remove(request)
                decoding.append(request)
        while waiting and budget > 0:
            request = waiting[0]
            start = timer.start()
            hit_blocks, hit, _ = manager.get_computed_blocks(request)
            timer.stop("get_computed_blocks", start)
            chunk = _chunk(request.num_prompt_tokens - hit, budget, align)
            if chunk == 0:
                break
            start = timer.start()
            blocks = manager.allocate_slots(
                request,
                chunk,
                num_new_computed_tokens=hit,
                new_computed_blocks=hit_blocks,
            )
            timer.stop("allocate_slots", start)
            if blocks is None:
                raise RuntimeError(f"{request.request_id}: pool exhausted")
            waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit + chunk
            timer.hit_tokens += hit
            budget -= chunk
            if request.num_computed_tokens == request.num_prompt_tokens:
                decoding.append(request)
            else:
                prefilling.append(request)
    for step in range(MANY_DECODE_STEPS):
        steps += 1
        start = timer.start()
        manager.new_step_starts()
        timer.stop("new_step_starts", start)
        for request in decoding:
            request.append_output_token_ids(1 + step)
            start = timer.start()
            blocks = manager.allocate_slots(request, 1)
            timer.stop("allocate_slots", start)
            if blocks is None:
                raise RuntimeError(f"{request.request_id}: pool exhausted in decode")
            request.num_computed_tokens += 1
    for request in decoding:
        start = timer.start()
        manager.free(request)
        timer.stop("free", start)
    if not manager.reset_prefix_cache():
        raise RuntimeError("blocks still held after freeing every request")
    return steps


def _profile_once(run: Any) -> dict[str, Any]:
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
    calls = sorted(
        (f"{Path(f).name}:{line}({name})", n)
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


def measure(
    workload: str, dcp: int, repeats: int, *, profile: bool = False
) -> dict[str, Any]:
    """Run ``workload`` ``repeats`` times in this process; JSON-ready result."""
    from vllm_dcp_geometry.cli import _vllm

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
    runs = []
    for _ in range(repeats):
        timer = Timer()
        requests = make_many_requests(setup, prompts) if prompts else []
        gc.collect()
        if workload == "replay":
            steps = run_replay_once(setup, timer)
        else:
            steps = run_many_once(setup, requests, timer)
        allocations = timer.calls["allocate_slots"]
        cpu_ns = sum(timer.cpu_ns.values())
        wall_ns = sum(timer.wall_ns.values())
        runs.append(
            {
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
        )
    best = min(runs, key=lambda r: r["manager_cpu_ns"])
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
        "us_per_allocation": best["us_per_allocation"],
        "wall_us_per_allocation": best["wall_us_per_allocation"],
        "best": best,
        "runs_us_per_allocation": [r["us_per_allocation"] for r in runs],
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
    apply = plugin._apply_patch_module

    def timed_apply(patch: Any, upstream: Any) -> None:
        begin = time.perf_counter_ns()
        apply(patch, upstream)
        applied_ns[patch.__name__] = time.perf_counter_ns() - begin

    plugin._apply_patch_module = timed_apply  # type: ignore[assignment]
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
    from vllm_dcp_geometry.cli import _vllm

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
