# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's decode-collective bytes, restated from vLLM's tensor shapes
(not from ``collectives``): ring all-gathers and reduce-scatters, the DSA
indexer's top-k merge, the latent attention's query, LSE and output, and the
query's element size as ``MLAAttention.__init__`` picks it."""

from __future__ import annotations

# DeepSeek-V3.2 at TP8: 128 query heads, 16 a rank; latent 512 + rope 64;
# bfloat16 activations; float32 LSEs from FlashMLA; index_topk 2048.
DSV32_HEADS, LATENT, ROPE, BF16, TOPK = 128 // 8, 512, 64, 2, 2048


def ring_all_gather(world: int, input_bytes: int) -> int:
    """A ring all-gather of ``input_bytes`` per rank: W - 1 sends and W - 1
    receives of it."""
    return 2 * (world - 1) * input_bytes


def ring_reduce_scatter(world: int, input_bytes: int, backend: str) -> int:
    """A ring reduce-scatter of ``input_bytes``: (W - 1)/W of it each way;
    gloo runs it as an all-reduce, twice that."""
    moved = 2 * (world - 1) * input_bytes // world
    return moved if backend == "nccl" else 2 * moved


def merge_bytes(world: int, tokens: int, topk: int) -> int:
    """The packed ``[T, topk, 2]`` float32 candidates, all-gathered."""
    return ring_all_gather(world, tokens * topk * 2 * 4)


def latent_bytes(
    world: int,
    tokens: int,
    heads: int,
    query: int,
    output: int,
    lse: int,
    backend: str = "nccl",
) -> int:
    """Query ``[T, h, L + R]`` and LSE ``[T, W h]`` all-gathers, output
    ``[T, W h, L]`` reduce-scatter, each in its element size."""
    return (
        ring_all_gather(world, tokens * heads * (LATENT + ROPE) * query)
        + ring_all_gather(world, tokens * world * heads * lse)
        + ring_reduce_scatter(world, tokens * world * heads * LATENT * output, backend)
    )


def query_element(activation: int, cache: str, quantized: bool, fp8_query: bool) -> int:
    """``MLAAttention.__init__``'s query dtype, as bytes."""
    if quantized and cache != "fp8_ds_mla" and fp8_query:
        return 1
    return activation
