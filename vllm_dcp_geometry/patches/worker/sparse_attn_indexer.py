# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.model_executor.layers.sparse_attn_indexer``: the DSA top-k
merge counts each shard of a partial indexer cache once.

What: wraps ``_merge_dcp_topk_global`` (the indexer op looks it up as a
module global at call time, so the registered custom op is covered too;
``apply`` refuses a vLLM whose op no longer does) and, as this module sees
it, ``get_dcp_group``. While ``group_context.use_indexer_geometry`` names a
partial indexer cache (1 < K < D; set by
``patches.worker.deepseek_v32_attention`` around the layer's indexer call,
which then passes the shard world ``(K, r % K)``):

- within its replica (rule A6, the default; the call also holds the
  replica, ``group_context.use_replica_group``): ``get_dcp_group`` answers
  the replica's ``GroupCoordinator`` (checked to be K ranks with this rank
  at ``r % K``), so the merge all-gathers the K shards' local top-k over the
  replica, K x top-k candidates per row, none of them padding;
- on the D-wide group (``partial_collectives: "dcp"``): a duplicate replica
  (``q = r // K != 0``) sends no candidates: its local top-k becomes id -1,
  which the merge packs as padding (key 0, never selected), so the D-rank
  all-gather holds every shard's local top-k exactly once.

Either way the stable top-k over the gathered candidates equals the
single-device top-k over the whole sequence (a token in the global top-k is
in its shard's local top-k), on every rank, with upstream's tie order (the
key orders ties by id, whatever order the ranks arrive in; contract rule
A5).

Why: upstream gathers over all D ranks; with D/K identical replicas each
shard's candidates arrive D/K times and duplicates displace real tokens.

Hand-back: outside such a call (K = D, K = 1 passes world 1 and never
merges, D == 1) upstream runs untouched.

Remove with: ``patches.worker.deepseek_v32_attention`` (the writer of the
channel). Remove when: the merge takes a replica group or index.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.group_context import (
    current_indexer_geometry,
    current_replica_group,
)
from vllm_dcp_geometry.runtime.mla_geometry import make_group_getter
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call


def _make_merge(original: Callable[..., None]) -> Callable[..., None]:
    def _merge_dcp_topk_global(
        logits: Any,
        topk_indices: Any,
        topk_tokens: int,
        dcp_rank: int,
        dcp_world_size: int,
        cp_interleave: int,
        row_starts: Any = None,
    ) -> None:
        geometry = current_indexer_geometry()
        if geometry is not None and geometry.is_partial:
            if (dcp_world_size, dcp_rank) != geometry.shard_world:
                raise DcpGeometryError(
                    f"{geometry.describe()}: the top-k merge was called with "
                    f"(dcp_world_size, dcp_rank)=({dcp_world_size}, {dcp_rank}), "
                    f"not the indexer cache's shard world {geometry.shard_world}"
                )
            replica = current_replica_group()
            if replica is not None:
                world = (replica.world_size, replica.rank_in_group)
                if world != geometry.shard_world:
                    raise DcpGeometryError(
                        f"{geometry.describe()}: the top-k merge's replica group "
                        f"has (world, rank)={world}, not the indexer cache's "
                        f"shard world {geometry.shard_world}"
                    )
            elif geometry.replica != 0:
                topk_indices.fill_(-1)
        original(
            logits,
            topk_indices,
            topk_tokens,
            dcp_rank,
            dcp_world_size,
            cp_interleave,
            row_starts,
        )

    return _merge_dcp_topk_global


def _require_global_merge(module: ModuleType) -> None:
    require_global_call(module, "sparse_attn_indexer", "_merge_dcp_topk_global")


PATCH = Patch(
    upstream_module="vllm.model_executor.layers.sparse_attn_indexer",
    replaces=(
        Wrap(
            "_merge_dcp_topk_global",
            "logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, "
            "cp_interleave, row_starts=",
            _make_merge,
        ),
        Wrap("get_dcp_group", "", make_group_getter),
    ),
    relies_on=(
        # Relied on: the op merges through the module global above, with the
        # dcp_rank / dcp_world_size it is given.
        Pin("sparse_attn_indexer"),
    ),
    remove_with=(
        "worker.deepseek_v32_attention",
        "worker.mla_attention",
        "worker.mla_indexer",
        "worker.sparse_mla_attention",
    ),
    why=(
        "The DSA top-k merge all-gathers candidates over all D ranks; a partial "
        "indexer cache's duplicate replicas would be counted D/K times, and its "
        "replica's K ranks are all it needs."
    ),
    remove_when="the DSA top-k merge takes a replica group or index",
    related="none upstream: the merge gathers over the DCP group",
    apply=_require_global_merge,
)
