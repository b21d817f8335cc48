# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Kimi-K3's fused CUDA epilogues, stood in for on a CPU.

On a GPU Kimi-K3's MLA layer calls three fused ``torch.ops._C`` kernels
through its Python wrappers in
``vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache``: the key
concat with the latent's cache write, the key concat alone, and the decode
query concat with the cache write. A CPU build has none of them;
``kimi_k3_fused_op_stand_ins`` puts these torch versions of the
unquantized-cache ops in their place while a ``ranks`` worker or the suite
runs the layer (the ``fp8``/``fp8_ds_mla`` ones are not stood in for: a CPU
run keeps the model's dtype in the cache). The suite checks them against
plain torch. torch is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
from typing import Any

from vllm_dcp_geometry.tooling.cpu_stand_ins import KernelNotHere
from vllm_dcp_geometry.tooling.custom_op_stand_ins import concat_and_cache_mla


def _kimi_full_key(k_nope: Any, k_pe: Any) -> Any:
    import torch

    k_pe = k_pe.reshape(k_pe.shape[0], 1, -1).expand(-1, k_nope.shape[1], -1)
    return torch.cat([k_nope, k_pe], dim=-1)


def _kimi_insert(kv_c: Any, k_pe: Any, kv_cache: Any, slot_mapping: Any) -> None:
    concat_and_cache_mla(
        kv_c, k_pe.reshape(k_pe.shape[0], -1), kv_cache, slot_mapping, "auto", None
    )


def kimi_k3_key_concat_kv_cache_insert(
    q, k_nope, k_pe, kv_c, k_out, kv_cache, slot_mapping, block_size, positions, cos
):  # fmt: skip
    """``fused_kimi_k3_mla_key_concat_kv_cache_insert`` (no RoPE):
    ``k_out = [k_nope | k_pe]`` per head; the latent ``[kv_c | k_pe]`` into
    the paged cache at ``slot_mapping`` (negative slots write nothing)."""
    if positions is not None or cos is not None:
        raise KernelNotHere("the Kimi-K3 key-concat stand-in applies no RoPE")
    if block_size != kv_cache.shape[1]:
        raise ValueError(f"block size {block_size} is not the cache's")
    k_out.copy_(_kimi_full_key(k_nope, k_pe))
    _kimi_insert(kv_c, k_pe, kv_cache, slot_mapping)


def kimi_k3_kv_concat(k_nope, k_pe, k_out) -> None:  # fmt: skip
    """``fused_kimi_k3_mla_kv_concat``: ``k_out = [k_nope | k_pe]``."""
    k_out.copy_(_kimi_full_key(k_nope, k_pe))


def kimi_k3_decode_q_concat_kv_cache_insert(
    ql_nope, q_pe, kv_c, k_pe, mqa_q, kv_cache, slot_mapping, block_size, pos, cos
):  # fmt: skip
    """``fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (no RoPE):
    ``mqa_q = [ql_nope | q_pe]``; the latent into the paged cache."""
    import torch

    if pos is not None or cos is not None:
        raise KernelNotHere("the Kimi-K3 decode-concat stand-in applies no RoPE")
    if block_size != kv_cache.shape[1]:
        raise ValueError(f"block size {block_size} is not the cache's")
    mqa_q.copy_(torch.cat([ql_nope, q_pe], dim=-1))
    _kimi_insert(kv_c, k_pe, kv_cache, slot_mapping)


KIMI_K3_FUSED_OPS = {
    "fused_kimi_k3_mla_key_concat_kv_cache_insert": kimi_k3_key_concat_kv_cache_insert,
    "fused_kimi_k3_mla_kv_concat": kimi_k3_kv_concat,
    "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert": (
        kimi_k3_decode_q_concat_kv_cache_insert
    ),
}
"""The ``torch.ops._C`` ops a CPU build lacks, by name, behind Kimi-K3's real
Python wrappers (checked against plain torch by the suite)."""


@contextlib.contextmanager
def kimi_k3_fused_op_stand_ins() -> Any:
    """``KIMI_K3_FUSED_OPS`` in ``torch.ops._C`` while the block runs; a
    build that has them (a CUDA build) is refused, not shadowed."""
    import torch

    namespace = torch.ops._C
    present = [name for name in KIMI_K3_FUSED_OPS if name in vars(namespace)]
    if present:
        raise RuntimeError(f"torch.ops._C already has {present}: not stood in for")
    for name, fn in KIMI_K3_FUSED_OPS.items():
        setattr(namespace, name, fn)
    try:
        yield
    finally:
        for name in KIMI_K3_FUSED_OPS:
            with contextlib.suppress(AttributeError):
                delattr(namespace, name)
