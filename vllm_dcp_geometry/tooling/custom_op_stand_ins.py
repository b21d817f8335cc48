# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""torch stand-ins for the three ``vllm._C`` cache ops a CPU build lacks.

On a GPU vLLM runs its own CUDA kernels for them; on a CPU a ``ranks``
worker (``cpu_stand_ins.install_cpu_stand_ins``) and the suite's simulated
ranks run these instead:

- ``concat_and_cache_mla``: the KV-cache write, each position's latent row at
  the slot the slot mapping names;
- ``cp_gather_cache`` and ``gather_and_maybe_dequant_cache``: the context
  gathers of the chunked prefill.

Each is checked against the contract's slot mapping by the suite
(``test_mla_stand_ins``) and pinned to the parameters it was written against
(``STAND_IN_SYMBOLS``). torch is imported inside the functions only.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, *a):
    """``vllm._C`` KV write: row ``slot`` of the flattened paged cache gets
    ``[kv_c, k_pe]``; ``PAD_SLOT_ID`` (< 0) writes nothing."""
    import torch

    assert kv_cache_dtype == "auto"
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    mine = slot_mapping >= 0
    rows = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
    flat[slot_mapping[mine].long()] = rows[mine].to(flat.dtype)


def _gather_rows(src_cache, block_row, start: int, count: int) -> Any:
    import torch

    tokens = torch.arange(start, start + count)
    blocks = block_row[tokens // src_cache.shape[1]].long()
    return src_cache[blocks, tokens % src_cache.shape[1]]


def cp_gather_cache(
    src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None
):
    """``vllm._C`` gather: ``dst[cu[b] + i] = cache[token starts[b] + i of
    request b]``, tokens numbered in the rank's own (local) order."""
    for b in range(batch_size):
        lo, hi = int(cu_seq_lens[b]), int(cu_seq_lens[b + 1])
        start = 0 if seq_starts is None else int(seq_starts[b])
        dst[lo:hi] = _gather_rows(src_cache, block_table[b], start, hi - lo)


def gather_and_maybe_dequant_cache(
    src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
    kv_cache_dtype, scale, seq_starts=None,
):  # fmt: skip
    """``vllm._C`` gather of the DCP1 context path; its kernel takes chunk
    starts in whole blocks, so an unaligned start is an error here too."""
    assert kv_cache_dtype == "auto"
    for b in range(cu_seq_lens.shape[0] - 1):
        lo, hi = int(cu_seq_lens[b]), min(int(cu_seq_lens[b + 1]), num_tokens)
        start = 0 if seq_starts is None else int(seq_starts[b])
        assert start % src_cache.shape[1] == 0, "unaligned chunk start"
        if hi > lo:
            dst[lo:hi] = _gather_rows(src_cache, block_table[b], start, hi - lo)


STAND_IN_OPS = (
    "concat_and_cache_mla",
    "cp_gather_cache",
    "gather_and_maybe_dequant_cache",
)
"""The ``vllm._custom_ops`` functions the stand-ins above replace on CPU."""

CUSTOM_OPS = "vllm._custom_ops"

STAND_IN_SYMBOLS = (
    UpstreamSymbol(
        CUSTOM_OPS,
        "concat_and_cache_mla",
        "kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, skip_scale=",
    ),
    UpstreamSymbol(
        CUSTOM_OPS,
        "cp_gather_cache",
        "src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=",
    ),
    UpstreamSymbol(
        CUSTOM_OPS,
        "gather_and_maybe_dequant_cache",
        "src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens, "
        "kv_cache_dtype, scale, seq_starts=",
    ),
)
"""The ops of ``STAND_IN_OPS`` with the parameters their stand-ins were
written against."""
