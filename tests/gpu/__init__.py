# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Checks of vLLM's compiled kernels on a CUDA device, run outside the suite
(``tests/conftest.py`` hides every GPU): what the scripts share."""

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


def run_outside_suite(path: str) -> int:
    """``python tests/gpu/<script>.py [pytest args]``: pytest on the script
    without the suite's conftest (which hides the GPU)."""
    os.environ.pop("TRITON_INTERPRET", None)
    return int(
        pytest.main(
            [path, "--noconftest", "-p", "no:cacheprovider", "-v", "-rs", *sys.argv[1:]]
        )
    )
