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
which then passes the shard world ``(K, r % K)``), the merge packs global
ids with ``(K, r % K)`` and:

- within its replica (rule A6, the default; the call also holds the
  replica, ``group_context.use_replica_group``): ``get_dcp_group`` answers
  the replica's ``GroupCoordinator`` (checked to be K ranks with this rank
  at ``r % K``), so the merge all-gathers the K shards' local top-k over the
  replica, K x top-k candidates per row, none of them padding;
- on the D-wide group (``partial_collectives: "dcp"``): a duplicate replica
  (``q = r // K != 0``) sends no candidates (its local top-k becomes id -1,
  which the merge packs as padding: key 0, never selected), and
  ``get_dcp_group`` answers the DCP group seen through ``FirstReplicaGather``:
  a rank-major (dim-0) all-gather still spans all D ranks but hands the
  selector the first K ranks' rows only (replica 0: shards 0 .. K-1 once),
  which is what vLLM 0.34's merge views as ``[K, rows, top-k, 2]`` (it
  reshapes by the world it is passed); vLLM 0.33's dim-1 gather is handed
  whole, every shard once among the padding.

On vLLM 0.34 a partial merge also never takes the symmetric-memory "direct"
exchange (``direct_max_rows`` forced to 0): its workspace packs ids with its
own group's ``(rank, world)`` (D's, not ``(K, r % K)``), and, asked for
within a replica, its ``functools.cache`` would rendezvous a new K-rank
workspace in the middle of a forward. The other new keywords
(``logits_dtype``, ``num_positions``) pass through.

Either way the stable top-k over the gathered candidates equals the
single-device top-k over the whole sequence (a token in the global top-k is
in its shard's local top-k), on every rank, with upstream's tie order (the
key orders ties by id, whatever order the ranks arrive in; contract rule
A5).

Why: upstream gathers over all D ranks; with D/K identical replicas each
shard's candidates arrive D/K times and duplicates displace real tokens (and
on 0.34 the D-rank gather no longer fits the view by K).

Hand-back: outside such a call (K = D, K = 1 passes world 1 and never
merges, D == 1) upstream runs untouched, with the arguments it was given.

Remove with: ``patches.worker.deepseek_v32_attention`` (the writer of the
channel). Remove when: the merge takes a replica group or index.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    current_indexer_geometry,
    current_replica_group,
)
from vllm_dcp_geometry.runtime.mla_geometry import make_group_getter
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call

DIRECT_MAX_ROWS = "direct_max_rows"
"""vLLM 0.34's merge keyword bounding its symmetric-memory exchange."""

_first_replica_shards: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "vllm_dcp_geometry_first_replica_shards", default=None
)
"""K while a partial merge runs on the D-wide group (this module's
``get_dcp_group`` then answers a ``FirstReplicaGather``), else None."""


class FirstReplicaGather:
    """The D-rank DCP group as a partial indexer's D-wide merge reads it.

    Invariant: a dim-0 ``all_gather`` (rank-major, ``[D * rows, ...]``) runs
    over all D ranks, as every rank of the DCP group must join it, and
    returns its first ``K * rows`` rows: DCP ranks 0 .. K-1, replica 0,
    which hold shards 0 .. K-1 once each (rank r holds shard r % K). Any
    other dim is returned whole (the duplicate replicas' candidates are then
    padding). Everything else is the DCP group's."""

    def __init__(self, group: Any, shard_count: int) -> None:
        self.group = group
        self.shard_count = shard_count

    def all_gather(self, tensor: Any, dim: int = -1) -> Any:
        gathered = self.group.all_gather(tensor, dim=dim)
        if dim != 0:
            return gathered
        return gathered[: self.shard_count * tensor.shape[0]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.group, name)


def make_indexer_group_getter(original: Callable[[], Any]) -> Callable[[], Any]:
    """Wrapper factory for this module's ``get_dcp_group``: MLA's getter
    (``mla_geometry.make_group_getter``: the replica while one is held),
    seen through ``FirstReplicaGather`` while a partial merge runs on the
    D-wide group."""
    inner = make_group_getter(original)

    def get_dcp_group() -> Any:
        shard_count = _first_replica_shards.get()
        group = inner()
        if shard_count is None:
            return group
        return FirstReplicaGather(group, shard_count)

    return get_dcp_group


@contextlib.contextmanager
def _first_replica(shard_count: int) -> Iterator[None]:
    token = _first_replica_shards.set(shard_count)
    try:
        yield
    finally:
        _first_replica_shards.reset(token)


def _check_shard_world(
    geometry: GroupGeometry, dcp_world_size: int, dcp_rank: int
) -> Any:
    """The replica group the merge runs in (None: the D-wide group), after
    checking the merge was handed the cache's shard world and the replica
    (if any) is the cache's."""
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
    return replica


def _make_merge(original: Callable[..., None]) -> Callable[..., None]:
    def _merge_dcp_topk_global(
        logits: Any,
        topk_indices: Any,
        topk_tokens: int,
        dcp_rank: int,
        dcp_world_size: int,
        cp_interleave: int,
        row_starts: Any = None,
        **release_kwargs: Any,
    ) -> None:
        # release_kwargs: 0.34's logits_dtype, num_positions, direct_max_rows.
        geometry = current_indexer_geometry()
        scope: Any = contextlib.nullcontext()
        if geometry is not None and geometry.is_partial:
            replica = _check_shard_world(geometry, dcp_world_size, dcp_rank)
            if DIRECT_MAX_ROWS in release_kwargs:
                # The direct workspace is D's (its own rank/world pack the ids).
                release_kwargs[DIRECT_MAX_ROWS] = 0
            if replica is None:
                if geometry.replica != 0:
                    topk_indices.fill_(-1)
                scope = _first_replica(geometry.shard_count)
        with scope:
            original(
                logits,
                topk_indices,
                topk_tokens,
                dcp_rank,
                dcp_world_size,
                cp_interleave,
                row_starts,
                **release_kwargs,
            )

    return _merge_dcp_topk_global


def _require_global_calls(module: ModuleType) -> None:
    require_global_call(module, "sparse_attn_indexer", "_merge_dcp_topk_global")
    # The replica and the first-replica view reach the merge through its
    # module global get_dcp_group.
    require_global_call(module, "_merge_dcp_topk_global", "get_dcp_group")


PATCH = Patch(
    upstream_module="vllm.model_executor.layers.sparse_attn_indexer",
    replaces=(
        Wrap(
            "_merge_dcp_topk_global",
            {
                "0.33.0": "logits, topk_indices, topk_tokens, dcp_rank, "
                "dcp_world_size, cp_interleave, row_starts=",
                "0.34.0": "logits, topk_indices, topk_tokens, dcp_rank, "
                "dcp_world_size, cp_interleave, row_starts=, logits_dtype=, "
                "num_positions=, direct_max_rows=",
            },
            _make_merge,
        ),
        Wrap("get_dcp_group", "", make_indexer_group_getter),
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
    apply=_require_global_calls,
)
