# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""gpt-oss-shaped attention groups for ``ranks`` topologies: 2 query heads
per rank over TP 32 and one KV head of 64, bfloat16, 16-token blocks."""

from __future__ import annotations

from typing import Any

HEADS = 64  # gpt-oss's query heads: 2 per rank over TP 32
HEAD_SIZE = 64
WINDOW = 128
BLOCK = 16


def gpt_oss_group(name: str, layer: int, k: int | None, dcp: int, **fields: Any) -> Any:
    """One gpt-oss-shaped group (K = ``k`` of D, None: vLLM's own)."""
    sharding: dict[str, Any] = {}
    if k == 1:
        sharding["dcp_sharded"] = False
    elif k is not None and k < dcp:
        sharding["dcp_kv_shard_count"] = k
    return {
        "name": name,
        "kind": "full_attention",
        "block_size": BLOCK,
        "layers": [f"model.layers.{layer}.attn.attn"],
        "query_heads": HEADS,
        "dtype": "bfloat16",
        "head_size": HEAD_SIZE,
        "num_kv_heads": 1,
        **sharding,
        **fields,
    }
