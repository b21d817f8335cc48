# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2 for ``ranks`` and ``plan``: one layer's two groups (the
``fp8_ds_mla`` latent cache and the indexer cache) as vLLM's model code specs
them, at K of D = 4, a topology mapping of such layers, and the built-in
profile with one line changed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
)

D = 4
TOPK = 512
BLOCK = 16
HEADS = 8  # query heads across TP: 2 per rank at D = 4
L, R = 512, 64
PROFILE = "deepseek-v32-tp8-dcp8"


def layer_groups(
    index: int, name: str, k: int, topk: int = TOPK
) -> list[dict[str, Any]]:
    """One DeepSeek-V3.2 layer's two groups, as vLLM's model code specs
    them (``fp8_ds_mla`` latent cache, indexer cache), at K = ``k`` of D."""
    sharding: dict[str, Any] = {"dcp_sharded": k > 1}
    if 1 < k < D:
        sharding["dcp_kv_shard_count"] = k
    prefix = f"model.layers.{index}.self_attn"
    common = {"kind": "mla", "block_size": BLOCK, "num_kv_heads": 1}
    return [
        {
            "name": f"latent.{name}",
            "layers": [f"{prefix}.attn"],
            "layer_class": DEEPSEEK_V32_ATTENTION,
            "query_heads": HEADS,
            "kv_lora_rank": L,
            "activation_dtype": "bfloat16",
            "head_size": L + R,
            "dtype": "uint8",
            "cache_dtype_str": "fp8_ds_mla",
            "cache_role": "sparse",
            "kv_quant_mode": "FP8_PER_TENSOR",
            "state_content_bytes": 656,
            "is_index_group_leader": True,
            "topk_buffer_width": topk,
            "max_tp_shards": 1,
            **common,
            **sharding,
        },
        {
            "name": f"indexer.{name}",
            "layers": [f"{prefix}.indexer.k_cache"],
            "layer_class": DEEPSEEK_V32_INDEXER_CACHE,
            "head_size": 132,
            "dtype": "uint8",
            "cache_role": "indexer",
            "max_tp_shards": 1,
            **common,
            **sharding,
        },
    ]


def topology_mapping(*layers: list[dict[str, Any]], **parallel: Any) -> dict:
    """A D = 4 topology of ``layers`` (each ``layer_groups``)."""
    return {
        "name": "dsv32-layers",
        "parallel": {
            "tensor_parallel_size": D,
            "decode_context_parallel_size": D,
            **parallel,
        },
        "limits": {"max_model_len": 4096, "max_num_seqs": 8},
        "groups": [group for layer in layers for group in layer],
    }


def dsv32_file(tmp_path: Path, old: str, new: str) -> str:
    """The DeepSeek-V3.2 profile with ``old`` replaced by ``new``."""
    from importlib import resources

    text = (
        resources.files("vllm_dcp_geometry.tooling")
        .joinpath(f"profiles/{PROFILE}.toml")
        .read_text(encoding="utf-8")
    )
    assert old in text, old
    path = tmp_path / "dsv32.toml"
    path.write_text(text.replace(old, new))
    return str(path)
