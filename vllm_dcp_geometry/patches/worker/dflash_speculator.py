# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.spec_decode.dflash.speculator``: check geometry.

What: wraps ``DFlashSpeculator.set_attn`` (inherited by DSpark, DFlash2,
XPress, LiLiCorr) to check, once the draft's KV-cache groups are known, that
every draft group's shard count K equals the ``CP_SIZE`` its own slot kernel
(``_prepare_dflash_inputs_kernel``) runs with, ``speculator.dcp_size``, and
raises a ``DcpGeometryError`` naming the group otherwise. One case is made
right instead: an MLA draft (vLLM runs it at DCP D) whose groups are all
replicated (K = 1, e.g. Kimi-K3's DSpark draft with a ``"replicated"``
override) gets ``speculator.dcp_size = 1``, so the kernel computes the
replicated slots (``CP_SIZE = 1`` ignores the rank) and the draft steps'
lengths are the full ones, as its local builders read them.

Why: the DFlash kernel computes draft slots itself, with ``CP_SIZE =
dcp_size`` and ``cp_rank = r``, not from the block tables' geometry. That is
already the contract's mapping for the groups vLLM builds: ``dcp_size`` is 1
when the draft runs at DCP 1 (its groups are then replicated, K = 1, by
``get_kv_cache_spec``; ``cp_local_slot`` ignores the rank when ``CP_SIZE ==
1``) and D for an MLA draft (sharded, K = D, and ``r % D == r``). Only an
override giving a draft group another K would disagree, and that fails here at
start-up instead of writing draft KV to the wrong slots.

Remove when: the DFlash kernels take the draft group's shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.geometry import (
    get_kv_cache_dcp_shard_count,
    kv_cache_group_name,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


def check_draft_group_geometry(
    kv_cache_config: Any,
    draft_group_ids: list[int],
    speculator_dcp_size: int,
    target_dcp_size: int,
) -> None:
    """Every draft group's K must be the ``CP_SIZE`` of the DFlash kernel."""
    for gid in draft_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        owner = kv_cache_group_name(group.layer_names, gid)
        k = get_kv_cache_dcp_shard_count(
            group.kv_cache_spec, target_dcp_size, owner=owner
        )
        if k != speculator_dcp_size:
            raise DcpGeometryError(
                f"{owner}: the DFlash-family draft computes its slots for DCP "
                f"size {speculator_dcp_size}, but the group's shard count is K={k} "
                f"(D={target_dcp_size}); a draft at DCP 1 must be replicated, and "
                "a draft at DCP D sharded over all D ranks or replicated in every "
                "draft group"
            )


def draft_groups_replicated(
    kv_cache_config: Any, draft_group_ids: list[int], target_dcp_size: int
) -> bool:
    """Whether the draft has groups and every one of them has K = 1."""
    counts = [
        get_kv_cache_dcp_shard_count(
            kv_cache_config.kv_cache_groups[gid].kv_cache_spec,
            target_dcp_size,
            owner=kv_cache_group_name(
                kv_cache_config.kv_cache_groups[gid].layer_names, gid
            ),
        )
        for gid in draft_group_ids
    ]
    return bool(counts) and all(k == 1 for k in counts)


def _make_set_attn(original: Callable[..., None]) -> Callable[..., None]:
    def set_attn(
        self: Any,
        model_state: Any,
        kv_cache_config: Any,
        block_tables: Any,
        target_input_buffers: Any,
        target_attn_groups: Any,
    ) -> None:
        original(
            self,
            model_state,
            kv_cache_config,
            block_tables,
            target_input_buffers,
            target_attn_groups,
        )
        if block_tables.cp_size > 1:
            replicated = draft_groups_replicated(
                kv_cache_config,
                list(self.draft_kv_cache_group_ids),
                block_tables.cp_size,
            )
            if replicated and self.dcp_size == block_tables.cp_size:
                self.dcp_size = 1
            check_draft_group_geometry(
                kv_cache_config,
                list(self.draft_kv_cache_group_ids),
                self.dcp_size,
                block_tables.cp_size,
            )

    return set_attn


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu.spec_decode.dflash.speculator",
    replaces=(
        Wrap(
            "DFlashSpeculator.set_attn",
            "self, model_state, kv_cache_config, block_tables, target_input_buffers, "
            "target_attn_groups",
            _make_set_attn,
        ),
    ),
    relies_on=(Pin("prepare_dflash_inputs"),),
    why=(
        "DFlash-family speculators compute draft slots with CP_SIZE = their own "
        "dcp_size, which only matches a draft group whose K is that size."
    ),
    remove_when="the DFlash slot kernels take each draft group's DCP shard count",
    related="vllm#48392 (dense DFlash/DSpark drafts under DCP)",
)
