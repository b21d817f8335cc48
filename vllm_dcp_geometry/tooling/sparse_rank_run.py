# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a run of DeepSeek-V3.2's sparse MLA layer and its DSA indexer across
DCP ranks needs outside vLLM, on any device (what a CPU lacks besides is
stood in for in ``sparse_stand_ins``):

- the **selection**: a float64 single-device top-k with vLLM's tie order
  (``reference_topk``, ties to the smaller id), each rank's indexer logits
  over the positions its shard stores (``shard_logits``, from the contract's
  rule L1), and ``indexer_op_stand_in``: vLLM's ``sparse_attn_indexer`` op
  stood in for (its DeepGEMM logits need CUDA and an fp8 indexer cache): its
  logits are handed in, it takes their local top-k and merges it with vLLM's
  own ``_merge_dcp_topk_global`` in the DCP world it was handed, as the op
  does;
- the **attention** reference: float64 sparse MLA over the selected latent
  rows (``reference_attention``);
- the **fp8_ds_mla** values (``fp8_ds_mla_values``): latent rows drawn on the
  grid FlashMLA's 656-byte cache holds exactly, so a bfloat16 or float32 cache
  holds what FlashMLA would dequantize;
- ``write_dsv32_config``: a weightless DeepSeek-V3.2 config directory.

Used by ``vllm-dcp-geometry ranks`` (``tooling.cli.ranks.runners.sparse_*``,
in its worker processes) and by the suite's simulated ranks
(``tests.support.sparse_mla``). torch is imported inside the functions only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract import cdiv, local_seq_len, reference_slot_mapping
from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.tooling.mla_rank_run import write_deepseek_config
from vllm_dcp_geometry.tooling.vllm_release import on_installed_release

LATENT_DIM = 576
"""``kv_lora_rank + rope``: the one head size of the sparse kernels."""
VALUE_DIM = 512
"""DeepSeek-V3.2's ``kv_lora_rank``: the latent part of a row, and the width
of the sparse kernel's output."""
ROPE_DIM = 64
NOPE_HEAD_DIM = 128
"""DeepSeek-V3.2's ``qk_nope_head_dim`` and ``v_head_dim``: they size only
``kv_b_proj`` (the absorbed query and the output up-projection), never a
cache or a collective."""

FP8_DS_MLA_TILE = 128
"""Latent values per fp8_ds_mla scale (four float32 scales per row)."""
E4M3_MAX = 448.0
"""The largest float8_e4m3 value: the fp8_ds_mla writer's scale is a tile's
largest magnitude over it."""

INDEXER_OP_PARAMETERS = {
    "0.33.0": "hidden_states, k_cache_prefix, kv_cache, q_quant, q_scale, k, "
    "weights, quant_block_size, scale_fmt, topk_tokens, head_dim, max_model_len, "
    "total_seq_lens, topk_indices_buffer, skip_k_cache_insert, use_pcp, "
    "pcp_shard_decode_requests, dense_mha_metadata_layer_name, use_fp4_cache=, "
    "dcp_rank=, dcp_world_size=, cp_kv_cache_interleave_size=, "
    "skip_topk_buffer_clear=, candidate_blocks=, candidate_block_size=, "
    "candidate_write=, topk_backend=",
}
# 0.34.0 adds the logits dtype and the direct merge's row limit, both handed
# on to the merge as the op does.
INDEXER_OP_PARAMETERS["0.34.0"] = (
    INDEXER_OP_PARAMETERS["0.33.0"] + ", logits_dtype=, dcp_direct_topk_max_rows="
)
MERGE_KEYWORDS_034 = {
    "logits_dtype": "logits_dtype",
    "num_positions": "max_model_len",
    "direct_max_rows": "dcp_direct_topk_max_rows",
}
"""What 0.34.0's op hands its merge beyond 0.33.0's arguments, by the op's
parameter it takes each from."""


def indexer_op_symbol() -> UpstreamSymbol:
    """The op ``indexer_op_stand_in`` stands in for, with the parameters it
    reads on the installed release."""
    return UpstreamSymbol(
        "vllm.model_executor.layers.sparse_attn_indexer",
        "sparse_attn_indexer",
        on_installed_release(INDEXER_OP_PARAMETERS),
    )


# Geometry -----------------------------------------------------------------------


def shard_positions(
    length: int, block_size: int, shard_count: int, interleave: int, shard: int
) -> Any:
    """The positions ``< length`` that ``shard`` stores, in its local order
    (rule L1 over an identity block table: the slot is the local index)."""
    import torch

    columns = max(cdiv(length, block_size * shard_count), 1)
    slots = reference_slot_mapping(
        range(length),
        range(columns),
        block_size=block_size,
        shard_count=shard_count,
        interleave_size=interleave,
        shard=shard,
    )
    slots_t = torch.as_tensor(slots)
    owned = torch.nonzero(slots_t >= 0).flatten()
    order = torch.argsort(slots_t[owned])
    assert torch.equal(slots_t[owned][order], torch.arange(owned.numel()))
    return owned[order]


