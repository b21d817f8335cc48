# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The platform a planning build runs on: vLLM's layers believe they are on
a Hopper (SM90) GPU while every tensor lives on the meta device.

A planning build constructs the model's real vLLM modules to read their
KV-cache specs; it never runs a kernel. vLLM asks its platform three things
while it builds: which attention backend a layer gets, which MLA prefill
backend, and how many compute units the device has. ``PlanningPlatform``
answers them as vLLM 0.33.0's CUDA platform does on an H200 for the decode
backend (``sm90_attention_backend``: the choice ``plan`` documents), with a
CPU prefill backend (prefill never changes a cache spec) and the H200's 132
SMs. It is a CUDA platform, so that vLLM's model packages that dispatch on
the platform (DeepSeek-V3.2, Kimi-K3, ...) load the code a GPU server runs,
and it supports the hybrid KV-cache manager as CUDA does. vLLM's own
``update_block_size_for_backend`` (the generic platform method the worker
calls after loading) then sets the block size from those backends, as at
start-up.
"""

from __future__ import annotations

from typing import Any

H200_COMPUTE_UNITS = 132
H200_DEVICE_NAME = "NVIDIA H200"
"""What the planning platform calls its device: vLLM 0.34.0's bundled
flash-linear-attention ops (Qwen3-Next's gated delta rule) ask the platform
for it when imported, to detect Hopper."""
SM90 = (9, 0)
PLANNED_GPUS = 1 << 16
"""What the planning platform reports as the GPUs of this node: a plan is of
one engine's parallel layout, whatever nodes it spans (vLLM's own check of
the node's GPU count is not a geometry rule)."""


def sm90_attention_backend(selector_config: Any) -> str:
    """The backend vLLM 0.33.0 selects on SM90 for a layer vLLM describes
    with ``selector_config`` (its ``AttentionSelectorConfig``), when the
    operator names none: FLASHMLA_SPARSE for sparse MLA (the one sparse
    backend with DCP there), FLASHINFER_MLA for non-causal multi-token MLA
    decode under DCP (a DSpark draft: the only builder with
    ``supports_non_causal_multi_token_dcp`` there), FLASH_ATTN_MLA for other
    MLA and FLASH_ATTN for the rest (``vllm.platforms.cuda``'s priorities)."""
    from vllm_dcp_geometry.tooling.sm90_backends import (
        DEFAULT_ATTENTION_BACKENDS,
        NON_CAUSAL_DCP_MLA_BACKEND,
    )

    if not selector_config.use_mla:
        return DEFAULT_ATTENTION_BACKENDS["full_attention"]
    if selector_config.use_sparse:
        return "FLASHMLA_SPARSE"
    if selector_config.use_non_causal and selector_config.use_dcp:
        return NON_CAUSAL_DCP_MLA_BACKEND
    return DEFAULT_ATTENTION_BACKENDS["mla"]


def make_planning_platform() -> Any:
    """An instance of the planning platform (a subclass of vLLM's
    ``Platform``, made when vLLM is imported)."""
    from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum
    from vllm.v1.attention.backends.mla.prefill.registry import (
        MLAPrefillBackendEnum,
    )
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    class PlanningPlatform(Platform):
        """SM90 answers for a meta-device build (see the module)."""

        _enum = PlatformEnum.CUDA
        device_name = "cpu"
        device_type = "cpu"
        dispatch_key = "CPU"

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(*SM90)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return H200_DEVICE_NAME

        @classmethod
        def device_count(cls) -> int:
            # The plan is of one engine's layout, not of the nodes it spans.
            return PLANNED_GPUS

        @classmethod
        def support_hybrid_kv_cache(cls) -> bool:
            return True

        @classmethod
        def num_compute_units(cls, device_id: int = 0) -> int:
            return H200_COMPUTE_UNITS

        @classmethod
        def get_mla_prefill_backend_cls(cls, selector_config: Any) -> Any:
            return MLAPrefillBackendEnum.CPU.get_class()

        @classmethod
        def get_attn_backend_cls(
            cls,
            selected_backend: Any,
            attn_selector_config: Any,
            num_heads: int | None = None,
        ) -> str:
            backend = (
                selected_backend
                or AttentionBackendEnum[sm90_attention_backend(attn_selector_config)]
            )
            module, qualname = backend.get_class().full_cls_name()
            return f"{module}.{qualname}"

    return PlanningPlatform()
