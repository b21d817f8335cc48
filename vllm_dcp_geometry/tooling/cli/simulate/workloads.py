# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The workloads ``simulate`` feeds vLLM's scheduler, seeded.

- ``replay``: the profile's one long request (e.g. 1,000,000 tokens) in
  ``step_tokens`` chunks, prefix caching and speculative decoding off;
- ``mixed``: many requests of mixed lengths, a quarter each behind one of
  three shared prefixes or none, half arriving at once and the rest over the
  following steps, with prefix caching, speculative decoding (a seeded share
  of the drafts accepted) and a pool small enough that the scheduler must
  preempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.tooling.cli.common.runs import replay_step_tokens
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError

WORKLOADS = ("replay", "mixed")
RUNNERS = ("v1", "v2")

VOCAB_SIZE = 32_000
MIXED_REQUESTS = 32
MIXED_MIN_PROMPT = 256
MIXED_MAX_PROMPT = 12_288
MIXED_MAX_OUTPUT = 48
MIXED_PREFIXES = 4
"""Request ``i`` shares prefix family ``i % 4``; family 0 has no prefix."""
MIXED_STEP_TOKENS = 4_096
MIXED_POOL_SHARE = 0.4
"""Share of the pages the longest requests would need at once, all running."""
MIXED_ACCEPTANCE = 0.6
MIXED_SPEC_TOKENS = 2
"""Draft tokens per step when no recurrent group fixes the count."""


@dataclass(frozen=True)
class RequestPlan:
    """One request of a workload: its prompt, output budget and arrival."""

    request_id: str
    prompt: tuple[int, ...] | int
    """Token ids, or a length (a prompt of zeros, for very long requests)."""
    max_tokens: int
    arrival_step: int

    @property
    def prompt_len(self) -> int:
        return self.prompt if isinstance(self.prompt, int) else len(self.prompt)

    def prompt_token_ids(self) -> list[int]:
        if isinstance(self.prompt, int):
            return [0] * self.prompt
        return list(self.prompt)


@dataclass(frozen=True)
class Workload:
    """Requests plus the engine settings the workload runs under."""

    name: str
    requests: tuple[RequestPlan, ...]
    step_tokens: int
    """``max_num_batched_tokens``: the scheduler's token budget per step."""
    max_num_seqs: int
    enable_prefix_caching: bool
    num_speculative_tokens: int
    acceptance: float
    seed: int

    @property
    def total_tokens(self) -> int:
        return sum(r.prompt_len + r.max_tokens for r in self.requests)


def _speculative_tokens(topology: Topology) -> int:
    """Draft tokens per step: what the recurrent groups reserve blocks for
    (vLLM sizes ``num_speculative_blocks`` from it), else a small default."""
    counts = {
        int(g.spec_fields.get("num_speculative_blocks", 0))
        for g in topology.groups
        if not g.is_attention
    }
    if len(counts) > 1:
        raise TopologyError(
            f"topology {topology.name!r}: recurrent groups reserve different "
            f"numbers of speculative blocks {sorted(counts)}; vLLM sizes them all "
            "from one num_speculative_tokens"
        )
    if counts:
        return counts.pop()
    return MIXED_SPEC_TOKENS


def make_workload(
    topology: Topology,
    name: str,
    *,
    tokens: int,
    step_tokens: int | None,
    num_requests: int | None,
    seed: int,
) -> Workload:
    """The workload ``name`` for ``topology`` (``tokens``: replay length)."""
    if name == "replay":
        if num_requests not in (None, 1):
            raise TopologyError("--requests applies to --workload mixed only")
        # The prompt plus its one generated token fill ``tokens`` positions:
        # vLLM admits no prompt as long as max_model_len.
        plan = RequestPlan("replay-0", max(tokens - 1, 1), 1, 0)
        return Workload(
            name=name,
            requests=(plan,),
            step_tokens=replay_step_tokens(topology, step_tokens),
            max_num_seqs=1,
            enable_prefix_caching=False,
            num_speculative_tokens=0,
            acceptance=0.0,
            seed=seed,
        )
    if name != "mixed":
        raise TopologyError(f"unknown workload {name!r}; one of {list(WORKLOADS)}")
    return _mixed_workload(topology, step_tokens, num_requests, seed)


def _mixed_workload(
    topology: Topology, step_tokens: int | None, num_requests: int | None, seed: int
) -> Workload:
    import numpy as np

    count = num_requests or MIXED_REQUESTS
    spec_tokens = _speculative_tokens(topology)
    longest_prompt = min(
        MIXED_MAX_PROMPT, topology.max_model_len - MIXED_MAX_OUTPUT - spec_tokens - 1
    )
    if longest_prompt < MIXED_MIN_PROMPT:
        raise TopologyError(
            f"--workload mixed needs max_model_len >= "
            f"{MIXED_MIN_PROMPT + MIXED_MAX_OUTPUT + spec_tokens + 1:,}"
        )
    rng = np.random.default_rng(seed)
    prefix_lens = np.linspace(0, longest_prompt // 2, MIXED_PREFIXES).astype(int)
    prefixes = [rng.integers(1, VOCAB_SIZE, n).tolist() for n in prefix_lens]
    plans = []
    arrival = 0
    for i in range(count):
        length = int(rng.integers(MIXED_MIN_PROMPT, longest_prompt, endpoint=True))
        shared = prefixes[i % MIXED_PREFIXES][: length // 2]
        tail = rng.integers(1, VOCAB_SIZE, length - len(shared)).tolist()
        output = int(rng.integers(1, MIXED_MAX_OUTPUT, endpoint=True))
        # Half arrive at once; the rest trickle in, one every few steps.
        if i >= count // 2:
            arrival += int(rng.integers(1, 4, endpoint=True))
        plans.append(RequestPlan(f"mixed-{i}", tuple(shared + tail), output, arrival))
    budget = step_tokens or max(
        MIXED_STEP_TOKENS, 2 * topology.scheduler_cache_block_size
    )
    return Workload(
        name="mixed",
        requests=tuple(plans),
        step_tokens=budget,
        max_num_seqs=min(count, max(topology.max_num_seqs, 16)),
        # vLLM caches recurrent state for prefix hits in align mode only.
        enable_prefix_caching=topology.mamba_cache_mode == "align"
        or all(g.is_attention for g in topology.groups),
        num_speculative_tokens=spec_tokens,
        acceptance=MIXED_ACCEPTANCE,
        seed=seed,
    )


def estimated_steps(workload: Workload) -> int:
    """A bound on the steps a run needs, for the stall guard."""
    prefill = sum(cdiv(r.prompt_len, workload.step_tokens) for r in workload.requests)
    decode = sum(r.max_tokens for r in workload.requests)
    arrival = max((r.arrival_step for r in workload.requests), default=0)
    return 4 * (prefill + decode + arrival) + 64
