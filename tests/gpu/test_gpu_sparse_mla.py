# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2 sparse MLA groups with K = 1 and a partial K on vLLM's compiled
kernels, on one CUDA device.

The CPU harness of ``tests/test_sparse_mla_selection.py`` and
``tests/test_sparse_mla_attention.py`` (``tests.support.sparse_mla``; only
the DCP collectives are simulated) with the kernels a GPU has:

- vLLM's CuteDSL stable top-k selector against the torch stand-in the CPU
  tests use (same key contract, compared as sets);
- the top-k merge with nothing stood in (compiled pack kernel, CuteDSL
  selector, vLLM's own input check, top-k 512) on D simulated ranks, every
  rank against the float64 single-device top-k;
- the end-to-end sparse attention of the CPU tests with the compiled Triton
  kernels (pack, filter, sparse MLA, combine) and the real selector;
- FLASHMLA_SPARSE with an ``fp8_ds_mla`` cache: each rank's real
  ``MLAAttention`` with the FLASHMLA_SPARSE impl (marked as the
  ``DeepseekV32Attention`` it is the MLA part of), its builders made by
  ``AttentionGroup`` (which bind the layer and the indexer cache), the cache
  written by vLLM's ``concat_and_cache_mla`` at the contract's slots (every
  other byte 0xFF, NaN in fp8, bf16 and fp32), the FlashMLA sparse decode
  kernel; K = 1 and K = 2 at D = 4 against vLLM's own K = D on the same
  inputs, and against float64.

Run it on a machine with a GPU, from the repository root:

    python tests/gpu/test_gpu_sparse_mla.py
    pytest --noconftest tests/gpu/test_gpu_sparse_mla.py

``tests/conftest.py`` hides every GPU and turns the Triton interpreter on, so
under a plain ``pytest tests`` these tests are skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.support.gpu import (  # noqa: E402
    MLA_TOLERANCE,
    gpu_marks,
    patched_vllm,  # noqa: F401
    require_backend,
    run_outside_suite,
)

pytestmark = [
    *gpu_marks(),
    pytest.mark.patches(
        "worker.sparse_attn_indexer",
        "worker.deepseek_v32_attention",
        "worker.flashmla_sparse",
        "worker.sparse_mla_attention",
        "worker.mla_indexer",
    ),
]

TOPK = 512
"""The DCP merge's CuteDSL path takes top-k 512, 1024 or 2048."""
B = 64  # fp8_ds_mla pages hold 64 tokens


def _require_cutedsl() -> None:
    from vllm.utils.import_utils import has_cutedsl

    if not has_cutedsl():
        pytest.skip("the DCP top-k merge needs CuteDSL, which is not installed")


def test_cutedsl_selector_keeps_the_stand_in_contract() -> None:
    import torch
    from vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl import (
        stable_topk_from_gathered_candidates_cutedsl,
    )

    from vllm_dcp_geometry.tooling.sparse_rank_run import selection_sets
    from vllm_dcp_geometry.tooling.sparse_stand_ins import (
        selector_reads_rank_major,
        stable_topk_stand_in,
    )

    _require_cutedsl()
    gen = torch.Generator().manual_seed(3)
    rows, width = 6, 4 * TOPK
    candidates = torch.zeros(rows, width, 2)
    candidates[..., 0] = (torch.randn(rows, width, generator=gen) * 2).round() / 2
    candidates[..., 0] += 0.0
    candidates[..., 1] = torch.stack(
        [torch.randperm(width, generator=gen) for _ in range(rows)]
    ).float()
    candidates[:, ::5, 1] = -1
    candidates[0, 7, 0] = float("-inf")
    candidates[1, :, 0] = 0.5
    candidates[2, TOPK // 2 :, 1] = -1  # fewer real candidates than top-k
    gathered = candidates.cuda()
    bits: dict[str, int] = {}
    if selector_reads_rank_major():
        # 0.34.0: rank-major [W, rows, top-k, 2], ids within id_bits, and the
        # bfloat16 logits' 16 score bits (the scores above are bfloat16 values).
        gathered = gathered.view(rows, 4, TOPK, 2).permute(1, 0, 2, 3).contiguous()
        bits = {"score_bits": 16, "id_bits": (width - 1).bit_length()}
    got = stable_topk_from_gathered_candidates_cutedsl(gathered, TOPK, **bits)
    want = stable_topk_stand_in(gathered, TOPK, **bits)
    assert selection_sets(got.cpu()) == selection_sets(want.cpu())


@pytest.mark.parametrize(
    ("dcp", "k", "interleave"), [(4, 1, 1), (4, 2, 1), (4, 4, 1), (4, 2, B), (8, 2, B)]
)
def test_real_merge_selects_the_single_device_topk(
    dcp: int, k: int, interleave: int
) -> None:
    import torch

    from tests.support.sparse_mla import reference_topk, tied_scores
    from tests.support.sparse_selection import select_on_ranks, selection_lengths
    from vllm_dcp_geometry.tooling.sparse_rank_run import (
        has_repeated_ids,
        selection_sets,
    )

    _require_cutedsl()
    width = dcp * interleave + 4 * TOPK + 7
    lengths = torch.tensor(selection_lengths(dcp, interleave, B, width))
    scores = tied_scores(lengths.numel(), width, seed=dcp * 10 + k).cuda()
    want = selection_sets(reference_topk(scores, lengths, TOPK).cpu())
    selections, _ = select_on_ranks(
        scores,
        lengths.cuda(),
        dcp=dcp,
        shard_count=k,
        interleave=interleave,
        block_size=B,
        topk=TOPK,
        stand_in_selector=False,
    )
    for rank, selection in enumerate(selections):
        assert not has_repeated_ids(selection.cpu()), rank
        assert selection_sets(selection.cpu()) == want, rank


GPU_SPARSE_CASES = [(4, 1, 1), (4, 2, 1), (4, 2, 16), (4, 4, 1)]


@pytest.mark.parametrize(("dcp", "k", "interleave"), GPU_SPARSE_CASES)
def test_compiled_triton_sparse_attention_follows_the_group(
    dcp: int, k: int, interleave: int
) -> None:
    """The CPU end-to-end case with the compiled Triton kernels and the real
    selector (fp32 inputs; ``tl.dot`` may run them as TF32, hence the
    GPU tolerance)."""
    from tests.support.sparse_mla import SparseShape
    from tests.support.sparse_mla_case import evaluate_sparse_case, run_sparse_case

    _require_cutedsl()
    shape = SparseShape(
        topk=TOPK,
        num_blocks=320,
        queries=((0, 1200), (1, 698), (1, 699), (1, 700), (2, 5), (3, 900)),
        seq_lens=(1200, 700, 5, 900),
        device="cuda",
    )
    report = run_sparse_case(dcp, k, interleave, seed=dcp + k, shape=shape)
    worst = evaluate_sparse_case(report, k)
    assert all(worst["selections_ok"]), worst
    for key in ("out_single", "out_f64", "lse_f64"):
        assert worst[key] <= MLA_TOLERANCE, (key, worst)


# FLASHMLA_SPARSE with an fp8_ds_mla cache ----------------------------------------------

HEADS = 16  # per rank; D * 16 = 64 gathered heads pad like 16 (fp8 kernel)
NOPE, ROPE, LORA = 128, 64, 512
SEQ_LENS = (1300, 700, 5, 900, 600)
"""One decode token per request."""


def _flashmla_rank(
    dcp: int, k: int, rank: int, coop: Any, latents: list[Any], seed: int
) -> dict[str, Any]:
    """Rank ``rank``: its config, layer, builders, metadata and cache."""
    import torch
    import vllm._custom_ops as ops
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from tests.support.simulated_collectives import replica_groups_of
    from tests.support.sparse_mla import (
        INDEXER_LAYER,
        LATENT_LAYER,
        PREFIX,
        SparseShape,
        block_table,
        build_group_builder,
        dsv32_config,
        layer_shell,
        rank_process,
    )
    from vllm_dcp_geometry.contract import reference_slot_mapping
    from vllm_dcp_geometry.contract.layer_classes import (
        DEEPSEEK_V32_ATTENTION,
        LAYER_CLASS_ATTR,
    )
    from vllm_dcp_geometry.tooling.sparse_rank_run import indexer_spec, latent_spec

    backend = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    vllm_config = dsv32_config(
        dcp,
        1,
        heads_per_rank=HEADS,
        block_size=B,
        cache_dtype="fp8_ds_mla",
        index_topk=TOPK,
        max_model_len=2048,
    )
    shape = SparseShape(block_size=B, num_blocks=128, seq_lens=SEQ_LENS)
    table = block_table(shape, k, seed).cuda()
    tokens = len(SEQ_LENS)
    # A partial K runs within its replica (rule A6, the default).
    replicas = [k] if 1 < k < dcp else []
    with (
        rank_process(vllm_config, dcp, rank, coop) as group,
        replica_groups_of(group, replicas),
        torch.device("cuda"),
    ):
        buffer = torch.full((tokens, TOPK), -1, dtype=torch.int32)
        kv_b_proj = ColumnParallelLinear(
            LORA,
            dcp * HEADS * (NOPE + 128),
            bias=False,
            params_dtype=torch.bfloat16,
            prefix=f"{PREFIX}.kv_b_proj",
        )
        layer = MLAAttention(
            num_heads=HEADS,
            scale=(NOPE + ROPE) ** -0.5,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=128,
            q_lora_rank=64,
            kv_lora_rank=LORA,
            kv_b_proj=kv_b_proj,
            cache_config=vllm_config.cache_config,
            prefix=LATENT_LAYER,
            attn_backend=backend,
            use_sparse=True,
            topk_indices_buffer=buffer,
        )
        setattr(layer, LAYER_CLASS_ATTR, DEEPSEEK_V32_ATTENTION)
        cache_layer = layer_shell(_indexer_cache_class())
        cache_layer.prefix = INDEXER_LAYER
        cache_layer.kv_cache = torch.empty(0)
        vllm_config.compilation_config.static_forward_context[INDEXER_LAYER] = (
            cache_layer
        )
        count = None if k == dcp else k
        builder = build_group_builder(
            backend, LATENT_LAYER, latent_spec(B, count), vllm_config, "cuda"
        )
        build_group_builder(
            DeepseekV32IndexerBackend,
            INDEXER_LAYER,
            indexer_spec(B, count),
            vllm_config,
            "cuda",
        )
        metadata = builder.build(0, _decode_metadata(dcp, rank, table))
        cache = torch.full((shape.num_blocks, B, 656), 0xFF, dtype=torch.uint8)
        for request, latent in enumerate(latents):
            slots = torch.as_tensor(
                reference_slot_mapping(
                    range(latent.shape[0]),
                    table[request].cpu(),
                    block_size=B,
                    shard_count=k,
                    interleave_size=1,
                    shard=rank % k,
                )
            ).cuda()
            mine = slots >= 0
            ops.concat_and_cache_mla(
                latent[mine, :LORA].contiguous(),
                latent[mine, LORA:].contiguous(),
                cache,
                slots[mine],
                "fp8_ds_mla",
                torch.ones((), device="cuda"),
            )
    return {
        "layer": layer,
        "cache_layer": cache_layer,
        "metadata": metadata,
        "cache": cache,
        "buffer": buffer,
    }


def _indexer_cache_class() -> type:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    return DeepseekV32IndexerCache


def _decode_metadata(dcp: int, rank: int, table: Any) -> Any:
    """One decode token per request; ``dcp_local_seq_lens`` vLLM's global
    (D, r) ones, as the runners compute them."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    starts = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts.cuda(),
        query_start_loc_cpu=starts,
        seq_lens=seq.cuda(),
        num_reqs=len(SEQ_LENS),
        num_actual_tokens=len(SEQ_LENS),
        max_query_len=1,
        max_seq_len=max(SEQ_LENS),
        block_table_tensor=table,
        slot_mapping=torch.zeros(len(SEQ_LENS), dtype=torch.int64, device="cuda"),
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq, dcp, rank, 1).cuda(),
        seq_lens_cpu_upper_bound=seq,
    )


def _flashmla_forward(dcp: int, k: int, seed: int) -> dict[str, Any]:
    """Every rank's sparse decode over the same inputs (``seed``)."""
    import contextlib

    import torch
    from vllm.forward_context import ForwardContext, override_forward_context
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
    )

    from tests.support.simulated_collectives import CooperativeRanks, SimulatedGroup
    from tests.support.sparse_mla import (
        INDEXER_LAYER,
        LATENT_LAYER,
        PerRankLayers,
        reference_topk,
        tied_scores,
    )
    from tests.support.sparse_mla_case import indexer_call_arguments
    from tests.support.sparse_selection import merge_stand_ins
    from vllm_dcp_geometry.patches.worker import deepseek_v32_attention
    from vllm_dcp_geometry.tooling.sparse_rank_run import (
        indexer_op_stand_in,
        shard_logits,
    )

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device("cuda"))
    gen = torch.Generator().manual_seed(seed)
    latents = [
        torch.randn(n, LORA + ROPE, generator=gen).to(torch.bfloat16).cuda()
        for n in SEQ_LENS
    ]
    q = torch.randn(len(SEQ_LENS), dcp * HEADS, LORA + ROPE, generator=gen)
    q = q.to(torch.bfloat16).cuda()
    scores = tied_scores(len(SEQ_LENS), max(SEQ_LENS), seed).cuda()
    lengths = torch.tensor(SEQ_LENS, dtype=torch.int32).cuda()
    coop = CooperativeRanks(dcp)
    groups = [SimulatedGroup(coop, dcp, r) for r in range(dcp)]
    ranks = [_flashmla_rank(dcp, k, r, coop, latents, seed) for r in range(dcp)]
    calls: dict[int, Any] = {}
    indexer_call = deepseek_v32_attention._make_sparse_attn_indexer(
        indexer_op_stand_in(lambda call: calls.__setitem__(coop.local.rank, call))
    )
    layers = [
        {LATENT_LAYER: rank["layer"], INDEXER_LAYER: rank["cache_layer"]}
        for rank in ranks
    ]

    def run(r: int) -> Any:
        rank = ranks[r]
        logits, _ = shard_logits(
            scores, lengths, block_size=B, shard_count=k, interleave=1, shard=r % k
        )
        layer = rank["layer"]
        # The layer hands its indexer its DCP manager's rank.
        manager_rank = layer.dcp_manager.group.rank_in_group
        args, kwargs = indexer_call_arguments(
            logits, rank["buffer"], TOPK, dcp=dcp, rank=manager_rank, interleave=1
        )
        indexer_call(*args, **kwargs)
        selection = rank["buffer"].clone()
        impl, manager = layer.impl, layer.dcp_manager
        impl.record_logical_topk_ready()
        impl.prepare_for_batch(rank["metadata"])
        mine = q[:, r * HEADS : (r + 1) * HEADS]
        query: Any = (mine[..., :LORA].contiguous(), mine[..., LORA:].contiguous())
        if impl.dcp_world_size > 1:
            query = manager.query_gather(torch.cat(query, dim=-1))
        out, lse = impl.forward_mqa(query, rank["cache"], rank["metadata"], layer)
        if impl.dcp_world_size > 1:
            out = manager.combine(out, lse, seq_lens=None, query_start_loc=None)
        return selection, out

    with contextlib.ExitStack() as stack:
        stack.enter_context(merge_stand_ins(coop, groups, stand_in_selector=False))
        context = ForwardContext(
            no_compile_layers=PerRankLayers(coop, layers),  # type: ignore[arg-type]
            attn_metadata={},
            slot_mapping={},
        )
        stack.enter_context(override_forward_context(context))
        outputs = coop.run(run)
    scale = ranks[0]["layer"].impl.softmax_scale
    return {
        "outputs": outputs,
        "want": reference_topk(scores, lengths, TOPK),
        "latents": latents,
        "q": q,
        "scale": scale,
    }


