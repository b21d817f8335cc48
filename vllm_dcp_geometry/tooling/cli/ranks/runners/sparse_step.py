# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One decode step of DeepSeek-V3.2's layer on one ``ranks`` worker, and its
float64 reference.

Its inputs (``make_sparse_inputs``) are the same on every rank: latent rows
on the ``fp8_ds_mla`` grid, the absorbed queries of every head, the
indexer's scores (many ties). The rank's shard is written at the contract's
slots (``write_latent_cache``: on a GPU vLLM's KV-write op writes the
656-byte rows; on a CPU the cache holds exactly the values those rows
represent). The step runs through the layer's own ``_sparse_indexer_and_attn``
under vLLM's forward context (``prepare_step``): its indexer call (the
plugin's wrapper where loaded, around the stood-in op) with the rank's
indexer logits, vLLM's ``_merge_dcp_topk_global``, then the query
all-gather, the impl's ``forward_mqa`` (the top-k filtered to the rank's
shard) and the combine, and the layer's ``W_UV`` up-projection. The
reference (``reference_step``) is the single-device top-k with vLLM's tie
order and float64 sparse attention over it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.tooling.cli.ranks.runners.inputs import (
    Inputs,
    common_metadata,
    group_slots,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import TIMED_STEPS, RankRun
from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_indexer import (
    CallTraffic,
    indexer_op_stood_in,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_layer import (
    INDEXER_LAYER,
    LATENT_LAYER,
    SparseSetUp,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    FP8_DS_MLA_ROW_BYTES,
    IndexerCall,
    fp8_ds_mla_values,
    reference_attention,
    reference_topk,
    shard_logits,
    tied_scores,
)


@dataclass(frozen=True)
class SparseInputs:
    """Float64 inputs of one decode step, identical on every rank (one
    seed): every position's latent row on the fp8_ds_mla grid, the absorbed
    queries of all D x h heads, the indexer's scores (many ties) and the
    block table (``base``: the requests, rows and latents as ``inputs``'
    metadata and slot helpers read them)."""

    base: Inputs
    latents: list[Any]
    q: Any
    scores: Any

    @property
    def lengths(self) -> Any:
        import torch

        return torch.tensor([c + n for c, n in self.base.requests], dtype=torch.int32)


def make_sparse_inputs(set_up: SparseSetUp, run: RankRun) -> SparseInputs:
    import torch

    shape = set_up.group.shape
    gen = torch.Generator().manual_seed(run.seed + 31 * set_up.group.index + 6)
    dtype = getattr(torch, shape.dtype)
    row = shape.kv_lora_rank + shape.rope_dim
    latents = [
        fp8_ds_mla_values(
            torch.randn(c + n, row, generator=gen, dtype=torch.float64),
            shape.kv_lora_rank,
        )
        for c, n in set_up.requests
    ]
    tokens = sum(n for _, n in set_up.requests)
    q = torch.randn(
        tokens,
        run.world * shape.heads_per_rank,
        row,
        generator=gen,
        dtype=torch.float64,
    )
    q = q.to(dtype).double()
    width = max(c + n for c, n in set_up.requests)
    scores = tied_scores(tokens, width, run.seed + 31 * set_up.group.index + 7)
    blocks = torch.randperm(set_up.num_blocks, generator=gen)
    columns = set_up.width
    rows = [
        blocks[i * columns : (i + 1) * columns] for i in range(len(set_up.requests))
    ]
    kv_c = [latent[:, : shape.kv_lora_rank] for latent in latents]
    k_pe = [latent[:, shape.kv_lora_rank :] for latent in latents]
    base = Inputs(list(set_up.requests), kv_c, k_pe, q, rows)
    return SparseInputs(base, latents, q, scores)


def write_latent_cache(inputs: SparseInputs, set_up: SparseSetUp, run: RankRun) -> Any:
    """The rank's paged latent cache with its shard of every position at the
    contract's slots for the group's K. On a CPU: rows of the run's dtype
    holding the fp8_ds_mla values, every slot the shard does not own NaN (a
    wrong read shows); on a GPU: the 656-byte ``fp8_ds_mla`` rows, written by
    vLLM's KV-write op."""
    import torch

    shape, layout, device = set_up.group.shape, set_up.layout, run.device
    slots = group_slots(inputs.base, layout, lambda c, n: range(c + n))
    if device == "cpu":
        row = shape.kv_lora_rank + shape.rope_dim
        cache = torch.full(
            (set_up.num_blocks, layout.block_size, row),
            float("nan"),
            dtype=getattr(torch, shape.dtype),
        )
        flat = cache.view(-1, row)
        for latent, row_slots in zip(inputs.latents, slots, strict=True):
            where = torch.as_tensor(row_slots)
            mine = where >= 0
            flat[where[mine]] = latent[mine].to(cache.dtype)
        return cache
    import vllm._custom_ops as ops

    cache = torch.full(
        (set_up.num_blocks, layout.block_size, FP8_DS_MLA_ROW_BYTES),
        0xFF,
        dtype=torch.uint8,
        device=device,
    )
    for latent, row_slots in zip(inputs.latents, slots, strict=True):
        where = torch.as_tensor(row_slots, device=device)
        mine = where >= 0
        rows = latent.to(device, torch.bfloat16)[mine]
        ops.concat_and_cache_mla(
            rows[:, : shape.kv_lora_rank].contiguous(),
            rows[:, shape.kv_lora_rank :].contiguous(),
            cache,
            where[mine],
            "fp8_ds_mla",
            torch.ones((), device=device),
        )
    return cache


@dataclass(frozen=True)
class StepOutcome:
    """What one decode step of this rank left: its output, the LSEs the
    attention handed on, its selection, the indexer calls and the
    collectives by part."""

    output: Any
    seen: dict[str, Any]
    selection: Any
    calls: list[IndexerCall]
    split: CallTraffic | None
    indexer_metadata: Any


def prepare_step(
    inputs: SparseInputs, set_up: SparseSetUp, run: RankRun, cache: Any
) -> tuple[Callable[[], None], Any, Any]:
    """One decode step of the rank's layer, ready to run: both builders'
    metadata built (as the runner builds them before the model runs), the
    rank's indexer logits and queries on the device; the call, the output
    [tokens, h * V] it writes, and the indexer's metadata."""
    import torch
    from vllm.forward_context import set_forward_context

    group, layout, device = set_up.group, set_up.layout, run.device
    shape = group.shape
    dtype = getattr(torch, shape.dtype)
    new = group_slots(inputs.base, layout, lambda c, n: range(c, c + n))
    slots = torch.as_tensor([s for row in new for s in row], dtype=torch.int64)
    common = common_metadata(inputs.base, layout.interleave, run, slots)
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            from vllm_dcp_geometry.tooling.sparse_stand_ins import (
                flashmla_scheduler_stand_in,
            )

            stack.enter_context(flashmla_scheduler_stand_in())
        latent_md = set_up.latent_builder.build(0, common)
    indexer_md = set_up.indexer_builder.build(0, common)
    logits, _ = shard_logits(
        inputs.scores,
        inputs.lengths,
        block_size=layout.block_size,
        shard_count=layout.shard_count,
        interleave=layout.interleave,
        shard=layout.shard,
    )
    h, rank = shape.heads_per_rank, run.rank
    q = inputs.q[:, rank * h : (rank + 1) * h].to(device, dtype)
    ql_nope = q[..., : shape.kv_lora_rank].contiguous()
    q_pe = q[..., shape.kv_lora_rank :].contiguous()
    tokens = q.shape[0]
    output = torch.zeros(tokens, h * shape.v_head_dim, dtype=dtype, device=device)
    layer = set_up.layer
    layer.kv_cache = cache
    layer.indexer.k_cache.kv_cache = torch.empty(0, device=device)
    on_device = slots.to(device)
    no_tensor = torch.empty(0, device=device)

    def step() -> None:
        layer.topk_indices_buffer.fill_(-1)
        with set_forward_context(
            {LATENT_LAYER: latent_md, INDEXER_LAYER: indexer_md},
            set_up.config,
            slot_mapping={LATENT_LAYER: on_device, INDEXER_LAYER: on_device},
        ):
            layer._sparse_indexer_and_attn(
                torch.arange(tokens, device=device),
                logits.to(device),  # q_c: the indexer op's stand-in reads it
                None,
                None,
                no_tensor,  # index_q_fp8
                None,
                no_tensor,  # index_weights_out
                None,
                None,
                ql_nope,
                q_pe,  # mqa_q: the roped query, unquantized (FlashMLA's)
                output,
            )

    return step, output, indexer_md


def _timed(run: RankRun, call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()`` with every rank starting together (a barrier on the world
    group, outside the timing; on CUDA synchronised around it); its result
    and seconds."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    dist.barrier(group=parallel_state.get_world_group().cpu_group)
    cuda = run.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = call()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def run_step(
    inputs: SparseInputs, set_up: SparseSetUp, run: RankRun, cache: Any
) -> tuple[StepOutcome, float]:
    """One counted decode step of this rank's layer (both builders' ``build``
    and the layer's ``_sparse_indexer_and_attn``), and its seconds."""
    calls: list[IndexerCall] = []
    split = CallTraffic(run.meters.traffic)

    def counted_step() -> StepOutcome:
        step, output, indexer_md = prepare_step(inputs, set_up, run, cache)
        with (
            indexer_op_stood_in(calls.append, split),
            run.meters.lse.recording() as seen,
            split.layer_call(),
        ):
            step()
        selection = set_up.layer.topk_indices_buffer[: output.shape[0]].clone()
        return StepOutcome(output, dict(seen), selection, calls, split, indexer_md)

    return _timed(run, counted_step)


def step_seconds(
    inputs: SparseInputs,
    set_up: SparseSetUp,
    run: RankRun,
    cache: Any,
    counted_s: float,
) -> float:
    """Seconds of one decode step of this rank: the median of
    ``TIMED_STEPS``, the counted one (``counted_s``) and as many more, each
    timed as ``run_step`` times it (an interpreted sparse step takes seconds
    on a CPU: the counted one is not run again)."""

    def step() -> None:
        call, _, _ = prepare_step(inputs, set_up, run, cache)
        call()

    seconds = [counted_s]
    with indexer_op_stood_in(lambda call: None):
        for _ in range(TIMED_STEPS - 1):
            seconds.append(_timed(run, step)[1])
    return statistics.median(seconds)


def reference_step(inputs: SparseInputs, set_up: SparseSetUp) -> dict[str, Any]:
    """Float64 single-device: the top-k over every position with vLLM's tie
    order, sparse attention of all heads over it, and its up-projection by
    every head's ``W_UV`` (from the same weight); output [T, H * V], LSE
    [T, H]."""
    import torch

    shape = set_up.group.shape
    selection = reference_topk(inputs.scores, inputs.lengths, set_up.topk)
    tokens = inputs.q.shape[0]
    out, lse = reference_attention(
        inputs.q, inputs.latents, list(range(tokens)), selection, shape_scale(shape)
    )
    heads = inputs.q.shape[1]
    up = set_up.weight.view(heads, shape.nope_dim + shape.v_head_dim, -1)
    w_uv = up[:, shape.nope_dim :, :]  # [H, V, L]
    projected = torch.einsum("thl,hvl->thv", out, w_uv)
    return {"selection": selection, "out": projected.flatten(1), "lse": lse}


def shape_scale(shape: Shape) -> float:
    """DeepSeek-V3.2's softmax scale: ``(nope + rope) ** -0.5`` (no YaRN in
    the run's config)."""
    return float((shape.nope_dim + shape.rope_dim) ** -0.5)
