# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a run of vLLM's MLA attention across DCP ranks needs outside vLLM,
on any device (what a CPU lacks besides is stood in for by the stand-in
modules ``cpu_stand_ins`` lists):

- ``mla_reference``: float64 single-device MLA attention, what every rank's
  output and LSE are held to, ``max_error`` and ``magnitude``;
- ``build_mla_layer`` and ``write_deepseek_config``: one rank's real MLA
  layer over a weightless DeepSeek-shaped config.

The traffic model the runs are held to lives in ``collectives``.

Used by ``vllm-dcp-geometry ranks`` (in its worker processes) and by the test
suite's simulated ranks (``tests.support.mla``). torch is imported inside the
functions only: importing this module stays cheap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.vllm_release import process_weights_after_loading

# The float64 reference -----------------------------------------------------------


REFERENCE_HEAD_CHUNK = 8
"""Query heads the float64 reference up-projects at a time: its peak memory
is that many heads' K and V of the longest request, whatever the model's
head count."""


def mla_reference(
    kv_c: Sequence[Any],
    k_pe: Sequence[Any],
    q: Any,
    kv_b_weight: Any,
    requests: Sequence[tuple[int, int]],
    *,
    nope_dim: int,
    v_head_dim: int,
    scale: float,
    causal: bool = True,
) -> dict[str, Any]:
    """Float64 single-device MLA over ``requests`` (``(context, new)``): per
    new token the output [H*V], the LSE over everything it sees [H], and the
    LSE over its request's context [H]. ``kv_c``/``k_pe``: per request, every
    position's latent and rope key; ``q``: [tokens, H, nope + rope]. A new
    token sees its context and the new tokens up to itself, or with
    ``causal=False`` all of its request's new tokens. Heads are computed
    ``REFERENCE_HEAD_CHUNK`` at a time (each head's attention is its own)."""
    import torch

    heads = q.shape[1]
    rows = nope_dim + v_head_dim
    weight = kv_b_weight.view(heads, rows, -1)
    outs, lses, context_lses = [], [], []
    for first in range(0, heads, REFERENCE_HEAD_CHUNK):
        chunk = slice(first, min(first + REFERENCE_HEAD_CHUNK, heads))
        w = weight[chunk].reshape(-1, weight.shape[-1])
        n = w.shape[0] // rows
        chunk_outs, chunk_lses, chunk_context_lses, t = [], [], [], 0
        for i, (context, new) in enumerate(requests):
            kv = (kv_c[i] @ w.T).view(-1, n, rows)
            k_nope, v = kv.split([nope_dim, v_head_dim], dim=-1)
            rope = k_pe[i][:, None, :].expand(-1, n, -1)
            k = torch.cat([k_nope, rope], dim=-1)
            for j in range(new):
                seen = context + (j + 1 if causal else new)
                scores = torch.einsum("hd,shd->hs", q[t, chunk], k[:seen]) * scale
                chunk_outs.append(
                    torch.einsum("hs,shv->hv", scores.softmax(-1), v[:seen])
                )
                chunk_lses.append(scores.logsumexp(-1))
                chunk_context_lses.append(scores[:, :context].logsumexp(-1))
                t += 1
        outs.append(torch.stack(chunk_outs))
        lses.append(torch.stack(chunk_lses))
        context_lses.append(torch.stack(chunk_context_lses))
    return {
        "out": torch.cat(outs, dim=1).flatten(1),
        "lse": torch.cat(lses, dim=1),
        "context_lse": torch.cat(context_lses, dim=1),
    }


def magnitude(want: Any) -> float:
    """Max |want| over its finite entries (0.0 where none is finite): the
    size of the values an error is measured against."""
    import torch

    want = want.double().cpu()
    finite = want[torch.isfinite(want)]
    return float(finite.abs().max().item()) if finite.numel() else 0.0


def max_error(got: Any, want: Any) -> float:
    """Max |got - want| where both are finite; inf where they disagree on
    which entries are infinite (an empty shard or context must stay -inf)."""
    import torch

    got, want = got.double().cpu(), want.double().cpu()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    return float((got[finite] - want[finite]).abs().max().item())


def build_mla_layer(
    vllm_config: Any,
    shape: Any,
    *,
    kv_b_weight: Any,
    rank: int,
    backend: Any,
    dtype: Any,
    device: str,
    layer_name: str,
) -> Any:
    """One rank's vLLM ``MLAAttention`` (``backend``; the ``cpu_sdpa``
    prefill on a CPU) with its TP slice of ``kv_b_weight`` in a real
    ``ColumnParallelLinear``, weights processed. ``shape`` gives
    ``heads_per_rank``, ``scale``, ``nope_dim``, ``rope_dim``, ``v_head_dim``
    and ``kv_lora_rank``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    prefill = None
    if device == "cpu":
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
            CPUSDPAMLAPrefillBackend,
        )

        prefill = CPUSDPAMLAPrefillBackend
    with set_current_vllm_config(vllm_config), torch.device(device):
        kv_b_proj = ColumnParallelLinear(
            shape.kv_lora_rank,
            kv_b_weight.shape[0],
            bias=False,
            params_dtype=dtype,
            prefix=layer_name.replace("attn", "kv_b_proj"),
        )
        layer = MLAAttention(
            num_heads=shape.heads_per_rank,
            scale=shape.scale,
            qk_nope_head_dim=shape.nope_dim,
            qk_rope_head_dim=shape.rope_dim,
            v_head_dim=shape.v_head_dim,
            q_lora_rank=None,
            kv_lora_rank=shape.kv_lora_rank,
            kv_b_proj=kv_b_proj,
            prefix=layer_name,
            attn_backend=backend,
            prefill_backend_cls=prefill,
        )
    rows = shape.heads_per_rank * (shape.nope_dim + shape.v_head_dim)
    kv_b_proj.weight.data.copy_(kv_b_weight[rank * rows : (rank + 1) * rows])
    process_weights_after_loading(layer, dtype)
    return layer


def write_deepseek_config(
    num_heads: int,
    *,
    kv_lora_rank: int,
    nope_dim: int,
    rope_dim: int,
    v_head_dim: int,
    dtype: str,
    max_position_embeddings: int,
    q_lora_rank: int | None = None,
    architecture: str = "DeepseekV3ForCausalLM",
    model_type: str = "deepseek_v3",
    extra: dict[str, Any] | None = None,
    prefix: str = "vllm_dcp_geometry_mla_",
) -> Path:
    """A directory holding a one-layer DeepSeek-shaped Hugging Face
    ``config.json`` (no weights): what vLLM's model config needs to size an
    MLA layer of ``num_heads`` query heads."""
    import json
    import tempfile

    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_hidden_layers": 1,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_heads,
        "vocab_size": 128,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": dtype,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": q_lora_rank,
        "qk_nope_head_dim": nope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        **(extra or {}),
    }
    path = Path(tempfile.mkdtemp(prefix=prefix))
    (path / "config.json").write_text(json.dumps(config))
    return path
