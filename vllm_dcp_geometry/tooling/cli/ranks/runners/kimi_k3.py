# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The runner of Kimi-K3's own MLA layer: one group of it on one ``ranks``
worker.

The layer is vLLM's ``vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention``
made by its own constructor (Kimi-Linear's layout: full-rank query and KV
projections, no RoPE, no output gate; ``non_causal_multi_token_decode`` for
a DSpark draft group), so its impl, its ``MLADCPManager`` and its prefill
backend are the ones it makes itself; only the backend vLLM's selector would
pick is the group's (TRITON_MLA, and ``cpu_sdpa`` for prefill, on a CPU; on
a GPU the group's compiled backend). Its
weights are absorbed by its own ``process_weights_after_loading``. It is in
the forward context before the group's builder is made, so the plugin's
builder binds it with the Kimi-K3 binder, as in a ``vllm serve`` worker.

Each batch runs through the layer's own ``_attention`` under vLLM's
``set_forward_context`` (its metadata and new-token slot mapping by layer
name): the fused epilogues write the new tokens' latents into the cache (the
runner leaves their slots zero, so a missing write shows), the decode path
gathers queries and combines LSEs through the manager the plugin bound (the
replica's for a partial group), the prefill path runs the layer's chunked
context. On a CPU its fused CUDA epilogues are ``kimi_k3_stand_ins``'s
(``kimi_k3_fused_op_stand_ins``) and the ``cpu_sdpa`` backend is told not to
offer ``out`` to the layer's DCP1 context loop (it asserts on one).

The planning, the phases, the reference, the traffic formula and the
tolerance are the generic MLA group's (``mla_cases``, ``mla_phases``,
``verdict.measure_dense``): the layer computes the same attention.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call
from vllm_dcp_geometry.tooling.cli.ranks.measuring import record_context_lse_in
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    LayerRunner,
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_cases import (
    DENSE_SPEC_VALUES,
    dense_case,
    dense_worker_bytes,
    mla_shape_refused,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_phases import (
    GroupSetUp,
    run_set_up,
    set_up_group,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.cli.ranks.verdict import measure_dense
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import LAYER, run_backend
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.vllm_release import process_weights_after_loading

KIMI_MLA = "vllm.models.kimi_k3.nvidia.mla"
CPU_SDPA = "vllm.v1.attention.backends.mla.prefill.cpu_sdpa"

HIDDEN_SIZE = 64
"""The layer's hidden size: it sizes only the projections ``ranks`` does not
run (the query and KV inputs are given), never the cache or a collective."""

RELIED_ON = (
    UpstreamSymbol(
        KIMI_MLA,
        "MultiHeadLatentAttention.__init__",
        "self, config, hidden_size, num_heads, qk_nope_head_dim, qk_rope_head_dim, "
        "v_head_dim, q_lora_rank, kv_lora_rank, use_output_gate=, cache_config=, "
        "quant_config=, prefix=, aux_stream=, use_rope=, "
        "non_causal_multi_token_decode=, run_gemm_rs_ar=",
    ),
    UpstreamSymbol(
        KIMI_MLA,
        "MultiHeadLatentAttention._attention",
        "self, positions, q, kv_c_normed, k_pe, attn_out",
    ),
    UpstreamSymbol(KIMI_MLA, "get_attn_backend", None),
    UpstreamSymbol(KIMI_MLA, "get_mla_prefill_backend", None),
    UpstreamSymbol(CPU_SDPA, "CPUSDPAMLAPrefillBackend.supports_out", "self"),
)
"""What this runner calls or replaces in vLLM, pinned: the constructor and
forward it drives, the two selectors its constructor asks (answered with the
run's backends) and the CPU prefill backend's ``supports_out``."""


def build_kimi_layer(
    config: Any,
    weight: Any,
    rank: int,
    shape: Shape,
    device: str,
    group: PlannedGroup,
) -> tuple[Any, Any]:
    """The rank's ``MultiHeadLatentAttention`` (its constructor, the run's
    backends answering its selectors), with its TP slice of ``weight`` in
    its ``kv_b_proj``, weights absorbed; and the backend class."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.models.kimi_k3.nvidia import mla as kimi_mla
    from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    from vllm.utils.torch_utils import set_default_torch_dtype

    for symbol in RELIED_ON:
        verify_symbol(symbol)
    for selector in ("get_attn_backend", "get_mla_prefill_backend"):
        require_global_call(kimi_mla, "MultiHeadLatentAttention.__init__", selector)
    backend, prefill = run_backend(shape.backend, device)
    dtype = getattr(torch, shape.dtype)
    with contextlib.ExitStack() as stack:
        stack.enter_context(
            replaced(kimi_mla, "get_attn_backend", lambda *a, **k: backend)
        )
        if prefill is not None:
            stack.enter_context(
                replaced(kimi_mla, "get_mla_prefill_backend", lambda *a: prefill)
            )
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(set_default_torch_dtype(dtype))
        stack.enter_context(torch.device(device))
        layer = kimi_mla.MultiHeadLatentAttention(
            config=KimiLinearConfig(),
            hidden_size=HIDDEN_SIZE,
            num_heads=config.parallel_config.tensor_parallel_size
            * shape.heads_per_rank,
            qk_nope_head_dim=shape.nope_dim,
            qk_rope_head_dim=shape.rope_dim,
            v_head_dim=shape.v_head_dim,
            q_lora_rank=None,
            kv_lora_rank=shape.kv_lora_rank,
            prefix=LAYER,
            non_causal_multi_token_decode=group.non_causal,
        )
    rows = shape.heads_per_rank * (shape.nope_dim + shape.v_head_dim)
    layer.kv_b_proj.weight.data.copy_(weight[rank * rows : (rank + 1) * rows])
    process_weights_after_loading(layer, dtype)
    return layer, backend


@contextlib.contextmanager
def _cpu_stand_ins(device: str) -> Iterator[None]:
    """On a CPU: the fused epilogues stood in for, and ``cpu_sdpa`` not
    offering ``out`` (its context chunks refuse it; the layer's DCP1 context
    loop would pass one)."""
    if device != "cpu":
        yield
        return
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
        CPUSDPAMLAPrefillBackend,
    )

    from vllm_dcp_geometry.tooling.kimi_k3_stand_ins import kimi_k3_fused_op_stand_ins

    with (
        kimi_k3_fused_op_stand_ins(),
        replaced(CPUSDPAMLAPrefillBackend, "supports_out", lambda self: False),
    ):
        yield


def kimi_attend(
    set_up: GroupSetUp,
    q: Any,
    kv_c: Any,
    k_pe: Any,
    cache: Any,
    metadata: Any,
    slots: Any,
    output: Any,
) -> None:
    """``MultiHeadLatentAttention._attention`` over the batch: the new
    tokens' slots in ``cache`` are zeroed first, so only the layer's own
    write puts their latents there."""
    import torch
    from vllm.forward_context import set_forward_context

    layer = set_up.layer
    written = slots[slots >= 0]
    cache.view(-1, cache.shape[-1])[written] = 0
    layer.kv_cache = cache
    positions = torch.arange(q.shape[0], device=q.device)
    with (
        _cpu_stand_ins(str(q.device)),
        set_forward_context(
            {LAYER: metadata}, set_up.config, slot_mapping={LAYER: slots}
        ),
    ):
        layer._attention(positions, q, kv_c, k_pe, output)


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Build and run one Kimi-K3 MLA group on this rank."""
    from vllm.models.kimi_k3.nvidia import mla as kimi_mla

    record_context_lse_in(kimi_mla, run.meters.lse)
    set_up = set_up_group(group, run, build_kimi_layer, kimi_attend)
    report = run_set_up(set_up, run)
    if run.device == "cpu":
        from vllm_dcp_geometry.tooling.kimi_k3_stand_ins import KIMI_K3_FUSED_OPS

        report["stand_ins"] = [
            *(f"torch.ops._C.{name}" for name in KIMI_K3_FUSED_OPS),
            f"{CPU_SDPA}.CPUSDPAMLAPrefillBackend.supports_out (False)",
        ]
    return report


RUNNER = LayerRunner(
    "kimi_k3",
    {**DENSE_SPEC_VALUES, "non_causal_multi_token_decode": (False, True)},
    plan=dense_case,
    refuse_shape=mla_shape_refused,
    worker_bytes=dense_worker_bytes,
    run_group=run_group,
    measure=measure_dense,
)
"""Kimi-K3's layer also decodes a DSpark draft's block non-causally."""
