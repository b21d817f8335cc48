# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The sizes ``ranks`` runs a group at (``Shape``), its batches, and the
constants its runners size themselves by.

A leaf of ``ranks``: the runners and the planner (``cases``) both build on
it, and it imports neither. Every group runs at its own shapes (see
``cases``); the nope and value head dims are not in a topology and are
``NOPE_DIM`` here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.contract.collectives import (
    FLOAT32_BYTES,
    NCCL,
    dcp_decode_step_bytes,
    mla_decode_step_bytes,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

BACKEND = "TRITON_MLA"
"""The MLA backend a group runs on without a GPU (its impl and builder; vLLM's
Triton kernels under the interpreter)."""

CUDA_MLA_BACKENDS = ("FLASH_ATTN_MLA", "FLASHINFER_MLA", "FLASHMLA", "CUTLASS_MLA")
"""The compiled dense MLA backends ``ranks --device cuda`` runs (their impls
and builders, as a ``vllm serve`` worker on the GPU makes them)."""

RUN_BACKENDS = (BACKEND, *CUDA_MLA_BACKENDS)
"""What ``--attention-backend`` may name for the dense MLA runners (``auto``:
the runner's CPU backend on a CPU, the group's SM90 choice on a GPU, as
``plan`` reports it)."""

LSE_IN_QUERY_DTYPE = frozenset({BACKEND})
"""Backends whose decode hands its LSEs on in the query's dtype
(``TritonMLAImpl.forward_mqa``); the others' are float32. The combine's LSE
all-gather moves that many bytes per LSE (``Shape.lse_bytes``)."""

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
    backend: str = BACKEND
    """The attention backend the group runs on."""
    head_size: int | None = None
    """A non-MLA group's query, key and value head size (its spec's
    ``head_size``; its ``kv_lora_rank`` and ``rope_dim`` are 0); None for an
    MLA group, whose rows are ``kv_lora_rank + rope_dim``."""
    sliding_window: int | None = None
    """A non-MLA group's sliding window (positions a token attends, itself
    included); None: the whole context."""
    sinks: bool = False
    """A non-MLA group's layers have attention sinks (``s_aux``)."""

    @property
    def is_mla(self) -> bool:
        return self.head_size is None

    @property
    def score_dim(self) -> int:
        """The length of the dot product behind one attention score: the
        latent row L + R (MLA), or the head size."""
        if self.head_size is None:
            return self.kv_lora_rank + self.rope_dim
        return self.head_size

    @property
    def scale(self) -> float:
        if self.head_size is not None:
            return float(self.head_size**-0.5)
        return float((self.nope_dim + self.rope_dim) ** -0.5)

    @property
    def words(self) -> str:
        """``h heads x L+R dtype`` (MLA) or ``h heads x d dtype``."""
        if self.head_size is not None:
            return f"{self.heads_per_rank} heads x {self.head_size} {self.dtype}"
        return (
            f"{self.heads_per_rank} heads x {self.kv_lora_rank}+{self.rope_dim} "
            f"{self.dtype}"
        )

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def lse_bytes(self) -> int:
        """Bytes of one LSE as the group's backend hands it on."""
        return self.dtype_bytes if self.backend in LSE_IN_QUERY_DTYPE else 4

    def decode_step_bytes(
        self, world_size: int, tokens: int, backend: str = NCCL
    ) -> int:
        """What one rank moves decoding ``tokens`` in one layer of this shape
        over ``world_size`` ranks on ``backend``
        (``collectives.mla_decode_step_bytes``; a non-MLA group's
        ``dcp_decode_step_bytes``: queries and outputs of the head size in
        the dtype, float32 LSEs, as FlashAttention's kernels return them)."""
        if self.head_size is not None:
            return dcp_decode_step_bytes(
                world_size,
                tokens=tokens,
                heads_per_rank=self.heads_per_rank,
                query_head_dim=self.head_size,
                output_head_dim=self.head_size,
                dtype_bytes=self.dtype_bytes,
                lse_bytes=FLOAT32_BYTES,
                backend=backend,
            )
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
        """Every field; an MLA group's without the non-MLA ones (all unset)."""
        values = asdict(self)
        if self.head_size is None:
            for name in NON_MLA_FIELDS:
                del values[name]
        return values


NON_MLA_FIELDS = ("head_size", "sliding_window", "sinks")
"""The ``Shape`` fields only a non-MLA group sets."""


NON_CAUSAL_DECODE_TOKENS = 4
"""New tokens per request in a non-causal multi-token decode step (a DSpark
draft's query block: every one of them attends every position of its
request, the block's own included); a uniform block, as vLLM's builder
requires."""


def decode_requests(
    block_size: int, shard_count: int, new_tokens: int = 1
) -> list[tuple[int, int]]:
    """One decode step: ``(context, new_tokens)`` over a long context (two
    rounds over the K shards and a partial block), one of a single round and
    one so short that some shards hold nothing."""
    round_ = block_size * shard_count
    return [
        (2 * round_ + block_size // 2 + 3, new_tokens),
        (round_ + 1, new_tokens),
        (3, new_tokens),
    ]


def prefill_requests(block_size: int, shard_count: int) -> list[tuple[int, int]]:
    """Chunked prefill over a context: a continuation past an unaligned
    context, a block-aligned context (a prefix-cache hit) and a prefill with
    no context."""
    round_ = block_size * shard_count
    return [(round_ + 5, 4), (2 * round_, 3), (0, 5)]


def phase_requests(
    block_size: int,
    shard_count: int,
    non_causal: bool = False,
    sliding_window: int | None = None,
) -> dict[str, list[tuple[int, int]]]:
    """The batches a group runs, by phase: a decode step (a non-causal
    multi-token one for a group that decodes so) and a chunked prefill; a
    group with a sliding window also runs, in each, a request whose context
    reaches past the window by a block and a half (the window drops its
    first positions, across a block boundary)."""
    new = NON_CAUSAL_DECODE_TOKENS if non_causal else 1
    phases = {
        "decode": decode_requests(block_size, shard_count, new),
        "prefill": prefill_requests(block_size, shard_count),
    }
    if sliding_window is not None:
        past = sliding_window + block_size + block_size // 2 + 1
        phases["decode"].append((past, new))
        phases["prefill"].append((past, 3))
    return phases


def group_model_len(
    block_size: int,
    shard_count: int,
    non_causal: bool = False,
    sliding_window: int | None = None,
) -> int:
    """``max_model_len`` of a group's run: its longest request, rounded up to
    a multiple of 64."""
    phases = phase_requests(block_size, shard_count, non_causal, sliding_window)
    longest = max(c + n for requests in phases.values() for c, n in requests)
    return cdiv(longest, 64) * 64


def sparse_decode_requests(
    block_size: int, shard_count: int, topk: int
) -> list[tuple[int, int]]:
    """One sparse decode step, ``(context, 1)`` per request: a context
    longer than the top-k by two rounds over the K shards and a partial
    block (the selection selects), one of exactly top-k + 1 positions (it
    drops one), one round (it keeps all) and one so short that some shards
    hold nothing."""
    round_ = block_size * shard_count
    return [
        (topk + 2 * round_ + block_size // 2 + 2, 1),
        (topk, 1),
        (round_, 1),
        (2, 1),
    ]


def topology_shape(topology: Topology, group: CacheGroup) -> dict[str, Any]:
    """The group's shapes as the topology gives them (None where not given)."""
    return {
        "heads_per_rank": topology.heads_per_rank(group),
        "kv_lora_rank": group.kv_lora_rank,
        "rope_dim": group.rope_dim,
        "dtype": str(group.spec_fields.get("dtype")),
    }


def scaled_heads(heads_per_rank: int, scale: int) -> int:
    """Query heads per rank divided by ``scale``, rounded up, and never
    scaled below two: one head per rank takes another decode kernel
    (``mla_cases.single_head_refused``), so scaling keeps the group's kernel."""
    return max(cdiv(heads_per_rank, scale), min(heads_per_rank, 2))


TRANSIENT_COPIES = 2
"""A runner's ``worker_bytes`` counts each tensor a worker allocates for a
group once; the dtype and device copies and the reference's intermediates
(one of each size at a time) at most double that."""
