# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One MLA group of the plan on one ``ranks`` worker: built, run, held to the
float64 reference.

``set_up_group`` builds the rank's real ``MLAAttention`` layer and its builder
through ``AttentionGroup.create_metadata_builders``; ``run_phase`` writes the
rank's shard of random K/V at the contract's slot mapping for the group's K
(``write_cache``, through vLLM's KV-write op) and runs
``MLAAttention.forward_impl`` once, a decode step or a chunked prefill over a
context, counting the collectives (``measuring.Traffic``) and recording the
LSEs the attention hands on; the output and LSEs are compared with
``mla_rank_run.mla_reference``.

Random inputs are the same on every rank (one seed per group and phase) and
hold values of the group's dtype (drawn in float64, rounded to the dtype):
the reference is float64 over exactly what the ranks hold, so what it
measures is the attention's own rounding, not the inputs'. vLLM and torch
are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.tooling.cli.ranks.cases import BACKEND, Shape, phase_requests
from vllm_dcp_geometry.tooling.cli.ranks.measuring import Meters, record_local_lse_of
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import (
    LAYER,
    build_layer,
    model_dir,
    vllm_config,
)
from vllm_dcp_geometry.tooling.mla_rank_run import magnitude, max_error, mla_reference

Requests = list[tuple[int, int]]
"""``(context, new)`` tokens per request."""

Attend = Callable[..., None]
"""How a group's layer attends one batch on a rank:
``attend(set_up, q, kv_c, k_pe, cache, metadata, slots, output)``, writing
``output`` (``forward_impl_attend`` for vLLM's ``MLAAttention``)."""

TIMED_STEPS = 3
"""Decode steps timed per group after the counted one; the median is
reported."""


@dataclass(frozen=True)
class RankRun:
    """What every group this worker runs shares, fixed once its distributed
    state exists."""

    world: int
    rank: int
    device: str
    seed: int
    patched: bool
    partial_collectives: str | None
    """Where partial groups run their collectives; None when unpatched."""
    meters: Meters
    cuda_graph: bool = False
    """Also capture each group's decode step in a CUDA graph and replay it
    (``--cuda-graph``; a GPU run only)."""


@dataclass(frozen=True)
class PlannedGroup:
    """One MLA group of the plan, as the launcher wrote it
    (``cases.plan_groups``; only the fields a worker reads), with the shapes
    it runs at."""

    index: int
    name: str
    block_size: int
    shard_count: int
    interleave: int
    dcp_sharded: bool
    draft: bool
    dcp_kv_shard_count: int | None
    non_causal: bool
    """The layer decodes a multi-token block non-causally (a DSpark draft)."""
    shape: Shape
    sparse_latent: str | None = None
    """A DeepSeek-V3.2 layer's latent cache group (both its groups run
    together, ``sparse_mla``); None for other layer classes."""
    sparse_indexer: str | None = None
    """That layer's indexer cache group."""
    indexer_topk: int | None = None
    """The top-k its indexer selects."""

    @classmethod
    def from_plan(cls, entry: dict[str, Any]) -> PlannedGroup:
        # Fields with a default may be absent (a plan written before them).
        values = {
            f.name: entry[f.name]
            for f in fields(cls)
            if f.name in entry or f.default is MISSING
        }
        return cls(**{**values, "shape": Shape(**entry["shape"])})


@dataclass(frozen=True)
class ShardLayout:
    """Where a rank's shard of a group's KV goes: the group's block size, K
    and interleave, and the rank's shard (``GroupGeometry.shard``)."""

    block_size: int
    shard_count: int
    interleave: int
    shard: int


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


def group_spec(group: PlannedGroup, shape: Shape, patched: bool) -> Any:
    """The group's ``MLAAttentionSpec`` at its run's head size and dtype,
    with the topology's block size, sharding and (patched) K."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    extra: dict[str, Any] = {}
    if patched and group.dcp_kv_shard_count is not None:
        extra["dcp_kv_shard_count"] = group.dcp_kv_shard_count
    return MLAAttentionSpec(
        block_size=group.block_size,
        num_kv_heads=1,
        head_size=shape.kv_lora_rank + shape.rope_dim,
        dtype=getattr(torch, shape.dtype),
        dcp_sharded=group.dcp_sharded,
        is_draft=group.draft,
        **extra,
    )


def group_slots(
    inputs: Inputs, layout: ShardLayout, positions: Callable[[int, int], range]
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


def common_metadata(inputs: Inputs, interleave: int, run: RankRun, slots: Any) -> Any:
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


@dataclass(frozen=True)
class GroupSetUp:
    """One group built on this rank: its layout, ``kv_b_proj`` weight (all
    heads, float64), layer and builder, and the batches of its phases."""

    group: PlannedGroup
    layout: ShardLayout
    weight: Any
    config: Any
    """The run's ``VllmConfig`` (the group's block size and interleave)."""
    layer: Any
    builder: Any
    attend: Attend
    cases: dict[str, Requests]
    width: int
    """Block-table entries per request."""
    num_blocks: int


def forward_impl_attend(
    set_up: GroupSetUp,
    q: Any,
    kv_c: Any,
    k_pe: Any,
    cache: Any,
    metadata: Any,
    slots: Any,
    output: Any,
) -> None:
    """``MLAAttention.forward_impl``: the new tokens' latents are written by
    the caller's cache (the runner's KV write runs before the layer)."""
    set_up.layer.forward_impl(q, kv_c, k_pe, cache, metadata, output=output)


LayerBuilder = Callable[[Any, Any, int, Shape, str, PlannedGroup], tuple[Any, Any]]
"""``build(config, weight, rank, shape, device, group) -> (layer, backend)``:
the rank's layer of the group's class, registered in the config's forward
context under ``LAYER``, with its TP slice of the float64 ``kv_b_proj``
weight, processed."""


def build_mla_attention(
    config: Any, weight: Any, rank: int, shape: Shape, device: str, group: PlannedGroup
) -> tuple[Any, Any]:
    """vLLM's generic ``MLAAttention`` (``vllm_setup.build_layer``)."""
    return build_layer(config, weight, rank, shape, device)


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


