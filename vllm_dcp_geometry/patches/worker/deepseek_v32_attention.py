# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.models.deepseek_v32.attention``: DeepSeek-V3.2's indexer call
takes its indexer cache's K.

What: wraps the module's ``sparse_attn_indexer`` (the name the layer calls)
and registers the binder of the indexer cache layers
(``layer_classes.LayerBinding.SPARSE_INDEXER_CACHE``), which the indexer
builder patch calls for every cache of a group with K < D once the cache is
known to belong to a ``DeepseekV32Attention`` (the layer of module ``P``
is ``P.attn``, its cache ``P.indexer.k_cache``;
``layer_binding.check_reader``) and marks it with its geometry. The call
wrapper finds the cache by the prefix the layer passes and, for a bound
cache, replaces the layer's ``dcp_rank`` / ``dcp_world_size`` (the DCP
manager's rank and the parallel config's D) with the cache's shard world
``(K, r % K)``:

- K = 1: world 1, so every rank scores all its (replicated) tokens and the
  D-rank top-k merge is skipped; every rank selects the same global positions.
- 1 < K < D: local positions map to global ones over K shards, and for the
  duration of the call ``group_context.use_indexer_geometry`` names the
  cache. Within its replica (rule A6, the default: the cache was bound in
  its replica group, and its latent cache shares its K, rule A5, so the
  layer's DCP manager is the replica's and hands the indexer the replica
  rank ``r % K``) the call also holds the replica
  (``group_context.use_replica_group``), and the merge
  (``patches.worker.sparse_attn_indexer``) all-gathers over its K ranks. On
  the D-wide group (``partial_collectives: "dcp"``) the merge drops the
  duplicate replicas' candidates from its D-rank all-gather.

