# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a CPU process lacks for vLLM's GPU-side MLA path, stood in for, in
this one module of the tooling.

- The CPU switches (see the project's CPU-testing notes): the Triton
  interpreter on, an empty (not unset) visible-devices list so that vLLM keeps
  its Triton path with no GPU, and no pinned host memory. The package never
  sets them in its own process, and ``tools/check_sources.py`` keeps their
  names out of every other library source (``CPU_WORKER_SWITCHES``).
  ``ranks`` puts ``child_environment`` in the environment of the worker
  processes it spawns on a machine with no visible GPU, and only there.
- torch stand-ins for the three ``vllm._C`` cache ops a CPU build lacks
  (``concat_and_cache_mla``: the KV-cache write; ``cp_gather_cache`` and
  ``gather_and_maybe_dequant_cache``: the context gathers), each checked
  against the contract's slot mapping by the suite (``test_mla_stand_ins``).
- ``install_cpu_stand_ins``: what a CPU worker of ``ranks`` calls once vLLM is
  imported: the ops above in ``vllm._custom_ops``, a device type and SM count
  for the unspecified platform, no pinned host memory, and ``constexprs`` on
  Triton's interpreted functions.

``install_cpu_stand_ins`` assigns rather than going through the patch
framework's ``wrap``: a stand-in replaces what is missing (there is no
original to call), it lasts for the rest of a worker process that exists
only for one measured run, and the framework's ledger is the plugin's record
of what its patches change, which these are not. The ops it replaces are
pinned to the parameters the stand-ins take (``STAND_IN_SYMBOLS``), so a vLLM
that changes them is refused before anything is replaced.

torch and vLLM are imported inside the functions only.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol

# The CPU switches ---------------------------------------------------------------

INTERPRETER = "TRITON_INTERPRET"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PINNED_MEMORY = "PIN_MEMORY"
HOST_BUFFER_MODULES = ("vllm.v1.utils", "vllm.utils.torch_utils")
"""The vLLM modules whose pinned-memory flag vLLM's host buffers (block
tables, input batches, CPU-GPU buffers) read."""
MLA_ATTENTION_MODULE = "vllm.model_executor.layers.attention.mla_attention"
PINNED_MEMORY_MODULES = (*HOST_BUFFER_MODULES, MLA_ATTENTION_MODULE)
"""The vLLM modules whose pinned-memory flag the MLA path reads."""


def child_environment() -> dict[str, str]:
    """What a worker process on a machine with no visible GPU gets in its
    environment (before it imports vLLM): the Triton interpreter, and an
    empty visible-devices list."""
    return {INTERPRETER: "1", VISIBLE_DEVICES: ""}


def disable_pinned_memory(
    modules: Sequence[str] = PINNED_MEMORY_MODULES,
) -> Callable[[], None]:
    """In a CPU process (a ``ranks`` worker, the test suite, a benchmark's CPU
    run): the host buffers of ``modules`` not pinned (no driver to pin them).
    The one place the flag is switched off; returns what switches it back,
    for a caller that needs it off only for a while."""
    owners = [importlib.import_module(name) for name in modules]
    before = [getattr(owner, PINNED_MEMORY) for owner in owners]
    for owner in owners:
        setattr(owner, PINNED_MEMORY, False)

    def restore() -> None:
        for owner, value in zip(owners, before, strict=True):
            setattr(owner, PINNED_MEMORY, value)

    return restore


# Stand-ins for the vllm._C cache ops -------------------------------------------


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


# The swaps of a CPU worker -----------------------------------------------------


def _constexpr_indices(self: Any) -> list[int]:
    """The indices of a Triton function's ``tl.constexpr`` parameters, what
    vLLM's kernel launcher reads as ``kernel.constexprs`` (the interpreter's
    function object has no such attribute)."""
    parameters = inspect.signature(self.fn).parameters.values()
    return [i for i, p in enumerate(parameters) if "constexpr" in str(p.annotation)]


def install_cpu_stand_ins() -> list[str]:
    """Stand in, for the rest of this process, for what it lacks for vLLM's
    MLA path (the module's list); the stand-in op names, as reported."""
    import vllm._custom_ops as ops
    from triton.runtime import interpreter
    from vllm.platforms import current_platform

    for symbol in STAND_IN_SYMBOLS:
        stand_in = globals()[symbol.qualname]
        if getattr(ops, symbol.qualname) is not stand_in:
            verify_symbol(symbol, ops)
    for name in STAND_IN_OPS:
        setattr(ops, name, globals()[name])
    current_platform.device_type = "cpu"
    current_platform.num_compute_units = lambda *_: 4  # type: ignore[method-assign]
    disable_pinned_memory()
    function: Any = interpreter.InterpretedFunction
    if not hasattr(function, "constexprs"):
        function.constexprs = property(_constexpr_indices)
    return [f"{CUSTOM_OPS}.{name}" for name in STAND_IN_OPS]
