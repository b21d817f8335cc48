# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The worker side of ``simulate``: Model Runner V1 on every DCP rank.

Each rank ``r`` of ``D`` gets vLLM's real ``MultiGroupBlockTable``, built the
way its runner builds it: ``GPUModelRunner.may_reinitialize_input_batch``'s
arguments (block size, ``spec.max_num_blocks_per_req`` and slot mode of every
group), and, patched at ``D > 1``, the plugin's per-group layout
(``geometry.input_batch_layout``) handed over through the same side channel
the patched runner uses. Unpatched, the tables get the DCP group's ``(D, r)``
(there is no process group here; ``emulate_dcp_group``).

What is restated rather than run (vLLM's own code needs a model, CUDA and
pinned host memory around it), each tested against vLLM's in the suite:

- the persistent batch's row bookkeeping of ``GPUModelRunner._update_states``
  and ``InputBatch`` (``V1RowBook``: a new request takes the lowest free row,
  a finished or unscheduled one leaves its row, ``condense`` moves the last
  rows down); the rows themselves are written by the tables' own
  ``add_row``/``append_row``/``move_row``;
- the batch's positions and ``query_start_loc`` from ``_prepare_inputs``
  (``make_batch``);
- the slot-mapping kernel (``kernels``), cross-checked against vLLM's
  where it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.tooling.cli.simulate.kernels import (
    KernelGeometry,
    twin_slot_mapping,
)
from vllm_dcp_geometry.tooling.topology import TopologyError

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step, in the runner's batch order."""

    req_ids: list[str]
    rows: np.ndarray
    """Per request: its row (V1) or request-state index (V2)."""
    first_positions: np.ndarray
    num_tokens: np.ndarray
    query_start_loc: np.ndarray
    positions: np.ndarray

    @property
    def seq_lens(self) -> np.ndarray:
        return self.first_positions + self.num_tokens

    @property
    def total_tokens(self) -> int:
        return int(self.query_start_loc[-1])


def make_batch(
    req_ids: list[str],
    rows: list[int],
    first_positions: list[int],
    num_tokens: list[int],
) -> ScheduledBatch:
    """Positions ``num_computed_tokens + [0, n)`` of each request and the
    cumulative ``query_start_loc`` (restated from ``_prepare_inputs``)."""
    import numpy as np

    first = np.asarray(first_positions, dtype=np.int64)
    counts = np.asarray(num_tokens, dtype=np.int64)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    offsets = np.arange(int(start[-1]), dtype=np.int64) - np.repeat(start[:-1], counts)
    positions = np.repeat(first, counts) + offsets
    return ScheduledBatch(
        req_ids, np.asarray(rows, dtype=np.int64), first, counts, start, positions
    )


def scheduled_positions(scheduler_output: Any) -> dict[str, int]:
    """``num_computed_tokens`` of every scheduled request (its first position)."""
    first = {
        r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs
    }
    cached = scheduler_output.scheduled_cached_reqs
    first.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return first


def scheduled_batch(
    scheduler_output: Any, order: list[str], row_of: dict[str, int]
) -> ScheduledBatch:
    """The step's batch: the requests in the runner's ``order``, each at its
    row (V1) or request-state index (V2) ``row_of[req_id]``."""
    first = scheduled_positions(scheduler_output)
    return make_batch(
        order,
        [row_of[r] for r in order],
        [first[r] for r in order],
        [scheduler_output.num_scheduled_tokens[r] for r in order],
    )


@dataclass(frozen=True)
class RowOp:
    """One write to every rank's table: ``add`` (replace the row), ``append``
    or ``move`` (row ``src`` to ``row``)."""

    kind: str
    row: int
    req_id: str
    block_ids: tuple[list[int], ...] = ()
    src: int = -1


