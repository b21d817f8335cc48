# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's layer built on one ``ranks`` worker (``set_up_layer``):
vLLM's ``DeepseekV32Attention`` made by its own constructor (its indexer, its
``DeepseekV32IndexerCache``, its impl and its ``MLADCPManager``) over a
weightless DeepSeek-V3.2 config with the group's ``fp8_ds_mla`` cache dtype,
top-k and shapes, its ``kv_b_proj`` holding the rank's slice of a random
weight, absorbed by its own ``process_weights_after_loading``; and both
groups' builders, made by ``AttentionGroup.create_metadata_builders`` as a
``vllm serve`` worker makes them (FLASHMLA_SPARSE's for the latent cache,
DEEPSEEK_V32_INDEXER's for the indexer cache), so the plugin's builders bind
the layer and its indexer cache for the group's K.

On a GPU the backend is FLASHMLA_SPARSE itself; on a CPU the same backend
hands out ``sparse_stand_ins.triton_sparse_impl_class`` as its impl, and
``cpu_sdpa`` answers the MLA prefill selector.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv
from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call
from vllm_dcp_geometry.tooling.cli.ranks.runners.inputs import (
    Requests,
    ShardLayout,
    up_projection_weight,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape, sparse_decode_requests
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import vllm_config
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    indexer_spec,
    latent_spec,
    write_dsv32_config,
)
from vllm_dcp_geometry.tooling.vllm_release import process_weights_after_loading

DSV32 = "vllm.models.deepseek_v32.attention"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
PREFIX = "model.layers.0.self_attn"
LATENT_LAYER = f"{PREFIX}.attn"
"""Where ``DeepseekV32Attention`` registers itself."""
INDEXER_LAYER = f"{PREFIX}.indexer.k_cache"
"""Where its ``DeepseekV32IndexerCache`` registers itself."""

RELIED_ON = (
    UpstreamSymbol(
        DSV32,
        "DeepseekV32Attention.__init__",
        "self, vllm_config, config, prefix, topk_indices_buffer=, attn_backend=, "
        "index_group_builder=",
    ),
    UpstreamSymbol(
        DSV32,
        "DeepseekV32Attention._sparse_indexer_and_attn",
        "self, positions, q_c, q_nope, q_pe, index_q_fp8, index_k, "
        "index_weights_out, kv_c, k_pe, ql_nope, mqa_q, output",
    ),
    UpstreamSymbol(MLA_ATTENTION, "get_mla_prefill_backend", "vllm_config"),
)
"""What this runner drives or answers in vLLM, pinned: the layer's
constructor and the method that runs its indexer and sparse attention (which
calls the module's ``sparse_attn_indexer`` by name), and the MLA prefill
selector the constructor asks (answered with ``cpu_sdpa`` on a CPU)."""


@dataclass(frozen=True)
class SparseSetUp:
    """One DeepSeek-V3.2 layer built on this rank: its layout, the float64
    ``kv_b_proj`` weight of all heads, the layer and both groups' builders,
    and the decode batch."""

    group: PlannedGroup
    topk: int
    layout: ShardLayout
    weight: Any
    config: Any
    layer: Any
    latent_builder: Any
    indexer_builder: Any
    requests: Requests
    width: int
    """Block-table entries per request."""
    num_blocks: int


def backend_class(device: str, dtype: str) -> type:
    """FLASHMLA_SPARSE; on a CPU the same backend (its builder, its name)
    handing out ``sparse_stand_ins.triton_sparse_impl_class`` as its impl (its
    Triton kernel as shipped, or with a float32 store for a float32 run)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    flashmla_sparse = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    if device != "cpu":
        return flashmla_sparse
    from vllm_dcp_geometry.tooling.sparse_stand_ins import triton_sparse_impl_class

    impl = triton_sparse_impl_class(fp32_store=dtype == "float32")

    class TritonImplOnCpu(flashmla_sparse):  # type: ignore[misc, valid-type]
        @staticmethod
        def get_impl_cls() -> type:
            return impl

    return TritonImplOnCpu


def sparse_config(group: PlannedGroup, run: RankRun) -> Any:
    """The run's ``VllmConfig`` for the layer: TP = DCP = D, a DeepSeek-V3.2
    model of D x h heads selecting the group's top-k, the group's block size,
    interleave and ``fp8_ds_mla`` cache dtype."""
    shape, topk = group.shape, group.indexer_topk
    assert topk is not None
    path = write_dsv32_config(
        run.world * shape.heads_per_rank,
        index_topk=topk,
        dtype=shape.dtype,
        max_position_embeddings=max(4096, shape.max_model_len),
        nope_dim=shape.nope_dim,
        v_head_dim=shape.v_head_dim,
    )
    config = vllm_config(
        path,
        run.world,
        group.interleave,
        group.block_size,
        shape,
        run.device,
        run.partial_collectives,
    )
    config.cache_config.cache_dtype = "fp8_ds_mla"
    return config


def build_layer(
    config: Any, weight: Any, rank: int, shape: Shape, device: str, topk: int
) -> Any:
    """The rank's ``DeepseekV32Attention`` by its own constructor (the
    run's backend; ``cpu_sdpa`` answering the MLA prefill selector on a
    CPU), with its TP slice of ``weight`` in ``kv_b_proj``, weights
    absorbed."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32 import attention as dsv32
    from vllm.utils.torch_utils import set_default_torch_dtype

    for symbol in RELIED_ON:
        verify_symbol(symbol)
    require_global_call(
        dsv32, "DeepseekV32Attention._sparse_indexer_and_attn", "sparse_attn_indexer"
    )
    require_global_call(
        mla_attention, "MLAAttention.__init__", "get_mla_prefill_backend"
    )
    dtype = getattr(torch, shape.dtype)
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
                CPUSDPAMLAPrefillBackend,
            )

            stack.enter_context(
                replaced(
                    mla_attention,
                    "get_mla_prefill_backend",
                    lambda *a, **k: CPUSDPAMLAPrefillBackend,
                )
            )
        else:
            from vllm.v1.worker.workspace import (
                init_workspace_manager,
                is_workspace_manager_initialized,
            )

            # FlashMLA's sparse impl reserves its workspace when it is built.
            if not is_workspace_manager_initialized():
                init_workspace_manager(torch.device(device))
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(set_default_torch_dtype(dtype))
        stack.enter_context(torch.device(device))
        buffer = torch.full((config.scheduler_config.max_num_seqs, topk), -1)
        layer = dsv32.DeepseekV32Attention(
            config,
            config.model_config.hf_config,
            PREFIX,
            topk_indices_buffer=buffer.to(torch.int32),
            attn_backend=backend_class(device, shape.dtype),
        )
    rows = shape.heads_per_rank * (shape.nope_dim + shape.v_head_dim)
    layer.kv_b_proj.weight.data.copy_(weight[rank * rows : (rank + 1) * rows])
    process_weights_after_loading(layer, dtype)
    if device == "cpu":
        # A one-layer index group converts nothing (``forward_mqa`` converts
        # per layer), and the CUDA event it records for its indexer raises
        # without a CUDA device.
        layer.impl.index_group = None
    return layer


