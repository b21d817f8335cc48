# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The tooling's CPU processes: their switches and what they install, in
this one module of the tooling (``tools/check_sources.py``'s
``CPU_WORKER_SWITCHES``), and the helpers every stand-in module shares.

- The CPU switches (see the project's CPU-testing notes): the Triton
  interpreter on, an empty (not unset) visible-devices list so that vLLM keeps
  its Triton path with no GPU, and no pinned host memory. The package never
  sets them in its own process, and ``tools/check_sources.py`` keeps their
  names out of every other library source. On a machine with no visible GPU,
  ``child_environment`` goes into the environment of the processes the
  tooling starts for vLLM's kernels, and only there: ``ranks``' workers,
  ``simulate``'s CPU process (``kernels_need_a_cpu_process``), which builds
  vLLM's block tables on CPU tensors (``block_tables_on_cpu``), and the
  planning process of a model directory.
- ``install_cpu_stand_ins``: what a CPU worker of ``ranks`` calls once vLLM is
  imported: ``custom_op_stand_ins``' ops in ``vllm._custom_ops``, a device
  type and SM count for the unspecified platform, no pinned host memory,
  ``constexprs`` on Triton's interpreted functions, and the interpreter's
  ``tl.dot`` over bfloat16 values rather than their bits
  (``INTERPRETER_DOT``). On a GPU none of this runs: vLLM's compiled kernels
  and Triton's compiler do.

What else a CPU lacks is stood in for by what it stands in for, each module
naming what the GPU runs instead: ``custom_op_stand_ins`` (vLLM's ``_C``
cache ops), ``kimi_k3_stand_ins`` (Kimi-K3's fused epilogues),
``sparse_stand_ins`` (DeepSeek-V3.2's CuteDSL selector and FlashMLA's sparse
kernels), ``flash_attn_stand_ins`` (FlashAttention's kernel, KV write and
version detection) and ``planning_stand_ins`` (what a meta-device planning
build binds but never runs).

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
import importlib.util
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.tooling import custom_op_stand_ins
from vllm_dcp_geometry.tooling.custom_op_stand_ins import (
    CUSTOM_OPS,
    STAND_IN_OPS,
    STAND_IN_SYMBOLS,
)

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


# vLLM's slot-mapping kernels in a CPU process ---------------------------------

BUFFER_UTILS_MODULE = "vllm.v1.worker.gpu.buffer_utils"
"""Where Model Runner V2's host buffers ask for UVA and pinned memory."""


def interpreting_on_cpu() -> bool:
    """Whether this process started with the CPU switches
    (``child_environment``'s interpreter and empty visible-devices list): a
    ``ranks`` worker, ``simulate``'s CPU process, the test suite."""
    return os.environ.get(INTERPRETER) == "1" and os.environ.get(VISIBLE_DEVICES) == ""


def kernels_need_a_cpu_process() -> bool:
    """Whether vLLM's Triton kernels run only in another process here: no GPU
    is visible, Triton is installed, and this process started without the
    CPU switches (Triton reads them once, when vLLM's kernels are defined)."""
    if interpreting_on_cpu() or importlib.util.find_spec("triton") is None:
        return False
    import torch

    return not torch.cuda.is_available()


def enable_block_tables_on_cpu() -> Callable[[], None]:
    """Let both model runners' block tables build and copy on CPU tensors
    (their host buffers ask for UVA and pinned memory, which need a driver;
    V2's also for the platform's device type, "" on an unspecified
    platform); returns the undo."""
    buffer_utils: Any = importlib.import_module(BUFFER_UTILS_MODULE)
    pin_back = disable_pinned_memory(HOST_BUFFER_MODULES)
    from vllm.platforms import current_platform

    saved_uva = buffer_utils.is_uva_available
    # vLLM 0.34.0's non-UVA buffers also pin their host side where the
    # platform says it can (0.33.0's never do).
    saved_pin = getattr(buffer_utils, "is_pin_memory_available", None)
    had_own = "device_type" in vars(current_platform)
    saved_type = current_platform.device_type
    buffer_utils.is_uva_available = lambda: False
    if saved_pin is not None:
        buffer_utils.is_pin_memory_available = lambda: False
    current_platform.device_type = "cpu"

    def undo() -> None:
        pin_back()
        buffer_utils.is_uva_available = saved_uva
        if saved_pin is not None:
            buffer_utils.is_pin_memory_available = saved_pin
        if had_own:
            current_platform.device_type = saved_type
        else:
            del current_platform.device_type

    return undo


@contextlib.contextmanager
def block_tables_on_cpu() -> Any:
    """``enable_block_tables_on_cpu`` while the block runs, in a process with
    the CPU switches; elsewhere (a GPU, or no interpreter) nothing."""
    if not interpreting_on_cpu():
        yield
        return
    undo = enable_block_tables_on_cpu()
    try:
        yield
    finally:
        undo()


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
        stand_in = getattr(custom_op_stand_ins, symbol.qualname)
        if getattr(ops, symbol.qualname) is not stand_in:
            verify_symbol(symbol, ops)
    for name in STAND_IN_OPS:
        setattr(ops, name, getattr(custom_op_stand_ins, name))
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


class KernelNotHere(RuntimeError):
    """A stand-in reached for what only a GPU machine has: a kernel a
    planning build binds but never runs (``planning_stand_ins``), or a case a
    CPU stand-in does not cover."""