@dataclass
class V1RowBook:
    """Which persistent-batch row holds which request, and the block ids the
    runner caches per request (restated from ``_update_states``/``InputBatch``)."""

    max_num_reqs: int
    block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    row_of: dict[str, int] = field(default_factory=dict)
    removed: list[int] = field(default_factory=list)
    num_rows: int = 0

    def _remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.removed.append(row)

    def _add(self, req_id: str, ops: list[RowOp]) -> None:
        if self.removed:
            row = min(self.removed)
            self.removed.remove(row)
        else:
            row = self.num_rows
            self.num_rows += 1
        if row >= self.max_num_reqs:
            raise RuntimeError(f"more than {self.max_num_reqs} requests in the batch")
        self.row_of[req_id] = row
        ops.append(RowOp("add", row, req_id, self.block_ids[req_id]))

    def _condense(self, ops: list[RowOp]) -> None:
        holes = sorted(self.removed)
        self.removed.clear()
        occupied = sorted(self.row_of.values())
        req_at = {row: req for req, row in self.row_of.items()}
        while holes and occupied and occupied[-1] > holes[0]:
            src, dst = occupied.pop(), holes.pop(0)
            self.row_of[req_at[src]] = dst
            ops.append(RowOp("move", dst, req_at[src], src=src))
            occupied.insert(0, dst)
            occupied.sort()
        self.num_rows = len(self.row_of)

    def update(self, scheduler_output: Any) -> list[RowOp]:
        """The table writes of one ``SchedulerOutput``, as ``_update_states``."""
        ops: list[RowOp] = []
        for req_id in scheduler_output.finished_req_ids:
            self.block_ids.pop(req_id, None)
            self._remove(req_id)
        scheduled = scheduler_output.num_scheduled_tokens.keys()
        cached = scheduler_output.scheduled_cached_reqs
        for req_id in list(self.row_of):
            if req_id not in scheduled or req_id in cached.resumed_req_ids:
                self._remove(req_id)
        to_add = []
        for new in scheduler_output.scheduled_new_reqs:
            self.block_ids[new.req_id] = tuple(list(ids) for ids in new.block_ids)
            to_add.append(new.req_id)
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:
                self.block_ids[req_id] = tuple(list(ids) for ids in new_ids)
            elif new_ids is not None:
                for ids, more in zip(self.block_ids[req_id], new_ids, strict=True):
                    ids.extend(more)
            if req_id not in self.row_of:
                to_add.append(req_id)
            elif new_ids is not None:
                ops.append(RowOp("append", self.row_of[req_id], req_id, new_ids))
        for req_id in to_add:
            self._add(req_id, ops)
        self._condense(ops)
        return ops

    def batch_order(self) -> list[str]:
        return sorted(self.row_of, key=self.row_of.__getitem__)


def upstream_v1_table_args(
    kv_cache_config: Any, vllm_config: Any, max_len: int
) -> dict:
    """What ``may_reinitialize_input_batch`` gives ``InputBatch`` for the
    tables: block sizes, ``spec.max_num_blocks_per_req`` and slot modes by
    cache kind (restated; the spec methods are vLLM's)."""
    from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind
    from vllm.v1.worker.block_table import SlotMappingMode

    args: dict[str, list[Any]] = {"block_sizes": [], "max_num_blocks": [], "modes": []}
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        kind = get_kv_cache_spec_kind(spec)
        if kind == KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
            continue
        args["block_sizes"].append(spec.block_size)
        args["max_num_blocks"].append(spec.max_num_blocks_per_req(vllm_config, max_len))
        args["modes"].append(
            SlotMappingMode.NONE
            if kind == KVCacheSpecKind.MAMBA
            else SlotMappingMode.TOKEN_TO_KV_SLOT
        )
    return args


def emulate_dcp_group(block_table: Any, dcp_world_size: int, dcp_rank: int) -> None:
    """What unpatched vLLM gives every table on rank ``dcp_rank`` of a real DCP
    group of ``dcp_world_size``: here no group exists, whose fallback is
    (1, 0)."""
    for table in block_table.block_tables:
        table.dcp_world_size = dcp_world_size
        table.dcp_rank = dcp_rank


def own_shard(group: int, rank: int, shard: int, shard_count: int) -> int:
    """The shard the runner gives rank ``rank``'s table of ``group``: its own."""
    return shard


@dataclass
class WorkerSetup:
    """What every runner's workers are built from."""

    kv_cache_config: Any
    vllm_config: Any
    max_len: int
    max_num_reqs: int
    max_num_batched_tokens: int
    dcp_world_size: int
    patched: bool
    device: str = "cpu"
    shard_of: Callable[[int, int, int, int], int] = own_shard
    """``(group, rank, shard, shard_count)``: the shard the workers use
    (``SimulationHooks.shard``; the runner's own unless a hook moves it)."""


def build_v1_tables(setup: WorkerSetup, rank: int) -> Any:
    """Rank ``rank``'s ``MultiGroupBlockTable``, built as its runner builds it."""
    import torch
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    from vllm_dcp_geometry.runtime.geometry import input_batch_layout
    from vllm_dcp_geometry.runtime.group_context import pending_block_table_layout

    args = upstream_v1_table_args(
        setup.kv_cache_config, setup.vllm_config, setup.max_len
    )
    dcp = setup.dcp_world_size

    def build() -> Any:
        return MultiGroupBlockTable(
            setup.max_num_reqs,
            setup.max_num_batched_tokens,
            False,
            torch.device(setup.device),
            args["block_sizes"],
            args["max_num_blocks"],
            setup.vllm_config.parallel_config.cp_kv_cache_interleave_size,
            args["modes"],
        )

    if setup.patched and dcp > 1:
        layout = input_batch_layout(
            setup.kv_cache_config, setup.vllm_config, setup.max_len, dcp, rank
        )
        with pending_block_table_layout(layout):
            tables = build()
    else:
        tables = build()
        emulate_dcp_group(tables, dcp, rank)
    for group, table in enumerate(tables.block_tables):
        shard = setup.shard_of(group, rank, table.dcp_rank, table.dcp_world_size)
        if shard != table.dcp_rank:
            table.dcp_rank = shard
    return tables


