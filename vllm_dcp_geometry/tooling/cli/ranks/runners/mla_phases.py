# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One dense MLA group on one ``ranks`` worker, whatever layer class builds
it (vLLM's ``MLAAttention``: ``runners.mla``; Kimi-K3's: ``runners.kimi_k3``):
built, run, held to the float64 reference.

``set_up_group`` builds the rank's layer (the runner's ``LayerBuilder``) and
its builder through ``AttentionGroup.create_metadata_builders``;
``run_phase`` writes the rank's shard of random K/V at the contract's slot
mapping for the group's K (``inputs.write_cache``, through vLLM's KV-write
op) and runs the layer once (the runner's ``Attend``), a decode step or a
chunked prefill over a context, counting the collectives
(``traffic.Traffic``) and recording the LSEs the attention hands on; the
output and LSEs are compared with ``mla_rank_run.mla_reference``. vLLM and
torch are imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv
from vllm_dcp_geometry.tooling.cli.ranks.measuring import record_local_lse_of
from vllm_dcp_geometry.tooling.cli.ranks.runners.inputs import (
    Inputs,
    Requests,
    ShardLayout,
    common_metadata,
    group_slots,
    make_inputs,
    up_projection_weight,
    write_cache,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    TIMED_STEPS,
    PlannedGroup,
    RankRun,
    run_every_phase,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import BACKEND, Shape, phase_requests
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import (
    LAYER,
    model_dir,
    vllm_config,
)
from vllm_dcp_geometry.tooling.mla_rank_run import magnitude, max_error, mla_reference

Attend = Callable[..., None]
"""How a group's layer attends one batch on a rank:
``attend(set_up, q, kv_c, k_pe, cache, metadata, slots, output)``, writing
``output`` (``runners.mla.forward_impl_attend`` for vLLM's ``MLAAttention``)."""


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


LayerBuilder = Callable[[Any, Any, int, Shape, str, PlannedGroup], tuple[Any, Any]]
"""``build(config, weight, rank, shape, device, group) -> (layer, backend)``:
the rank's layer of the group's class, registered in the config's forward
context under ``LAYER``, with its TP slice of the float64 ``kv_b_proj``
weight, processed."""


def set_up_group(
    group: PlannedGroup,
    run: RankRun,
    build: LayerBuilder,
    attend: Attend,
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


def replay_in_graph(call: Callable[[], None], output: Any, run: RankRun) -> Any:
    """``call`` (a decode step, its metadata built before) captured in a CUDA
    graph and replayed: one eager warm-up, the capture inside vLLM's own
    ``graph_capture`` context (its stream and its groups' capture contexts,
    as the model runner captures), ``output`` cleared, one replay; the
    output the replay wrote."""
    import torch
    from vllm.distributed.parallel_state import graph_capture

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


def replay_decode_graph(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> Any:
    """The decode step captured in a CUDA graph and replayed
    (``replay_in_graph``); the output the replay wrote."""
    call, output = prepare_forward(inputs, set_up, run, cache)
    return replay_in_graph(call, output, run)


def time_steps(step: Callable[[], Any], run: RankRun) -> float:
    """Seconds of one ``step`` on this rank, the median of ``TIMED_STEPS``,
    every rank starting each one together (a barrier on the world group,
    outside the step); on CUDA the device is synchronised around each
    step."""
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
        step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def time_decode_steps(
    inputs: Inputs, set_up: GroupSetUp, run: RankRun, cache: Any
) -> float:
    """Seconds of one decode step of this rank (the builder's ``build`` and
    ``forward_impl``, as ``run_forward`` runs them; ``time_steps``)."""
    return time_steps(lambda: run_forward(inputs, set_up, run, cache), run)


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


def run_set_up(set_up: GroupSetUp, run: RankRun) -> dict[str, Any]:
    """Run every phase of a group built on this rank; its errors and
    traffic."""
    return run_every_phase(set_up, run, run_phase)