def set_up_group(
    group: PlannedGroup,
    run: RankRun,
    build: LayerBuilder = build_mla_attention,
    attend: Attend = forward_impl_attend,
) -> GroupSetUp:
    """The rank's layer (made by ``build``) and builder for ``group``, over a
    config with the group's block size and interleave; ``attend`` runs the
    layer on a batch. The layer is in the forward context before the builder
    is made, as in a worker, so the plugin's builder binds it."""
    import torch
    from vllm.v1.worker.utils import AttentionGroup

    shape, world, rank, device = group.shape, run.world, run.rank, run.device
    k, block = group.shard_count, group.block_size
    shard = GroupGeometry(group.name, k, world, rank).shard
    weight = up_projection_weight(group, run)
    width = cdiv(shape.max_model_len, block * k)
    cases = phase_requests(block, k, group.non_causal)
    config = vllm_config(
        model_dir(world, shape),
        world,
        group.interleave,
        block,
        shape,
        device,
        run.partial_collectives,
    )
    layer, backend = build(config, weight, rank, shape, device, group)
    if backend.get_name() != BACKEND:
        record_local_lse_of(type(layer.impl), run.meters.lse)
    attn_group = AttentionGroup(
        backend, [LAYER], group_spec(group, shape, run.patched), 0
    )
    attn_group.create_metadata_builders(config, torch.device(device))
    return GroupSetUp(
        group=group,
        layout=ShardLayout(block, k, group.interleave, shard),
        weight=weight,
        config=config,
        layer=layer,
        builder=attn_group.get_metadata_builder(),
        attend=attend,
        cases=cases,
        width=width,
        num_blocks=width * max(len(r) for r in cases.values()) + 1,
    )


