# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s capacity proof: vLLM's real scheduler, on the pool
start-up makes for the budget, holds exactly the target-context requests
vLLM's rule predicts.

The pool. ``vllm_pool`` is the pool start-up makes for a budget (its
planner's groups, padding layers included, and sizing) with the blocks one
``max_model_len`` request takes from it by vLLM's rule; ``capacity_check``
runs the scheduler on the pools of the points ``plan --optimize`` names.

The engine. ``simulate``'s ``build_engine`` builds the scheduler class
vLLM's engine core picks for the config (``AsyncScheduler`` under vLLM's
default async scheduling) over the pool's own ``KVCacheConfig``
(``start_up_pool``: start-up's groups, padding and block count), with the
step budget (``max_num_batched_tokens``) of the config the rule read,
chunked prefill on, prefix caching off and no speculative decoding, as that
config has them. It is driven as ``EngineCore.step_with_batch_queue``
drives it: a step is scheduled while up to ``max_concurrent_batches`` are in
flight, and outputs go back oldest first, so freeing on the processed-token
basis (sliding windows) sees the in-flight tokens vLLM's rule reserves for.

The measurement. One request more than predicted arrives at once (with
recycling groups, below, one more than the pool could hold were each of
their requests a single block), ``max_num_seqs`` that many, so only the
pool limits them. Each has ``max_model_len - 1`` prompt tokens (the longest
prompt vLLM admits: its one sampled token completes the context and is
never cached). The stand-in model samples nothing (``hold_prefilled``): a
request whose prompt is computed stays running with its whole context in
the pool and asks for nothing more. The loop stops when a step schedules
nothing and no step that scheduled anything is in flight; after that no
state can change (or the request past the held ones is admitted and
preempted over and over: ``_run_until_settled``). ``admitted``: the
requests then running with their whole prompt computed.

Why it is exact. A held request frees and allocates nothing: it keeps what
it held at its last chunk. Prefills run in arrival order and may overlap
(Mamba align mode ends chunks at state-block boundaries and leaves the rest
of the budget to the next requests); vLLM's admission gate counts the blocks
free at that moment, not those earlier prefills will still take, so the
request past the prediction may be admitted. When blocks run out vLLM
preempts the newest running request, that one, so the requests ahead of it
reach their whole context undisturbed where they fit, and it is not
counted: the gate refuses it (it waits), or vLLM preempts it, once or over
and over (the gate lets it in again). A pool that holds fewer than
predicted preempts a request the rule counted, which then waits or cycles
in its place. So ``admitted`` is how many prefilled requests the pool holds
at once.
For full attention, MLA, the DSA indexer and Mamba state (align mode: the
two state blocks of a chunk boundary) a prefilled request holds what vLLM's
rule counts per request (``max_memory_usage_bytes``), and ``admitted`` must
equal the prediction. Recycling groups (sliding window, chunked local) are
counted by the rule at their prefill peak, window plus
``max_in_flight_tokens``; once prefilled a request holds its window and its
last chunks, fewer blocks by where its chunks fell, so vLLM's scheduler may
hold more at once: there the rule is a lower bound, and ``admitted`` must be
at least it (both reported).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.tooling.cli.plan.optimize_candidates import Choice, applied
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError


@dataclasses.dataclass(frozen=True)
class Pool:
    """vLLM's pool for a budget and the max-length requests its rule holds."""

    num_blocks: int
    blocks_per_request: int
    kv_cache_config: Any
    config: Any

    @property
    def requests(self) -> int:
        # Every group's blocks come from one pool, less its null block.
        return (self.num_blocks - 1) // self.blocks_per_request


def vllm_pool(topology: Topology, backend_names: set[str], kv_bytes: int) -> Pool:
    """Start-up's pool for ``kv_bytes`` per rank (vLLM's planner, padding
    layers included, and its sizing) and the blocks one ``max_model_len``
    request takes from it at its peak, summed over vLLM's groups
    (``max_memory_usage_bytes`` per page, vLLM's concurrency rule)."""
    from vllm_dcp_geometry.contract import cdiv
    from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import (
        start_up_pool,
    )

    kv_cache_config, config = start_up_pool(topology, backend_names, kv_bytes)
    per_request = sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(config),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in kv_cache_config.kv_cache_groups
    )
    return Pool(kv_cache_config.num_blocks, per_request, kv_cache_config, config)


def capacity_check(
    topology: Topology,
    picked: Sequence[Choice],
    points: dict[str, tuple[int, ...]],
    pool_of: Any,
) -> dict[str, Any]:
    """vLLM's scheduler on each named point's pool (``pool_of(ks)``, a
    ``Pool``): predicted and admitted requests per point. ``holds`` only
    where every point whose pool start-up makes admits exactly the
    prediction (at least it where the rule is a bound); one start-up's
    planner refuses is named, not run."""
    result: dict[str, Any] = {}
    measured: dict[tuple[int, ...], dict[str, Any]] = {}
    for label, ks in points.items():
        if ks not in measured:
            measured[ks] = _checked_point(topology, picked, ks, pool_of)
        result[label] = measured[ks]
    result["holds"] = all(e["agrees"] for e in measured.values() if "refused" not in e)
    return result


