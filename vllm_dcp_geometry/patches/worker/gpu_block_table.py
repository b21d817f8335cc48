# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.block_table``: V2 slot mappings per group K.

What: ``BlockTables.__init__`` takes an optional keyword ``dcp_shard_counts``
(one K per cache group; Model Runner V2 hands it over through the
``group_context.pending_dcp_shard_counts`` side channel).
``compute_slot_mappings`` then launches vLLM's own
``_compute_slot_mappings_kernel`` once with ``CP_SIZE`` = the most common
sharded K (its per-group ``dcp_sharded`` mask covers the K = 1 groups in the
same launch), and once more per contiguous run of groups with any other K, on
that run's slice of the per-group tensors, with ``CP_SIZE = K`` and ``cp_rank
= r % K``. Where every group's K is what upstream implies from ``dcp_sharded``
(D or 1), the original method runs. Sliding-window null masking stays on for
replicated groups (K = 1), whose columns still cover contiguous token ranges:
Model Runner V2 hands the counts over wherever a replicated sliding-window
group exists at D > 1, even if every K is vLLM's default.

Why: vLLM 0.33.0 has one ``CP_SIZE`` for all groups plus a sharded/replicated
bool, so a partial group (1 < K < D) gets the D-shard mapping, and it turns the
sliding-window masking off for every group as soon as D > 1.

