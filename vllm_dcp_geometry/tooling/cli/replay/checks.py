# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``replay`` checks after every allocation step, and what it tracks.

With each group's geometry under the contract (``V = B * K``, its width):

- ownership: every non-null physical block sits in exactly one group's row at
  one column, and held + free pages account for the whole pool;
- width: no group's row is longer than its block-table width
  (``spec.max_num_blocks_per_req``);
- addressability: every computed position has a block at the column the
  worker maps it to (``V = B * K`` for attention, the running state's column
  for recurrent groups);
- geometry: each manager allocates in units of the contract's ``V`` (checked
  once the manager exists, in ``replay``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import cdiv, virtual_block_size
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.common.violations import ItemSchema, Violations
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

CATEGORIES = ("ownership", "width", "addressability", "geometry", "pool")
REQUEST_ID = "replay-0"
ITEMS = ItemSchema("category", ("kind", "group", "step", "position", "message"))
"""A violation in ``replay``'s report: its kind is its ``category``."""


@dataclass
class Track:
    """What the replay knows and has seen of one group."""

    group: CacheGroup
    spec: Any
    shard_count: int
    """K under the contract: the worker's geometry for this group."""
    virtual_block_size: int
    width: int
    recurrent_align: bool
    num_speculative_blocks: int
    sliding_window: int | None
    manager: Any = None
    max_column_used: int = -1
    max_row_length: int = 0
    pages_held: int = 0
    first_unaddressable_position: int | None = None

    def first_position_beyond_width(self) -> int:
        if self.recurrent_align:
            # The running state after n tokens sits in column cdiv(n, B) - 1,
            # followed by the speculative columns.
            return (self.width - self.num_speculative_blocks) * self.group.block_size
        return self.width * self.virtual_block_size


def make_tracks(
    topology: Topology, specs: list[Any], config: Any, violations: Violations
) -> list[Track]:
    dcp = topology.decode_context_parallel_size
    patched = vllm_objects.is_vllm_patched()
    tracks = []
    for group, spec in zip(topology.groups, specs, strict=True):
        k = group.shard_count(dcp)
        if patched and spec.dcp_shard_count(dcp) != k:
            violations.add(
                "geometry",
                f"spec reports K={spec.dcp_shard_count(dcp)}, the contract K={k}",
                step=0,
                group=group.name,
            )
        recurrent = group.kind == "mamba"
        tracks.append(
            Track(
                group=group,
                spec=spec,
                shard_count=k,
                virtual_block_size=virtual_block_size(group.block_size, k),
                width=spec.max_num_blocks_per_req(config, topology.max_model_len),
                recurrent_align=recurrent and topology.mamba_cache_mode == "align",
                num_speculative_blocks=(
                    spec.num_speculative_blocks if recurrent else 0
                ),
                sliding_window=getattr(spec, "sliding_window", None),
            )
        )
    return tracks


def _check_addressable(
    track: Track, ids: Any, nonnull: Any, num_tokens: int, step: int, v: Violations
) -> None:
    name = track.group.name

    def fail(position: int, message: str, category: str = "addressability") -> None:
        if (
            track.first_unaddressable_position is None
            or position < track.first_unaddressable_position
        ):
            track.first_unaddressable_position = position
        v.add(category, message, step=step, group=name, position=position)

    if track.group.kind == "mamba":
        if not track.recurrent_align:
            if ids.size == 0 or not nonnull[0]:
                fail(num_tokens - 1, "no block holds the running recurrent state")
            return
        column = cdiv(num_tokens, track.group.block_size) - 1
        if column + 1 + track.num_speculative_blocks > track.width:
            fail(
                track.first_position_beyond_width(),
                f"after {num_tokens:,} tokens the running state needs column "
                f"{column} plus {track.num_speculative_blocks} speculative "
                f"columns, but the table has {track.width} columns",
                "width",
            )
        if ids.size <= column or not nonnull[column]:
            fail(
                num_tokens - 1,
                f"after {num_tokens:,} tokens the running state's column {column} "
                f"has no block (row length {ids.size})",
            )
        return

    virtual = track.virtual_block_size
    need = cdiv(num_tokens, virtual)
    first_column = 0
    if track.sliding_window is not None:
        first_column = max(0, num_tokens - track.sliding_window) // virtual
    if need > track.width:
        fail(
            track.first_position_beyond_width(),
            f"position {track.first_position_beyond_width():,} maps to column "
            f"{track.width} (V = B*K = {virtual}), beyond the table's "
            f"{track.width} columns",
            "width",
        )
    if ids.size < need:
        column = max(ids.size, first_column)
        fail(
            column * virtual,
            f"position {column * virtual:,} maps to column {column} (V = B*K = "
            f"{virtual}) but the manager allocated only {ids.size} columns for "
            f"{num_tokens:,} tokens (it allocates in units of "
            f"{track.manager.block_size} tokens)",
        )
        return
    missing = (~nonnull[first_column:need]).nonzero()[0]
    if missing.size:
        column = first_column + int(missing[0])
        fail(
            column * virtual,
            f"position {column * virtual:,} maps to column {column}, which holds "
            "the null block",
        )


def check_step(
    tracks: list[Track],
    block_pool: Any,
    num_tokens: int,
    step: int,
    usable_pages: int,
    v: Violations,
) -> int:
    """All per-step checks; returns the number of pages in use."""
    import numpy as np

    null_id = block_pool.null_block.block_id
    held = []
    for track in tracks:
        row = track.manager.req_to_blocks.get(REQUEST_ID, ())
        ids = np.fromiter((b.block_id for b in row), dtype=np.int64, count=len(row))
        nonnull = ids != null_id
        used = nonnull.nonzero()[0]
        if used.size:
            track.max_column_used = max(track.max_column_used, int(used[-1]))
        track.max_row_length = max(track.max_row_length, ids.size)
        track.pages_held = int(used.size)
        if ids.size > track.width:
            v.add(
                "width",
                f"the manager's row has {ids.size} columns but the block table "
                f"is {track.width} wide (spec.max_num_blocks_per_req)",
                step=step,
                group=track.group.name,
            )
        _check_addressable(track, ids, nonnull, num_tokens, step, v)
        held.append(ids[nonnull])
    all_held = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
    unique, counts = np.unique(all_held, return_counts=True)
    shared = unique[counts > 1]
    if shared.size:
        block_id = int(shared[0])
        owners = [
            f"{t.group.name}[{c}]"
            for t in tracks
            for c, b in enumerate(t.manager.req_to_blocks.get(REQUEST_ID, ()))
            if b.block_id == block_id
        ]
        v.add(
            "ownership",
            f"{shared.size} physical block(s) have more than one owner, e.g. "
            f"block {block_id} at {', '.join(owners)}",
            step=step,
        )
    free = block_pool.get_num_free_blocks()
    if unique.size + free != usable_pages:
        v.add(
            "ownership",
            f"{unique.size:,} pages held + {free:,} free != {usable_pages:,} usable "
            "pages: a page is both held and free, or leaked",
            step=step,
        )
    return int(unique.size)
