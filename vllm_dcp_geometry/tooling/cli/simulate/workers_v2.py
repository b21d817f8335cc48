# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The worker side of ``simulate``: Model Runner V2 on every DCP rank.

Model Runner V2 keeps one ``BlockTables`` per worker: a row per request-state
index and group, written through staged writes, with one ``cp_size``/
``cp_rank`` plus a sharded flag per group; patched at ``D > 1``, the per-group
shard counts (``geometry.group_shard_counts``) reach it through the side
channel the patched ``initialize_kv_cache`` uses.

vLLM's ``BlockTables`` keeps its host-side buffers in pinned (UVA) memory and
applies, gathers and maps through Triton kernels, so it can only be built and
fed where those kernels run (a GPU, or the Triton interpreter in tests). There
each rank gets the real object, fed every step; everywhere the rows live in
``RowStore`` and the kernels are twins. Restated, and checked against the
real ``BlockTables`` on sampled steps wherever it can be built:

- the request-index bookkeeping of ``finish_requests``/``add_requests``/
  ``update_requests`` (``V2RowBook``: freed indices are reused last-in
  first-out, like ``RequestState``) and the staged row writes
  (``RowStore``);
- the per-group arguments ``initialize_kv_cache`` gives ``BlockTables``;
- the slot-mapping kernel (``kernels``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.tooling.cli.simulate.kernels import (
    KernelGeometry,
    twin_slot_mapping,
)
from vllm_dcp_geometry.tooling.cli.simulate.workers import (
    ScheduledBatch,
    WorkerSetup,
    scheduled_batch,
)

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class RowWrite:
    """``append_block_ids(index, block_ids, overwrite)`` of one request."""

    req_id: str
    index: int
    block_ids: tuple[list[int], ...]
    overwrite: bool


@dataclass
class V2RowBook:
    """Request-state index of every request (restated from ``RequestState``
    and the runner's ``finish_requests``/``add_requests``/``update_requests``)."""

    max_num_reqs: int
    index_of: dict[str, int] = field(default_factory=dict)
    free_indices: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_indices = list(range(self.max_num_reqs))

    def _remove(self, req_id: str) -> None:
        index = self.index_of.pop(req_id, None)
        if index is not None:
            self.free_indices.append(index)

    def update(self, scheduler_output: Any) -> list[RowWrite]:
        finished = set(scheduler_output.finished_req_ids)
        finished |= set(scheduler_output.preempted_req_ids or ())
        for req_id in sorted(finished):
            self._remove(req_id)
        writes = []
        for new in scheduler_output.scheduled_new_reqs:
            self._remove(new.req_id)
            if not self.free_indices:
                raise RuntimeError(f"more than {self.max_num_reqs} request states")
            index = self.free_indices.pop()
            self.index_of[new.req_id] = index
            writes.append(RowWrite(new.req_id, index, new.block_ids, True))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_ids is not None:
                writes.append(RowWrite(req_id, self.index_of[req_id], new_ids, False))
        return writes


class RowStore:
    """Every group's rows by request-state index, as ``BlockTables`` holds them
    after ``apply_staged_writes`` (rows are the same on every rank)."""

    def __init__(self, max_num_reqs: int, widths: list[int]) -> None:
        import numpy as np

        self.rows: list[Any] = [
            np.zeros((max_num_reqs, w), dtype=np.int32) for w in widths
        ]
        self.num_blocks: Any = np.zeros((len(widths), max_num_reqs), dtype=np.int64)

    def fit(self, write: RowWrite) -> tuple[RowWrite, list[tuple[str, int, int]]]:
        """``write`` clipped to the tables, and (request, group, columns) of
        any part that would overflow (``append_block_ids`` raises there)."""
        overflows = []
        fitted = []
        for group, ids in enumerate(write.block_ids):
            start = 0 if write.overwrite else int(self.num_blocks[group, write.index])
            room = self.rows[group].shape[1] - start
            if len(ids) > room:
                overflows.append((write.req_id, group, start + len(ids)))
            fitted.append(list(ids[:room]))
        clipped = RowWrite(write.req_id, write.index, tuple(fitted), write.overwrite)
        return clipped, overflows

    def apply(self, write: RowWrite) -> None:
        for group, ids in enumerate(write.block_ids):
            start = 0 if write.overwrite else int(self.num_blocks[group, write.index])
            self.rows[group][write.index, start : start + len(ids)] = ids
            self.num_blocks[group, write.index] = start + len(ids)


def upstream_v2_table_args(
    kv_cache_config: Any, vllm_config: Any, max_len: int
) -> dict:
    """The per-group lists ``initialize_kv_cache`` gives ``BlockTables``
    (restated; the spec methods and ``get_block_table_width`` are vLLM's).
    The tests' ``BlockTables`` are built from these too."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

    from vllm_dcp_geometry.runtime.geometry import runner_table_width

    args: dict[str, list[Any]] = {
        "block_sizes": [],
        "max_num_blocks_per_group": [],
        "slot_mapping_enabled": [],
        "dcp_sharded": [],
        "sliding_window_reach": [],
    }
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        layer = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        args["block_sizes"].append(spec.block_size)
        args["slot_mapping_enabled"].append(bool(layer.uses_slot_mapping))
        args["dcp_sharded"].append(bool(spec.dcp_sharded))
        args["sliding_window_reach"].append(
            layer.num_retained_tokens if isinstance(layer, SlidingWindowSpec) else 0
        )
        args["max_num_blocks_per_group"].append(
            runner_table_width(spec, spec.max_num_blocks_per_req(vllm_config, max_len))
        )
    return args


def v2_launch_shard_counts(setup: WorkerSetup) -> list[int]:
    """The K each group's slot-mapping launch divides positions by: the
    patched runner's per-group counts, or upstream's ``cp_size`` for a
    sharded group and 1 for the rest."""
    from vllm_dcp_geometry.runtime.geometry import (
        default_shard_count,
        group_shard_counts,
    )

    dcp = setup.dcp_world_size
    groups = setup.kv_cache_config.kv_cache_groups
    if setup.patched and dcp > 1:
        parallel = setup.vllm_config.parallel_config
        return group_shard_counts(
            groups,
            dcp,
            pcp_world_size=parallel.prefill_context_parallel_size,
            interleave_size=parallel.cp_kv_cache_interleave_size,
        )
    return [default_shard_count(group.kv_cache_spec, dcp) for group in groups]


def v2_kernel_geometries(
    setup: WorkerSetup, args: dict, counts: list[int]
) -> list[list[KernelGeometry]]:
    """``[group][rank]``: what each rank's slot-mapping launch of each group
    carries: the group's K and the rank's shard of it (``GroupGeometry``)."""
    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.runtime.geometry import kv_cache_group_name

    dcp = setup.dcp_world_size
    interleave = setup.vllm_config.parallel_config.cp_kv_cache_interleave_size
    table = []
    for index, k in enumerate(counts):
        row = []
        for rank in range(dcp):
            shard = GroupGeometry(kv_cache_group_name(index=index), k, dcp, rank).shard
            shard = setup.shard_of(index, rank, shard, k)
            row.append(KernelGeometry(args["block_sizes"][index], k, shard, interleave))
        table.append(row)
    return table


def build_v2_tables(
    setup: WorkerSetup, rank: int, args: dict, counts: list[int]
) -> Any:
    """Rank ``rank``'s real ``BlockTables`` as its runner builds it; raises
    ``RuntimeError`` where vLLM cannot allocate its host buffers."""
    import torch
    from vllm.v1.worker.gpu.block_table import BlockTables

    from vllm_dcp_geometry.runtime.group_context import pending_dcp_shard_counts

    channel: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if setup.patched and setup.dcp_world_size > 1:
        channel = pending_dcp_shard_counts(counts)
    with channel:
        return BlockTables(
            block_sizes=list(args["block_sizes"]),
            max_num_reqs=setup.max_num_reqs,
            max_num_batched_tokens=setup.max_num_batched_tokens,
            max_num_blocks_per_group=list(args["max_num_blocks_per_group"]),
            device=torch.device(setup.device),
            cp_size=setup.dcp_world_size,
            cp_rank=rank,
            cp_interleave=setup.vllm_config.parallel_config.cp_kv_cache_interleave_size,
            slot_mapping_enabled=list(args["slot_mapping_enabled"]),
            dcp_sharded=list(args["dcp_sharded"]),
            sliding_window_reach=list(args["sliding_window_reach"]),
        )


class V2Workers:
    """Model Runner V2's block tables on all D ranks, fed each step."""

    runner = "v2"

    def __init__(
        self, setup: WorkerSetup, *, real: bool, fed_every_step: bool = True
    ) -> None:
        self.setup = setup
        self.fed_every_step = fed_every_step
        """Whether the real tables take every step's writes (a GPU), or only
        the batch's current rows on a cross-checked step (the Triton
        interpreter, where each staged write is an interpreted launch)."""
        args = upstream_v2_table_args(
            setup.kv_cache_config, setup.vllm_config, setup.max_len
        )
        self.args = args
        self.counts = v2_launch_shard_counts(setup)
        self.kernel_geometries = v2_kernel_geometries(setup, args, self.counts)
        self.slot_mapped = list(args["slot_mapping_enabled"])
        self.widths = list(args["max_num_blocks_per_group"])
        self.book = V2RowBook(setup.max_num_reqs)
        self.store = RowStore(setup.max_num_reqs, self.widths)
        self.real: list[Any] = []
        self.real_reason = (
            "rows restated (vLLM's BlockTables applies and maps through Triton "
            "kernels, which do not run here)"
        )
        if real:
            try:
                self.real = [
                    build_v2_tables(setup, r, args, self.counts)
                    for r in range(setup.dcp_world_size)
                ]
                self.real_reason = "vLLM BlockTables per rank" + (
                    ""
                    if fed_every_step
                    else ", given the batch's rows on each cross-checked step"
                )
            except RuntimeError as exc:
                self.real_reason = f"BlockTables cannot be built here: {exc}"
        self.overflows: list[tuple[str, int, int]] = []

    def update(self, scheduler_output: Any) -> ScheduledBatch:
        self.overflows = []
        writes = []
        for write in self.book.update(scheduler_output):
            fitted, overflows = self.store.fit(write)
            self.store.apply(fitted)
            self.overflows += overflows
            writes.append(fitted)
        if self.fed_every_step:
            for tables in self.real:
                for write in writes:
                    tables.append_block_ids(
                        write.index, write.block_ids, write.overwrite
                    )
                tables.apply_staged_writes()
        return scheduled_batch(
            scheduler_output,
            list(scheduler_output.num_scheduled_tokens),
            self.book.index_of,
        )

    def kernel_geometry(self, rank: int, group: int) -> KernelGeometry:
        return self.kernel_geometries[group][rank]

    def rows(self, rank: int, group: int, batch: ScheduledBatch) -> np.ndarray:
        return self.store.rows[group][batch.rows]

    def twin_slot_mappings(self, batch: ScheduledBatch, group: int) -> np.ndarray:
        import numpy as np

        rows = self.rows(0, group, batch)
        return np.stack(
            [
                twin_slot_mapping(
                    rows,
                    batch.query_start_loc,
                    batch.positions,
                    self.kernel_geometry(rank, group),
                )
                for rank in range(self.setup.dcp_world_size)
            ]
        )

    def _write_batch_rows(self, batch: ScheduledBatch) -> None:
        """The real tables take the current rows of the batch's requests (as
        overwrites, staged and applied by vLLM), where they are not fed
        every step."""
        # The rows are the same on every rank: read them once.
        writes = [
            (
                state,
                tuple(
                    self.store.rows[g][state, : int(n)].tolist()
                    for g, n in enumerate(self.store.num_blocks[:, state])
                ),
            )
            for state in (int(s) for s in batch.rows)
        ]
        for tables in self.real:
            for state, rows in writes:
                tables.append_block_ids(state, rows, True)
            tables.apply_staged_writes()

    def real_slot_mappings(self, batch: ScheduledBatch) -> dict[int, np.ndarray]:
        """vLLM's own ``compute_slot_mappings`` on every rank."""
        import numpy as np
        import torch

        if not self.fed_every_step:
            self._write_batch_rows(batch)
        device = torch.device(self.setup.device)
        index = torch.tensor(batch.rows, dtype=torch.int32, device=device)
        start = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=device)
        tokens = batch.total_tokens
        per_rank = [
            tables.compute_slot_mappings(index, start, positions, tokens).cpu().numpy()
            for tables in self.real
        ]
        return {
            g: np.stack([slots[g] for slots in per_rank])
            for g, on in enumerate(self.slot_mapped)
            if on
        }

    def real_row_mismatches(self, batch: ScheduledBatch) -> list[tuple[int, int]]:
        """(rank, group) whose gathered real rows differ from ``RowStore``."""
        import numpy as np
        import torch

        device = torch.device(self.setup.device)
        index = torch.tensor(batch.rows, dtype=torch.int32, device=device)
        found = []
        for rank, tables in enumerate(self.real):
            gathered = tables.gather_block_tables(index, len(batch.req_ids))
            for group, rows in enumerate(gathered):
                real = rows.cpu().numpy()
                for i, state in enumerate(batch.rows):
                    n = int(self.store.num_blocks[group, state])
                    if not np.array_equal(
                        real[i, :n], self.store.rows[group][state, :n]
                    ):
                        found.append((rank, group))
                        break
        return found

    def describe(self) -> dict[str, Any]:
        restated = [
            "request-index bookkeeping of finish_requests/add_requests/"
            "update_requests and the staged row writes (RowStore)",
            "positions and query_start_loc of prepare_inputs",
            "initialize_kv_cache's per-group BlockTables arguments",
        ]
        return {"tables": self.real_reason, "restated": restated}