class V1Workers:
    """Model Runner V1's block tables on all D ranks, fed each step."""

    runner = "v1"

    def __init__(self, setup: WorkerSetup) -> None:
        from vllm.v1.worker.block_table import SlotMappingMode

        self.setup = setup
        self.ranks = [build_v1_tables(setup, r) for r in range(setup.dcp_world_size)]
        self.book = V1RowBook(setup.max_num_reqs)
        first = self.ranks[0].block_tables
        if len(first) != len(setup.kv_cache_config.kv_cache_groups):
            # Model Runner V1 gives encoder-only groups no table.
            raise TopologyError(
                "simulate needs one block table per KV-cache group; "
                "encoder-only groups are not simulated"
            )
        self.slot_mapped = [
            t.slot_mapping_mode == SlotMappingMode.TOKEN_TO_KV_SLOT for t in first
        ]
        self.widths = [t.max_num_blocks_per_req for t in first]
        self.overflows: list[tuple[str, int, int]] = []
        """(request, group, columns asked for) of writes beyond a table."""

    def _fit(self, op: RowOp) -> RowOp:
        """Clip a write that would run past a table (vLLM would crash there)."""
        if op.kind == "move":
            return op
        fitted = []
        table_rows = self.ranks[0].block_tables
        for group, ids in enumerate(op.block_ids):
            have = 0
            if op.kind == "append":
                have = int(table_rows[group].num_blocks_per_row[op.row])
            room = self.widths[group] - have
            if len(ids) > room:
                self.overflows.append((op.req_id, group, have + len(ids)))
                ids = ids[:room]
            fitted.append(list(ids))
        return RowOp(op.kind, op.row, op.req_id, tuple(fitted), op.src)

    def update(self, scheduler_output: Any) -> ScheduledBatch:
        """Apply one ``SchedulerOutput`` to every rank's tables; the batch."""
        self.overflows = []
        ops = [self._fit(op) for op in self.book.update(scheduler_output)]
        for tables in self.ranks:
            for op in ops:
                if op.kind == "add":
                    tables.add_row(op.block_ids, op.row)
                elif op.kind == "append":
                    tables.append_row(op.block_ids, op.row)
                else:
                    tables.move_row(op.src, op.row)
        return scheduled_batch(
            scheduler_output, self.book.batch_order(), self.book.row_of
        )

    def kernel_geometry(self, rank: int, group: int) -> KernelGeometry:
        table = self.ranks[rank].block_tables[group]
        return KernelGeometry(
            table.block_size,
            table.dcp_world_size,
            table.dcp_rank,
            table.cp_kv_cache_interleave_size,
        )

    def rows(self, rank: int, group: int, batch: ScheduledBatch) -> np.ndarray:
        """The batch's rows of one table (the host copy the runner commits)."""
        return self.ranks[rank].block_tables[group].block_table.np[: len(batch.req_ids)]

    def twin_slot_mappings(self, batch: ScheduledBatch, group: int) -> np.ndarray:
        """Slots of every rank (``D x tokens``) for one slot-mapped group."""
        import numpy as np

        return np.stack(
            [
                twin_slot_mapping(
                    self.rows(rank, group, batch),
                    batch.query_start_loc,
                    batch.positions,
                    self.kernel_geometry(rank, group),
                )
                for rank in range(len(self.ranks))
            ]
        )

    def real_slot_mappings(self, batch: ScheduledBatch) -> dict[int, np.ndarray]:
        """vLLM's own ``compute_slot_mapping`` on every rank (kernels needed)."""
        import numpy as np
        import torch

        device = torch.device(self.setup.device)
        start = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=device)
        positions = torch.tensor(batch.positions, dtype=torch.int64, device=device)
        count, tokens = len(batch.req_ids), batch.total_tokens
        per_rank = []
        for tables in self.ranks:
            tables.commit_block_table(count)
            tables.compute_slot_mapping(count, start, positions)
            per_rank.append(
                {
                    g: t.slot_mapping.gpu[:tokens].cpu().numpy()
                    for g, t in enumerate(tables.block_tables)
                    if self.slot_mapped[g]
                }
            )
        return {g: np.stack([slots[g] for slots in per_rank]) for g in per_rank[0]}

    def describe(self) -> dict[str, Any]:
        return {
            "tables": "vLLM MultiGroupBlockTable per rank",
            "restated": [
                "persistent-batch row bookkeeping of GPUModelRunner._update_states "
                "and InputBatch (rows written by the tables' own add_row/"
                "append_row/move_row)",
                "positions and query_start_loc of _prepare_inputs",
                "may_reinitialize_input_batch's table arguments",
            ],
        }
