# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's sparse MLA on a CPU, stood in for where CUDA is needed.

- The DSA top-k merge's CuteDSL selector and its CUDA-only input check: a CPU
  runs vLLM's own pack kernel and ``_merge_dcp_topk_global`` around a checked
  torch stand-in of the selector (``stable_topk_stand_in``,
  ``cutedsl_merge_stand_ins``), written to each release's contract: 0.33.0's
  ``[rows, W * top-k, 2]`` candidates keyed on 32 score bits, 0.34.0's
  rank-major ``[W, rows, top-k, 2]`` keyed on ``score_bits`` / ``id_bits``.
- FlashMLA's sparse kernels: vLLM's ``SparseMLACommonImpl`` with its kernel
  hook running vLLM's Triton sparse MLA kernel (``xpu_mla_sparse``,
  ``triton_sparse_impl_class``); everything before the hook - the top-k
  filter to the rank's shard and the conversion to slots - is upstream's
  ``forward_mqa``. FlashMLA's scheduler metadata gets an empty
  ``FlashMLASchedMeta`` (``flashmla_scheduler_stand_in``).

On a GPU none of these runs: ``ranks --device cuda`` runs the CuteDSL
selector and FlashMLA's sparse kernels on the ``fp8_ds_mla`` cache. Every
symbol stood in for or filled in is pinned per release
(``sparse_stand_in_symbols``). torch and vLLM are imported inside the
functions only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import types
from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.vllm_release import on_installed_release

DSA_CUTEDSL = "vllm.model_executor.kernels.attention.dsa.dcp_indexer_cutedsl"
SPARSE_ATTN_INDEXER = "vllm.model_executor.layers.sparse_attn_indexer"
SPARSE_MLA_ATTENTION = "vllm.model_executor.layers.attention.sparse_mla_attention"
SPARSE_KERNEL_MODULE = "vllm.v1.attention.ops.xpu_mla_sparse"

SELECTOR_PARAMETERS = {
    "0.33.0": "gathered, topk, out=",
    "0.34.0": "gathered, topk, out=, score_bits=, id_bits=",
}
"""The CuteDSL selector's parameters per release (0.34.0 reads rank-major
candidates and keys ``score_bits`` / ``id_bits``)."""


def selector_reads_rank_major() -> bool:
    """Whether the installed release's selector reads 0.34.0's rank-major
    candidates (the D-wide gather no longer fits a view by K there)."""
    return "score_bits" in on_installed_release(SELECTOR_PARAMETERS)


def sparse_stand_in_symbols() -> tuple[UpstreamSymbol, ...]:
    """What the sparse stand-ins replace or fill in on the installed release,
    with the parameters they were written against: the selector and the
    merge's input check (replaced), the Triton kernel the impl's hook calls,
    and the hook itself."""
    return (
        UpstreamSymbol(
            DSA_CUTEDSL,
            "stable_topk_from_gathered_candidates_cutedsl",
            on_installed_release(SELECTOR_PARAMETERS),
        ),
        UpstreamSymbol(
            SPARSE_ATTN_INDEXER,
            "_assert_cutedsl_dcp_merge_supported",
            "logits, topk_indices, k",
        ),
        UpstreamSymbol(
            SPARSE_KERNEL_MODULE,
            "triton_bf16_mla_sparse_interface",
            "q, kv, indices, sm_scale, d_v=, block_dpe=",
        ),
        UpstreamSymbol(
            SPARSE_MLA_ATTENTION,
            "SparseMLACommonImpl._forward_mqa_kernel",
            "self, q, kv_cache, topk_indices, valid_counts, *, layer, block_size, "
            "is_decode",
        ),
    )


