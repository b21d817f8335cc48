# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.mla.indexer``: the DSA indexer's
metadata follows its cache's K.

What: wraps ``DeepseekV32IndexerMetadataBuilder.__init__`` with the one
taught-builder constructor (``metadata_builders.builder_init``). For an
indexer cache with K < D, after upstream's constructor the builder's DCP
world is the cache's shard world: ``dcp_world_size = K``, ``dcp_rank =
r % K`` (and its device copy), the draft-metadata update allowed only at
K = 1 (upstream: only at DCP 1) and, on vLLM 0.34, prefill chunks planned
for the fused MQA+top-k kernel exactly where the op may take it: with the
whole context, K = 1 (upstream: DCP 1). Everything the builder derives per
step then follows the cache: decode lengths localised with
``get_dcp_local_seq_lens(seq, K, s, I)`` (an identity at K = 1), the prefill
chunks' per-query local bounds from ``build_prefill_chunk_metadata(...,
dcp_rank=s, dcp_world_size=K)``. The indexer cache layers are then bound
(their attention layer's indexer call takes the same shard world; see
``patches.worker.deepseek_v32_attention``); a partial cache whose
collectives stay within its replica (rule A6, the default) is bound, and
its builder constructed, in the replica (``use_replica_group``), so its
layer's top-k merge gathers over the replica's K ranks.

Why: the builder takes D from the parallel config and r from the DCP group,
whatever the indexer cache's spec says.

Hand-back: D == 1, or vLLM's own K = D, runs upstream untouched. Compressed
indexer caches (``tokens_per_state > 1``: DeepSeek-V4, GLM-5.3-Flash's kpool)
are refused for K < D: their DCP interleave is in compressed states.

Remove when: the indexer builder takes a per-group DCP shard count.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.metadata_builders import BuilderTeaching, builder_init
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group


def _take_shard_world(
    builder: Any, geometry: GroupGeometry, vllm_config: Any, device: Any
) -> None:
    import torch

    if builder.compress_ratio != 1:
        raise DcpGeometryError(
            f"{geometry.describe()}: the indexer cache is compressed "
            f"(tokens_per_state={builder.compress_ratio}); its DCP interleave "
            "is in compressed states, which only vLLM's own K=D runs; use K=D"
        )
    shard_count, shard = geometry.shard_world
    builder.dcp_world_size = shard_count
    builder.dcp_rank = shard
    builder.dcp_rank_tensor = torch.tensor(shard, dtype=torch.int32, device=device)
    builder.compressed_cp_interleave_size = builder.cp_kv_cache_interleave_size
    builder.supports_draft_decode_metadata_update = shard_count == 1
    if hasattr(builder, "fused_mqa_topk_eligible"):
        builder.fused_mqa_topk_eligible = _fused_mqa_topk_eligible(builder)


def _fused_mqa_topk_eligible(builder: Any) -> bool:
    """vLLM 0.34's prefill-chunk eligibility for the fused MQA+top-k kernel,
    re-evaluated in the builder's shard world: upstream's constructor decides
    it with ``full_context = (D == 1)`` before the world is K, while the op
    (handed world K) may fuse exactly when K = 1, every rank holding the whole
    context. Same inputs as upstream's (the indexer's heads, head size,
    top-k per pool, FP4 cache)."""
    from vllm.v1.attention.backends.mla import indexer

    model_config = builder.vllm_config.model_config
    cfg = model_config.hf_text_config if model_config is not None else None
    if cfg is None:
        return False
    eligible: bool = indexer.use_fused_mqa_topk(
        query_shape=(
            getattr(cfg, "index_n_heads", 0),
            getattr(cfg, "index_head_dim", 0),
        ),
        topk=getattr(cfg, "index_topk", 0) // (getattr(cfg, "index_kpool", None) or 1),
        fp4_cache=builder.indexer_uses_fp4,
        full_context=builder.dcp_world_size == 1,
    )
    return eligible


BUILDER_TEACHING = BuilderTeaching(
    mla=True,
    construct_in_group=lambda geometry: False,
    finish=_take_shard_world,
    # Within its replica (rule A6) the caches are bound in the replica, so
    # the layer's top-k merge gathers over its K ranks.
    replica_group=operator_replica_group,
)


PATCH = Patch(
    upstream_module="vllm.v1.attention.backends.mla.indexer",
    replaces=(
        Wrap(
            "DeepseekV32IndexerMetadataBuilder.__init__",
            "self, *args, block_table_width, **kwargs",
            builder_init(BUILDER_TEACHING),
        ),
    ),
    relies_on=(
        # Relied on: every per-step use of the DCP world reads these attributes.
        Pin(
            "DeepseekV32IndexerMetadataBuilder._dcp_localize_decode_seq_lens",
            "self, seq_lens, num_decodes, seq_lens_is_buffer_view",
        ),
        Pin(
            "DeepseekV32IndexerMetadataBuilder.build",
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        ),
        # Relied on (0.34): the fused MQA+top-k eligibility rule recomputed
        # in the shard world.
        Pin(
            "use_fused_mqa_topk",
            {
                "0.34.0": "*, query_shape, topk, fp4_cache, full_context, "
                "candidate_selection="
            },
        ),
    ),
    remove_with=(
        "worker.mla_dcp_manager",
        "worker.sparse_attn_indexer",
    ),
    why=(
        "The DSA indexer builder takes D from the parallel config and r from the "
        "DCP group; a replicated or partial indexer cache needs (K, r % K)."
    ),
    remove_when="the DSA indexer builder takes a per-group DCP shard count",
    related="none upstream: the indexer builder reads the parallel config",
)
