# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's sparse builders on every rank follow their group's K, on CPU.

The real ``DeepseekV32IndexerMetadataBuilder`` and
``FlashMLASparseMetadataBuilder`` (a ``SparseMLACommonMetadataBuilder``),
made by ``AttentionGroup.create_metadata_builders`` from a real
``VllmConfig`` of a tiny DeepSeek-V3.2 (D=4, TP=4, an ``fp8_ds_mla`` latent
cache), with the DCP group stood in for and shells of the model's
``DeepseekV32Attention`` (impl, real ``MLADCPManager``) and
``DeepseekV32IndexerCache`` in the forward context under the names the model
gives them.

- Indexer: K < D takes the shard world ``(K, r % K)`` (the draft-metadata
  update only at K = 1) and binds the indexer cache; K = D is upstream's
  constructor exactly. ``build()`` localises decode lengths and the prefill
  chunks' per-query bounds with ``(K, r % K)``: the contract's local lengths
  on every rank.
- Sparse latent (FLASHMLA_SPARSE): K = 1 is vLLM's DCP1 builder (world 1, no
  DCP manager, an N-row workspace; built where upstream's DCP limits refuse
  the head count, since nothing is gathered); 1 < K < D within its replica
  (rule A6, the default) is vLLM's builder for K sharded ranks over the
  replica group (world K, N + N/K rows, the layer's replica manager, the
  indexer cache bound with the replica), and on the D-wide group
  (``partial_collectives: "dcp"``) keeps D and binds the layer (shard-world
  ``forward_mqa``, replica-masked combine); K = D is upstream's.

About 5 s on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.mla import cpu_shims
from tests.support.sparse_builders import (
    NUM_DECODES,
    REQUESTS,
    B,
    D,
    build_on_rank,
    builder_config,
    common_metadata,
    flashmla_sparse_backend,
    indexer_backend,
    plan_refusal,
    spec_count,
    upstream_builder,
)
from tests.support.sparse_mla import (
    INDEXER_LAYER,
    LATENT_LAYER,
    dsv32_config,
    rank_process,
)
from vllm_dcp_geometry.contract import local_seq_len
from vllm_dcp_geometry.patches.worker.deepseek_v32_attention import REPLICA_ATTR
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine
from vllm_dcp_geometry.runtime.mla_geometry import ShardWorldForwardMqa
from vllm_dcp_geometry.runtime.patching import original_of
from vllm_dcp_geometry.tooling.sparse_rank_run import indexer_spec, latent_spec

pytestmark = pytest.mark.patches(
    "worker.mla_indexer",
    "worker.sparse_mla_attention",
    "worker.flashmla_sparse",
    "worker.deepseek_v32_attention",
    "common.kv_cache_interface",
)

