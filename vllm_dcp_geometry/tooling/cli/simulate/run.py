# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The simulation: vLLM's scheduler feeding all D worker ranks, checked.

``run_simulation`` builds one engine (vLLM's real ``Scheduler``, ``engine``)
and the block tables of its D workers for the chosen model runner
(``workers``, ``workers_v2``), then runs the engine loop: every
``SchedulerOutput`` of the workload (``workloads``) goes to every rank's
tables, every group's slot mappings and local lengths are checked at every
step (``checks``, with slot mappings from ``kernels``), and the stand-in
model's output goes back to the scheduler. The report is ``report``'s.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.contract import virtual_block_size
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.common.noise import vllm_notes_held_back
from vllm_dcp_geometry.tooling.cli.common.runs import progress_bar, replay_tokens
from vllm_dcp_geometry.tooling.cli.simulate.checks import Checker
from vllm_dcp_geometry.tooling.cli.simulate.engine import (
    Engine,
    StandInModel,
    build_engine,
    make_request,
    model_directory,
    model_runner_choice,
)
from vllm_dcp_geometry.tooling.cli.simulate.kernels import (
    CROSS_CHECK_EVERY,
    crosses_virtual_block,
    interpreted_check_due,
    probe_real_kernels,
)
from vllm_dcp_geometry.tooling.cli.simulate.options import (
    SimulationHooks,
    SimulationOptions,
    StepView,
)
from vllm_dcp_geometry.tooling.cli.simulate.report import build_report
from vllm_dcp_geometry.tooling.cli.simulate.views import GroupInfo
from vllm_dcp_geometry.tooling.cli.simulate.workers import (
    ScheduledBatch,
    V1Workers,
    WorkerSetup,
)
from vllm_dcp_geometry.tooling.cli.simulate.workers_v2 import V2Workers
from vllm_dcp_geometry.tooling.cli.simulate.workloads import (
    Workload,
    estimated_steps,
    make_workload,
)
from vllm_dcp_geometry.tooling.cpu_stand_ins import block_tables_on_cpu
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError

IDLE_STEPS_LIMIT = 64
"""Steps in a row that schedule nothing with nothing left to arrive: the pool
cannot hold any waiting request."""


@dataclass
class Tally:
    """What the run did, besides violations."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    scheduled_draft_tokens: int = 0
    finished_requests: int = 0
    cross_checked_steps: int = 0
    next_interpreted_check: int = 1
    """Under the Triton interpreter: the step index from which the next step
    is cross-checked (``kernels.interpreted_check_due``)."""
    accepted_tokens: int = 0
    """Draft tokens the stand-in model accepted."""
    scheduler_digest: Any = field(
        default_factory=lambda: hashlib.blake2b(digest_size=16)
    )
    slot_digest: Any = field(default_factory=lambda: hashlib.blake2b(digest_size=16))


def builder_shard_count(spec: Any, dcp: int, *, patched: bool) -> int:
    """The K a group's attention builder reads its cache with: the group's own
    (the patched builders run with ``(K, r % K)``), or what vLLM 0.33.0's
    attention code uses (MLA: always D; others: D if ``dcp_sharded``)."""
    from vllm_dcp_geometry.runtime.geometry import get_kv_cache_dcp_shard_count
    from vllm_dcp_geometry.runtime.worker_admission import upstream_read_shard_count

    if patched:
        return get_kv_cache_dcp_shard_count(spec, dcp)
    k = upstream_read_shard_count(spec, dcp)
    return 1 if k is None else k


def group_infos(topology: Topology, engine: Engine, patched: bool) -> list[GroupInfo]:
    """The checks' view of every group: the contract's K and V, the K its
    attention builder uses, and what its table holds."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    dcp = topology.decode_context_parallel_size
    infos = []
    for index, (group, spec) in enumerate(
        zip(topology.groups, engine.specs, strict=True)
    ):
        k = group.shard_count(dcp)
        recurrent = not group.is_attention
        infos.append(
            GroupInfo(
                index=index,
                name=group.name,
                kind=group.kind + (" (draft)" if group.draft else ""),
                spec=spec,
                block_size=group.block_size,
                shard_count=k,
                builder_shard_count=(
                    1 if recurrent else builder_shard_count(spec, dcp, patched=patched)
                ),
                virtual_block_size=virtual_block_size(group.block_size, k),
                slot_mapped=not recurrent and bool(spec.uses_slot_mapping),
                recurrent=recurrent,
                append_only=isinstance(spec, FullAttentionSpec)
                and getattr(spec, "sliding_window", None) is None
                and getattr(spec, "attention_chunk_size", None) is None,
            )
        )
    return infos


def _build_workers(
    setup: WorkerSetup, runner: str, kernels: bool, hooks: SimulationHooks
) -> Any:
    interpreted = setup.device == "cpu" and not hooks.cross_checks_as_on_a_gpu()
    if runner == "v1":
        workers: Any = V1Workers(setup)
    else:
        workers = V2Workers(setup, real=kernels, fed_every_step=not interpreted)
    workers.cross_check = kernels and (runner == "v1" or bool(workers.real))
    workers.interpreted = interpreted
    return workers


def _record_scheduler_output(tally: Tally, output: Any) -> None:
    """Counts and the digest of what the scheduler handed the workers."""
    tally.steps += 1
    tally.scheduled_tokens += output.total_num_scheduled_tokens
    tally.preemptions += len(output.preempted_req_ids or ())
    cached = output.scheduled_cached_reqs
    tally.prefix_hit_tokens += sum(
        r.num_computed_tokens for r in output.scheduled_new_reqs
    )
    # Only Model Runner V1 gets resumed requests as cached ones; a release
    # without V1 (0.34.0) has no such field and sends them as new requests.
    resumed = getattr(cached, "resumed_req_ids", None) or set()
    tally.prefix_hit_tokens += sum(
        n
        for r, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        if r in resumed
    )
    tally.scheduled_draft_tokens += sum(
        len(t) for t in output.scheduled_spec_decode_tokens.values()
    )
    record = [
        sorted(output.num_scheduled_tokens.items()),
        sorted(
            (r.req_id, r.num_computed_tokens, r.block_ids)
            for r in output.scheduled_new_reqs
        ),
        sorted(
            zip(
                cached.req_ids,
                cached.num_computed_tokens,
                [repr(b) for b in cached.new_block_ids],
                strict=True,
            )
        ),
        sorted(output.finished_req_ids),
        sorted(output.preempted_req_ids or ()),
    ]
    tally.scheduler_digest.update(repr(record).encode())


def check_step(
    step: int,
    batch: ScheduledBatch,
    engine: Engine,
    workers: Any,
    checker: Checker,
    tally: Tally,
) -> None:
    """Every check of one step, every group."""
    scheduler = engine.scheduler
    checker.check_block_sizes(step, scheduler.block_size, scheduler.hash_block_size)
    checker.check_overflows(step, workers.overflows, workers.widths)
    if not batch.req_ids:
        return
    groups = checker.groups
    sharded = [g.virtual_block_size for g in groups if g.slot_mapped]
    if workers.cross_check and workers.interpreted:
        cross, tally.next_interpreted_check = interpreted_check_due(
            step, tally.next_interpreted_check
        )
    else:
        cross = workers.cross_check and (
            step % CROSS_CHECK_EVERY == 0
            or crosses_virtual_block(batch.first_positions, batch.num_tokens, sharded)
        )
    real = workers.real_slot_mappings(batch) if cross else {}
    tally.cross_checked_steps += int(cross)
    for group in groups:
        if group.slot_mapped:
            slots = workers.twin_slot_mappings(batch, group.index)
            tally.slot_digest.update(slots.tobytes())
            checker.check_coverage(step, group, batch, slots)
            checker.check_slots(step, group, batch, slots)
            if cross:
                checker.compare_kernel(step, group, batch, slots, real[group.index])
        if group.recurrent:
            # Model Runner V2's restated rows are one store for every rank.
            ranks = range(checker.dcp) if workers.runner == "v1" else range(1)
            rows = [workers.rows(r, group.index, batch) for r in ranks]
            checker.check_recurrent(step, group, batch, rows)
        else:
            checker.check_local_lengths(step, group, batch)
    if cross and workers.runner == "v2" and workers.fed_every_step:
        # Tables given only the batch's rows hold what RowStore holds.
        for rank, index in workers.real_row_mismatches(batch):
            checker.violations.add(
                "kernel_mismatch",
                f"rank {rank}: vLLM's BlockTables rows differ from the restated rows",
                step=step,
                group=groups[index].name,
                rank=rank,
            )


def run_loop(
    engine: Engine,
    workload: Workload,
    workers: Any,
    checker: Checker,
    bar: Any,
    hooks: SimulationHooks,
) -> Tally:
    """The engine loop: schedule, hand the output to every rank, check, feed
    the stand-in model's output back (``EngineCore.step`` and ``post_step``)."""
    scheduler = engine.scheduler
    model = StandInModel(
        workload.seed, workload.num_speculative_tokens, workload.acceptance
    )
    pending = deque(sorted(workload.requests, key=lambda r: r.arrival_step))
    tally = Tally()
    idle = 0
    limit = estimated_steps(workload)
    while pending or scheduler.has_requests():
        while pending and pending[0].arrival_step <= tally.steps:
            scheduler.add_request(make_request(pending.popleft(), engine))
        output = scheduler.schedule()
        _record_scheduler_output(tally, output)
        checker.release(
            set(output.finished_req_ids) | set(output.preempted_req_ids or ())
        )
        batch = workers.update(output)
        check_step(tally.steps, batch, engine, workers, checker, tally)
        hooks.step_checked(
            StepView(tally.steps, output, batch, workers, checker, engine)
        )
        model_output = model.output(output, scheduler)
        finished = scheduler.update_from_output(output, model_output)
        for outputs in finished.values():
            tally.finished_requests += sum(
                1 for o in outputs.outputs if o.finish_reason is not None
            )
        drafts = model.propose(model_output, scheduler)
        if drafts is not None:
            scheduler.update_draft_token_ids(drafts)
        bar.update(output.total_num_scheduled_tokens)
        idle = 0 if output.total_num_scheduled_tokens or pending else idle + 1
        if idle > IDLE_STEPS_LIMIT or tally.steps > limit:
            raise TopologyError(
                f"the scheduler stopped making progress after {tally.steps} steps "
                f"with {len(scheduler.waiting)} request(s) waiting: a pool of "
                f"{engine.num_pages:,} pages cannot hold them; raise --num-pages"
            )
    tally.accepted_tokens = model.accepted_tokens
    return tally


def run_simulation(topology: Topology, options: SimulationOptions) -> dict[str, Any]:
    """Simulate one engine and its D workers; a JSON-ready report.

    Uses whatever vLLM this process has: patched after ``register()``, else
    upstream's.
    """
    import torch

    hooks = options.hooks()
    patched = vllm_objects.is_vllm_patched()
    tokens = replay_tokens(topology, options.tokens)
    workload = make_workload(
        topology,
        options.workload,
        tokens=tokens,
        step_tokens=options.step_tokens,
        num_requests=options.requests,
        seed=options.seed,
    )
    dcp = topology.decode_context_parallel_size
    started = time.perf_counter()
    with (
        model_runner_choice(options.runner),
        model_directory() as model_dir,
        block_tables_on_cpu(),
    ):
        with vllm_notes_held_back(not options.verbose):
            engine = build_engine(
                topology,
                workload,
                patched=patched,
                num_pages=options.num_pages,
                model_dir=model_dir,
            )
        groups = group_infos(topology, engine, patched)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        setup = WorkerSetup(
            kv_cache_config=engine.kv_cache_config,
            vllm_config=engine.vllm_config,
            max_len=topology.max_model_len,
            max_num_reqs=workload.max_num_seqs,
            max_num_batched_tokens=workload.step_tokens,
            dcp_world_size=dcp,
            patched=patched,
            device=device,
            shard_of=hooks.shard,
        )
        with vllm_notes_held_back(not options.verbose):
            # On CPU vLLM notes that its host buffers are not pinned.
            kernels, kernel_note = probe_real_kernels(device)
            workers = _build_workers(setup, options.runner, kernels, hooks)
        checker = Checker(
            groups, engine, dcp, topology.interleave_size, topology.mamba_cache_mode
        )
        bar = progress_bar(
            workload.total_tokens,
            f"simulate {options.runner} {'patched' if patched else 'unpatched'}",
            options.progress,
        )
        with bar:
            tally = run_loop(engine, workload, workers, checker, bar, hooks)
    elapsed = time.perf_counter() - started
    return build_report(
        topology,
        options,
        workload,
        engine,
        groups,
        workers,
        checker,
        tally,
        patched=patched,
        kernel_note=kernel_note,
        elapsed=elapsed,
    )
