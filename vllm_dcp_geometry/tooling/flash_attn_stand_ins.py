# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM's FlashAttention backend on a CPU, stood in for where CUDA is needed.

A CPU build of vLLM has no ``vllm_flash_attn`` extension: the FlashAttention
backend module (``FLASH_ATTN``) then leaves its kernel, its KV write and its
sinks check undefined, and detects no FlashAttention version. What the
backend's own code (``FlashAttentionImpl.forward``, its DCP path, the
plugin's wrappers around them) calls instead on a CPU:

- ``varlen_attention`` for ``flash_attn_varlen_func``: FlashAttention's varlen
  contract in float64 (ragged queries over ragged keys or a paged cache,
  causal aligned bottom-right, a sliding window, GQA, the LSE ``[H, T]``, the
  ``s_aux`` sinks in every row's denominator), rounded once to the output's
  dtype; every argument it does not honour is refused (``KernelNotHere``),
  never ignored;
- ``reshape_and_cache_flash``: the KV write, each token's key and value at
  the slot the slot mapping names (negative slots write nothing);
- ``flash_attn_supports_sinks``: True, FlashAttention 3's answer;
- ``FA3_WHILE_BUILT``: the impl detects FlashAttention 3 (Hopper's, the
  version sinks need) while its layer is built (``fa3_while_built``); the
  metadata builder detects none, so it plans no AOT scheduler metadata.

``install_flash_attn_stand_ins`` puts them in the backend module once per
process and names them; a build that has the kernel (CUDA) is refused, not
shadowed. On a GPU none of this runs: ``ranks --device cuda`` runs vLLM's
compiled FlashAttention and KV write. The KV write is pinned to the
parameters its stand-in takes (``STAND_IN_SYMBOLS``). torch and vLLM are
imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.tooling.cpu_stand_ins import KernelNotHere, replaced

if TYPE_CHECKING:
    import torch

FLASH_ATTN = "vllm.v1.attention.backends.flash_attn"
"""vLLM's FlashAttention backend module, where the stand-ins go."""

FA_UTILS = "vllm.v1.attention.backends.fa_utils"

STAND_IN_SYMBOLS = (
    UpstreamSymbol(
        "vllm._custom_ops",
        "reshape_and_cache_flash",
        "key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, "
        "k_scale, v_scale",
    ),
    UpstreamSymbol(
        FA_UTILS,
        "get_flash_attn_version",
        "requires_alibi=, head_size=, head_size_v=, has_sinks=, "
        "requires_softcap=, kv_cache_block_size=, supports_fa4_hd256=",
    ),
    UpstreamSymbol(FA_UTILS, "flash_attn_supports_sinks", ""),
)
"""What a CUDA build binds in ``FLASH_ATTN`` under the names the stand-ins
take, with the parameters the stand-ins were written against."""

IGNORED_ARGUMENTS = frozenset(
    {
        "max_seqlen_q",
        "max_seqlen_k",
        "scheduler_metadata",
        "fa_version",
        "num_splits",
    }
)
"""Arguments that steer how FlashAttention schedules its work, never what it
computes: the stand-in takes and ignores them."""

DESCALES = ("q_descale", "k_descale", "v_descale")
"""FlashAttention's fp8 descales: the stand-in takes only ones (an
unquantized cache)."""

FA3_WHILE_BUILT = 3
"""The FlashAttention version an impl detects while ``fa3_while_built``."""


def _keys_of(
    i: int,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s keys and values: its ragged span, or its first
    ``seqused_k`` positions in the paged cache ``[blocks, block, H, d]``."""
    import torch

    if block_table is None:
        if cu_seqlens_k is None:
            raise KernelNotHere("varlen attention needs cu_seqlens_k or a block table")
        start, end = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        return k[start:end], v[start:end]
    if seqused_k is None:
        raise KernelNotHere("paged varlen attention needs seqused_k")
    j = torch.arange(int(seqused_k[i]), device=k.device)
    blocks = block_table[i, j // k.shape[1]].long()
    return k[blocks, j % k.shape[1]], v[blocks, j % k.shape[1]]


def _visible(
    rows: int, keys: int, causal: bool, window: Any, device: Any
) -> torch.Tensor:
    """``[rows, keys]``: which keys each query row sees, FlashAttention's
    way: query ``t`` sits at key position ``t + keys - rows`` (bottom-right
    aligned); causal hides later keys; ``window = (left, right)`` keeps keys
    within ``left`` before and ``right`` after it (-1: unbounded)."""
    import torch

    position = torch.arange(rows, device=device)[:, None] + keys - rows
    key = torch.arange(keys, device=device)[None, :]
    seen = torch.ones(rows, keys, dtype=torch.bool, device=device)
    if causal:
        seen &= key <= position
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if left >= 0:
        seen &= key >= position - left
    if right >= 0:
        seen &= key <= position + right
    return seen


def _refuse_unhonoured(extra: dict[str, Any], **features: Any) -> None:
    """``KernelNotHere`` for an argument the stand-in would otherwise ignore
    while it changes the result."""
    unknown = sorted(set(extra) - IGNORED_ARGUMENTS - set(DESCALES))
    if unknown:
        raise KernelNotHere(f"the varlen attention stand-in does not take {unknown}")
    for name in DESCALES:
        scale = extra.get(name)
        if scale is not None and not bool((scale == 1).all()):
            raise KernelNotHere(f"the varlen attention stand-in has no {name} != 1")
    used = sorted(name for name, value in features.items() if value)
    if used:
        raise KernelNotHere(f"the varlen attention stand-in does not run {used}")


def varlen_attention(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    cu_seqlens_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    return_softmax_lse: bool = False,
    s_aux: torch.Tensor | None = None,
    window_size: Any = None,
    alibi_slopes: Any = None,
    softcap: float = 0,
    mask_mod: Any = None,
    aux_tensors: Any = None,
    dynamic_causal: Any = None,
    **extra: Any,
) -> Any:
    """FlashAttention's varlen contract in float64 (the module doc): per
    request, queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` over its keys,
    GQA by repeating each KV head over its query heads; ``out`` ``[T, H, d]``
    written in its dtype, the LSE ``[H, T]`` float32 (``-inf`` and an output
    of 0 for a row that sees no key); ``s_aux`` ``[H]`` adds ``e^s`` to every
    row's denominator and nothing to its numerator."""
    import torch

    _refuse_unhonoured(
        extra,
        alibi_slopes=alibi_slopes is not None,
        softcap=bool(softcap),
        mask_mod=mask_mod is not None or aux_tensors is not None,
        dynamic_causal=dynamic_causal is not None,
    )
    if out is None:
        out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    heads, kv_heads = q.shape[1], k.shape[-2]
    lse = torch.full(
        (heads, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device
    )
    for i in range(cu_seqlens_q.numel() - 1):
        start, end = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        keys, values = _keys_of(i, k, v, cu_seqlens_k, seqused_k, block_table)
        keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
        values = values.double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[start:end].double(), keys)
        seen = _visible(end - start, keys.shape[0], causal, window_size, q.device)
        scores = (scores * softmax_scale).masked_fill(~seen, float("-inf"))
        denominator = scores
        if s_aux is not None:
            sinks = s_aux.double()[:, None, None].expand(heads, end - start, 1)
            denominator = torch.cat([scores, sinks], dim=-1)
        row_lse = torch.logsumexp(denominator, dim=-1)
        weights = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[start:end] = torch.einsum("htn,nhd->thd", weights, values).to(out.dtype)
        lse[:, start:end] = row_lse.float()
    return (out, lse) if return_softmax_lse else out


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """vLLM's FlashAttention KV write: token ``t``'s key and value ``[H, d]``
    at slot ``s = slot_mapping[t]`` of the paged caches ``[blocks, block, H,
    d]`` (block ``s // block``, offset ``s % block``); a negative slot writes
    nothing. Only an unquantized cache (``"auto"``) is written."""
    if kv_cache_dtype != "auto":
        raise KernelNotHere(f"the KV-write stand-in writes no {kv_cache_dtype} cache")
    mine = slot_mapping >= 0
    slots = slot_mapping[mine].long()
    block = key_cache.shape[1]
    rows = key[: slot_mapping.shape[0]][mine]
    key_cache[slots // block, slots % block] = rows.to(key_cache.dtype)
    rows = value[: slot_mapping.shape[0]][mine]
    value_cache[slots // block, slots % block] = rows.to(value_cache.dtype)


def _supports_sinks() -> bool:
    """FlashAttention 3's answer to ``flash_attn_supports_sinks``."""
    return True


STAND_INS = {
    "flash_attn_varlen_func": varlen_attention,
    "reshape_and_cache_flash": reshape_and_cache_flash,
    "flash_attn_supports_sinks": _supports_sinks,
}
"""The names ``FLASH_ATTN`` binds on a CUDA build, and their stand-ins."""

STAND_IN_WORDS = {
    "flash_attn_varlen_func": "float64 torch, FlashAttention's varlen contract "
    "with s_aux sinks and sliding windows (flash_attn_stand_ins.varlen_attention)",
    "reshape_and_cache_flash": "torch, at the slot mapping",
    "flash_attn_supports_sinks": "True, as FlashAttention 3",
}


@functools.cache
def install_flash_attn_stand_ins() -> tuple[str, ...]:
    """Bind ``STAND_INS`` in ``FLASH_ATTN`` for the rest of this process (once;
    the symbols a CUDA build binds there are checked first); the stand-ins as
    a report names them. A module that binds the kernel (a CUDA build) is
    refused, not shadowed."""
    import importlib

    module = importlib.import_module(FLASH_ATTN)
    present = sorted(name for name in STAND_INS if name in vars(module))
    if present:
        raise RuntimeError(f"{FLASH_ATTN} already binds {present}: not stood in for")
    for symbol in STAND_IN_SYMBOLS:
        verify_symbol(symbol)
    for name, stand_in in STAND_INS.items():
        setattr(module, name, stand_in)
    return (
        *(f"{FLASH_ATTN}.{name} ({STAND_IN_WORDS[name]})" for name in STAND_INS),
        f"{FLASH_ATTN}.get_flash_attn_version ({FA3_WHILE_BUILT} while the impl "
        "is built; none in the metadata builder: no AOT scheduler metadata)",
    )


def _version_while_built(**_: Any) -> int:
    return FA3_WHILE_BUILT


@contextlib.contextmanager
def fa3_while_built() -> Iterator[None]:
    """The backend module's ``get_flash_attn_version`` answers
    ``FA3_WHILE_BUILT`` while the block runs (an impl built within takes
    it); restored after."""
    import importlib

    module = importlib.import_module(FLASH_ATTN)
    with replaced(module, "get_flash_attn_version", _version_while_built):
        yield