# The indexer builder ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "collectives"), [(1, "replica"), (2, "replica"), (2, "dcp"), (4, "replica")]
)
def test_indexer_builder_takes_the_shard_world(k: int, collectives: str) -> None:
    vllm_config = builder_config(collectives=collectives)
    spec = indexer_spec(B, spec_count(k))
    with cpu_shims():
        for rank in range(D):
            builder, layers = build_on_rank(
                vllm_config, rank, indexer_backend(), INDEXER_LAYER, spec
            )
            shard = rank % k
            cache = layers[INDEXER_LAYER]
            assert (builder.dcp_world_size, builder.dcp_rank) == (k, shard)
            assert builder.dcp_rank_tensor.item() == builder.dcp_rank
            assert builder.supports_draft_decode_metadata_update is (k == 1)
            if k == D:
                with rank_process(vllm_config, D, rank):
                    upstream = upstream_builder(
                        builder,
                        spec,
                        INDEXER_LAYER,
                        vllm_config,
                        block_table_width=builder.expanded_block_table_buffer.shape[1],
                    )
                for attr in (
                    "dcp_world_size",
                    "dcp_rank",
                    "supports_draft_decode_metadata_update",
                    "compressed_cp_interleave_size",
                    "cp_kv_cache_interleave_size",
                ):
                    assert getattr(builder, attr) == getattr(upstream, attr), attr
                assert torch.equal(builder.dcp_rank_tensor, upstream.dcp_rank_tensor)
                assert not hasattr(builder, BOUND_GEOMETRY_ATTR)
                assert not hasattr(cache, BOUND_GEOMETRY_ATTR)
            else:
                geometry = getattr(builder, BOUND_GEOMETRY_ATTR)
                assert geometry.shard_world == (k, shard) and geometry.dcp_rank == rank
                assert getattr(cache, BOUND_GEOMETRY_ATTR).shard_world == (k, shard)
                # Bound in its replica (the merge gathers over it) or D-wide.
                replica = getattr(cache, REPLICA_ATTR)
                if k > 1 and collectives == "replica":
                    assert (replica.world_size, replica.rank_in_group) == (k, shard)
                    assert replica.ranks == [rank // k * k + s for s in range(k)]
                else:
                    assert replica is None


@pytest.mark.parametrize("interleave", [1, B])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_indexer_build_gives_the_contract_local_lengths(
    k: int, interleave: int
) -> None:
    """Decode ``seq_lens`` and every prefill chunk's ``local_cu_seq_lens`` and
    per-query ``[cu_seqlen_ks, cu_seqlen_ke)`` are the contract's local
    lengths of shard ``r % K``; the merge trigger stays set for K > 1."""
    vllm_config = builder_config(interleave)
    spec = indexer_spec(B, spec_count(k))

    def local(length: int, shard: int) -> int:
        return local_seq_len(length, B, k, interleave, shard)

    with cpu_shims():
        for rank in range(D):
            shard = rank % k
            builder, _ = build_on_rank(
                vllm_config, rank, indexer_backend(), INDEXER_LAYER, spec
            )
            with rank_process(vllm_config, D, rank):
                metadata = builder.build(0, common_metadata(vllm_config, rank))
            decode = metadata.decode
            assert metadata.num_decodes == NUM_DECODES
            want = [local(c + n, shard) for c, n in REQUESTS[:NUM_DECODES]]
            assert decode.seq_lens.flatten()[:NUM_DECODES].tolist() == want, rank
            if k > 1:
                assert decode.global_seq_lens is not None
            prefills = REQUESTS[NUM_DECODES:]
            lens = [local(c + n, shard) for c, n in prefills]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            starts, ends = [], []
            for i, (context, new) in enumerate(prefills):
                for j in range(new):
                    starts.append(cu[i])
                    ends.append(cu[i] + local(context + j + 1, shard))
            assert metadata.prefill is not None and len(metadata.prefill.chunks) == 1
            chunk = metadata.prefill.chunks[0]
            assert chunk.local_cu_seq_lens.tolist() == cu, rank
            assert chunk.cu_seqlen_ks.tolist() == starts, rank
            assert chunk.cu_seqlen_ke.tolist() == ends, rank


# The sparse latent builder ------------------------------------------------------------


def _workspace_facts(builder: Any) -> dict[str, Any]:
    return {
        "dcp_world_size": builder.dcp_world_size,
        "workspace_rows": builder.chunked_prefill_workspace.shape[0],
        "workspace_size": builder.chunked_prefill_workspace_size,
        "dcp_virtual_block_size": builder.dcp_virtual_block_size,
        "num_heads": builder.num_heads,
        "fp8_decode_padded_heads": builder.fp8_decode_padded_heads,
        "fp8_use_mixed_batch": builder.fp8_use_mixed_batch,
        "reorder_batch_threshold": builder.reorder_batch_threshold,
        "has_dcp_manager": builder.dcp_manager is not None,
    }


def test_replicated_sparse_latent_builder_is_the_dcp1_builder() -> None:
    """K = 1 at D = 4 builds what the same model at DCP 1 builds: world 1,
    no DCP manager, an N-row workspace; the impl runs local."""
    dcp1 = dsv32_config(1, 1)
    with cpu_shims():
        want, _ = build_on_rank(
            dcp1, 0, flashmla_sparse_backend(), LATENT_LAYER, latent_spec(B, None), 1
        )
        vllm_config = builder_config()
        for rank in range(D):
            builder, layers = build_on_rank(
                vllm_config,
                rank,
                flashmla_sparse_backend(),
                LATENT_LAYER,
                latent_spec(B, 1),
            )
            assert _workspace_facts(builder) == _workspace_facts(want)
            assert builder.dcp_manager is None
            impl = layers[LATENT_LAYER].impl
            assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
            assert isinstance(impl.forward_mqa, ShardWorldForwardMqa)
            assert getattr(builder, BOUND_GEOMETRY_ATTR).shard_world == (1, 0)


def test_replicated_sparse_latent_builder_is_not_refused_for_gathered_heads() -> None:
    """32 heads per rank: upstream's FlashMLA sparse builder refuses DCP (the
    D-gathered query misses the fp8 mixed-batch path); a K = 1 group gathers
    nothing and builds."""
    vllm_config = dsv32_config(D, 1, heads_per_rank=32)
    with cpu_shims():
        builder, _ = build_on_rank(
            vllm_config, 1, flashmla_sparse_backend(), LATENT_LAYER, latent_spec(B, 1)
        )
        assert builder.dcp_world_size == 1 and builder.num_heads == 32
        with pytest.raises(NotImplementedError, match="mixed-batch fp8 path"):
            build_on_rank(
                vllm_config,
                1,
                flashmla_sparse_backend(),
                LATENT_LAYER,
                latent_spec(B, None),
            )


@pytest.mark.parametrize(("k", "collectives"), [(2, "replica"), (2, "dcp"), (4, "")])
def test_partial_sparse_latent_builders_run_in_their_collective_world(
    k: int, collectives: str
) -> None:
    """1 < K < D within its replica: vLLM's builder for K sharded ranks over
    the replica group (world K, N + N/K rows, the layer's replica manager,
    whose query gather and combine span the replica; nothing masked). On the
    D-wide group it keeps upstream's D-wide builder (N + N/D rows) and masks
    duplicate replicas. K = D is upstream's builder and binds nothing."""
    vllm_config = builder_config(collectives=collectives or "replica")
    spec = latent_spec(B, spec_count(k))
    world = k if collectives == "replica" else D
    with cpu_shims():
        for rank in range(D):
            builder, layers = build_on_rank(
                vllm_config, rank, flashmla_sparse_backend(), LATENT_LAYER, spec
            )
            layer = layers[LATENT_LAYER]
            facts = _workspace_facts(builder)
            assert (
                facts["dcp_world_size"] == world
                and builder.dcp_manager is layer.dcp_manager
            )
            assert layer.dcp_manager.group.world_size == world
            assert facts["workspace_rows"] == (
                facts["workspace_size"] * (world + 1) // world
            )
            if k == D:
                with rank_process(vllm_config, D, rank):
                    upstream = upstream_builder(
                        builder, spec, LATENT_LAYER, vllm_config
                    )
                assert _workspace_facts(upstream) == facts
                assert not hasattr(builder, BOUND_GEOMETRY_ATTR)
                assert not isinstance(layer.impl.forward_mqa, ShardWorldForwardMqa)
                assert not isinstance(layer.dcp_manager.combine, ReplicaMaskedCombine)
                continue
            assert getattr(builder, BOUND_GEOMETRY_ATTR).shard_world == (k, rank % k)
            assert layer.impl.dcp_world_size == world
            assert isinstance(layer.impl.forward_mqa, ShardWorldForwardMqa)
            combine = layer.dcp_manager.combine
            if collectives == "replica":
                assert layer.dcp_manager.group.rank_in_group == rank % k
                assert not isinstance(combine, ReplicaMaskedCombine)
            else:
                assert isinstance(combine, ReplicaMaskedCombine)
                assert combine.replica == rank // k


@pytest.mark.parametrize(("k", "collectives"), [(2, "replica"), (2, "dcp"), (4, "")])
def test_sparse_dense_mha_context_is_planned_over_the_group(
    k: int, collectives: str
) -> None:
    """The dense-MHA prefill of a sparse layer reads its context through
    vLLM's MLA chunk planner: a partial group's chunks hold each shard's
    contract local lengths (K shards, not D), a K = D group's D shards."""
    from vllm_dcp_geometry.contract import local_seq_len

    vllm_config = builder_config(collectives=collectives or "replica")
    spec = latent_spec(B, spec_count(k))
    decodes = sum(1 for _, n in REQUESTS if n == 1)
    prefills = REQUESTS[decodes:]
    query_lens = torch.tensor([n for _, n in prefills], dtype=torch.int32)
    with cpu_shims():
        for rank in range(D):
            builder, _ = build_on_rank(
                vllm_config, rank, flashmla_sparse_backend(), LATENT_LAYER, spec
            )
            chunked = builder._build_chunked_context_fields(
                common_metadata(vllm_config, rank), decodes, len(prefills), query_lens
            )
            contexts = [c for c, _ in prefills]
            assert chunked.context_lens_list == contexts
            covered = sum(chunk.num_context_tokens for chunk in chunked.chunks)
            assert covered == sum(contexts)
            for chunk in chunked.chunks:
                requests = range(chunk.request_slice.start, chunk.request_slice.stop)
                assert chunk.local_context_lens_allranks == [
                    [local_seq_len(contexts[i], B, k, 1, s) for s in range(k)]
                    for i in requests
                ]
            if k < D and collectives == "dcp":
                # Upstream's own method plans the partial cache over D shards.
                upstream = original_of(type(builder)._build_chunked_context_fields)
                wrong = upstream(
                    builder,
                    common_metadata(vllm_config, rank),
                    decodes,
                    len(prefills),
                    query_lens,
                )
                assert len(wrong.chunks[0].local_context_lens_allranks[0]) == D


@pytest.mark.parametrize(
    ("k", "collectives", "builds"),
    [(2, "replica", True), (2, "dcp", False), (4, "replica", False), (1, "dcp", True)],
)
def test_the_gathered_head_envelope_is_checked_for_the_world_gathered(
    k: int, collectives: str, builds: bool
) -> None:
    """24 heads per rank pad to FlashMLA's 64-head fp8 envelope; gathered over
    a replica of 2 (48) they still do, over D = 4 (96) they pad to 128. The
    real builder builds a partial group within its replica (the plugin shows
    it the replica's world) and refuses it on the D-wide group and at K = D,
    as vLLM does; ``plan``'s restated rule refuses exactly where it does."""
    vllm_config = builder_config(collectives=collectives, heads_per_rank=24)
    spec = latent_spec(B, spec_count(k))
    refusal = plan_refusal(k, collectives, 24)
    with cpu_shims():
        if builds:
            builder, _ = build_on_rank(
                vllm_config, 1, flashmla_sparse_backend(), LATENT_LAYER, spec
            )
            assert builder.num_heads == 24 and builder.fp8_decode_padded_heads == 64
            assert refusal is None
            return
        with pytest.raises(
            NotImplementedError, match="same fp8 decode kernel envelope"
        ):
            build_on_rank(vllm_config, 1, flashmla_sparse_backend(), LATENT_LAYER, spec)
    assert refusal is not None and "pad to 64" in refusal and "to 128" in refusal
