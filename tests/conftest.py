# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Test-only set-up: run vLLM's real GPU-side code on CPU.

These settings must be in place before anything imports vLLM, which is why
they live here and never in library code.
"""

import os
from collections.abc import Iterator

# An empty (not unset) CUDA_VISIBLE_DEVICES keeps vLLM's Triton check on with
# no GPU; the interpreter then runs the real @triton.jit kernels on CPU tensors.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import pytest

from tests.subprocess_runner import run_python  # noqa: F401


@pytest.fixture
def v2_on_cpu() -> Iterator[None]:
    """Model Runner V2's block tables on CPU (no UVA, CPU device type)."""
    from tests import worker_harness

    undo = worker_harness.enable_v2_on_cpu()
    try:
        yield
    finally:
        undo()


def _disable_pinned_memory() -> None:
    import vllm.utils.torch_utils
    import vllm.v1.utils

    vllm.v1.utils.PIN_MEMORY = False  # type: ignore[attr-defined]
    vllm.utils.torch_utils.PIN_MEMORY = False  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    _disable_pinned_memory()
    import vllm_dcp_geometry

    # Tests in this process run patched vLLM; unpatched baselines run in a
    # subprocess (tests.subprocess_runner.run_python(..., patched=False)).
    vllm_dcp_geometry.register()