Remove when: vLLM's V2 block tables take a shard count per cache group.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.geometry import kv_cache_group_name
from vllm_dcp_geometry.runtime.group_context import (
    TAKEN_SHARD_COUNTS_ATTR,
    pending_shard_counts,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


@dataclass(frozen=True)
class SlotMappingLaunch:
    """One launch of the slot-mapping kernel over groups ``[start, stop)``.

    ``enabled``/``sharded`` are the per-group masks of that slice (None: the
    table's own). Groups whose K is neither 1 nor ``shard_count`` are disabled
    in the launch and written by a later one.
    """

    start: int
    stop: int
    shard_count: int
    shard: int
    enabled: Any = None
    sharded: Any = None
    block_table_ptrs: Any = None
    """The table's per-group tensors sliced to ``[start, stop)`` once, at
    start-up (views: the table keeps its tensors for its lifetime)."""
    block_table_strides: Any = None
    block_sizes: Any = None


def plan_slot_mapping_launches(
    shard_counts: Sequence[int],
    slot_mapping_enabled: Sequence[bool],
) -> list[tuple[int, int, int, list[bool], list[bool]]]:
    """Kernel launches that give every group its own K, as
    ``(start, stop, K, enabled, sharded)`` over groups ``[start, stop)``.

    The first launch covers every group with the most common sharded K (ties:
    the larger), K = 1 groups riding along as unsharded; every other K gets one
    launch per contiguous run of its groups, after the first.
    """
    n = len(shard_counts)
    sharded_counts = Counter(
        k
        for k, on in zip(shard_counts, slot_mapping_enabled, strict=True)
        if on and k > 1
    )
    main = max(sharded_counts, key=lambda k: (sharded_counts[k], k), default=1)
    launches = [
        (
            0,
            n,
            main,
            [
                on and k in (1, main)
                for k, on in zip(shard_counts, slot_mapping_enabled, strict=True)
            ],
            [k == main and main > 1 for k in shard_counts],
        )
    ]
    index = 0
    while index < n:
        k = shard_counts[index]
        if k in (1, main) or not slot_mapping_enabled[index]:
            index += 1
            continue
        stop = index
        while stop < n and shard_counts[stop] == k and slot_mapping_enabled[stop]:
            stop += 1
        launches.append(
            (index, stop, k, [True] * (stop - index), [True] * (stop - index))
        )
        index = stop
    return launches


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(
        self: Any,
        *args: Any,
        dcp_shard_counts: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        counts = (
            tuple(dcp_shard_counts)
            if dcp_shard_counts is not None
            else pending_shard_counts()
        )
        original(self, *args, **kwargs)
        setattr(self, TAKEN_SHARD_COUNTS_ATTR, None)
        self._dcp_slot_launches = None
        if counts is None:
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        _configure(self, counts, bound.arguments)

    return __init__


def _configure(self: Any, counts: tuple[int, ...], arguments: dict[str, Any]) -> None:
    import torch

    n = self.num_kv_cache_groups
    if len(counts) != n:
        raise DcpGeometryError(
            f"{len(counts)} DCP shard counts for {n} KV-cache groups"
        )
    cp_size, cp_rank = self.cp_size, self.cp_rank
    # Validates every K against (D, r); a launch with shard count K runs as
    # shard r % K of that K.
    shard_of = {
        k: GroupGeometry(kv_cache_group_name(index=i), k, cp_size, cp_rank).shard
        for i, k in enumerate(counts)
    }
    shard_of.setdefault(1, 0)
    setattr(self, TAKEN_SHARD_COUNTS_ATTR, counts)
    if cp_size == 1:
        return

    reach = arguments["sliding_window_reach"]
    if reach is not None:
        # A replicated group's column still covers B contiguous tokens, so the
        # masking upstream drops for every group under CP stays valid for it.
        self._sliding_window_reach = [
            r if k == 1 else 0 for r, k in zip(reach, counts, strict=True)
        ]
        self.has_sliding_window_groups = any(r > 0 for r in self._sliding_window_reach)
        self.sliding_window_reach = torch.tensor(
            self._sliding_window_reach, dtype=torch.int32, device=self.device
        )

    sharded = arguments["dcp_sharded"]
    if sharded is None:
        sharded = [True] * n
    enabled = list(self._slot_mapping_enabled)
    implied = [cp_size if s else 1 for s in sharded]
    if all(k == u or not on for k, u, on in zip(counts, implied, enabled, strict=True)):
        return
    launches = []
    for start, stop, k, on, sh in plan_slot_mapping_launches(counts, enabled):
        launches.append(
            SlotMappingLaunch(
                start=start,
                stop=stop,
                shard_count=k,
                shard=shard_of[k],
                enabled=torch.tensor(on, dtype=torch.bool, device=self.device),
                sharded=torch.tensor(sh, dtype=torch.bool, device=self.device),
                block_table_ptrs=self.block_table_ptrs[start:stop],
                block_table_strides=self.block_table_strides[start:stop],
                block_sizes=self.block_sizes_tensor[start:stop],
            )
        )
    self._dcp_slot_launches = launches


def _make_compute_slot_mappings(
    original: Callable[..., Any], module: ModuleType
) -> Callable[..., Any]:
    def compute_slot_mappings(
        self: Any,
        idx_mapping: Any,
        query_start_loc: Any,
        positions: Any,
        num_tokens_padded: int,
        out: Any = None,
    ) -> Any:
        launches = getattr(self, "_dcp_slot_launches", None)
        if not launches:
            return original(
                self, idx_mapping, query_start_loc, positions, num_tokens_padded, out
            )
        slot_mappings = self.slot_mappings if out is None else out
        num_reqs = idx_mapping.shape[0]
        for launch in launches:
            a, b = launch.start, launch.stop
            module._compute_slot_mappings_kernel[(b - a, num_reqs + 1)](
                slot_mappings.shape[1],
                idx_mapping,
                query_start_loc,
                positions,
                launch.block_table_ptrs,
                launch.block_table_strides,
                launch.block_sizes,
                launch.enabled,
                launch.sharded,
                slot_mappings[a:b],
                slot_mappings.stride(0),
                launch.shard,
                CP_SIZE=launch.shard_count,
                CP_INTERLEAVE=self.cp_interleave,
                PAD_ID=module.PAD_SLOT_ID,
                TRITON_BLOCK_SIZE=1024,
            )
        return slot_mappings[:, :num_tokens_padded]

    return compute_slot_mappings


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu.block_table",
    replaces=(
        Wrap(
            "BlockTables.__init__",
            "self, block_sizes, max_num_reqs, max_num_batched_tokens, "
            "max_num_blocks_per_group, device, cp_size=, cp_rank=, cp_interleave=, "
            "slot_mapping_enabled=, dcp_sharded=, sliding_window_reach=",
            _make_init,
        ),
        Wrap(
            "BlockTables.compute_slot_mappings",
            "self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=",
            _make_compute_slot_mappings,
            with_module=True,
        ),
    ),
    relies_on=(
        # Launched, not replaced.
        Pin(
            "_compute_slot_mappings_kernel",
            "max_num_tokens, idx_mapping, query_start_loc, pos, block_table_ptrs, "
            "block_table_strides, block_sizes, slot_mapping_enabled, dcp_sharded, "
            "slot_mappings_ptr, slot_mappings_stride, cp_rank, CP_SIZE, "
            "CP_INTERLEAVE, PAD_ID, TRITON_BLOCK_SIZE",
        ),
        Pin("PAD_SLOT_ID"),
    ),
    remove_with=("worker.gpu_model_runner_v2",),
    why=(
        "Model Runner V2 block tables have one CP_SIZE for all groups plus a bool, "
        "so partial shard counts get the D-shard slot mapping."
    ),
    remove_when="vLLM's V2 block tables take the DCP shard count per cache group",
    related="vllm#56723 (per-group dcp_sharded in BlockTables); vllm#51031",
)