def shard_logits(
    scores: Any,
    lengths: Any,
    *,
    block_size: int,
    shard_count: int,
    interleave: int,
    shard: int,
) -> tuple[Any, Any]:
    """One shard's indexer logits ``[rows, local positions]`` in local order
    (``-inf`` past each row's local length) and the local lengths: what the
    indexer scores on a rank holding ``shard`` of a K-shard indexer cache."""
    import torch

    width = scores.shape[1]
    positions = shard_positions(width, block_size, shard_count, interleave, shard)
    logits = scores[:, positions.to(scores.device)].float().clone()
    local = torch.tensor(
        [
            local_seq_len(int(n), block_size, shard_count, interleave, shard)
            for n in lengths.tolist()
        ],
        dtype=torch.int32,
    )
    beyond = torch.arange(positions.numel())[None, :] >= local[:, None]
    logits[beyond.to(logits.device)] = float("-inf")
    return logits.contiguous(), local.to(scores.device)


# Selection ----------------------------------------------------------------------


def reference_topk(scores: Any, lengths: Any, topk: int) -> Any:
    """Float64 top-k of each row's first ``lengths[t]`` scores, ties to the
    smaller index, ``-1`` padding: ``[rows, topk]`` int32 (on ``scores``'s
    device)."""
    import torch

    rows, width = scores.shape
    values = scores.detach().double().cpu()
    lengths_cpu = lengths.detach().cpu().long()
    columns = torch.arange(width)
    values = torch.where(columns[None, :] < lengths_cpu[:, None], values, float("-inf"))
    # A stable sort keeps equal scores in index order: ties to the smaller id.
    order = torch.sort(-values, dim=1, stable=True).indices
    out = torch.full((rows, topk), -1, dtype=torch.int64)
    take = min(topk, width)
    out[:, :take] = order[:, :take]
    valid = torch.arange(topk)[None, :] < lengths_cpu.clamp(max=topk)[:, None]
    out = torch.where(valid, out, -1)
    return out.to(torch.int32).to(scores.device).contiguous()


def selection_sets(selection: Any) -> list[list[int]]:
    """Each row's selected ids, sorted, padding dropped (the real selector's
    output order is unspecified)."""
    return [sorted(x for x in row if x >= 0) for row in selection.tolist()]


def has_repeated_ids(selection: Any) -> bool:
    """Whether any row selects the same id twice."""
    for row in selection.tolist():
        ids = [x for x in row if x >= 0]
        if len(ids) != len(set(ids)):
            return True
    return False


def tied_scores(rows: int, width: int, seed: int) -> Any:
    """Coarse random scores (many ties). ``+ 0.0`` turns -0.0 into +0.0: the
    selector's key orders -0.0 below +0.0, a float comparison does not."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 2).round() / 2 + 0.0


@dataclass(frozen=True)
class IndexerCall:
    """What the stand-in of vLLM's indexer op was called with."""

    dcp_rank: int
    dcp_world_size: int
    interleave: int
    indexer_geometry: Any
    """The plugin's ``current_indexer_geometry()`` during the call."""


def indexer_op_stand_in(
    record: Callable[[IndexerCall], None],
) -> Callable[..., Any]:
    """Stand-in for vLLM's ``sparse_attn_indexer`` op (DeepGEMM logits and
    top-k need CUDA), bound to its real signature (``indexer_op_symbol``, checked):
    ``hidden_states`` carries this rank's indexer logits over its local
    positions (``-inf`` past the local length); it writes their local top-k
    into ``topk_indices_buffer`` and merges it with vLLM's
    ``_merge_dcp_topk_global`` (the module's, patched where the plugin is
    loaded) and the DCP rank and world it was handed, as the op does.
    ``record`` gets what each call was handed."""
    import torch
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.runtime.group_context import current_indexer_geometry

    verify_symbol(indexer_op_symbol())
    signature = inspect.signature(sai.sparse_attn_indexer)
    # 0.33.0's op has max_model_len too, but its merge takes none of these.
    merge_keywords = on_installed_release({"0.33.0": {}, "0.34.0": MERGE_KEYWORDS_034})

    def sparse_attn_indexer(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits = a["hidden_states"]
        topk = a["topk_tokens"]
        buffer = a["topk_indices_buffer"]
        record(
            IndexerCall(
                a["dcp_rank"],
                a["dcp_world_size"],
                a["cp_kv_cache_interleave_size"],
                current_indexer_geometry(),
            )
        )
        local = torch.isfinite(logits).sum(dim=1)
        rows = buffer[: logits.shape[0], :topk]
        rows.copy_(reference_topk(logits, local, topk))
        sai._merge_dcp_topk_global(
            logits,
            rows,
            topk,
            a["dcp_rank"],
            a["dcp_world_size"],
            a["cp_kv_cache_interleave_size"],
            **{key: a[name] for key, name in merge_keywords.items()},
        )
        return buffer

    return sparse_attn_indexer


# The caches' specs --------------------------------------------------------------

FP8_DS_MLA_ROW_BYTES = 656
"""One token of an ``fp8_ds_mla`` latent cache: 512 float8_e4m3 values, four
float32 scales, 64 bfloat16 rope values."""
INDEXER_HEAD_DIM = 128


def indexer_spec(
    block_size: int, shard_count: int | None, *, dcp_sharded: bool = True
) -> Any:
    """The indexer cache's spec as ``DeepseekV32IndexerCache.get_kv_cache_spec``
    builds it (128 fp8 values and one fp32 scale per token), with K where
    given (the plugin's spec field)."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    extra = {} if shard_count is None else {"dcp_kv_shard_count": shard_count}
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=INDEXER_HEAD_DIM + INDEXER_HEAD_DIM // 128 * 4,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
        dcp_sharded=dcp_sharded,
        **extra,
    )


def latent_spec(
    block_size: int, shard_count: int | None, *, dcp_sharded: bool = True
) -> Any:
    """The sparse latent cache's spec in vLLM's ``fp8_ds_mla`` format
    (``FP8_DS_MLA_ROW_BYTES`` per token), with K where given."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    extra = {} if shard_count is None else {"dcp_kv_shard_count": shard_count}
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=LATENT_DIM,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=FP8_DS_MLA_ROW_BYTES,
        dcp_sharded=dcp_sharded,
        **extra,
    )


