# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks`` runs, before any process starts: the scaled-down sizes
(``Shape``), each group's batches, and which groups run on this machine.

The topology's geometry is kept (every group's K, block size, the
interleave); heads, head sizes and lengths are scaled down so that a D = 4 run
ends in a minute on two CPU cores: 2 query heads per rank, MLA latent
256 + rope 64 (a head size vLLM's MLA admits), fp32, and contexts of a few
rounds over the group's K shards (a few times B * K tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology


@dataclass(frozen=True)
class Shape:
    """The run's model and batch sizes (the same on every rank)."""

    heads_per_rank: int = 2
    kv_lora_rank: int = 256
    rope_dim: int = 64
    nope_dim: int = 16
    v_head_dim: int = 16
    dtype: str = "float32"
    max_num_seqs: int = 8
    max_model_len: int = 4096

    @property
    def scale(self) -> float:
        return float((self.nope_dim + self.rope_dim) ** -0.5)

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_requests(
    block_size: int, shard_count: int, world: int, shape: Shape
) -> list[tuple[int, int]]:
    """One decode step: ``(context, 1)`` over a long context (two rounds over
    the K shards and a partial block), one of a single round and one so
    short that some shards hold nothing."""
    round_ = block_size * shard_count
    return [(2 * round_ + block_size // 2 + 3, 1), (round_ + 1, 1), (3, 1)]


def prefill_requests(
    block_size: int, shard_count: int, world: int, shape: Shape
) -> list[tuple[int, int]]:
    """Chunked prefill over a context: a continuation past an unaligned
    context, a block-aligned context (a prefix-cache hit) and a prefill with
    no context."""
    round_ = block_size * shard_count
    return [(round_ + 5, 4), (2 * round_, 3), (0, 5)]


def longest_request(topology: Topology) -> int:
    """The longest request any group's batches hold."""
    dcp = topology.decode_context_parallel_size
    longest = 1
    for group in topology.groups:
        if group.kind != "mla":
            continue
        k = group.shard_count(dcp)
        for requests in (
            decode_requests(group.block_size, k, dcp, Shape()),
            prefill_requests(group.block_size, k, dcp, Shape()),
        ):
            longest = max(longest, *(c + n for c, n in requests))
    return longest


CUDA_BACKENDS = {
    "full_attention": "FlashAttention/FlashInfer",
    "sliding_window": "FlashAttention/FlashInfer",
}
"""The backends a non-MLA attention group runs on, which need CUDA."""

GENERIC_MLA_FIELDS = {"num_kv_heads", "head_size", "dtype", "dcp_kv_shard_count"}
"""Spec fields of an MLA group that the generic dense MLA path runs; any other
(a sparse cache role, an fp8 cache dtype, non-causal decode) needs a layer or
kernel this command does not build."""


LAYER_CLASS_REASONS = {
    "vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention": "its fused CUDA "
    "ops fused_kimi_k3_* have no stand-in here",
}
"""Why a layer class a topology names is not built by ``ranks``."""


def why_not_run(group: CacheGroup, *, gpu: bool) -> str | None:
    """Why ``group`` is not run by ``ranks`` here (None: it runs)."""
    if not group.is_attention:
        return "no attention (recurrent state, not token-sharded)"
    if group.kind != "mla":
        backends = CUDA_BACKENDS.get(group.kind, group.kind)
        if not gpu:
            return f"not run on this machine: {backends} backends need CUDA"
        return f"not run: {backends} groups are not built by this command yet"
    if group.layer_class is not None:
        name = group.layer_class.rsplit(".", 1)[-1]
        why = LAYER_CLASS_REASONS.get(
            group.layer_class, "only vLLM's generic MLAAttention layer is built here"
        )
        return f"not run: layer class {name} ({why})"
    extra = sorted(set(group.spec_fields) - GENERIC_MLA_FIELDS - {"dcp_sharded"})
    if extra:
        return f"not run: {', '.join(extra)} needs a kernel or layer not built here"
    return None
