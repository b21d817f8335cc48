# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM 0.34.0's sparse MLA builders under the plugin: the indexer builder's
fused MQA+top-k eligibility follows the shard world (upstream decides it at
D before the plugin's world change), and a bf16 sparse latent builds at every
K in the world its collectives span (0.34.0 keeps its DCP limits for fp8
caches only), with ``plan`` saying the same. The builders on both releases
are in ``test_sparse_mla_builders``.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.mla import cpu_shims
from tests.support.sparse_builders import (
    B,
    D,
    build_on_rank,
    builder_config,
    flashmla_sparse_backend,
    indexer_backend,
    plan_refusal,
    spec_count,
)
from tests.support.sparse_mla import INDEXER_LAYER, LATENT_LAYER
from vllm_dcp_geometry.tooling.sparse_rank_run import indexer_spec, latent_spec

pytestmark = pytest.mark.patches(
    "worker.mla_indexer",
    "worker.sparse_mla_attention",
    "worker.flashmla_sparse",
    "worker.deepseek_v32_attention",
    "common.kv_cache_interface",
)

# vLLM 0.34 ---------------------------------------------------------------------------


@pytest.mark.vllm_releases("0.34.0")
@pytest.mark.parametrize(
    ("k", "collectives"), [(1, "replica"), (2, "replica"), (2, "dcp"), (4, "replica")]
)
def test_indexer_fused_topk_eligibility_follows_the_shard_world(
    k: int, collectives: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.34's builder plans prefill chunks for the fused MQA+top-k
    kernel only with the whole context; the op, handed world K, may fuse
    exactly at K = 1. Upstream's constructor decides it at D before the
    plugin's world change; the builder must end up eligible iff K = 1 (the
    rule's other inputs stood in for: no CUDA here)."""
    from vllm.v1.attention.backends.mla import indexer

    asked: list[bool] = []

    def rule(**kwargs: Any) -> bool:
        asked.append(kwargs["full_context"])
        return bool(kwargs["full_context"])

    monkeypatch.setattr(indexer, "use_fused_mqa_topk", rule)
    vllm_config = builder_config(collectives=collectives)
    spec = indexer_spec(B, spec_count(k))
    with cpu_shims():
        for rank in range(D):
            builder, _ = build_on_rank(
                vllm_config, rank, indexer_backend(), INDEXER_LAYER, spec
            )
            assert builder.dcp_world_size == k
            assert builder.fused_mqa_topk_eligible is (k == 1), rank
    # Upstream asks at D (K = D: nothing more); K < D asks again at K.
    assert asked == ([False] * D if k == D else [False, k == 1] * D)


@pytest.mark.vllm_releases("0.34.0")
@pytest.mark.parametrize(
    ("k", "collectives", "world"),
    [(1, "replica", 1), (2, "replica", 2), (2, "dcp", D), (4, "replica", D)],
)
def test_a_bf16_sparse_latent_builds_at_every_k_on_034(
    k: int, collectives: str, world: int
) -> None:
    """32 heads per rank with a bf16 cache: vLLM 0.33 refuses DCP (no fp8
    mixed-batch path); 0.34 keeps its DCP limits for fp8 caches only, so the
    builder builds at every K, in the world its collectives span (the
    plugin's config view then changes no refusal)."""
    vllm_config = builder_config(collectives=collectives, heads_per_rank=32)
    vllm_config.cache_config.cache_dtype = "auto"
    spec = latent_spec(B, spec_count(k))
    with cpu_shims():
        builder, _ = build_on_rank(
            vllm_config, 1, flashmla_sparse_backend(), LATENT_LAYER, spec
        )
    assert not builder.use_fp8_kv_cache and not builder.fp8_use_mixed_batch
    assert builder.dcp_world_size == world and builder.num_heads == 32
    # plan says the same; with an fp8_ds_mla cache it refuses, as the builder.
    assert plan_refusal(k, collectives, 32, cache_dtype="auto") is None
    if world > 1:
        assert "mixed-batch fp8 path" in str(plan_refusal(k, collectives, 32))