def set_up_layer(group: PlannedGroup, run: RankRun) -> SparseSetUp:
    """The rank's layer and both groups' builders for ``group``'s layer
    (the layer in the forward context first, as in a worker, so the plugin's
    builders bind it and its indexer cache)."""
    import torch
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.worker.utils import AttentionGroup

    shape, topk, k = group.shape, group.indexer_topk, group.shard_count
    assert topk is not None
    shard = GroupGeometry(group.name, k, run.world, run.rank).shard
    weight = up_projection_weight(group, run)
    config = sparse_config(group, run)
    layer = build_layer(config, weight, run.rank, shape, run.device, topk)
    count = group.dcp_kv_shard_count if run.patched else None
    builders = []
    for backend, name, spec in (
        (
            layer.attn_backend,
            LATENT_LAYER,
            latent_spec(group.block_size, count, dcp_sharded=group.dcp_sharded),
        ),
        (
            DeepseekV32IndexerBackend,
            INDEXER_LAYER,
            indexer_spec(group.block_size, count, dcp_sharded=group.dcp_sharded),
        ),
    ):
        attn_group = AttentionGroup(backend, [name], spec, 0)
        attn_group.create_metadata_builders(config, torch.device(run.device))
        builders.append(attn_group.get_metadata_builder())
    requests = sparse_decode_requests(group.block_size, k, topk)
    width = cdiv(shape.max_model_len, group.block_size * k)
    return SparseSetUp(
        group=group,
        topk=topk,
        layout=ShardLayout(group.block_size, k, group.interleave, shard),
        weight=weight,
        config=config,
        layer=layer,
        latent_builder=builders[0],
        indexer_builder=builders[1],
        requests=requests,
        width=width,
        num_blocks=width * len(requests) + 1,
    )
