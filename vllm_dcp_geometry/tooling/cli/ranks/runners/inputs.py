# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a rank hands a group's layer, the same way for every runner: random
inputs identical on every rank, the contract's slots for the rank's shard,
the paged cache written there by vLLM's KV-write op, vLLM's common attention
metadata, and the ``kv_b_proj`` weight of all heads.

Random inputs are the same on every rank (one seed per group and phase) and
hold values of the group's dtype (drawn in float64, rounded to the dtype):
the reference is float64 over exactly what the ranks hold, so what it
measures is the attention's own rounding, not the inputs'. vLLM and torch
are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from vllm_dcp_geometry.contract import reference_slot_mapping
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape

if TYPE_CHECKING:
    from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
        PlannedGroup,
        RankRun,
    )

Requests = list[tuple[int, int]]
"""``(context, new)`` tokens per request."""


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard of a group's KV goes: the group's block size, K
    and interleave, and the rank's shard (``GroupGeometry.shard``)."""

    block_size: int
    shard_count: int
    interleave: int
    shard: int


class PagedBatch(Protocol):
    """What the slots and the common metadata read of a batch (``Inputs``,
    or another runner's inputs): its requests, each request's block-table
    row and whether its new tokens attend causally."""

    @property
    def requests(self) -> Requests: ...

    @property
    def rows(self) -> list[Any]: ...

    @property
    def causal(self) -> bool: ...


@dataclass(frozen=True)
class Inputs:
    """Float64 inputs of one forward, identical on every rank (one seed)."""

    requests: Requests
    kv_c: list[Any]
    k_pe: list[Any]
    q: Any
    rows: list[Any]
    causal: bool = True
    """False: every new token of a request attends all of its positions."""


def make_inputs(
    requests: Requests,
    weight_heads: int,
    shape: Shape,
    num_blocks: int,
    width: int,
    seed: int,
    causal: bool = True,
) -> Inputs:
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, shape.dtype)

    def rand(*size: int) -> Any:
        drawn = torch.randn(*size, generator=gen, dtype=torch.float64)
        return drawn.to(dtype).double()

    kv_c = [rand(c + n, shape.kv_lora_rank) for c, n in requests]
    k_pe = [rand(c + n, shape.rope_dim) for c, n in requests]
    tokens = sum(n for _, n in requests)
    q = rand(tokens, weight_heads, shape.nope_dim + shape.rope_dim)
    blocks = torch.randperm(num_blocks, generator=gen)
    rows = [blocks[i * width : (i + 1) * width] for i in range(len(requests))]
    return Inputs(list(requests), kv_c, k_pe, q, rows, causal)


def group_slots(
    inputs: PagedBatch, layout: ShardLayout, positions: Callable[[int, int], range]
) -> list[Any]:
    """Per request, the contract's slot of each position in ``positions(c,
    n)`` on the layout's shard (-1 where another shard owns it)."""
    return [
        reference_slot_mapping(
            positions(context, new),
            inputs.rows[i],
            block_size=layout.block_size,
            shard_count=layout.shard_count,
            interleave_size=layout.interleave,
            shard=layout.shard,
        )
        for i, (context, new) in enumerate(inputs.requests)
    ]


def write_cache(
    inputs: Inputs, layout: ShardLayout, shape: Shape, num_blocks: int, device: str
) -> Any:
    """The rank's paged cache with its shard of every position, written by
    vLLM's KV-write op (``concat_and_cache_mla``) at the contract's slots."""
    import torch
    import vllm._custom_ops as ops

    dtype = getattr(torch, shape.dtype)
    cache = torch.zeros(
        num_blocks, layout.block_size, shape.kv_lora_rank + shape.rope_dim
    )
    cache = cache.to(device, dtype)
    slots = group_slots(inputs, layout, lambda c, n: range(c + n))
    for i, row_slots in enumerate(slots):
        ops.concat_and_cache_mla(
            inputs.kv_c[i].to(device, dtype),
            inputs.k_pe[i].to(device, dtype),
            cache,
            torch.as_tensor(row_slots, device=device),
            "auto",
            torch.ones((), device=device),
        )
    return cache


def common_metadata(
    inputs: PagedBatch, interleave: int, run: RankRun, slots: Any
) -> Any:
    """The runner's ``CommonAttentionMetadata`` (vLLM's global (D, r) local
    lengths, as both model runners compute them)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    requests, device = inputs.requests, run.device
    seq_cpu = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    query = torch.tensor([n for _, n in requests], dtype=torch.int32)
    starts_cpu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    starts_cpu[1:] = query.cumsum(0)
    seq = seq_cpu.to(device)
    return CommonAttentionMetadata(
        query_start_loc=starts_cpu.to(device),
        query_start_loc_cpu=starts_cpu,
        seq_lens=seq,
        num_reqs=len(requests),
        num_actual_tokens=int(query.sum()),
        max_query_len=int(query.max()),
        max_seq_len=int(seq_cpu.max()),
        block_table_tensor=torch.stack(inputs.rows).to(device, torch.int32),
        slot_mapping=slots.to(device),
        causal=inputs.causal,
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq, run.world, run.rank, interleave),
        seq_lens_cpu_upper_bound=seq_cpu,
    )


def up_projection_weight(group: PlannedGroup, run: RankRun) -> Any:
    """The ``kv_b_proj`` weight of all D x h heads, the same on every rank
    (seeded by the run and the group), held in float64 at values the group's
    dtype represents, so the layer and the reference multiply the same."""
    import torch

    shape = group.shape
    heads = run.world * shape.heads_per_rank
    gen = torch.Generator().manual_seed(run.seed + 7919 * group.index)
    weight = torch.randn(
        heads * (shape.nope_dim + shape.v_head_dim),
        shape.kv_lora_rank,
        generator=gen,
        dtype=torch.float64,
    )
    weight = (weight * shape.kv_lora_rank**-0.5).to(getattr(torch, shape.dtype))
    return weight.double()