def prepare_forward(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> tuple[Callable[[], None], Any]:
    """One forward of this rank's layer over ``inputs`` and ``cache``, ready
    to run: the builder's metadata built (as the runner builds it before the
    model runs), the inputs on the device; the call (``set_up.attend``) and
    the output [tokens, h * V] it writes."""
    import torch

    shape, device, rank = set_up.group.shape, run.device, run.rank
    dtype = getattr(torch, shape.dtype)
    new = group_slots(inputs, set_up.layout, lambda c, n: range(c, c + n))
    slots = torch.as_tensor([s for row in new for s in row], dtype=torch.int64)
    metadata = set_up.builder.build(
        0, common_metadata(inputs, set_up.layout.interleave, run, slots)
    )
    contexts = [c for c, _ in inputs.requests]
    kv_c = torch.cat([kv[c:] for kv, c in zip(inputs.kv_c, contexts, strict=True)])
    k_pe = torch.cat([pe[c:] for pe, c in zip(inputs.k_pe, contexts, strict=True)])
    h = shape.heads_per_rank

    def on_device(tensor: Any) -> Any:
        return tensor.to(device, dtype).contiguous()

    output = torch.zeros(
        inputs.q.shape[0], h * shape.v_head_dim, dtype=dtype, device=device
    )
    args = (
        set_up,
        on_device(inputs.q[:, rank * h : (rank + 1) * h]),
        on_device(kv_c),
        on_device(k_pe)[:, None, :],
        cache,
        metadata,
        slots.to(device),
        output,
    )
    return (lambda: set_up.attend(*args)), output


def run_forward(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> tuple[Any, dict[str, Any]]:
    """One forward of this rank's layer over ``inputs`` and ``cache``: its
    output [tokens, h * V] and the LSEs it handed on."""
    call, output = prepare_forward(inputs, set_up, run, cache)
    with run.meters.lse.recording() as seen:
        call()
    return output, seen


def replay_decode_graph(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> Any:
    """The decode step captured in a CUDA graph and replayed: its metadata
    built before capture, one eager warm-up, the capture inside vLLM's own
    ``graph_capture`` context (its stream and its groups' capture contexts,
    as the model runner captures), the output cleared, one replay; the
    output the replay wrote."""
    import torch
    from vllm.distributed.parallel_state import graph_capture

    call, output = prepare_forward(inputs, set_up, run, cache)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        graph_capture(torch.device(run.device)) as context,
        torch.cuda.graph(graph, stream=context.stream),
    ):
        call()
    output.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return output


def time_decode_steps(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> float:
    """Seconds of one decode step of this rank (the builder's ``build`` and
    ``forward_impl``, as ``run_forward`` runs them), the median of
    ``TIMED_STEPS``, every rank starting each one together (a barrier on the
    world group, outside the step); on CUDA the device is synchronised around
    each step."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    world = parallel_state.get_world_group().cpu_group
    cuda = run.device.startswith("cuda")
    seconds = []
    for _ in range(TIMED_STEPS):
        dist.barrier(group=world)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run_forward(inputs, set_up, run, cache)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _decode_lse_error(
    set_up: GroupSetUp, seen: dict[str, Any], expected: Any, run: RankRun
) -> float | None:
    # The combine's LSE covers the query heads of every rank its
    # collectives span (the replica's, or all D); a local one its own.
    h = set_up.group.shape.heads_per_rank
    w = set_up.layer.impl.dcp_world_size
    got = seen.get("combined_lse" if w > 1 else "local_lse")
    first = run.rank // w * w
    if got is None:
        return None
    return max_error(got, expected[:, first * h : (first + w) * h])


def _context_lse_error(
    set_up: GroupSetUp, seen: dict[str, Any], expected: Any, run: RankRun
) -> float | None:
    h = set_up.group.shape.heads_per_rank
    got = seen.get("context_lse")
    if got is None:
        return None
    return max_error(got.T, expected[:, run.rank * h : (run.rank + 1) * h])


def run_phase(
    phase: str, requests: Requests, set_up: GroupSetUp, run: RankRun
) -> dict[str, Any]:
    """One forward of the group (``decode`` or ``prefill``) on fresh inputs:
    its errors against the reference and its traffic, keyed by phase."""
    group = set_up.group
    shape = group.shape
    inputs = make_inputs(
        requests,
        run.world * shape.heads_per_rank,
        shape,
        set_up.num_blocks,
        set_up.width,
        run.seed + 31 * group.index + len(phase),
        causal=not (phase == "decode" and group.non_causal),
    )
    cache = write_cache(inputs, set_up.layout, shape, set_up.num_blocks, run.device)
    traffic = run.meters.traffic
    with traffic.counted():
        output, seen = run_forward(inputs, set_up, run, cache)
    expected = mla_reference(
        inputs.kv_c,
        inputs.k_pe,
        inputs.q,
        set_up.weight,
        inputs.requests,
        nope_dim=shape.nope_dim,
        v_head_dim=shape.v_head_dim,
        scale=shape.scale,
        causal=inputs.causal,
    )
    own = shape.heads_per_rank * shape.v_head_dim
    want = expected["out"][:, run.rank * own : (run.rank + 1) * own]
    report: dict[str, Any] = {}
    if phase == "decode":
        lse_error = _decode_lse_error(set_up, seen, expected["lse"], run)
        report["decode_tokens"] = inputs.q.shape[0]
        report["decode_step_s"] = time_decode_steps(inputs, set_up, run, cache)
        if run.cuda_graph:
            replayed = replay_decode_graph(inputs, set_up, run, cache)
            report["graph_max_abs_error"] = max_error(replayed, want)
    else:
        lse_error = _context_lse_error(set_up, seen, expected["context_lse"], run)
    report[f"{phase}_max_abs_error"] = max_error(output, want)
    report[f"{phase}_max_lse_error"] = lse_error
    report[f"{phase}_output_magnitude"] = magnitude(want)
    report[f"{phase}_lse_magnitude"] = magnitude(
        expected["lse" if phase == "decode" else "context_lse"]
    )
    report[f"{phase}_bytes"] = traffic.total
    report[f"{phase}_bytes_by_op"] = traffic.by_op
    report[f"{phase}_bytes_by_group"] = traffic.by_group
    report[f"{phase}_unmodeled_collectives"] = traffic.unmodeled
    report[f"{phase}_collective_calls"] = traffic.calls
    report[f"{phase}_collective_worlds"] = sorted(traffic.worlds)
    return report


class PhaseCrashed(Exception):
    """A phase of a built group raised (its ``__cause__``): what the group
    had measured before it (``ran``: at least its layer class and the world
    its impl attends over) and the phase."""

    def __init__(self, ran: dict[str, Any], phase: str) -> None:
        super().__init__(phase)
        self.ran, self.phase = ran, phase


def run_set_up(set_up: GroupSetUp, run: RankRun) -> dict[str, Any]:
    """Run every phase of a group built on this rank; its errors and
    traffic."""
    layer = type(set_up.layer)
    report: dict[str, Any] = {
        "name": set_up.group.name,
        "layer_class_run": f"{layer.__module__}.{layer.__qualname__}",
        "impl_dcp_world_size": int(set_up.layer.impl.dcp_world_size),
    }
    for phase, requests in set_up.cases.items():
        try:
            report.update(run_phase(phase, requests, set_up, run))
        except Exception as exc:
            raise PhaseCrashed(report, phase) from exc
    return report


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Build and run one group of vLLM's ``MLAAttention`` on this rank."""
    return run_set_up(set_up_group(group, run), run)
