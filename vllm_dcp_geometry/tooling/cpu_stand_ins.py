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
- DeepSeek-V3.2's sparse MLA: a checked stand-in for the DSA top-k merge's
  CuteDSL selector (``stable_topk_stand_in``, ``cutedsl_merge_stand_ins``)
  and, for FlashMLA's sparse kernels, vLLM's ``SparseMLACommonImpl`` with its
  kernel hook running vLLM's Triton sparse MLA kernel
  (``triton_sparse_impl_class``).
- ``install_cpu_stand_ins``: what a CPU worker of ``ranks`` calls once vLLM is
  imported: the ops above in ``vllm._custom_ops``, a device type and SM count
  for the unspecified platform, no pinned host memory, ``constexprs`` on
  Triton's interpreted functions, and the interpreter's ``tl.dot`` over
  bfloat16 values rather than their bits (``INTERPRETER_DOT``).

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

import contextlib
import functools
import importlib
import inspect
import sys
import types
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
    environment (before it imports vLLM): the Triton interpreter, an empty
    visible-devices list, and no background build of the humming kernel
    launcher (importing vLLM's MoE layers starts one, a CUDA compile that
    only takes CPU from the build here)."""
    return {
        INTERPRETER: "1",
        VISIBLE_DEVICES: "",
        "HUMMING_DISABLE_PARALLEL_BUILD": "1",
    }


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


# The Triton interpreter's bfloat16 dot ------------------------------------------

INTERPRETER_DOT = UpstreamSymbol(
    "triton.runtime.interpreter",
    "InterpreterBuilder.create_dot",
    "self, a, b, d, input_precision, max_num_imprecise_acc",
)
"""The interpreter's ``tl.dot``: it holds bfloat16 as raw uint16 bits and
(unlike fp8, which it widens) multiplies those bits as integers, so every
bfloat16 ``tl.dot`` (TRITON_MLA's decode) returns garbage of order 1e10."""


def _widen_bfloat16(handle: Any) -> Any:
    """A bfloat16 interpreter tensor as the float32 it exactly is (its bits
    are float32's upper half)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if handle.dtype.scalar != tl.bfloat16:
        return handle
    bits = handle.data.astype(np.uint32) << 16
    return TensorHandle(bits.view(np.float32), tl.float32)


def _dot_of_bfloat16_values(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_dot(self: Any, a: Any, b: Any, *args: Any) -> Any:
        return original(self, _widen_bfloat16(a), _widen_bfloat16(b), *args)

    create_dot.bfloat16_values = True  # type: ignore[attr-defined]
    return create_dot


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
    builder: Any = interpreter.InterpreterBuilder
    if not getattr(builder.create_dot, "bfloat16_values", False):
        verify_symbol(INTERPRETER_DOT)
        builder.create_dot = _dot_of_bfloat16_values(builder.create_dot)
    return [
        *(f"{CUSTOM_OPS}.{name}" for name in STAND_IN_OPS),
        f"{INTERPRETER_DOT.module}.{INTERPRETER_DOT.qualname} (bfloat16)",
    ]


@contextlib.contextmanager
def replaced(owner: Any, name: str, value: Any) -> Any:
    """``owner.name`` is ``value`` while the block runs (a stand-in or a
    run's own answer to one of vLLM's selectors), restored after."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


# Kimi-K3's fused CUDA epilogues ------------------------------------------------

# The unquantized-cache ops Kimi-K3's MLA layer calls through its wrappers in
# ``vllm.models.kimi_k3.nvidia.ops.fused_mla_key_concat_kv_cache`` (the
# ``fp8``/``fp8_ds_mla`` ones are not stood in for: a CPU run keeps the
# model's dtype in the cache).


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


# What a planning build (a meta-device model, no kernel run) lacks ---------------


class KernelNotHere(RuntimeError):
    """A planning build reached for something only a GPU machine has."""


def _kernel_not_here(*args: Any, **kwargs: Any) -> Any:
    raise KernelNotHere(
        "a planning build reads KV-cache specs and runs no attention kernel; "
        "this FlashAttention kernel exists only on a CUDA machine"
    )


FLASH_ATTENTION_PACKAGE = "vllm.vllm_flash_attn"
FLASH_ATTENTION_INTERFACE = f"{FLASH_ATTENTION_PACKAGE}.flash_attn_interface"


def _sm90_flash_attention_version(version: int, *args: Any) -> bool:
    # An H200 (SM90) runs FlashAttention 2 and 3; 4 is Blackwell's.
    return version in (2, 3)


SM90_FLASH_ATTENTION_PROBES = {"is_fa_version_supported": _sm90_flash_attention_version}
"""What vLLM's FlashAttention layers ask the kernel package while they are
built, answered as on an H200."""


class _KernelsNotHere(types.ModuleType):
    """A CUDA kernel package on a machine without it: every name is a
    function that raises when called, except the version probes an SM90
    machine answers (``SM90_FLASH_ATTENTION_PROBES``)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return SM90_FLASH_ATTENTION_PROBES.get(name, _kernel_not_here)


CAPABILITY_PROBES = {
    "cutlass_scaled_mm_supports_block_fp8": False,
    "cutlass_scaled_mm_supports_fp8": False,
}
"""The ops of vLLM's CUDA extension that vLLM calls while importing (to
choose weight kernels, never a KV-cache spec), and what a planning process
answers for them."""


def _answers(answer: Any) -> Callable[..., Any]:
    def probe(*args: Any, **kwargs: Any) -> Any:
        return answer

    return probe


BUILD_TIME_ANSWERS = {("_flashkda_C", "get_workspace_size"): 0}
"""Ops of vLLM's CUDA extensions that a layer calls while it is built, to
size a kernel workspace (never a KV-cache spec), and what a planning build
answers for them."""

CUDA_EXTENSIONS = ("vllm._flashkda_C", "vllm._flashmla_C", "vllm._flashmla_extension_C")
"""vLLM's CUDA extension modules (shipped in its wheel, built for SM90) that
a layer or backend imports while it is built, only to register its ops or to
see that the kernels exist; a planning process that cannot load one (no CUDA
driver) gets an empty module in its place."""


class _OpsNotHere:
    """An op namespace whose missing ops are functions that raise when
    called: what a layer binds while it is built (it calls none, except the
    workspace sizes of ``BUILD_TIME_ANSWERS``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name.startswith("__"):
                raise
            key = (object.__getattribute__(self, "name"), name)
            if key in BUILD_TIME_ANSWERS:
                return _answers(BUILD_TIME_ANSWERS[key])
            return _OpNotHere(name)


class _OpNotHere:
    """A missing op and its overloads (``.default``, ``.out``): bound freely
    (compile-pass modules name ops when imported), never run."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _kernel_not_here(self._name)


class _DeviceHandleNotHere:
    """A CUDA stream or event a layer makes when built and uses only when
    run: made freely, used never."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        raise KernelNotHere(f"a planning build has no CUDA stream or event ({name})")


CUDA_HANDLES = ("Stream", "Event")


def _device_zero() -> int:
    return 0


@contextlib.contextmanager
def ops_bound_not_run(
    namespaces: Sequence[str] = ("_C", "_moe_C", "_flashkda_C"),
) -> Any:
    """While a planning build constructs layers: the missing ops of vLLM's
    CUDA extension namespaces are functions that raise when called, and CUDA
    streams and events are handles that cannot be used. Only for the build:
    vLLM's import-time ``hasattr`` probes must see the truth."""
    import torch

    handles = {name: getattr(torch.cuda, name) for name in CUDA_HANDLES}
    for name in CUDA_HANDLES:
        setattr(torch.cuda, name, _DeviceHandleNotHere)
    # vLLM 0.34.0's FlashMLA sparse impl sizes itself by the current device's
    # SMs when built; a planning build is device 0 (the platform answers the
    # SMs), where asking torch would initialise CUDA.
    device_index = torch.accelerator.current_device_index
    torch.accelerator.current_device_index = _device_zero
    swapped = []
    for namespace in namespaces:
        ops = getattr(torch.ops, namespace)
        original = type(ops)
        ops.__class__ = type("OpsNotHere", (_OpsNotHere, original), {})
        swapped.append((ops, original))
    try:
        yield
    finally:
        for ops, original in swapped:
            ops.__class__ = original
        for name, handle in handles.items():
            setattr(torch.cuda, name, handle)
        torch.accelerator.current_device_index = device_index


def install_planning_stand_ins() -> list[str]:
    """In a planning process (CUDA's model code built on the meta device):
    vLLM's FlashAttention kernel package, which needs its CUDA extension to
    import, stood in for by one whose kernels raise when called, so that the
    FlashAttention backends (SM90's first choice) import and a layer can be
    built on them. Only a package that does not import is stood in for; the
    names stood in for, as reported."""
    import torch

    for name, answer in CAPABILITY_PROBES.items():
        if not hasattr(torch.ops._C, name):
            setattr(torch.ops._C, name, _answers(answer))
    stood_in = []
    for extension in CUDA_EXTENSIONS:
        try:
            importlib.import_module(extension)
        except ImportError:
            sys.modules[extension] = types.ModuleType(extension)
            stood_in.append(extension)
    try:
        importlib.import_module(FLASH_ATTENTION_PACKAGE)
    except ImportError:
        for name in (FLASH_ATTENTION_PACKAGE, FLASH_ATTENTION_INTERFACE):
            sys.modules[name] = _KernelsNotHere(name)
            stood_in.append(name)
    return stood_in