Every other argument passes through as the layer gave it (on vLLM 0.34 also
``logits_dtype``), except that a substituted shard world never takes 0.34's
symmetric-memory top-k exchange (``dcp_direct_topk_max_rows`` = 0; the
layer passes none today, so upstream's default 0 holds): that workspace
packs ids with the DCP group's own ``(r, D)``.

The sparse attention of the same layer is the generic MLA binding (the impl
filters the selection to its shard in ``(K, r % K)``; the query gather and
combine run within the replica, or D-wide with duplicate replicas masked).

Why: the layer hands its indexer the global DCP world whatever the indexer
cache's spec says, and the merge counts every replica's candidates.

Hand-back: with no bound indexer cache in the process (D == 1, or vLLM's own
K = D) the call goes straight to upstream.

Remove with: ``patches.worker.sparse_attn_indexer`` (the reader of the
channel). Remove when: the layer passes its indexer cache's DCP geometry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    LAYER_BINDERS,
    LayerBinding,
)
from vllm_dcp_geometry.runtime.group_context import (
    current_replica_group,
    use_indexer_geometry,
    use_replica_group,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR, check_rebind
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap, set_item
from vllm_dcp_geometry.runtime.upstream_symbols import (
    require_class_path,
    require_global_call,
)

DIRECT_TOPK_MAX_ROWS = "dcp_direct_topk_max_rows"
"""vLLM 0.34's indexer keyword enabling the merge's symmetric-memory exchange."""

_bound_caches: list[str] = []
"""Names of the indexer caches bound in this process (empty: hand-back)."""

REPLICA_ATTR = "_vllm_dcp_geometry_replica_group"
"""Set on an indexer cache bound within its replica group (rule A6) to that
``GroupCoordinator``."""


def bind_indexer_cache(layer: Any, geometry: GroupGeometry, layer_name: str) -> None:
    """Bind one DeepSeek-V3.2 indexer cache to its group (idempotent; its
    reader's class is checked by ``layer_binding.check_reader``), with the
    replica group it is bound in, if any."""
    if check_rebind(layer, geometry, f"the indexer cache {layer_name}"):
        return
    replica = current_replica_group() if geometry.is_partial else None
    setattr(layer, REPLICA_ATTR, replica)
    setattr(layer, BOUND_GEOMETRY_ATTR, geometry)
    _bound_caches.append(layer_name)


def _bound_cache(k_cache_prefix: Any) -> Any:
    from vllm.forward_context import get_forward_context
    from vllm.utils.torch_utils import _resolve_layer_name

    name = _resolve_layer_name(k_cache_prefix)
    return get_forward_context().no_compile_layers[name]


def _make_sparse_attn_indexer(original: Callable[..., Any]) -> Callable[..., Any]:
    def sparse_attn_indexer(
        hidden_states: Any, k_cache_prefix: Any, *args: Any, **kwargs: Any
    ) -> Any:
        cache = _bound_cache(k_cache_prefix) if _bound_caches else None
        geometry = getattr(cache, BOUND_GEOMETRY_ATTR, None)
        if geometry is None:
            return original(hidden_states, k_cache_prefix, *args, **kwargs)
        replica = getattr(cache, REPLICA_ATTR, None)
        # The layer passes its DCP manager's rank: the replica's within it.
        rank = geometry.dcp_rank if replica is None else replica.rank_in_group
        seen = (kwargs.get("dcp_rank"), kwargs.get("dcp_world_size"))
        if seen != (rank, geometry.dcp_world_size):
            raise DcpGeometryError(
                f"{geometry.describe()}: {DEEPSEEK_V32_ATTENTION} called its indexer "
                f"with (dcp_rank, dcp_world_size)={seen}, not "
                f"({rank}, {geometry.dcp_world_size}), the DCP world this patch "
                "was taught to replace"
            )
        kwargs["dcp_world_size"], kwargs["dcp_rank"] = geometry.shard_world
        if DIRECT_TOPK_MAX_ROWS in kwargs:
            # vLLM 0.34's direct top-k exchange packs with D's (rank, world).
            kwargs[DIRECT_TOPK_MAX_ROWS] = 0
        if not geometry.is_partial:
            return original(hidden_states, k_cache_prefix, *args, **kwargs)
        with contextlib.ExitStack() as scope:
            scope.enter_context(use_indexer_geometry(geometry))
            if replica is not None:
                scope.enter_context(use_replica_group(replica))
            return original(hidden_states, k_cache_prefix, *args, **kwargs)

    return sparse_attn_indexer


def apply(module: ModuleType) -> None:
    require_class_path(module, "DeepseekV32Attention", DEEPSEEK_V32_ATTENTION)
    require_global_call(
        module, "DeepseekV32Attention._sparse_indexer_and_attn", "sparse_attn_indexer"
    )
    set_item(
        LAYER_BINDERS,
        LayerBinding.SPARSE_INDEXER_CACHE,
        (__name__, bind_indexer_cache),
    )


_INDEXER_PARAMETERS = (
    "hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, weights, "
    "quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len, "
    "total_seq_lens, topk_indices_buffer, skip_k_cache_insert, use_pcp, "
    "pcp_shard_decode_requests, dense_mha_metadata_layer_name, "
    "use_fp4_cache=, dcp_rank=, dcp_world_size=, "
    "cp_kv_cache_interleave_size=, skip_topk_buffer_clear=, "
    "candidate_blocks=, candidate_block_size=, candidate_write=, "
    "topk_backend="
)
"""The indexer op's parameters on vLLM 0.33.0 (0.34.0 appends two)."""

PATCH = Patch(
    upstream_module="vllm.models.deepseek_v32.attention",
    replaces=(
        Wrap(
            "sparse_attn_indexer",
            {
                "0.33.0": _INDEXER_PARAMETERS,
                "0.34.0": _INDEXER_PARAMETERS
                + ", logits_dtype=, dcp_direct_topk_max_rows=",
            },
            _make_sparse_attn_indexer,
        ),
    ),
    relies_on=(
        # Relied on: the layer calls the name above with its indexer cache's
        # prefix and passes dcp_rank / dcp_world_size by keyword; it gates the
        # query gather and combine on impl.dcp_world_size.
        Pin(
            "DeepseekV32Attention._sparse_indexer_and_attn",
            "self, positions, q_c, q_nope, q_pe, index_q_fp8, index_k, "
            "index_weights_out, kv_c, k_pe, ql_nope, mqa_q, output",
        ),
    ),
    remove_with=(
        "worker.sparse_attn_indexer",
        "worker.mla_dcp_manager",
    ),
    why=(
        "DeepSeek-V3.2's layer hands its indexer the global DCP world; a "
        "replicated or partial indexer cache needs its own (K, r % K)."
    ),
    remove_when="the layer passes its indexer cache's DCP geometry",
    related="none upstream: the layer reads the parallel config's DCP size",
    apply=apply,
)