# The latent cache's values ------------------------------------------------------


def fp8_ds_mla_values(rows: Any, kv_lora_rank: int = VALUE_DIM) -> Any:
    """Float64 latent rows ``[n, L + R]`` moved onto the values a 656-byte
    ``fp8_ds_mla`` row holds exactly: each tile of ``FP8_DS_MLA_TILE`` latent
    values becomes float8_e4m3 values times a power-of-two scale, with its
    largest magnitude at ``E4M3_MAX`` times that scale (so the writer's scale,
    the tile's largest magnitude over ``E4M3_MAX``, is that power of two
    whether or not it rounds it, and every value quantizes without loss);
    the rope part becomes bfloat16 values (stored unquantized). Every result
    is exact in bfloat16 and float32: a cache of either dtype holds what
    FlashMLA dequantizes from the fp8_ds_mla row."""
    import torch

    out = rows.double().clone()
    nope = out[:, :kv_lora_rank].reshape(out.shape[0], -1, FP8_DS_MLA_TILE)
    largest = nope.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(largest / E4M3_MAX)))
    on_grid = (nope / scale).to(torch.float8_e4m3fn).double()
    peak = on_grid.abs().argmax(dim=-1, keepdim=True)
    sign = torch.where(on_grid.gather(-1, peak) < 0, -1.0, 1.0).double()
    on_grid.scatter_(-1, peak, sign * E4M3_MAX)
    out[:, :kv_lora_rank] = (on_grid * scale).reshape(out.shape[0], kv_lora_rank)
    out[:, kv_lora_rank:] = out[:, kv_lora_rank:].to(torch.bfloat16).double()
    return out


# The attention reference --------------------------------------------------------


def reference_attention(
    q: Any, latents: list[Any], requests: list[int], selection: Any, scale: float
) -> tuple[Any, Any]:
    """Float64 sparse MLA: token ``t`` of request ``requests[t]`` attends to
    the latent rows its ``selection`` names (request positions, ``-1``
    padding); output ``[T, H, 512]`` and LSE ``[T, H]``."""
    import torch

    outs, lses = [], []
    for t, request in enumerate(requests):
        ids = selection[t][selection[t] >= 0].long().cpu()
        kv = latents[request][ids].double().cpu()
        logits = torch.einsum("hd,kd->hk", q[t].double().cpu(), kv) * scale
        outs.append(logits.softmax(-1) @ kv[:, :VALUE_DIM])
        lses.append(logits.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


# The model ------------------------------------------------------------------------


def write_dsv32_config(
    num_heads: int,
    *,
    index_topk: int,
    dtype: str = "bfloat16",
    max_position_embeddings: int = 4096,
    nope_dim: int = NOPE_HEAD_DIM,
    v_head_dim: int = NOPE_HEAD_DIM,
) -> Path:
    """A DeepSeek-V3.2 config directory (no weights): one layer, DeepSeek's
    latent sizes (512 + 64), ``num_heads`` query heads, an indexer of 4 heads
    of 128 selecting ``index_topk`` positions."""
    return write_deepseek_config(
        num_heads,
        kv_lora_rank=VALUE_DIM,
        nope_dim=nope_dim,
        rope_dim=ROPE_DIM,
        v_head_dim=v_head_dim,
        dtype=dtype,
        max_position_embeddings=max_position_embeddings,
        q_lora_rank=64,
        architecture="DeepseekV32ForCausalLM",
        model_type="deepseek_v32",
        extra={"index_topk": index_topk, "index_n_heads": 4, "index_head_dim": 128},
        prefix="vllm_dcp_geometry_dsv32_",
    )
