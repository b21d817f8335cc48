# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the GPU scripts in ``tests/gpu`` share (they check vLLM's compiled
kernels on a CUDA device, outside the suite, whose ``tests/conftest.py`` hides
every GPU): ``gpu_marks`` (a GPU test's ``pytestmark``), ``run_outside_suite``
(pytest on a script without the suite's conftest), the module fixture
``patched_vllm`` (registers the plugin), and for the MLA scripts
``MLA_TOLERANCE``, ``mla_shape`` (the harness's sizes on a CUDA device) and
``require_backend`` (skip a backend this device cannot run).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest


def gpu_marks() -> list[Any]:
    """A GPU test's ``pytestmark``: skipped without a CUDA device, or under
    the Triton interpreter (these check the compiled kernels)."""
    import torch

    return [
        pytest.mark.gpu,
        pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA device (see docstring)"
        ),
        pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") == "1",
            reason="checks the compiled kernels; unset TRITON_INTERPRET",
        ),
    ]


@pytest.fixture(scope="module", autouse=True)
def patched_vllm() -> None:
    """Register the plugin in this (otherwise unpatched) process: the GPU
    scripts run without the suite's conftest. Autouse wherever imported."""
    import vllm_dcp_geometry

    vllm_dcp_geometry.register()


def run_outside_suite(path: str) -> int:
    """``python tests/gpu/<script>.py [pytest args]``: pytest on the script
    without the suite's conftest (which hides the GPU)."""
    os.environ.pop("TRITON_INTERPRET", None)
    return int(
        pytest.main(
            [path, "--noconftest", "-p", "no:cacheprovider", "-v", "-rs", *sys.argv[1:]]
        )
    )


MLA_TOLERANCE = 3e-2
"""bfloat16 inputs and caches: the kernels' rounding, not the geometry."""

_MLA_BLOCK_SIZES = {"CUTLASS_MLA": 128}


def mla_shape(backend: str) -> Any:
    """The MLA harness's sizes on a CUDA device for ``backend``: DeepSeek-V3's
    latent sizes (Kimi-K3's too) in bfloat16, the CPU batch scaled by 8."""
    import torch

    from tests.support.mla import CPU, Shape

    return Shape(
        block_size=_MLA_BLOCK_SIZES.get(backend, 64),
        heads_per_rank=16,
        kv_lora_rank=512,
        rope_dim=64,
        nope_dim=128,
        v_head_dim=128,
        max_model_len=512,
        num_blocks=128,
        requests=tuple((8 * c, n) for c, n in CPU.requests),
        device="cuda",
        dtype=torch.bfloat16,
    )


def require_backend(backend: str) -> None:
    """Skip, naming it, a backend this device cannot import or run."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        backend_cls = AttentionBackendEnum[backend].get_class()
    except Exception as exc:
        pytest.skip(f"{backend} does not import here: {exc}")
    capability = current_platform.get_device_capability()
    if not backend_cls.supports_compute_capability(capability):
        pytest.skip(f"{backend} does not run on compute capability {capability}")
