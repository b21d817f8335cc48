# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Kimi-K3's MLA layer over D simulated DCP ranks on CPU (``run_kimi_case``):
each rank is built as in ``tests.support.mla`` (a real TRITON_MLA impl, the
``cpu_sdpa`` prefill backend, the layer's ``MLADCPManager`` and a real builder
made by ``AttentionGroup.create_metadata_builders``), except that the layer in
the forward context, the one the builder and the plugin's binding see, is
vLLM's real ``vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention``, made
without ``__init__`` (which needs a Kimi config, a CUDA stream and the
selector), its attributes set as ``__init__`` sets them and its weights
absorbed by its own ``process_weights_after_loading``; the forward is the
layer's own ``_attention``. Stood in for: the four
``torch.ops._C.fused_kimi_k3_*`` CUDA ops behind the layer's real Python
wrappers (checked against plain torch in ``test_kimi_k3_layer``), the forward
context, and what ``tests.support.mla`` stands in for. Importable without the
plugin, so the unpatched baseline runs the same code. On vLLM 0.34.0 the
layer also gets the ``act_dtype`` and ``W_UV_dcp`` its ``__init__`` sets
there, and ``comm_backend`` reaches the config (``"a2a"``: the fused
up-projection).
"""

from __future__ import annotations

import contextlib
import inspect
from types import SimpleNamespace
from typing import Any

import torch

from tests.support.mla import (
    CPU,
    LAYER,
    Batch,
    Rank,
    Shape,
    cpu_shims,
    make_batch,
    make_ranks,
    mla_spec,
    process_weights,
    replaced,
)
from tests.support.mla_forward import (
    RankResult,
    evaluate,
    forward_inputs,
    rank_results,
    recording,
    run_rank,
)
from tests.support.simulated_collectives import CooperativeRanks, simulated_collectives
from vllm_dcp_geometry.contract import reference_slot_mapping
from vllm_dcp_geometry.tooling.kimi_k3_stand_ins import (
    KIMI_K3_FUSED_OPS,
    kimi_k3_fused_op_stand_ins,
)

# Stand-ins for the fused CUDA ops: the tooling's (``cpu_stand_ins``) --------------

FUSED_OPS = KIMI_K3_FUSED_OPS
fused_op_stand_ins = kimi_k3_fused_op_stand_ins


# The layer ------------------------------------------------------------------------


def kimi_k3_layer(mla_layer: Any, vllm_config: Any, shape: Shape) -> Any:
    """vLLM's ``MultiHeadLatentAttention`` with the attributes its ``__init__``
    sets, built from a real ``MLAAttention``'s impl, DCP manager, prefill
    backend and ``kv_b_proj``; D from the parallel config as ``__init__``
    reads it."""
    from torch import nn
    from vllm.models.kimi_k3.nvidia import mla as kimi_mla
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    layer = MultiHeadLatentAttention.__new__(MultiHeadLatentAttention)
    nn.Module.__init__(layer)
    layer.hidden_size = 64
    layer.qk_nope_head_dim = shape.nope_dim
    layer.qk_rope_head_dim = shape.rope_dim
    layer.qk_head_dim = shape.nope_dim + shape.rope_dim
    layer.v_head_dim = shape.v_head_dim
    layer.q_lora_rank = None
    layer.kv_lora_rank = shape.kv_lora_rank
    layer.use_output_gate = False
    layer.non_causal_multi_token_decode = False
    layer.head_size = shape.head_size
    layer.scale = shape.scale
    layer.layer_name = LAYER
    layer.rotary_emb = None
    layer.num_heads = shape.heads_per_rank * vllm_config.parallel_config.world_size
    layer.num_local_heads = shape.heads_per_rank
    layer.kv_b_proj = mla_layer.kv_b_proj
    layer.gemm_rs_ar = None
    layer.quant_config = None
    layer.kv_cache_dtype = "auto"
    layer.attn_backend = mla_layer.attn_backend
    kimi_mla._init_kv_cache_quant(layer, None, LAYER)
    layer.register_buffer(
        "_one_scale", torch.ones(1, device=shape.device), persistent=False
    )
    layer.impl = mla_layer.impl
    layer.q_pad_num_heads = getattr(layer.impl, "q_pad_num_heads", None)
    layer.dcp_world_size = vllm_config.parallel_config.decode_context_parallel_size
    layer.dcp_manager = mla_layer.dcp_manager
    layer.prefill_backend = mla_layer.prefill_backend
    layer.kv_cache = torch.tensor([])
    # Set by vLLM 0.34.0's __init__ only: the activation dtype its weight
    # processing reads, and the fused a2a up-projection it may gather.
    init = inspect.getsource(MultiHeadLatentAttention.__init__)
    if "self.act_dtype = " in init:
        layer.act_dtype = shape.dtype
    if "self.W_UV_dcp: " in init:
        layer.W_UV_dcp = None
    process_weights(layer, shape.dtype)
    return layer


def make_kimi_ranks(
    batch: Batch,
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    spec: Any,
    coop: CooperativeRanks | None,
    additional_config: dict[str, Any] | None = None,
    backend_name: str = "TRITON_MLA",
    partial_collectives: str | None = None,
    comm_backend: str = "ag_rs",
) -> tuple[list[Rank], list[Any]]:
    """The ranks of ``tests.support.mla.make_ranks`` with Kimi-K3's layer in
    the forward context before the builders (and the plugin's binding) see
    it; each rank's cache holds its shard of every request's context."""
    layers: list[Any] = []

    def configure(vllm_config: Any) -> None:
        if additional_config is not None:
            vllm_config.additional_config = additional_config
        context = vllm_config.compilation_config.static_forward_context
        layer = kimi_k3_layer(context[LAYER], vllm_config, batch.shape)
        context[LAYER] = layer
        layers.append(layer)

    ranks = make_ranks(
        batch,
        dcp,
        shard_count,
        interleave,
        spec=spec,
        backend_name=backend_name,
        coop=coop,
        configure=configure,
        comm_backend=comm_backend,
        partial_collectives=partial_collectives,
    )
    for rank, layer in zip(ranks, layers, strict=True):
        slots = new_token_slots(batch, shard_count, interleave, rank.rank % shard_count)
        written = slots[slots >= 0].to(rank.kv_cache.device)
        rank.kv_cache.view(-1, rank.kv_cache.shape[-1])[written] = 0
        layer.kv_cache = rank.kv_cache
    return ranks, layers


def new_token_slots(
    batch: Batch, shard_count: int, interleave: int, shard: int
) -> torch.Tensor:
    """The slot of every new token on shard ``shard`` (the contract's slot
    mapping, what the plugin's block tables give the runner; -1 elsewhere)."""
    shape = batch.shape
    slots: list[int] = []
    for i, (context, new) in enumerate(shape.requests):
        slots.extend(
            int(slot)
            for slot in reference_slot_mapping(
                range(context, context + new),
                batch.rows[i],
                block_size=shape.block_size,
                shard_count=shard_count,
                interleave_size=interleave,
                shard=shard,
            )
        )
    return torch.as_tensor(slots, dtype=torch.int64)


# One forward --------------------------------------------------------------------


def kimi_forward(
    batch: Batch,
    ranks: list[Rank],
    layers: list[Any],
    coop: CooperativeRanks,
    shard_count: int,
) -> list[RankResult]:
    """Every rank's ``MultiHeadLatentAttention._attention`` over the batch."""
    from vllm.models.kimi_k3.nvidia import mla as kimi_mla

    shape = batch.shape
    dcp = len(ranks)
    new_kv_c, new_k_pe, metadata = forward_inputs(batch, ranks)
    forward_contexts = [
        SimpleNamespace(
            attn_metadata={LAYER: metadata[r]},
            slot_mapping={
                LAYER: new_token_slots(
                    batch, shard_count, ranks[r].interleave, r % shard_count
                ).to(shape.device)
            },
        )
        for r in range(dcp)
    ]

    def on_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(shape.device, shape.dtype).contiguous()

    def run(r: int) -> torch.Tensor:
        h = shape.heads_per_rank

        def call(output: torch.Tensor) -> None:
            layers[r]._attention(
                torch.arange(batch.num_tokens, device=shape.device),
                on_device(batch.q[:, r * h : (r + 1) * h]),
                on_device(new_kv_c),
                on_device(new_k_pe)[:, None, :],
                output,
            )

        return run_rank(batch, layers[r], r, records, call)

    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
        CPUSDPAMLAPrefillBackend,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(
            replaced(
                kimi_mla,
                "get_forward_context",
                lambda: forward_contexts[coop.local.rank],
            )
        )
        records = stack.enter_context(recording(coop, kimi_mla))
        if shape.device == "cpu":
            # The CPU backend says it honours ``out`` but refuses it for
            # context chunks, which the layer's DCP1 context loop passes it.
            stack.enter_context(
                replaced(CPUSDPAMLAPrefillBackend, "supports_out", lambda self: False)
            )
        outputs = coop.run(run)
    # Kimi-K3's impl runs in the layer's DCP world (1 for K = 1, K within its
    # replica, else D), so the impl's world says which heads the LSE covers.
    return rank_results(outputs, layers, records, metadata)


def run_kimi_case(
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    patched: bool,
    seed: int = 0,
    shape: Shape = CPU,
    backend_name: str = "TRITON_MLA",
    partial_collectives: str | None = None,
    comm_backend: str = "ag_rs",
) -> dict[str, Any]:
    """One (D, K, I) case through Kimi-K3's layer (a partial K within
    simulated replica groups unless ``partial_collectives`` is ``"dcp"``), evaluated against the
    float64 single-device reference (``tests.support.mla_forward.evaluate``). Raises
    what the layer raises (the unpatched baseline's crash). On a GPU the
    fused ops and every kernel are the real ones; only the collectives are
    simulated."""
    explicit = patched and shard_count != dcp
    batch = make_batch(dcp, shard_count, seed + 131 * dcp + 11 * shard_count, shape)
    coop = CooperativeRanks(dcp)
    with contextlib.ExitStack() as stack:
        if shape.device == "cpu":
            stack.enter_context(cpu_shims())
            stack.enter_context(fused_op_stand_ins())
        else:
            stack.enter_context(simulated_collectives())
        ranks, layers = make_kimi_ranks(
            batch,
            dcp,
            shard_count,
            interleave,
            spec=mla_spec(shard_count if explicit else None, shape=shape),
            coop=coop,
            backend_name=backend_name,
            partial_collectives=partial_collectives if patched else None,
            comm_backend=comm_backend,
        )
        results = kimi_forward(batch, ranks, layers, coop, shard_count)
    report = evaluate(batch, results)
    report["layer_dcp_world_sizes"] = [layer.dcp_world_size for layer in layers]
    report["decode_seq_lens"] = [r.metadata.decode.seq_lens.tolist() for r in results]
    report["chunks"] = [len(r.metadata.prefill.chunked_context.chunks) for r in results]
    return report
