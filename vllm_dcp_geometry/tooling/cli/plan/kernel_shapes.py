# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The shape rules of vLLM's kernels a group's backend runs, for ``plan``.

Unpatched vLLM has the same limits, so they are not the plugin's to lift; but
``plan`` answers "will this start and run" before GPUs are rented, and a crash
after it said yes is the failure it exists to prevent. Each rule is read from
vLLM where vLLM states it:

- the latent row of an MLA group (``kv_lora_rank`` + rope dim) must be a head
  size the group's backend admits (``supports_head_size`` of its class, or of
  ``MLACommonBackend`` where the class does not import here);
- where a collective combines partial outputs (collective world W > 1), the
  combine kernels of ``vllm.v1.attention.ops.dcp`` tile the output's head
  dimension (``kv_lora_rank`` for MLA, the value head size otherwise) with one
  ``tl.arange(0, HEAD_DIM)``, which Triton takes only for a power of two. The
  rule is applied while the installed release's kernel source reads so.

FlashMLA sparse's head-count envelope lives with its builder refusal
(``attention.flashmla_sparse_refusal``).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from vllm_dcp_geometry.tooling.topology import CacheGroup
from vllm_dcp_geometry.tooling.vllm_release import vllm_release

COMBINE_MODULE = "vllm.v1.attention.ops.dcp"
COMBINE_TILING = "tl.arange(0, HEAD_DIM)"
"""How the combine kernels of ``COMBINE_MODULE`` tile the head dimension."""


def _backend_class(backend: str | None) -> Any:
    """The backend's class, or ``MLACommonBackend`` where none is named or it
    cannot be imported on this machine (its GPU-only kernels)."""
    from vllm_dcp_geometry.tooling.cli.common.noise import third_party_noise_hidden

    # A GPU backend's module logs its missing CUDA ops as it imports here,
    # on vLLM's logger (standard output, where --json goes).
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        with third_party_noise_hidden():
            from vllm.model_executor.layers.attention.mla_attention import (
                MLACommonBackend,
            )
            from vllm.v1.attention.backends.registry import AttentionBackendEnum

            if backend is None:
                return MLACommonBackend
            try:
                return AttentionBackendEnum[backend].get_class()
            except (KeyError, ImportError, RuntimeError, AttributeError):
                return MLACommonBackend
    finally:
        vllm_logger.setLevel(level)


def refused_latent_row(backend: str | None, row: int) -> tuple[str, str] | None:
    """The backend class (``MLACommonBackend`` for None) and the latent rows it
    admits, where it refuses an MLA latent row of ``row`` (None: it admits
    it): vLLM's own ``supports_head_size``."""
    cls = _backend_class(backend)
    if cls.supports_head_size(row):
        return None
    return cls.__name__, ", ".join(map(str, cls.get_supported_head_sizes()))


def latent_row_refusal(group: CacheGroup, name: str, backend: str | None) -> str | None:
    """Why the group's backend refuses its MLA latent row (None: it admits it,
    or the topology gives no ``kv_lora_rank``)."""
    if group.kind != "mla" or group.kv_lora_rank is None or backend is None:
        return None
    row = int(group.spec_fields["head_size"])
    refused = refused_latent_row(backend, row)
    if refused is None:
        return None
    cls_name, sizes = refused
    return (
        f"{name}: {backend} ({cls_name}) admits MLA latent rows of {sizes}; "
        f"this group's is {row} (kv_lora_rank {group.kv_lora_rank} + rope "
        f"{row - group.kv_lora_rank}) (vLLM {vllm_release()} refuses it at "
        "start-up, with or without DCP)"
    )


@functools.cache
def combine_tiles_head_dim() -> bool:
    """Whether the installed release's DCP combine kernels tile the head
    dimension with one Triton arange (so need a power of two)."""
    import importlib

    source = inspect.getsource(importlib.import_module(COMBINE_MODULE))
    return COMBINE_TILING in source


def combined_head_dim(group: CacheGroup) -> tuple[str, int] | None:
    """The head dimension the DCP combine tiles, and what it is called."""
    fields = group.spec_fields
    if group.kind == "mla":
        if group.kv_lora_rank is None:
            return None
        return "kv_lora_rank", group.kv_lora_rank
    if group.kind == "mamba" or "head_size" not in fields:
        return None
    if "head_size_v" in fields:
        return "head_size_v", int(fields["head_size_v"])
    return "head_size", int(fields["head_size"])


def combine_refusal(group: CacheGroup, name: str, world: int) -> str | None:
    """Why the group's output combine over ``world`` ranks cannot run (None:
    it can, or nothing is combined)."""
    head = combined_head_dim(group)
    if world <= 1 or head is None or not combine_tiles_head_dim():
        return None
    what, size = head
    if size > 0 and size & (size - 1) == 0:
        return None
    return (
        f"{name}: DCP combines this group's outputs over W = {world} ranks in "
        f"the Triton kernels of {COMBINE_MODULE}, which tile the head dimension "
        f"with {COMBINE_TILING} and need a power of two; its {what} is {size} "
        f"(vLLM {vllm_release()} crashes there at its first decode; K = 1 "
        "attends locally with no combine)"
    )
