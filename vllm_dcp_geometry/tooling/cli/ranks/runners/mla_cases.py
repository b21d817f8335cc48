# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the MLA runners plan before any process starts: the spec values the
dense latent path runs (``DENSE_SPEC_VALUES``), a dense MLA group's case
(``dense_case``) and what a worker allocates for it (``dense_worker_bytes``),
and the MLA shapes vLLM's metadata and this machine take
(``mla_shape_refused``, every MLA runner's ``refuse_shape``).
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import GroupCase
from vllm_dcp_geometry.tooling.cli.ranks.shapes import (
    BACKEND,
    DTYPE_BYTES,
    TRANSIENT_COPIES,
    Shape,
    decode_requests,
    group_model_len,
    prefill_requests,
    scaled_heads,
    topology_shape,
)
from vllm_dcp_geometry.tooling.mla_rank_run import REFERENCE_HEAD_CHUNK
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

DENSE_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("sparse",),
    "cache_dtype_str": (None, "auto"),
    "kv_quant_mode": (None,),
    "state_content_bytes": (None,),
    "non_causal_multi_token_decode": (False,),
}
"""The values of the spec fields that change how a cache is read which the
dense latent path runs (an ``MLAAttentionSpec``'s ``cache_role`` defaults to
``"sparse"``, the role of every latent cache that is not an indexer's)."""


def dense_case(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = BACKEND,
    dtype: str | None = None,
) -> GroupCase | str:
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
    non_causal = bool(group.spec_fields.get("non_causal_multi_token_decode", False))
    shape = Shape(
        heads_per_rank=scaled_heads(given["heads_per_rank"], scale),
        kv_lora_rank=given["kv_lora_rank"],
        rope_dim=given["rope_dim"],
        dtype=dtype or given["dtype"],
        max_model_len=group_model_len(group.block_size, k, non_causal),
        backend=backend,
    )
    return GroupCase(shape)


def dense_worker_bytes(
    case: GroupCase, world: int, block_size: int, shard_count: int
) -> int:
    """The bytes one worker allocates for one group at its case's shape, its
    tensors counted once and then times ``TRANSIENT_COPIES``: the float64
    ``kv_b_proj`` weight of all ``world * h`` heads and the rank's slice of
    it in the dtype (twice: ``W_UK`` and ``W_UV``), the paged cache, vLLM's
    chunked-prefill workspace (up to twice its rows under DCP), the float64
    inputs of the larger phase and the reference's up-projected K and V of
    the longest request, ``REFERENCE_HEAD_CHUNK`` heads at a time."""
    shape = case.shape
    e, h = shape.dtype_bytes, shape.heads_per_rank
    heads = world * h
    row = shape.kv_lora_rank + shape.rope_dim
    up = shape.nope_dim + shape.v_head_dim
    weight = (heads * 8 + 2 * h * e) * up * shape.kv_lora_rank
    phases = (
        decode_requests(block_size, shard_count),
        prefill_requests(block_size, shard_count),
    )
    width = cdiv(shape.max_model_len, block_size * shard_count)
    cache = (width * max(len(p) for p in phases) + 1) * block_size * row * e
    workspace_rows = min(
        max(8 * shape.max_model_len, 4 * shape.max_num_seqs * block_size), 64 * 1024
    )
    workspace = 2 * workspace_rows * row * e
    query = heads * (shape.nope_dim + shape.rope_dim)
    inputs = 8 * max(sum((c + n) * row + n * query for c, n in p) for p in phases)
    longest = max(c + n for p in phases for c, n in p)
    chunk = min(heads, REFERENCE_HEAD_CHUNK)
    reference = longest * chunk * (up + shape.nope_dim + shape.rope_dim) * 8
    return TRANSIENT_COPIES * (weight + cache + workspace + inputs + reference)


INTERPRETED_DTYPES = ("bfloat16",)
"""Dtypes the Triton interpreter holds as raw bits (it widens them only in
``tl.dot``, where ``cpu_stand_ins`` makes it read their values)."""


def single_head_refused(
    shape: Shape, world: int, *, gpu: bool, backend: str = "TRITON_MLA"
) -> str | None:
    """Why a local group (collective world 1) with one query head per rank
    cannot run its decode here (None: it can): TRITON_MLA decodes one head
    per KV head with its non-grouped kernel, whose bfloat16 arithmetic the
    Triton interpreter cannot run (no bfloat16 constants; sums of raw
    bits). On a GPU it runs."""
    if gpu or backend != BACKEND or world != 1 or shape.heads_per_rank != 1:
        return None
    if shape.dtype not in INTERPRETED_DTYPES:
        return None
    return (
        f"not run on this machine: one {shape.dtype} query head per rank takes "
        f"{backend}'s non-grouped decode kernel, whose {shape.dtype} arithmetic "
        "the Triton interpreter cannot run (a GPU runs it)"
    )


def head_size_refused(head_size: int) -> str | None:
    """Why vLLM's MLA path refuses a latent row of ``head_size`` (None: it
    admits it), asked of vLLM's own ``MLACommonBackend`` by ``plan``'s rule."""
    from vllm_dcp_geometry.tooling.cli.plan.kernel_shapes import refused_latent_row

    refused = refused_latent_row(None, head_size)
    if refused is None:
        return None
    return (
        f"not run: head_size {head_size} (kv_lora_rank + rope dim) is not one "
        f"vLLM's MLA metadata admits ({refused[1]})"
    )


def mla_shape_refused(shape: Shape, world: int, gpu: bool) -> str | None:
    """Why an MLA group cannot run at ``shape`` here (None: it can): a latent
    row vLLM's MLA metadata does not admit, or a local bfloat16 head the
    Triton interpreter cannot decode."""
    return head_size_refused(
        shape.kv_lora_rank + shape.rope_dim
    ) or single_head_refused(shape, world, gpu=gpu, backend=shape.backend)
