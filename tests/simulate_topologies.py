# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Small topologies for the ``simulate`` tests: every kind of group at once
(and the attention group the CLI input tests start from).

``hybrid(dcp)``: a sharded attention group (K = D), a partially sharded one
(K = 2 where D > 2), a recurrent Mamba group in align mode with speculative
blocks, and a replicated draft group (K = 1), at TP = DCP = ``dcp``. Small
enough that a simulation is a few dozen steps.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.topology import Topology, topology_from_mapping


def attention_group(name: str = "g", layer: str = "l0", **extra: Any) -> dict[str, Any]:
    """A small full-attention group of a topology file (``extra`` adds or
    replaces fields); the CLI input tests start from it too."""
    return {
        "name": name,
        "kind": "full_attention",
        "layers": [layer],
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "bfloat16",
        **extra,
    }


def hybrid_mapping(dcp: int) -> dict[str, Any]:
    groups = [attention_group("attn.kD", "model.layers.0.attn")]
    if dcp > 2:
        groups.append(
            attention_group("attn.k2", "model.layers.1.attn", dcp_kv_shard_count=2)
        )
    groups.append(
        {
            "name": "state",
            "kind": "mamba",
            "layers": ["model.layers.2.mixer"],
            "block_size": 64,
            "shapes": [[3, 32], [2, 16, 16]],
            "dtypes": ["bfloat16", "float32"],
            "num_speculative_blocks": 2,
        }
    )
    groups.append(attention_group("draft", "model.mtp.layers.0.attn", draft=True))
    return {
        "name": f"test-hybrid-dcp{dcp}",
        "description": "simulate test topology",
        "parallel": {
            "tensor_parallel_size": dcp,
            "decode_context_parallel_size": dcp,
            "cp_kv_cache_interleave_size": 1,
        },
        "limits": {"max_model_len": 4096, "max_num_seqs": 4},
        "cache": {"block_size": 64, "mamba_cache_mode": "align"},
        "replay": {"tokens": 2048, "step_tokens": 256},
        "groups": groups,
    }


def hybrid(dcp: int) -> Topology:
    return topology_from_mapping(hybrid_mapping(dcp), source=f"test hybrid {dcp}")


def group_index(topology: Topology, name: str) -> int:
    return next(i for i, g in enumerate(topology.groups) if g.name == name)
