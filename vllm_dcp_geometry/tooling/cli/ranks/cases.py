# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks`` runs, before any process starts: each MLA group's shapes
(``Shape``), its batches, and which groups run on this machine
(``plan_groups``).

Every group runs at its own shapes, what the operator's model runs: query
heads per TP rank (``Topology.heads_per_rank``), latent rank L and rope dim
R (``CacheGroup.kv_lora_rank`` and ``rope_dim``), the spec's dtype, the
group's block size and K, and the topology's interleave. A group whose
topology gives no ``query_heads`` or ``kv_lora_rank`` is not run (no shape
is made up for it), nor one whose latent row L + R vLLM's MLA metadata does
not admit (``MLACommonBackend.supports_head_size``: 320, 512 or 576). Only
where the operator asks (``--scale N``) are the query heads per rank divided
by N (rounded up): they are what a worker's memory and time grow with; L and
R stay, since vLLM admits no smaller row than 320, and so do the dtype,
block size, K and interleave. The nope and value head dims are not in a topology: they
size only ``kv_b_proj``'s up-projection (absorbed into the latent query on
decode), never the cache or a collective, and are ``NOPE_DIM`` here.
Contexts are a few rounds over the group's K shards (a few times B * K
tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.contract.attention_backends import collectives_within_replica
from vllm_dcp_geometry.contract.collectives import (
    NCCL,
    REPLICA,
    collective_world_size,
    mla_decode_step_bytes,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

BACKEND = "TRITON_MLA"
"""The MLA backend every group runs on (its impl and builder). Its decode
(``TritonMLAImpl.forward_mqa``) hands on its LSEs in the query's dtype, not
float32, so the combine's LSE all-gather moves ``Shape.dtype_bytes`` per
LSE (``Shape.lse_bytes``)."""

NOPE_DIM = 16
"""The nope and value head dims (not in a topology; see the module doc)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The cache dtypes a group runs in, and their element sizes."""


@dataclass(frozen=True)
class Shape:
    """One group's sizes, the same on every rank."""

    heads_per_rank: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    max_model_len: int
    """Long enough for the group's batches (``group_model_len``)."""
    nope_dim: int = NOPE_DIM
    v_head_dim: int = NOPE_DIM
    max_num_seqs: int = 8

    @property
    def scale(self) -> float:
        return float((self.nope_dim + self.rope_dim) ** -0.5)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def lse_bytes(self) -> int:
        """Bytes of one LSE as ``BACKEND`` hands it on: the query's dtype."""
        return self.dtype_bytes

    def decode_step_bytes(
        self, world_size: int, tokens: int, backend: str = NCCL
    ) -> int:
        """What one rank moves decoding ``tokens`` in one layer of this shape
        over ``world_size`` ranks on ``backend``
        (``collectives.mla_decode_step_bytes``)."""
        return mla_decode_step_bytes(
            world_size,
            tokens=tokens,
            heads_per_rank=self.heads_per_rank,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            dtype_bytes=self.dtype_bytes,
            lse_bytes=self.lse_bytes,
            backend=backend,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_requests(block_size: int, shard_count: int) -> list[tuple[int, int]]:
    """One decode step: ``(context, 1)`` over a long context (two rounds over
    the K shards and a partial block), one of a single round and one so
    short that some shards hold nothing."""
    round_ = block_size * shard_count
    return [(2 * round_ + block_size // 2 + 3, 1), (round_ + 1, 1), (3, 1)]


def prefill_requests(block_size: int, shard_count: int) -> list[tuple[int, int]]:
    """Chunked prefill over a context: a continuation past an unaligned
    context, a block-aligned context (a prefix-cache hit) and a prefill with
    no context."""
    round_ = block_size * shard_count
    return [(round_ + 5, 4), (2 * round_, 3), (0, 5)]


def group_model_len(block_size: int, shard_count: int) -> int:
    """``max_model_len`` of a group's run: its longest request, rounded up to
    a multiple of 64."""
    longest = max(
        c + n
        for requests in (
            decode_requests(block_size, shard_count),
            prefill_requests(block_size, shard_count),
        )
        for c, n in requests
    )
    return cdiv(longest, 64) * 64


def topology_shape(topology: Topology, group: CacheGroup) -> dict[str, Any]:
    """The group's shapes as the topology gives them (None where not given)."""
    return {
        "heads_per_rank": topology.heads_per_rank(group),
        "kv_lora_rank": group.kv_lora_rank,
        "rope_dim": group.rope_dim,
        "dtype": str(group.spec_fields.get("dtype")),
    }


def group_shape(topology: Topology, group: CacheGroup, scale: int) -> Shape | str:
    """The shapes an MLA group runs at (its own, its heads per rank divided
    by ``scale``), or why it cannot run: a shape the topology does not give."""
    given = topology_shape(topology, group)
    missing = [
        field
        for field, value in (
            ("query_heads", group.query_heads),
            ("kv_lora_rank", group.kv_lora_rank),
        )
        if value is None
    ]
    if missing:
        return (
            f"not run: the topology gives no {' or '.join(missing)} (ranks runs "
            "each group at its own shapes)"
        )
    if given["dtype"] not in DTYPE_BYTES:
        return f"not run: dtype {given['dtype']} (ranks runs {', '.join(DTYPE_BYTES)})"
    k = group.shard_count(topology.decode_context_parallel_size)
    return Shape(
        heads_per_rank=cdiv(given["heads_per_rank"], scale),
        kv_lora_rank=given["kv_lora_rank"],
        rope_dim=given["rope_dim"],
        dtype=given["dtype"],
        max_model_len=group_model_len(group.block_size, k),
    )


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
    """Why ``group`` is not run by ``ranks`` here for what it is (None: its
    kind, layer and spec run; ``group_shape`` checks its shapes)."""
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


def head_size_refused(head_size: int) -> str | None:
    """Why vLLM's MLA path refuses a latent row of ``head_size`` (None: it
    admits it), asked of vLLM's own ``MLACommonBackend``."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    if MLACommonBackend.supports_head_size(head_size):
        return None
    sizes = ", ".join(map(str, MLACommonBackend.get_supported_head_sizes()))
    return (
        f"not run: head_size {head_size} (kv_lora_rank + rope dim) is not one "
        f"vLLM's MLA metadata admits ({sizes})"
    )


def planned_world_size(k: int, dcp: int, partial_collectives: str) -> int:
    """What a group's collectives span with K shards, as ``plan`` says for
    the same input: rule A6 where ``partial_collectives`` is ``replica`` and
    the backend binds the replica group, else D-wide."""
    replica = partial_collectives == REPLICA and collectives_within_replica(BACKEND)
    return collective_world_size(k, dcp, replica_collectives=replica)


def plan_groups(
    topology: Topology, *, gpu: bool, scale: int, partial_collectives: str
) -> list[dict[str, Any]]:
    """Every group of the topology: what the workers run, at which shapes,
    or why not."""
    dcp = topology.decode_context_parallel_size
    planned = []
    for index, group in enumerate(topology.groups):
        k = group.shard_count(dcp) if group.is_attention else None
        reason = why_not_run(group, gpu=gpu)
        shape = None
        if reason is None:
            found = group_shape(topology, group, scale)
            shape, reason = (None, found) if isinstance(found, str) else (found, None)
        if shape is not None:
            reason = head_size_refused(shape.kv_lora_rank + shape.rope_dim)
            shape = None if reason else shape
        planned.append(
            {
                "index": index,
                "name": group.name,
                "kind": group.kind + (" (draft)" if group.draft else ""),
                "layer_class": group.layer_class,
                "block_size": group.block_size,
                "shard_count": k,
                "dcp_kv_shard_count": group.dcp_kv_shard_count,
                "dcp_sharded": group.dcp_sharded,
                "draft": group.draft,
                "interleave": topology.interleave_size,
                "collective_world_size": None
                if k is None
                else planned_world_size(k, dcp, partial_collectives),
                "topology_shape": topology_shape(topology, group)
                if group.kind == "mla"
                else None,
                "shape": None if shape is None else shape.to_dict(),
                "run": reason is None,
                "reason": reason,
            }
        )
    return planned


def nothing_to_run(topology: Topology, groups: list[dict[str, Any]]) -> str:
    """The one line ``ranks`` refuses a topology with no group it can run:
    the groups, by why each cannot."""
    by_reason: dict[str, list[str]] = {}
    for g in groups:
        by_reason.setdefault(g["reason"], []).append(g["name"])
    why = "; ".join(
        f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()
    )
    return (
        f"ranks: no group of {topology.name} can run here "
        f"(D={topology.decode_context_parallel_size}): {why}"
    )
