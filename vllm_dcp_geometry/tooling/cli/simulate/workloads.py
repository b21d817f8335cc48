# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The workloads ``simulate`` feeds vLLM's scheduler, seeded.

- ``replay``: the profile's one long request (e.g. 1,000,000 tokens) in
  ``step_tokens`` chunks, prefix caching and speculative decoding off;
- ``mixed``: many requests shaped by the profile's own geometry (``MixedShape``),
  with prefix caching, speculative decoding (a seeded share of the drafts
  accepted) and preemption, each of which must happen (``promised_events``):

  - a *wave* of requests arrives first, each prompt one token short of a
    scheduler-block boundary (the scheduler block is rule S1's LCM of every
    group's ``V = B * K``, e.g. 6,144 tokens on Kimi-K3), within one step's
    token budget together; vLLM admits a request only when its whole prompt fits, and
    ``engine.build_engine`` sizes the default pool to what vLLM's scheduler
    allocates the wave's prompts (``engine.held_pages``), so when the wave's
    first decode step crosses the boundary the scheduler must preempt;
  - a quarter of the other requests each follow one of three shared prefixes
    of whole scheduler blocks, or none; the first request of a family is its
    prefix alone, so the prefix ends where its prefill ends, on a block
    boundary, which is where a hybrid in Mamba ``align`` mode caches recurrent
    state: later requests of the family hit the prefix cache across it;
  - no request is longer than the whole wave, so the pool holds the longest
    alone (at least vLLM's pages-per-request rule for it) and every request
    can finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dcp_geometry.contract import cdiv, scheduler_block_size, virtual_block_size
from vllm_dcp_geometry.tooling.cli.common.runs import replay_step_tokens
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError

WORKLOADS = ("replay", "mixed")
RUNNERS = ("v1", "v2")

VOCAB_SIZE = 32_000
MIXED_REQUESTS = 32
MIXED_MIN_PROMPT = 256
MIXED_MAX_PROMPT = 12_288
"""About the tokens the wave's prompts hold together."""
MIXED_MAX_OUTPUT = 48
MIXED_PREFIXES = 4
"""Request ``i`` past the wave follows prefix family ``i % 4``; family 0 has
no prefix."""
MIXED_STEP_TOKENS = 4_096
MIXED_WAVE = 2
"""Requests of the wave, at least (more where a sliding window keeps each
prompt short)."""
MIXED_WAVE_TOKENS = 6_144
"""About the tokens of one wave prompt, at least one scheduler block, at most
a sliding window (vLLM frees the pages a window leaves behind, which would
give the wave room to grow)."""
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
    wave: int = 0
    """The first ``wave`` requests: the default pool holds exactly their
    prompts (``engine.default_num_pages``)."""
    scheduler_block: int = 0
    """The scheduler block the workload was shaped by (0: not shaped)."""
    prefixes: tuple[int, ...] = ()
    """Tokens of each prefix family's shared prefix (0: none)."""

    @property
    def total_tokens(self) -> int:
        return sum(r.prompt_len + r.max_tokens for r in self.requests)

    def promised_events(self) -> tuple[str, ...]:
        """What the run must show for the workload to have proven anything:
        the mixed workload promises preemption, prefix-cache hits where
        caching is on and accepted drafts where there are drafts."""
        if self.name != "mixed":
            return ()
        events = ["preemptions"]
        if self.enable_prefix_caching:
            events.append("prefix_hit_tokens")
        if self.num_speculative_tokens:
            events.append("accepted_draft_tokens")
        return tuple(events)


@dataclass(frozen=True)
class MixedShape:
    """The mixed workload's sizes, from the profile's geometry."""

    block: int
    """The scheduler block: rule S1's LCM of every group's ``V = B * K``."""
    wave: int
    """Requests of the wave (0: none, too few requests or no room)."""
    wave_prompt: int
    """Tokens of each wave prompt: whole blocks less one."""
    longest_prompt: int
    prefixes: tuple[int, ...]
    """Each family's shared prefix, whole blocks (0: none)."""
    step_tokens: int
    spec_tokens: int


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


def _scheduler_block(topology: Topology) -> int:
    """Rule S1's scheduler block of the topology (a recurrent group's K is 1):
    the unit vLLM rounds a prefix-cache hit down to."""
    dcp = topology.decode_context_parallel_size
    return scheduler_block_size(
        virtual_block_size(g.block_size, g.shard_count(dcp)) for g in topology.groups
    )


def _wave_size(
    topology: Topology, block: int, step_tokens: int | None, count: int
) -> tuple[int, int]:
    """``(requests, blocks per prompt)`` of the wave: prompts of about
    ``MIXED_WAVE_TOKENS`` (at most a sliding window) that together hold about
    ``MIXED_MAX_PROMPT``, within one step's budget together (``step_tokens``),
    and the longest request, as long as the whole wave, fits
    ``max_model_len``."""
    windows = [
        int(g.spec_fields["sliding_window"])
        for g in topology.groups
        if g.spec_fields.get("sliding_window")
    ]
    soft = min([MIXED_WAVE_TOKENS, *windows])
    limit = min(topology.max_model_len, step_tokens or topology.max_model_len)
    blocks = min(max(1, soft // block), limit // (MIXED_WAVE * block))
    if not blocks:
        return 0, 0
    wave = max(MIXED_WAVE, MIXED_MAX_PROMPT // (blocks * block))
    seqs = min(count, max(topology.max_num_seqs, 16))
    wave = min(wave, seqs, count // 2, limit // (blocks * block))
    return (wave, blocks) if wave >= MIXED_WAVE else (0, 0)


def mixed_shape(topology: Topology, step_tokens: int | None, count: int) -> MixedShape:
    """The mixed workload's sizes, from the profile's geometry (see the module
    docstring): the scheduler block, the wave, prompts that fit its pool and
    the shared prefixes, each whole blocks."""
    block = _scheduler_block(topology)
    spec_tokens = _speculative_tokens(topology)
    wave, blocks = _wave_size(topology, block, step_tokens, count)
    tail = MIXED_MAX_OUTPUT + spec_tokens + 1
    if wave:
        # Pages per request are subadditive in its length: a request as long
        # as the whole wave fits the pool that holds the wave's prompts.
        longest = wave * (blocks * block - 1) - tail
    else:
        longest = min(MIXED_MAX_PROMPT, topology.max_model_len - tail)
    if longest < 2:
        raise TopologyError(f"--workload mixed needs max_model_len >= {tail + 2:,}")
    families = MIXED_PREFIXES - 1
    prefixes = [0]
    for family in range(1, MIXED_PREFIXES):
        length = max(1, family * longest // (2 * families) // block) * block
        prefixes.append(length if length < longest else 0)
    budget = step_tokens or max(
        cdiv(MIXED_STEP_TOKENS, block) * block, wave * blocks * block
    )
    return MixedShape(
        block=block,
        wave=wave,
        wave_prompt=blocks * block - 1,
        longest_prompt=longest,
        prefixes=tuple(prefixes),
        step_tokens=budget,
        spec_tokens=spec_tokens,
    )


def _family(index: int) -> int:
    """The prefix family of the ``index``-th request past the wave: first each
    family's prefix alone, followed at once by one more of the family (a hit
    before the small pool evicts the prefix), then the families in turn."""
    opening = 2 * (MIXED_PREFIXES - 1)
    if index < opening:
        return index // 2 + 1
    return index % MIXED_PREFIXES


def _mixed_workload(
    topology: Topology, step_tokens: int | None, num_requests: int | None, seed: int
) -> Workload:
    """The wave (arriving first), then the prefix families and unshared
    requests arriving from the next step on, seeded."""
    import numpy as np

    count = num_requests or MIXED_REQUESTS
    shape = mixed_shape(topology, step_tokens, count)
    rng = np.random.default_rng(seed)

    def tokens(n: int) -> list[int]:
        return rng.integers(1, VOCAB_SIZE, n).tolist()

    plans = []
    for i in range(shape.wave):
        output = int(
            rng.integers(MIXED_MAX_OUTPUT // 2, MIXED_MAX_OUTPUT, endpoint=True)
        )
        plans.append(
            RequestPlan(f"mixed-{i}", tuple(tokens(shape.wave_prompt)), output, 0)
        )
    prefixes = [tokens(n) for n in shape.prefixes]
    started: set[int] = set()
    arrival = 1
    shortest = min(MIXED_MIN_PROMPT, shape.longest_prompt)
    for i in range(shape.wave, count):
        family = _family(i - shape.wave)
        shared = prefixes[family]
        if shared and family not in started:
            # The family's prefix alone: its prefill ends on a block boundary.
            length = len(shared)
            started.add(family)
        elif shared:
            length = int(
                rng.integers(len(shared) + 1, shape.longest_prompt, endpoint=True)
            )
        else:
            length = int(rng.integers(shortest, shape.longest_prompt, endpoint=True))
        prompt = shared + tokens(length - len(shared))
        output = int(rng.integers(1, MIXED_MAX_OUTPUT, endpoint=True))
        # Half arrive at once after the wave; the rest trickle in.
        if i - shape.wave >= (count - shape.wave) // 2:
            arrival += int(rng.integers(1, 4, endpoint=True))
        plans.append(RequestPlan(f"mixed-{i}", tuple(prompt), output, arrival))
    return Workload(
        name="mixed",
        requests=tuple(plans),
        step_tokens=shape.step_tokens,
        max_num_seqs=min(count, max(topology.max_num_seqs, 16)),
        # vLLM caches recurrent state for prefix hits in align mode only.
        enable_prefix_caching=topology.mamba_cache_mode == "align"
        or all(g.is_attention for g in topology.groups),
        num_speculative_tokens=shape.spec_tokens,
        acceptance=MIXED_ACCEPTANCE,
        seed=seed,
        wave=shape.wave,
        scheduler_block=shape.block,
        prefixes=shape.prefixes,
    )


def estimated_steps(workload: Workload) -> int:
    """A bound on the steps a run needs, for the stall guard."""
    prefill = sum(cdiv(r.prompt_len, workload.step_tokens) for r in workload.requests)
    decode = sum(r.max_tokens for r in workload.requests)
    arrival = max((r.arrival_step for r in workload.requests), default=0)
    return 4 * (prefill + decode + arrival) + 64
