# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One FlashAttention group on one ``ranks`` worker: vLLM's generic
``Attention`` layer on the FLASH_ATTN backend, built, run, held to the
float64 reference.

``set_up_group`` builds the rank's ``Attention`` (its query heads, one KV
head, the group's sliding window, its heads' attention sinks where the
group's layers have them, as gpt-oss passes them) and the group's
``FlashAttentionMetadataBuilder`` through
``AttentionGroup.create_metadata_builders``, the layer already in the
config's forward context, so the plugin's builder binds the layer's impl to
the group's K as in a worker. ``run_phase`` writes the rank's shard of
random K/V (every position of every request, at the contract's slot mapping
for the group's K, through the impl's own KV write,
``FlashAttentionImpl.do_kv_cache_update``), then runs
``FlashAttentionImpl.forward`` once, a decode step or a chunked prefill over
a context, counting every collective (``traffic.Traffic``) and recording the
combined context LSE the DCP path hands its merge. The invariant held: every
rank's output for its own query heads, and (where the DCP path runs) its
combined context LSE, equal ``attention_reference``'s
(``flash_attention_inputs``: float64 causal GQA attention over the same
dtype values with the window and the sinks in the softmax denominator),
within the dtype's tolerance. vLLM and torch are imported inside the
functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv
from vllm_dcp_geometry.tooling.cli.ranks.measuring import record_context_lse_in
from vllm_dcp_geometry.tooling.cli.ranks.runners.flash_attention_inputs import (
    AttentionBatch,
    attention_reference,
    group_sinks,
    make_batch,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.inputs import (
    Requests,
    ShardLayout,
    common_metadata,
    group_slots,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    PlannedGroup,
    RankRun,
    run_every_phase,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_phases import (
    replay_in_graph,
    time_steps,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import phase_requests
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import (
    LAYER,
    model_dir,
    vllm_config,
)
from vllm_dcp_geometry.tooling.mla_rank_run import magnitude, max_error

FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"

# The rank's layer and builder ------------------------------------------------------


def group_spec(group: PlannedGroup, patched: bool) -> Any:
    """The group's ``FullAttentionSpec`` (a ``SlidingWindowSpec`` with its
    window), one KV head of the head size in the run's dtype, with the
    topology's block size, sharding and (patched) K."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = group.shape
    fields: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": 1,
        "head_size": shape.head_size,
        "dtype": getattr(torch, shape.dtype),
        "dcp_sharded": group.dcp_sharded,
        "is_draft": group.draft,
    }
    if patched and group.dcp_kv_shard_count is not None:
        fields["dcp_kv_shard_count"] = group.dcp_kv_shard_count
    if shape.sliding_window is None:
        return FullAttentionSpec(**fields)
    return SlidingWindowSpec(**fields, sliding_window=shape.sliding_window)


def build_attention(config: Any, group: PlannedGroup, run: RankRun, sinks: Any) -> Any:
    """The rank's ``Attention`` (FLASH_ATTN) of ``h`` query heads and one KV
    head, built as a model builds it (the config current, the model's dtype
    the default, on the device) and registered in the config's forward
    context under ``LAYER``; with its heads' slice of ``sinks``. On a CPU its
    impl detects FlashAttention 3 (``flash_attn_stand_ins``)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    shape = group.shape
    dtype = getattr(torch, shape.dtype)
    h = shape.heads_per_rank
    own = None
    if sinks is not None:
        own = sinks[run.rank * h : (run.rank + 1) * h].to(run.device, dtype)
    with contextlib.ExitStack() as stack:
        if run.device == "cpu":
            from vllm_dcp_geometry.tooling.flash_attn_stand_ins import fa3_while_built

            stack.enter_context(fa3_while_built())
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(set_default_torch_dtype(dtype))
        stack.enter_context(torch.device(run.device))
        return Attention(
            h,
            shape.head_size,
            shape.scale,
            num_kv_heads=1,
            per_layer_sliding_window=shape.sliding_window,
            prefix=LAYER,
            attn_backend=FlashAttentionBackend,
            sinks=own,
        )


@dataclass(frozen=True)
class FlashSetUp:
    """One FlashAttention group built on this rank: its layout, sinks,
    layer and builder, and the batches of its phases."""

    group: PlannedGroup
    layout: ShardLayout
    sinks: Any
    config: Any
    layer: Any
    builder: Any
    cases: dict[str, Requests]
    width: int
    """Block-table entries per request."""
    num_blocks: int


def _workspace(device: str) -> None:
    """vLLM's workspace manager, which the DCP path takes its context
    output from (a model runner makes it; here the first group does)."""
    import torch
    from vllm.v1.worker.workspace import (
        init_workspace_manager,
        is_workspace_manager_initialized,
    )

    if not is_workspace_manager_initialized():
        init_workspace_manager(torch.device(device))


def set_up_group(group: PlannedGroup, run: RankRun) -> FlashSetUp:
    """The rank's layer and builder for ``group`` over a config with the
    group's block size and interleave (and where partial groups run their
    collectives); the layer is in the forward context before the builder is
    made, as in a worker, so the plugin's builder binds its impl."""
    import importlib

    import torch
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    shape, k, block = group.shape, group.shard_count, group.block_size
    _workspace(run.device)
    record_context_lse_in(importlib.import_module(FLASH_ATTN), run.meters.lse)
    config = vllm_config(
        model_dir(run.world, shape),
        run.world,
        group.interleave,
        block,
        shape,
        run.device,
        run.partial_collectives,
    )
    sinks = group_sinks(group, run)
    layer = build_attention(config, group, run, sinks)
    attn_group = AttentionGroup(
        FlashAttentionBackend, [LAYER], group_spec(group, run.patched), 0
    )
    attn_group.create_metadata_builders(config, torch.device(run.device))
    cases = phase_requests(block, k, sliding_window=shape.sliding_window)
    width = cdiv(shape.max_model_len, block * k)
    return FlashSetUp(
        group=group,
        layout=ShardLayout(
            block,
            k,
            group.interleave,
            GroupGeometry(group.name, k, run.world, run.rank).shard,
        ),
        sinks=sinks,
        config=config,
        layer=layer,
        builder=attn_group.get_metadata_builder(),
        cases=cases,
        width=width,
        num_blocks=width * max(len(r) for r in cases.values()) + 1,
    )


# One forward -------------------------------------------------------------------


def write_cache(batch: AttentionBatch, set_up: FlashSetUp, run: RankRun) -> Any:
    """The rank's paged cache (vLLM's layout: ``[blocks, KV heads, block, 2d]``
    over NHD memory) with its shard of every position of every request,
    written by the impl's own KV write at the contract's slots (-1 where
    another shard holds the position)."""
    import torch

    shape, layer = set_up.group.shape, set_up.layer
    assert shape.head_size is not None
    dtype = getattr(torch, shape.dtype)
    memory = torch.zeros(
        set_up.num_blocks, set_up.layout.block_size, 1, 2 * shape.head_size
    )
    cache = memory.to(run.device, dtype).permute(0, 2, 1, 3)
    slots = group_slots(batch, set_up.layout, lambda c, n: range(c + n))
    mapping = torch.as_tensor([s for row in slots for s in row], dtype=torch.int64)
    keys = torch.cat(batch.keys)[:, None, :].to(run.device, dtype)
    values = torch.cat(batch.values)[:, None, :].to(run.device, dtype)
    layer.impl.do_kv_cache_update(layer, keys, values, cache, mapping.to(run.device))
    return cache


def prepare_forward(
    batch: AttentionBatch, set_up: FlashSetUp, run: RankRun, cache: Any
) -> tuple[Callable[[], None], Any]:
    """One forward of this rank's layer over ``batch`` and ``cache``, ready to
    run: the builder's metadata built, the rank's queries and the new
    tokens' keys and values on the device; the call
    (``FlashAttentionImpl.forward``, as the layer's impl holds it) and the
    output ``[tokens, h, d]`` it writes."""
    import torch

    shape, layer, rank = set_up.group.shape, set_up.layer, run.rank
    dtype, h = getattr(torch, shape.dtype), shape.heads_per_rank
    new = group_slots(batch, set_up.layout, lambda c, n: range(c, c + n))
    slots = torch.as_tensor([s for row in new for s in row], dtype=torch.int64)
    metadata = set_up.builder.build(
        0, common_metadata(batch, set_up.layout.interleave, run, slots)
    )
    contexts = [c for c, _ in batch.requests]
    key = torch.cat([k[c:] for k, c in zip(batch.keys, contexts, strict=True)])
    value = torch.cat([v[c:] for v, c in zip(batch.values, contexts, strict=True)])

    def on_device(tensor: Any) -> Any:
        return tensor.to(run.device, dtype).contiguous()

    query = on_device(batch.queries[:, rank * h : (rank + 1) * h])
    key, value = on_device(key[:, None, :]), on_device(value[:, None, :])
    output = torch.zeros_like(query)

    def call() -> None:
        layer.impl.forward(layer, query, key, value, cache, metadata, output)

    return call, output


def run_forward(
    batch: AttentionBatch, set_up: FlashSetUp, run: RankRun, cache: Any
) -> tuple[Any, dict[str, Any]]:
    """One forward of this rank's layer: its output and the LSEs it handed
    on (the DCP path's combined context LSE, ``context_lse``)."""
    call, output = prepare_forward(batch, set_up, run, cache)
    with run.meters.lse.recording() as seen:
        call()
    return output, seen


def _lse_error(seen: dict[str, Any], expected: Any, run: RankRun, h: int) -> Any:
    """The combined context LSE's error for this rank's heads (None where no
    DCP path ran: a local group hands no LSE on)."""
    got = seen.get("context_lse")
    if got is None:
        return None
    return max_error(got, expected[:, run.rank * h : (run.rank + 1) * h].T)


def run_phase(
    phase: str, requests: Requests, set_up: FlashSetUp, run: RankRun
) -> dict[str, Any]:
    """One forward of the group (``decode`` or ``prefill``) on fresh inputs:
    its errors against the reference and its traffic, keyed by phase."""
    group = set_up.group
    shape, h = group.shape, group.shape.heads_per_rank
    batch = make_batch(
        requests,
        run.world * h,
        shape,
        set_up.num_blocks,
        set_up.width,
        run.seed + 31 * group.index + len(phase),
    )
    cache = write_cache(batch, set_up, run)
    traffic = run.meters.traffic
    with traffic.counted():
        output, seen = run_forward(batch, set_up, run, cache)
    expected = attention_reference(batch, shape, set_up.sinks)
    want = expected["out"][:, run.rank * h : (run.rank + 1) * h]
    report: dict[str, Any] = {}
    if phase == "decode":
        report["decode_tokens"] = batch.queries.shape[0]
        report["decode_step_s"] = time_steps(
            lambda: run_forward(batch, set_up, run, cache), run
        )
        if run.cuda_graph:
            call, replayed = prepare_forward(batch, set_up, run, cache)
            replay_in_graph(call, replayed, run)
            report["graph_max_abs_error"] = max_error(replayed, want)
    report[f"{phase}_max_abs_error"] = max_error(output, want)
    report[f"{phase}_max_lse_error"] = _lse_error(seen, expected["context_lse"], run, h)
    report[f"{phase}_output_magnitude"] = magnitude(want)
    report[f"{phase}_lse_magnitude"] = magnitude(expected["context_lse"])
    report[f"{phase}_bytes"] = traffic.total
    report[f"{phase}_bytes_by_op"] = traffic.by_op
    report[f"{phase}_bytes_by_group"] = traffic.by_group
    report[f"{phase}_unmodeled_collectives"] = traffic.unmodeled
    report[f"{phase}_collective_calls"] = traffic.calls
    report[f"{phase}_collective_worlds"] = sorted(traffic.worlds)
    return report


def run_set_up(set_up: FlashSetUp, run: RankRun) -> dict[str, Any]:
    """Run every phase of a group built on this rank; its errors and
    traffic, the class it ran and the world its impl attends over (read
    from the bound impl)."""
    return run_every_phase(set_up, run, run_phase)