def _checked_point(
    topology: Topology, picked: Sequence[Choice], ks: tuple[int, ...], pool_of: Any
) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "shard_counts": {c.name: k for c, k in zip(picked, ks, strict=True)}
    }
    try:
        pool = pool_of(ks)
    except TopologyError as exc:
        entry["refused"] = str(exc)
        return entry
    admission = scheduler_admission(applied(topology, picked, ks), pool)
    return entry | {
        "num_blocks": pool.num_blocks,
        "blocks_per_request": pool.blocks_per_request,
        "step_tokens": pool.config.scheduler_config.max_num_batched_tokens,
        **admission.as_json(),
    }


@dataclasses.dataclass(frozen=True)
class Admission:
    """What vLLM's scheduler held at once against what the rule predicted."""

    predicted: int
    submitted: int
    admitted: int | None
    """``None`` where the scheduler cannot be configured to try (``reason``)."""
    preemptions: int
    preempted: tuple[int, ...]
    """The preempted requests, numbered from 1 in arrival order."""
    steps: int
    scheduler: str
    batches_in_flight: int
    recycling_groups: int
    """Groups whose rule reserves a prefill peak a prefilled request need
    not hold (sliding window, chunked local): the rule is then a lower bound."""
    cycling: bool = False
    """The request past the held ones is admitted and preempted over and over
    (vLLM's admission gate counts fewer blocks than its prefill takes)."""
    reason: str | None = None

    @property
    def agrees(self) -> bool:
        """Exactly the prediction; at least it where the rule is a bound."""
        if self.reason is not None or self.admitted is None:
            return False
        if self.recycling_groups:
            return self.admitted >= self.predicted
        return self.admitted == self.predicted

    def as_json(self) -> dict[str, Any]:
        return {
            "predicted_requests": self.predicted,
            "submitted_requests": self.submitted,
            "admitted_requests": self.admitted,
            "preemptions": self.preemptions,
            "preempted_requests": list(self.preempted),
            "cycling": self.cycling,
            "scheduler_steps": self.steps,
            "scheduler": self.scheduler,
            "batches_in_flight": self.batches_in_flight,
            "rule": "lower bound" if self.recycling_groups else "exact",
            "not_run": self.reason,
            "agrees": self.agrees,
        }


def _is_recycling(spec: Any) -> bool:
    # vLLM's recycling-aware specs cap admission at their prefill peak
    # (``max_admission_blocks_per_request``) and free blocks behind it.
    one = (
        next(iter(spec.kv_cache_specs.values()), spec)
        if hasattr(spec, "kv_cache_specs")
        else spec
    )
    return hasattr(one, "max_admission_blocks_per_request")


def scheduler_admission(topology: Topology, pool: Pool) -> Admission:
    """How many ``max_model_len`` requests vLLM's scheduler holds at once in
    ``pool``. One more than predicted is submitted; with recycling groups,
    one more than the pool could hold were each of their requests one block,
    so the count is never cut short by the submissions (within
    ``max_num_seqs <= max_num_batched_tokens``)."""
    from vllm_dcp_geometry.tooling.cli.simulate.engine import (
        StandInModel,
        make_request,
    )

    groups = pool.kv_cache_config.kv_cache_groups
    recycling = [g for g in groups if _is_recycling(g.kv_cache_spec)]
    step_tokens = pool.config.scheduler_config.max_num_batched_tokens
    submitted = _submissions(pool, recycling)
    if submitted > step_tokens:
        # vLLM requires max_num_seqs <= max_num_batched_tokens.
        return Admission(
            predicted=pool.requests,
            submitted=submitted,
            admitted=None,
            preemptions=0,
            preempted=(),
            steps=0,
            scheduler="not built",
            batches_in_flight=0,
            recycling_groups=len(recycling),
            reason=f"vLLM's scheduler runs at most max_num_batched_tokens "
            f"({step_tokens:,}) requests at once (max_num_seqs), fewer than "
            f"{submitted:,}",
        )
    workload = _capacity_workload(topology.max_model_len, submitted, step_tokens)
    engine = _engine_on(topology, workload, pool)
    scheduler = engine.scheduler
    for plan in workload.requests:
        scheduler.add_request(make_request(plan, engine))
    in_flight = engine.vllm_config.max_concurrent_batches
    steps, ending = _run_until_settled(
        scheduler,
        StandInModel(0, 0, 0.0, hold_prefilled=True),
        in_flight,
        preemption_limit=4 * submitted,
    )
    arrivals = {plan.request_id: i for i, plan in enumerate(workload.requests, 1)}
    requests = scheduler.requests.values()
    return Admission(
        predicted=pool.requests,
        submitted=submitted,
        admitted=sum(map(_is_held, scheduler.running)),
        preemptions=sum(r.num_preemptions for r in requests),
        preempted=tuple(
            sorted(arrivals[r.request_id] for r in requests if r.num_preemptions)
        ),
        steps=steps,
        scheduler=type(scheduler).__name__,
        batches_in_flight=in_flight,
        recycling_groups=len(recycling),
        cycling=ending == "cycling",
        reason=None
        if ending != "unsettled"
        else f"vLLM's scheduler did not settle ({4 * submitted:,} preemptions)",
    )


