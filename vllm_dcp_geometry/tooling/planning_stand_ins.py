# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a planning build lacks, stood in for: vLLM's model code built on the
meta device (``plan --model``, ``serve``) to read its KV-cache specs, on a
machine that may have no GPU.

On a GPU machine the layers bind vLLM's real CUDA extensions and kernel
packages; a planning build binds them too but runs no kernel. Here:

- ``install_planning_stand_ins``: vLLM's FlashAttention kernel package, which
  needs its CUDA extension to import, stood in for by one whose kernels raise
  when called (its version probes answered as on an H200), and an empty
  module for each CUDA extension that does not load;
- ``ops_bound_not_run``: while a build constructs layers, the missing ops of
  vLLM's CUDA extension namespaces are functions that raise when called, and
  CUDA streams and events handles that cannot be used.

A kernel reached anyway raises ``KernelNotHere``. torch and vLLM are
imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

from vllm_dcp_geometry.tooling.cpu_stand_ins import KernelNotHere


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