@pytest.mark.parametrize("k", [1, 2])
def test_flashmla_sparse_fp8_follows_the_group(k: int) -> None:
    """D = 4: every rank of a K = 1 and a K = 2 group gives what vLLM's own
    K = D gives on the same inputs (the fp8 cache quantises each token alike
    wherever it is stored), and what float64 gives within fp8's rounding."""
    import torch

    from tests.support.sparse_mla import reference_attention
    from vllm_dcp_geometry.tooling.sparse_rank_run import selection_sets

    require_backend("FLASHMLA_SPARSE")
    _require_cutedsl()
    dcp, seed = 4, 5
    got = _flashmla_forward(dcp, k, seed)
    sharded = _flashmla_forward(dcp, dcp, seed)
    want = selection_sets(got["want"].cpu())
    ref_out, _ = reference_attention(
        got["q"].float(),
        [latent.float() for latent in got["latents"]],
        list(range(len(SEQ_LENS))),
        got["want"],
        got["scale"],
    )
    scale = ref_out.abs().max().item()
    for r, ((selection, out), (_, out_d)) in enumerate(
        zip(got["outputs"], sharded["outputs"], strict=True)
    ):
        assert selection_sets(selection.cpu()) == want, r
        heads = slice(r * HEADS, (r + 1) * HEADS)
        out = out.double().cpu()
        assert (out - out_d.double().cpu()).abs().max().item() <= 2e-2 * scale, r
        error = (out - ref_out[:, heads]).abs().max().item()
        assert error <= 10 * MLA_TOLERANCE * scale, (r, error, scale)
    assert torch.isfinite(ref_out).all()


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
