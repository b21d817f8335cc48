# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The vLLM objects a ``ranks`` worker runs on, made from the plan: a
weightless DeepSeek-V3-shaped model directory (Llama-shaped for a non-MLA
group), real ``VllmConfig``s (the
run's, and the one a ``vllm serve`` worker of the plan would hold, with the
operator's overrides) and the rank's real ``MLAAttention`` layer (TRITON_MLA
impl; on CPU the ``cpu_sdpa`` prefill backend).

vLLM and torch are imported inside the functions.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract.overrides import (
    CONFIG_KEY,
    LAYERS_KEY,
    PARTIAL_COLLECTIVES_KEY,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.mla_rank_run import (
    build_mla_layer,
    write_deepseek_config,
)

LAYER = "model.layers.0.self_attn.attn"
"""The name of the one MLA layer every group runs (an override names group
``i``'s copy ``LAYER.i``)."""


@functools.cache
def model_dir(world: int, shape: Shape) -> Path:
    """A DeepSeek-V3-shaped Hugging Face config (no weights) at ``shape``
    (its dtype, latent and rope dims) with ``world`` times
    ``heads_per_rank`` attention heads, or for a non-MLA shape a Llama-shaped
    one (``write_gqa_config``); one per shape in a process."""
    if shape.head_size is not None:
        return write_gqa_config(world * shape.heads_per_rank, shape)
    return write_deepseek_config(
        world * shape.heads_per_rank,
        kv_lora_rank=shape.kv_lora_rank,
        nope_dim=shape.nope_dim,
        rope_dim=shape.rope_dim,
        v_head_dim=shape.v_head_dim,
        dtype=shape.dtype,
        max_position_embeddings=8192,
        prefix="vllm_dcp_geometry_ranks_",
    )


def write_gqa_config(num_heads: int, shape: Shape) -> Path:
    """A directory holding a one-layer Llama-shaped Hugging Face
    ``config.json`` (no weights) of ``num_heads`` query heads of the shape's
    head size and one KV head, in its dtype: what vLLM's model config reads
    to size a FlashAttention layer (its builder's head counts and head size).
    One KV head in all keeps TP above the KV heads at every D, which vLLM
    requires of DCP, and is one per rank, as DCP needs."""
    import json
    import tempfile

    assert shape.head_size is not None
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": num_heads * shape.head_size,
        "head_dim": shape.head_size,
        "intermediate_size": 64,
        "num_attention_heads": num_heads,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 8192,
        "torch_dtype": shape.dtype,
        "rms_norm_eps": 1e-6,
    }
    path = Path(tempfile.mkdtemp(prefix="vllm_dcp_geometry_ranks_gqa_"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def vllm_config(
    path: Path,
    world: int,
    interleave: int,
    block_size: int,
    shape: Shape,
    device: str,
    partial_collectives: str | None = None,
) -> Any:
    """A real ``VllmConfig``: TP = DCP = ``world``, the group's block size
    and shape, and (patched) where partial groups run their collectives."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    length = shape.max_model_len
    return VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=world,
            decode_context_parallel_size=world,
            cp_kv_cache_interleave_size=interleave,
        ),
        cache_config=CacheConfig(block_size=block_size),
        model_config=ModelConfig(
            model=str(path),
            skip_tokenizer_init=True,
            dtype=shape.dtype,
            max_model_len=length,
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=length,
            is_encoder_decoder=False,
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=length * shape.max_num_seqs,
        ),
        device_config=DeviceConfig(device=device),
        additional_config=(
            {}
            if partial_collectives is None
            else {CONFIG_KEY: {PARTIAL_COLLECTIVES_KEY: partial_collectives}}
        ),
    )


def serving_config(plan: dict[str, Any], shape: Shape, path: Path, device: str) -> Any:
    """The ``VllmConfig`` a ``vllm serve`` worker of this plan holds: the
    run's, with overrides giving each group of the plan its K (by layer name)
    and saying where partial groups run their collectives, as an operator's
    would."""
    config = vllm_config(path, plan["world"], 1, 16, shape, device)
    config.additional_config = {
        CONFIG_KEY: {
            LAYERS_KEY: {
                f"{LAYER}.{g['index']}": g["shard_count"] for g in plan["groups"]
            },
            PARTIAL_COLLECTIVES_KEY: plan["partial_collectives"],
        }
    }
    return config


def run_backend(name: str, device: str) -> tuple[Any, Any]:
    """The backend class ``name`` (the group's) and, on a CPU, the
    ``cpu_sdpa`` prefill backend (None elsewhere: the layer's own choice)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[name].get_class()
    if device != "cpu":
        return backend, None
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
        CPUSDPAMLAPrefillBackend,
    )

    return backend, CPUSDPAMLAPrefillBackend


def build_layer(
    config: Any, weight: Any, rank: int, shape: Shape, device: str
) -> tuple[Any, Any]:
    """The rank's ``MLAAttention`` (the group's backend) with its slice of
    ``kv_b_proj`` (a real ``ColumnParallelLinear`` over the TP group), and
    the backend class."""
    import torch

    backend, _ = run_backend(shape.backend, device)
    layer = build_mla_layer(
        config,
        shape,
        kv_b_weight=weight,
        rank=rank,
        backend=backend,
        dtype=getattr(torch, shape.dtype),
        device=device,
        layer_name=LAYER,
    )
    return layer, backend
