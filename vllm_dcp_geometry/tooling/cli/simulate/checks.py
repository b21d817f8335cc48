# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The checks ``simulate`` runs on every step and every cache group.

With the contract's K of a group (its replicas ``q = r // K``), B and
``V = B * K``, against the engine's own view of each request's blocks
(``req_to_blocks`` of vLLM's managers):

- ``unwritten`` / ``written_twice``: in each replica, every scheduled
  position is written by exactly one rank;
- ``foreign_slot``: every slot written lies inside one of the request's own
  blocks;
- ``shared_slot``: no rank writes a block for two live requests;
- ``recurrent_index`` / ``table_width``: recurrent-state indices (vLLM's own
  ``mamba_get_block_table_tensor`` over the worker's rows) stay inside the
  table and the request's blocks; no row grows past its table;
- ``local_lengths``: per replica, the ranks' local sequence lengths (as the
  patched attention builder computes them, ``group_local_seq_lens``) sum to
  the global length;
- ``block_sizes``: the scheduler block size is a multiple of every group's V,
  and the hash block size divides it and (when finer) every V;
- ``kernel_mismatch``: on cross-checked steps, the vectorized slot mapping
  equals vLLM's kernel (and, on Model Runner V2, the restated rows equal the
  real table's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import PAD_SLOT_ID, GroupGeometry
from vllm_dcp_geometry.tooling.cli.common.violations import ItemSchema, Violations
from vllm_dcp_geometry.tooling.cli.simulate.views import GroupInfo, OwnRows, RankLayout

if TYPE_CHECKING:
    import numpy as np

    from vllm_dcp_geometry.tooling.cli.simulate.workers import ScheduledBatch

KINDS = (
    "unwritten",
    "written_twice",
    "foreign_slot",
    "shared_slot",
    "recurrent_index",
    "table_width",
    "local_lengths",
    "block_sizes",
    "kernel_mismatch",
)
ITEMS = ItemSchema(
    "kind", ("kind", "step", "group", "request", "position", "rank", "message")
)
"""A violation in ``simulate``'s report (``violation_items``, ``first_violation``)."""


class Checker:
    """Runs every check of one step; keeps what spans steps (who wrote which
    block on which rank, for live requests)."""

    def __init__(
        self,
        groups: list[GroupInfo],
        engine: Any,
        dcp: int,
        interleave: int,
        mamba_cache_mode: str,
    ) -> None:
        import numpy as np

        manager = engine.scheduler.kv_cache_manager
        self.groups = groups
        self.dcp = dcp
        self.interleave = interleave
        self.mamba_cache_mode = mamba_cache_mode
        self.num_blocks = engine.num_pages
        self.own = OwnRows(
            list(manager.coordinator.single_type_managers),
            groups,
            manager.block_pool.null_block.block_id,
        )
        self.writer = {
            g.index: np.zeros((dcp, self.num_blocks), dtype=np.int64)
            for g in groups
            if g.slot_mapped
        }
        self.stamp = np.zeros(self.num_blocks, dtype=np.int64)
        self.stamp_value = 0
        self.serials: dict[str, int] = {}
        self.violations = Violations(ITEMS)
        self.slot_writes_checked = 0
        self._layouts: dict[int, RankLayout] = {}

    def rank_layout(self, shard_count: int) -> RankLayout:
        """The ranks' places for ``shard_count`` (made once per K)."""
        layout = self._layouts.get(shard_count)
        if layout is None:
            layout = RankLayout.of("simulate", shard_count, self.dcp)
            self._layouts[shard_count] = layout
        return layout

    def serial(self, req_id: str) -> int:
        return self.serials.setdefault(req_id, len(self.serials) + 1)

    def release(self, req_ids: set[str]) -> None:
        """Requests finished or preempted: their blocks are no longer theirs."""
        for req_id in req_ids:
            serial = self.serials.get(req_id)
            if serial is None:
                continue
            for owners in self.writer.values():
                owners[owners == serial] = 0
            self.own.forget(req_id)

    def _own_ids(self, req_id: str, group: GroupInfo) -> np.ndarray:
        """The request's own blocks of ``group``; those it dropped since last
        asked (a sliding window's) are no longer its."""
        ids, dropped = self.own.ids(req_id, group.index)
        if dropped.size and group.index in self.writer:
            owners = self.writer[group.index][:, dropped]
            owners[owners == self.serial(req_id)] = 0
            self.writer[group.index][:, dropped] = owners
        return ids

    def _stamp(self, ids: np.ndarray) -> int:
        """Mark blocks ``ids`` (one request's own); the mark's value."""
        self.stamp_value += 1
        self.stamp[ids] = self.stamp_value
        return self.stamp_value

    def check_coverage(
        self, step: int, group: GroupInfo, batch: ScheduledBatch, slots: np.ndarray
    ) -> None:
        """Per replica, each scheduled position is written by exactly one rank."""
        import numpy as np

        k = group.shard_count
        layout = self.rank_layout(k)
        written = layout.sum_by_replica(slots != PAD_SLOT_ID)
        self.slot_writes_checked += int(slots.size)
        for kind, bad in (("unwritten", written == 0), ("written_twice", written > 1)):
            if not bad.any():
                continue
            token = int(np.nonzero(bad.any(axis=0))[0][0])
            replica = int(np.nonzero(bad[:, token])[0][0])
            req = int(np.searchsorted(batch.query_start_loc, token, side="right")) - 1
            position = int(batch.positions[token])
            self.violations.add(
                kind,
                f"position {position:,} of {batch.req_ids[req]} is written by "
                f"{int(written[replica, token])} ranks of replica {replica} "
                f"({layout.describe_ranks(replica)}, K={k})",
                step=step,
                count=int(bad.sum()),
                group=group.name,
                position=position,
                request=batch.req_ids[req],
            )

    def check_slots(
        self, step: int, group: GroupInfo, batch: ScheduledBatch, slots: np.ndarray
    ) -> None:
        """Written slots lie in the request's own blocks, and no rank writes a
        block for two live requests."""
        import numpy as np

        owners = self.writer[group.index]
        # Every request's dropped blocks first: the scheduler may have given a
        # block one request's window dropped this step to a request before it
        # in the batch.
        own_ids = [self._own_ids(req_id, group) for req_id in batch.req_ids]
        for i, req_id in enumerate(batch.req_ids):
            a, b = int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1])
            mine = slots[:, a:b]
            ranks, tokens = np.nonzero(mine != PAD_SLOT_ID)
            if not ranks.size:
                continue
            value = self._stamp(own_ids[i])
            blocks = mine[ranks, tokens] // group.block_size
            inside = (blocks >= 0) & (blocks < self.num_blocks)
            own = np.zeros(blocks.shape, dtype=bool)
            own[inside] = self.stamp[blocks[inside]] == value
            if not own.all():
                j = int(np.nonzero(~own)[0][0])
                position = int(batch.positions[a + tokens[j]])
                self.violations.add(
                    "foreign_slot",
                    f"rank {int(ranks[j])} writes position {position:,} of {req_id} "
                    f"to slot {int(mine[ranks[j], tokens[j]]):,}, outside its blocks",
                    step=step,
                    count=int((~own).sum()),
                    group=group.name,
                    position=position,
                    request=req_id,
                    rank=int(ranks[j]),
                )
            serial = self.serial(req_id)
            r, blk = ranks[own], blocks[own]
            before = owners[r, blk]
            clash = (before != 0) & (before != serial)
            if clash.any():
                j = int(np.nonzero(clash)[0][0])
                other = next(k for k, v in self.serials.items() if v == before[j])
                self.violations.add(
                    "shared_slot",
                    f"rank {int(r[j])} writes block {int(blk[j])} for {req_id} while "
                    f"live request {other} wrote it",
                    step=step,
                    count=int(clash.sum()),
                    group=group.name,
                    request=req_id,
                    rank=int(r[j]),
                )
            owners[r, blk] = serial

    def check_recurrent(
        self, step: int, group: GroupInfo, batch: ScheduledBatch, rows: list[np.ndarray]
    ) -> None:
        """State indices vLLM's Mamba builders take from each rank's rows stay
        inside the table and the request's own blocks."""
        import numpy as np
        import torch
        from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        own = [self.own.ids(r, group.index)[0] for r in batch.req_ids]
        for rank, table in enumerate(rows):
            try:
                state = mamba_get_block_table_tensor(
                    torch.from_numpy(np.ascontiguousarray(table)),
                    seq_lens,
                    group.spec,
                    self.mamba_cache_mode,
                ).numpy()
            except (IndexError, RuntimeError) as exc:
                self.violations.add(
                    "recurrent_index",
                    f"rank {rank}: the state index runs past the table: {exc}",
                    step=step,
                    group=group.name,
                    rank=rank,
                )
                continue
            for i, req_id in enumerate(batch.req_ids):
                self.stamp_value += 1
                self.stamp[own[i]] = self.stamp_value
                ids = state[i]
                inside = (ids >= 0) & (ids < self.num_blocks)
                ok = np.zeros(ids.shape, dtype=bool)
                ok[inside] = self.stamp[ids[inside]] == self.stamp_value
                if not ok.all():
                    self.violations.add(
                        "recurrent_index",
                        f"rank {rank}: {req_id} (length {int(batch.seq_lens[i]):,}) "
                        f"reads state blocks {ids.tolist()}, not all its own",
                        step=step,
                        count=int((~ok).sum()),
                        group=group.name,
                        request=req_id,
                        rank=rank,
                        position=int(batch.seq_lens[i]) - 1,
                    )

    def check_local_lengths(
        self, step: int, group: GroupInfo, batch: ScheduledBatch
    ) -> None:
        """Per replica, the builder's local lengths sum to the global length."""
        import numpy as np
        import torch

        from vllm_dcp_geometry.runtime.metadata_builders import group_local_seq_lens

        builder_k = group.builder_shard_count
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        per_shard = np.stack(
            [
                group_local_seq_lens(
                    seq_lens,
                    GroupGeometry(
                        owner=group.name,
                        shard_count=builder_k,
                        dcp_world_size=self.dcp,
                        dcp_rank=shard,
                        interleave_size=self.interleave,
                    ),
                ).numpy()
                for shard in range(builder_k)
            ]
        )
        per_rank = per_shard[self.rank_layout(builder_k).shards]
        k = group.shard_count
        sums = self.rank_layout(k).sum_by_replica(per_rank)
        bad = sums != batch.seq_lens[None, :]
        if bad.any():
            replica, i = (int(x[0]) for x in np.nonzero(bad))
            self.violations.add(
                "local_lengths",
                f"replica {replica}: local lengths sum to {int(sums[replica, i]):,}, "
                f"not {batch.req_ids[i]}'s {int(batch.seq_lens[i]):,} "
                f"(builder K={builder_k}, contract K={k})",
                step=step,
                count=int(bad.sum()),
                group=group.name,
                request=batch.req_ids[i],
                position=int(batch.seq_lens[i]) - 1,
            )

    def check_block_sizes(
        self, step: int, scheduler_block: int, hash_block: int
    ) -> None:
        """The scheduler and hash block sizes tile every group's V."""
        for group in self.groups:
            v = group.virtual_block_size
            fine = hash_block == scheduler_block or v % hash_block == 0
            if scheduler_block % v or scheduler_block % hash_block or not fine:
                self.violations.add(
                    "block_sizes",
                    f"scheduler block {scheduler_block:,} / hash block "
                    f"{hash_block:,} do not tile V = B*K = {v:,}",
                    step=step,
                    group=group.name,
                )

    def check_overflows(
        self, step: int, overflows: list[tuple[str, int, int]], widths: list[int]
    ) -> None:
        for req_id, index, columns in overflows:
            self.violations.add(
                "table_width",
                f"{req_id} needs {columns:,} columns, the table has {widths[index]:,}",
                step=step,
                group=self.groups[index].name,
                request=req_id,
            )

    def compare_kernel(
        self,
        step: int,
        group: GroupInfo,
        batch: ScheduledBatch,
        twin: np.ndarray,
        real: np.ndarray,
    ) -> None:
        import numpy as np

        differ = twin != real
        if differ.any():
            rank, token = (int(x[0]) for x in np.nonzero(differ))
            self.violations.add(
                "kernel_mismatch",
                f"rank {rank}: vLLM's kernel writes slot {int(real[rank, token])} "
                f"for position {int(batch.positions[token]):,}, the vectorized path "
                f"{int(twin[rank, token])}",
                step=step,
                count=int(differ.sum()),
                group=group.name,
                rank=rank,
                position=int(batch.positions[token]),
            )
