# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The CPU switches of ``ranks``' worker processes, in this one place.

vLLM's GPU-side MLA path runs on a CPU only with three switches (see the
project's CPU-testing notes): the Triton interpreter on, an empty (not unset)
visible-devices list so that vLLM keeps its Triton path with no GPU, and no
pinned host memory. The package never sets them in its own process, and
``tools/check_sources.py`` keeps their names out of every other library
source. ``ranks`` needs them in the worker processes it spawns on a machine
with no visible GPU, and only there: ``child_environment`` is what it adds to
such a child's environment, and ``disable_pinned_memory`` is what the child
calls once vLLM is imported.
"""

from __future__ import annotations

import importlib

INTERPRETER = "TRITON_INTERPRET"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
PINNED_MEMORY = "PIN_MEMORY"
PINNED_MEMORY_MODULES = (
    "vllm.v1.utils",
    "vllm.utils.torch_utils",
    "vllm.model_executor.layers.attention.mla_attention",
)
"""The vLLM modules whose pinned-memory flag the MLA path reads."""


def child_environment() -> dict[str, str]:
    """What a worker process on a machine with no visible GPU gets in its
    environment (before it imports vLLM): the Triton interpreter, and an
    empty visible-devices list."""
    return {INTERPRETER: "1", VISIBLE_DEVICES: ""}


def disable_pinned_memory() -> None:
    """In a CPU worker, after vLLM is imported: host buffers not pinned (no
    driver to pin them)."""
    for name in PINNED_MEMORY_MODULES:
        setattr(importlib.import_module(name), PINNED_MEMORY, False)
