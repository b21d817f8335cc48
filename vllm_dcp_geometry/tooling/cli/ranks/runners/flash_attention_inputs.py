# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a FlashAttention group's ranks are handed and held to: random
inputs identical on every rank (``make_batch``; one seed per group and
phase), the sinks of every query head (``group_sinks``; one seed per group),
and ``attention_reference``, float64 single-device attention over them.

Inputs hold values of the group's dtype (drawn in float64, rounded to the
dtype): the reference is float64 over exactly what the ranks hold, so what
it measures is the attention's own rounding, not the inputs'. The invariant
every rank is held to: its output for its own query heads, and its combined
context LSE, equal the reference's within the dtype's tolerance. torch is
imported inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.tooling.cli.ranks.runners.inputs import Requests
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape

SINK_SCALE = 2.0
"""Sinks are drawn as this many standard deviations: of either sign and of
the scores' size, so they change every row's softmax."""


@dataclass(frozen=True)
class AttentionBatch:
    """Float64 inputs of one forward, identical on every rank (one seed), at
    values of the group's dtype: per request every position's key and value
    ``[positions, d]`` (one KV head), the new tokens' queries of every rank
    ``[tokens, D * h, d]``, the block-table rows."""

    requests: Requests
    keys: list[Any]
    values: list[Any]
    queries: Any
    rows: list[Any]
    causal: bool = True


def _rounded(gen: Any, dtype: Any, *size: int) -> Any:
    """Standard normal float64 values rounded to ``dtype``, held in float64."""
    import torch

    drawn = torch.randn(*size, generator=gen, dtype=torch.float64)
    return drawn.to(dtype).double()


def make_batch(
    requests: Requests,
    heads: int,
    shape: Shape,
    num_blocks: int,
    width: int,
    seed: int,
) -> AttentionBatch:
    """A batch of ``requests`` with ``heads`` query heads (all ranks'), its
    rows ``width`` random blocks each of ``num_blocks``."""
    import torch

    assert shape.head_size is not None
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    d = shape.head_size
    keys = [_rounded(gen, dtype, c + n, d) for c, n in requests]
    values = [_rounded(gen, dtype, c + n, d) for c, n in requests]
    queries = _rounded(gen, dtype, sum(n for _, n in requests), heads, d)
    blocks = torch.randperm(num_blocks, generator=gen)
    rows = [blocks[i * width : (i + 1) * width] for i in range(len(requests))]
    return AttentionBatch(list(requests), keys, values, queries, rows)


def group_sinks(group: PlannedGroup, run: RankRun) -> Any:
    """The sinks of all D x h query heads (None: the group has none), the
    same on every rank (seeded by the run and the group), float64 at values
    of the group's dtype, as the layer holds them."""
    import torch

    shape = group.shape
    if not shape.sinks:
        return None
    gen = torch.Generator().manual_seed(run.seed + 7919 * group.index)
    drawn = _rounded(gen, getattr(torch, shape.dtype), run.world * shape.heads_per_rank)
    return (drawn * SINK_SCALE).to(getattr(torch, shape.dtype)).double()


def attention_reference(
    batch: AttentionBatch, shape: Shape, sinks: Any
) -> dict[str, Any]:
    """Float64 single-device attention over the batch, every query head: per
    new token at position ``p`` of its request, softmax attention over the
    positions ``p - window < j <= p`` (causal; all of them without a window)
    with ``e^sink`` in the denominator, the output ``[tokens, H, d]``; and the
    LSE over the positions before its request's new tokens (its context, the
    part a DCP path combines over the ranks) ``[tokens, H]`` (``-inf`` where
    there is none)."""
    import torch

    outs, context_lses, t = [], [], 0
    heads = batch.queries.shape[1]
    window = shape.sliding_window
    for i, (context, new) in enumerate(batch.requests):
        for j in range(new):
            p = context + j
            first = 0 if window is None else max(0, p - window + 1)
            k, v = batch.keys[i][first : p + 1], batch.values[i][first : p + 1]
            scores = batch.queries[t] @ k.T * shape.scale  # [heads, positions]
            denominator = scores
            if sinks is not None:
                denominator = torch.cat([scores, sinks[:, None]], dim=-1)
            weights = torch.exp(scores - torch.logsumexp(denominator, -1)[:, None])
            outs.append(weights @ v)
            seen = max(0, context - first)
            context_lses.append(
                scores[:, :seen].logsumexp(-1)
                if seen
                else torch.full((heads,), float("-inf"), dtype=torch.float64)
            )
            t += 1
    return {"out": torch.stack(outs), "context_lse": torch.stack(context_lses)}
