# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The runner of vLLM's generic ``Attention`` on the FLASH_ATTN backend
(``full_attention`` and ``sliding_window`` groups whose topology names no
layer class, or that one): planned here (``flash_case``), built and run by
``flash_attention_phases`` through ``FlashAttentionImpl.forward``, held to
``verdict.measure_dense`` (the formula: ``collectives.dcp_decode_step_bytes``
at the group's head size, float32 LSEs).

A group runs at its own shapes: query heads per TP rank (``query_heads`` /
TP, divided by ``--scale`` where asked), one KV head per rank (what vLLM's
DCP needs of a GQA model), the spec's head size, dtype, block size, K and
sliding window, and its layers' attention sinks (``attention_features``,
gpt-oss's). What it does not run is named, never made up: no
``query_heads``, another KV-head count, an attention feature other than
sinks (a ``mask_mod``), a sliding window sharded over DCP (vLLM cannot shard
one) or on a full-attention spec, a head size FLASH_ATTN does not take, one
vLLM's DCP combine kernel does not take (a power of two under DCP), and
float32 on a GPU (FlashAttention runs float16 and bfloat16).

On a CPU the backend's CUDA kernel, KV write and version detection are
``flash_attn_stand_ins``' (named in the report); vLLM's DCP combine and
merge run as vLLM's Triton kernels, interpreted. The backend is fixed: the
runner builds FLASH_ATTN on every device (``--device cuda`` runs vLLM's
compiled FlashAttention).
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.tooling.cli.ranks.runners.flash_attention_phases import (
    run_set_up,
    set_up_group,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    GroupCase,
    LayerRunner,
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import (
    DTYPE_BYTES,
    TRANSIENT_COPIES,
    Shape,
    group_model_len,
    phase_requests,
    scaled_heads,
)
from vllm_dcp_geometry.tooling.cli.ranks.verdict import measure_dense
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

FLASH_ATTN = "FLASH_ATTN"
"""The backend this runner builds, on every device."""

RUN_FEATURES = frozenset({"sinks"})
"""The ``attention_features`` the runner runs (attention sinks, ``s_aux``)."""

WINDOWS = range(1, 2**31)
"""Every sliding window a spec may give."""

FLASH_SPEC_VALUES: dict[str, Any] = {"sliding_window": WINDOWS}
"""The values of the spec fields that change how a cache is read which the
runner runs (a sliding window: any; nothing quantized)."""


def _refusal(topology: Topology, group: CacheGroup) -> str | None:
    """Why the group's spec or features cannot run here (None: they can)."""
    fields = group.spec_fields
    if group.query_heads is None:
        return (
            "not run: the topology gives no query_heads (ranks runs each group at "
            "its own shapes)"
        )
    if str(fields["dtype"]) not in DTYPE_BYTES:
        return f"not run: dtype {fields['dtype']} (ranks runs {', '.join(DTYPE_BYTES)})"
    if int(fields.get("num_kv_heads", 1)) != 1:
        return (
            f"not run: {fields['num_kv_heads']} KV heads per rank (ranks runs one, "
            "what vLLM's DCP needs of a GQA model)"
        )
    others = sorted(set(group.attention_features) - RUN_FEATURES)
    if others:
        return f"not run: attention features {others} need a kernel not built here"
    window = fields.get("sliding_window")
    if window is not None and group.kind != "sliding_window":
        return "not run: a full-attention spec with a sliding window"
    k = group.shard_count(topology.decode_context_parallel_size)
    if window is not None and k > 1:
        return (
            f"not run: a sliding window sharded over K = {k} ranks (vLLM's "
            "FlashAttention DCP path cannot shard one)"
        )
    return None


def flash_case(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = FLASH_ATTN,
    dtype: str | None = None,
) -> GroupCase | str:
    """The shapes a FlashAttention group runs at (its own, its heads per rank
    divided by ``scale``), or why it cannot run; always on FLASH_ATTN."""
    refused = _refusal(topology, group)
    if refused is not None:
        return refused
    fields = group.spec_fields
    heads = topology.heads_per_rank(group)
    assert heads is not None
    k = group.shard_count(topology.decode_context_parallel_size)
    window = fields.get("sliding_window")
    shape = Shape(
        heads_per_rank=scaled_heads(heads, scale),
        kv_lora_rank=0,
        rope_dim=0,
        dtype=dtype or str(fields["dtype"]),
        max_model_len=group_model_len(group.block_size, k, sliding_window=window),
        backend=FLASH_ATTN,
        head_size=int(fields["head_size"]),
        sliding_window=window,
        sinks="sinks" in group.attention_features,
    )
    return GroupCase(shape)


def flash_shape_refused(shape: Shape, world: int, gpu: bool) -> str | None:
    """Why a FlashAttention group cannot run at ``shape`` over a collective
    world of ``world`` ranks here (None: it can): a head size the backend
    does not take, or (under DCP) one vLLM's combine kernel does not take, or
    float32 on a GPU."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    d = shape.head_size
    assert d is not None
    if not FlashAttentionBackend.supports_head_size(d):
        return f"not run: head size {d} (FLASH_ATTN does not take it)"
    if world > 1 and d & (d - 1):
        return (
            f"not run: head size {d} under DCP (vLLM's DCP combine kernel, "
            "correct_attn_out, takes power-of-two head sizes)"
        )
    if gpu and shape.dtype == "float32":
        return (
            "not run on a GPU: float32 (FlashAttention runs float16 and bfloat16; "
            "a CPU runs it)"
        )
    return None


def flash_worker_bytes(
    case: GroupCase, world: int, block_size: int, shard_count: int
) -> int:
    """The bytes one worker allocates for one group at its case's shape, its
    tensors counted once and then times ``TRANSIENT_COPIES``: the paged
    cache, the DCP path's context workspace (vLLM sizes it by the batched
    tokens, every gathered head), the float64 inputs of the larger phase and
    the reference's scores of one token."""
    shape = case.shape
    assert shape.head_size is not None
    e, d = shape.dtype_bytes, shape.head_size
    heads = world * shape.heads_per_rank
    phases = phase_requests(
        block_size, shard_count, sliding_window=shape.sliding_window
    ).values()
    width = cdiv(shape.max_model_len, block_size * shard_count)
    cache = (width * max(len(p) for p in phases) + 1) * block_size * 2 * d * e
    workspace = shape.max_model_len * shape.max_num_seqs * heads * d * e
    inputs = 8 * max(sum(2 * (c + n) * d + n * heads * d for c, n in p) for p in phases)
    reference = 8 * heads * shape.max_model_len * 2
    return TRANSIENT_COPIES * (cache + workspace + inputs + reference)


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Build and run one FlashAttention group on this rank; on a CPU with
    ``flash_attn_stand_ins`` in place (named in its row)."""
    stand_ins: tuple[str, ...] = ()
    if run.device == "cpu":
        from vllm_dcp_geometry.tooling.flash_attn_stand_ins import (
            install_flash_attn_stand_ins,
        )

        stand_ins = install_flash_attn_stand_ins()
    report = run_set_up(set_up_group(group, run), run)
    if stand_ins:
        report["stand_ins"] = list(stand_ins)
    return report


RUNNER = LayerRunner(
    "flash_attention",
    FLASH_SPEC_VALUES,
    plan=flash_case,
    refuse_shape=flash_shape_refused,
    worker_bytes=flash_worker_bytes,
    run_group=run_group,
    measure=measure_dense,
    cpu_backend=FLASH_ATTN,
    cuda_backends=(),
    fixed_backend=True,
    kinds=frozenset({"full_attention", "sliding_window"}),
)
"""vLLM's ``Attention`` on FLASH_ATTN, on every device."""
