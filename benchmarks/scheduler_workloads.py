# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The scheduler benchmark's workloads on vLLM's real ``KVCacheManager``.

Both on the default profile ``kimi-k3-tp16-dcp16`` (4 sharded MLA groups, 12
Mamba align groups with B = 768, 1 replicated draft group):

- ``replay``: one 1,000,000-token request in 768-token chunked-prefill steps,
  prefix caching off (what ``vllm-dcp-geometry replay`` drives, without its
  per-step checks).
- ``many``: 64 concurrent requests of 8K-128K tokens (max_model_len 131,072),
  a quarter each behind one of three shared prefixes or none, prefix caching
  on, a 16,384-token step budget (chunks on scheduler-block boundaries, as
  vLLM's Mamba-align scheduler cuts them), then 16 decode steps, then free.

Only the manager's own calls are timed (``Timer``); building requests,
hashing prompts and the pool are not.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
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
    from vllm_dcp_geometry.tooling.topology import load_profile

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
    rule, plus a page per group of headroom); built by the CLI's
    ``_vllm.build_kv_cache_manager``, as ``replay`` builds it."""
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    config = _vllm.sizing_config(topology, enable_prefix_caching=caching)
    specs = [_vllm.build_spec(g, topology, patched=patched) for g in topology.groups]
    num_pages = 1  # the null page
    for length in lengths:
        sized = _vllm.sizing_config(topology.with_layout(max_model_len=length))
        num_pages += sum(_vllm.pages_per_request(s, sized) for s in specs)
        num_pages += len(specs)
    built = _vllm.build_kv_cache_manager(
        topology, specs, config, num_pages, enable_caching=caching
    )
    return Setup(
        built.manager, built.scheduler_block_size, built.hash_block_size, num_pages
    )


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