def stable_keys(gathered: Any, score_bits: int = 32, id_bits: int = 32) -> Any:
    """vLLM's CuteDSL selector key of every ``(score, id)`` candidate of
    ``gathered [rows, candidates, 2]``, minus 2**63 so that it orders as
    int64: ``(bits ^ (sign ? 0xFFFFFFFF : 0x80000000))`` with only its high
    ``score_bits`` kept, shifted up 32, or ``~id`` within its low ``id_bits``;
    the lowest key for ``id < 0``. Within ``id_bits`` every id keeps its
    order, so ties go to the smaller id as with 32 bits."""
    import torch

    score = gathered[..., 0].contiguous()
    ids = gathered[..., 1].to(torch.int64)  # exact: ids < 2**24 travel in fp32
    bits = score.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = (bits & 0x80000000) != 0
    score_key = torch.where(negative, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    score_key = (score_key >> (32 - score_bits)) << (32 - score_bits)
    id_key = (~ids) & ((1 << id_bits) - 1)
    key = ((score_key - 2**31) << 32) | id_key
    return torch.where(ids < 0, torch.full_like(key, -(2**63)), key)


def candidates_by_row(gathered: Any, topk: int) -> Any:
    """``[rows, W * topk, 2]``: each row's candidates in rank order, from
    0.34.0's rank-major ``[W, rows, topk, 2]`` (0.33.0's layout as it is)."""
    if gathered.dim() == 3:
        assert gathered.shape[2] == 2
        return gathered
    assert gathered.dim() == 4 and tuple(gathered.shape[2:]) == (topk, 2)
    return gathered.permute(1, 0, 2, 3).reshape(gathered.shape[1], -1, 2)


def stable_topk_stand_in(
    gathered: Any,
    topk: int,
    out: Any = None,
    score_bits: int = 32,
    id_bits: int = 32,
) -> Any:
    """Stand-in for ``stable_topk_from_gathered_candidates_cutedsl`` (CUDA
    only) with its contract on either release: per row the ``topk`` largest
    keys (``stable_keys``) as int32 ids, -1 where the key is a padding
    one's. The real kernel writes them in an unspecified order; this one in
    key order. An id past ``id_bits`` breaks the contract and is refused."""
    import torch

    rows = candidates_by_row(gathered, topk)
    assert rows.dtype == torch.float32
    ids = rows[..., 1].to(torch.int64)
    if bool((ids >= 2**id_bits).any()):
        raise ValueError(f"a candidate id past id_bits={id_bits}")
    keys = stable_keys(rows, score_bits, id_bits)
    top = keys.topk(topk, dim=1, sorted=True)
    chosen = ids.gather(1, top.indices)
    chosen = torch.where(top.values == -(2**63), -1, chosen).to(torch.int32)
    if out is None:
        return chosen
    out.copy_(chosen)
    return out


def check_merge_inputs(logits: Any, topk_indices: Any, k: int) -> None:
    """The device-independent half of vLLM's ``_assert_cutedsl_dcp_merge_supported``
    (CUDA, CuteDSL and ``k`` in {512, 1024, 2048} aside)."""
    import torch

    if logits.dtype != torch.float32 or topk_indices.dtype != torch.int32:
        raise RuntimeError("the DCP top-k merge takes fp32 logits, int32 indices")


@contextlib.contextmanager
def cutedsl_merge_stand_ins(
    on_select: Callable[[Any], None] | None = None,
) -> Any:
    """While the block runs: the merge's CuteDSL selector is
    ``stable_topk_stand_in`` and its input check ``check_merge_inputs``
    (both pinned, ``sparse_stand_in_symbols``); ``on_select`` sees every
    candidate tensor the selector is handed, as ``[rows, W * top-k, 2]``."""
    sai: Any = importlib.import_module(SPARSE_ATTN_INDEXER)
    cutedsl: Any = importlib.import_module(DSA_CUTEDSL)
    for symbol in sparse_stand_in_symbols()[:2]:
        verify_symbol(symbol)

    def selector(gathered: Any, topk: int, out: Any = None, **bits: int) -> Any:
        if on_select is not None:
            on_select(candidates_by_row(gathered, topk))
        return stable_topk_stand_in(gathered, topk, out, **bits)

    with (
        replaced(cutedsl, "stable_topk_from_gathered_candidates_cutedsl", selector),
        replaced(sai, "_assert_cutedsl_dcp_merge_supported", check_merge_inputs),
    ):
        yield


SPARSE_KERNEL_STORE = "acc.to(tl.bfloat16)"
"""The output store of vLLM's Triton sparse MLA kernel (rounds to bfloat16)."""
OUTPUT_DTYPE_STORE = "acc.to(out_ptr.dtype.element_ty)"


@functools.cache
def fp32_store_kernel_module() -> types.ModuleType:
    """vLLM's ``xpu_mla_sparse`` ops module regenerated from the installed
    source with one change, the output store keeping the output buffer's
    dtype (``SPARSE_KERNEL_STORE`` -> ``OUTPUT_DTYPE_STORE``). Written to a
    temporary directory (Triton reads kernel sources from a file), never into
    the repository; only a float32 run uses it."""
    import importlib.util
    import tempfile
    from pathlib import Path

    upstream = importlib.import_module(SPARSE_KERNEL_MODULE)
    source = inspect.getsource(upstream)
    if source.count(SPARSE_KERNEL_STORE) != 1:
        raise RuntimeError("vLLM's sparse MLA kernel store changed")
    path = Path(tempfile.mkdtemp(prefix="vllm_dcp_geometry_sparse_")) / (
        "fp32_store_mla_sparse.py"
    )
    path.write_text(source.replace(SPARSE_KERNEL_STORE, OUTPUT_DTYPE_STORE))
    spec = importlib.util.spec_from_file_location("fp32_store_mla_sparse", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sparse_attention(
    q: Any, kv_rows: Any, indices: Any, scale: float, *, fp32_store: bool = True
) -> tuple[Any, Any]:
    """vLLM's ``triton_bf16_mla_sparse_interface`` (``q [T, H, 576]``,
    ``kv_rows [N, 576]``, ``indices [T, topk]``; ``-1`` and ``>= N`` read
    nothing): output ``[T, H, 512]`` and natural-log LSE ``[T, H]``. With
    ``fp32_store`` the output is stored in ``q``'s dtype
    (``fp32_store_kernel_module``), else as shipped (bfloat16-rounded)."""
    if fp32_store:
        module = fp32_store_kernel_module()
    else:
        module = importlib.import_module(SPARSE_KERNEL_MODULE)
        verify_symbol(sparse_stand_in_symbols()[2])
    out, _, lse = module.triton_bf16_mla_sparse_interface(
        q.contiguous(),
        kv_rows.reshape(-1, 1, kv_rows.shape[-1]),
        indices.reshape(indices.shape[0], 1, -1).contiguous(),
        scale,
    )
    return out, lse


@functools.cache
def triton_sparse_impl_class(fp32_store: bool = True) -> type:
    """``TritonSparseMLAImpl``: vLLM's ``SparseMLACommonImpl`` with its kernel
    hook ``_forward_mqa_kernel`` (pinned) running the Triton sparse kernel
    (``sparse_attention``; ``fp32_store`` False: the kernel as shipped).
    Everything before the hook - the top-k filter to the rank's shard
    (``triton_filter_and_convert_dcp_index`` with the impl's own
    ``dcp_world_size`` / ``dcp_rank``) or, at world 1, the plain conversion -
    is upstream's ``forward_mqa``. Like FlashMLA's sparse impl it returns its
    LSE only where the impl is to (``need_to_return_lse_for_decode``) and
    takes no quantized query; the kernel's LSE is kept as ``kernel_lse``."""
    import torch
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl,
    )
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    verify_symbol(sparse_stand_in_symbols()[3])

    class TritonSparseMLAImpl(SparseMLACommonImpl):  # type: ignore[type-arg]
        can_return_lse_for_decode = True
        supports_dcp = True
        # Convert per layer at world 1 (a one-layer index group).
        group_conversion_decode_only = True
        kernel_lse: Any = None

        def _forward_mqa_kernel(
            self,
            q: Any,
            kv_cache: Any,
            topk_indices: Any,
            valid_counts: Any,
            *,
            layer: Any,
            block_size: int,
            is_decode: bool,
        ) -> tuple[Any, Any]:
            if isinstance(q, tuple):
                q = torch.cat(q, dim=-1)
            rows, _ = flat_kv_row_view(kv_cache, block_size)
            out, lse = sparse_attention(
                q, rows, topk_indices, self.scale, fp32_store=fp32_store
            )
            self.kernel_lse = lse
            return out, lse if self.need_to_return_lse_for_decode else None

    return TritonSparseMLAImpl


FLASHMLA_SPARSE = "vllm.v1.attention.backends.mla.flashmla_sparse"

FLASHMLA_SCHEDULER = UpstreamSymbol(
    FLASHMLA_SPARSE, "FlashMLASparseMetadataBuilder._build_fp8_mixed_decode_prefill"
)
"""Where FLASHMLA_SPARSE's builder asks FlashMLA for its fp8 kernel's
scheduling metadata (``get_mla_metadata``, a module global)."""


@contextlib.contextmanager
def flashmla_scheduler_stand_in() -> Any:
    """While the block runs: FLASHMLA_SPARSE's builder gets an empty
    ``FlashMLASchedMeta`` from ``get_mla_metadata``, as FlashMLA's own
    returns one (its fp8 kernel fills it on its first call); without the
    CUDA extension vLLM's binding raises instead. Only FlashMLA's fp8 kernel
    reads it, which a CPU does not run."""
    from vllm.v1.attention.ops import flashmla

    from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call

    module: Any = importlib.import_module(FLASHMLA_SPARSE)
    verify_symbol(FLASHMLA_SCHEDULER)
    require_global_call(
        module,
        "FlashMLASparseMetadataBuilder._build_fp8_mixed_decode_prefill",
        "get_mla_metadata",
    )

    def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[Any, None]:
        return flashmla.FlashMLASchedMeta(), None

    with replaced(module, "get_mla_metadata", get_mla_metadata):
        yield