def _submissions(pool: Pool, recycling: list[Any]) -> int:
    # Were each recycling group's requests one block, the pool would hold
    # ``bound``; one step's tokens cap ``max_num_seqs`` unless the prediction
    # reaches them (then the scheduler is not run).
    from vllm_dcp_geometry.tooling import vllm_objects

    step_tokens = pool.config.scheduler_config.max_num_batched_tokens
    smallest = pool.blocks_per_request - sum(
        vllm_objects.pages_per_request(g.kv_cache_spec, pool.config) - 1
        for g in recycling
    )
    bound = (pool.num_blocks - 1) // smallest if recycling else pool.requests
    return min(bound + 1, max(step_tokens, pool.requests + 1))


def _capacity_workload(length: int, submitted: int, step_tokens: int) -> Any:
    """``submitted`` requests of the longest prompt vLLM admits, at once."""
    from vllm_dcp_geometry.tooling.cli.simulate.workloads import (
        RequestPlan,
        Workload,
    )

    return Workload(
        name="capacity",
        requests=tuple(
            RequestPlan(f"capacity-{i}", length - 1, 1, 0) for i in range(submitted)
        ),
        step_tokens=step_tokens,
        max_num_seqs=submitted,
        enable_prefix_caching=False,
        num_speculative_tokens=0,
        acceptance=0.0,
        seed=0,
    )


def _engine_on(topology: Topology, workload: Any, pool: Pool) -> Any:
    """``simulate``'s engine over the pool's own ``KVCacheConfig``."""
    from vllm_dcp_geometry.tooling import vllm_objects
    from vllm_dcp_geometry.tooling.cli.common.noise import vllm_notes_held_back
    from vllm_dcp_geometry.tooling.cli.simulate.engine import (
        build_engine,
        model_directory,
    )

    with model_directory() as model_dir, vllm_notes_held_back():
        engine = build_engine(
            topology,
            workload,
            patched=True,
            num_pages=None,
            model_dir=model_dir,
            kv_cache_config=pool.kv_cache_config,
            as_served=True,
        )
    # The rule read start-up's config; the scheduler must size by the same.
    per_request = sum(
        vllm_objects.pages_per_request(g.kv_cache_spec, engine.vllm_config)
        for g in pool.kv_cache_config.kv_cache_groups
    )
    if per_request != pool.blocks_per_request:
        raise TopologyError(
            f"--optimize: the scheduler's config gives {per_request:,} blocks per "
            f"request by vLLM's rule, start-up's {pool.blocks_per_request:,}"
        )
    return engine


def _is_held(request: Any) -> bool:
    return request.num_computed_tokens >= request.num_prompt_tokens


def _run_until_settled(
    scheduler: Any, model: Any, batches_in_flight: int, *, preemption_limit: int
) -> tuple[int, str]:
    """``EngineCore.step_with_batch_queue``'s loop until nothing can change:
    the steps scheduled and how it ended. ``settled``: a step schedules
    nothing with no step that scheduled anything in flight. ``cycling``: a
    request is preempted again with the same requests held and no other
    prefilling, so the scheduler is where it was at that request's previous
    preemption (held requests never change, the rest wait uncomputed) and
    repeats it forever. ``unsettled``: more than ``preemption_limit``
    preemptions otherwise (never seen; a guard)."""
    queue: deque[Any] = deque()
    held_at_preemption: dict[str, int] = {}
    steps = preemptions = 0
    while preemptions <= preemption_limit:
        output = scheduler.schedule()
        steps += 1
        for request_id in output.preempted_req_ids or ():
            preemptions += 1
            held = sum(map(_is_held, scheduler.running))
            if held == len(scheduler.running) and (
                held_at_preemption.get(request_id) == held
            ):
                return steps, "cycling"
            held_at_preemption[request_id] = held
        queue.appendleft(output)
        if not any(o.total_num_scheduled_tokens for o in queue):
            return steps, "settled"
        if len(queue) < batches_in_flight and output.total_num_scheduled_tokens:
            continue
        oldest = queue.pop()
        scheduler.update_from_output(oldest, model.output(oldest, scheduler))
    return steps, "unsettled"
