# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Kimi-K3's MLA layer with K = 1, a partial K and K = D on vLLM's compiled
MLA backends and its real fused CUDA epilogues.

The CPU numerics of ``tests/test_kimi_k3_layer.py`` on one CUDA device: D
simulated ranks (``tests.support.kimi_k3``; only the DCP collectives are
simulated) run the layer's own ``_attention`` with FLASH_ATTN_MLA and
FLASHINFER_MLA (the DSpark draft's backend under DCP) and their own prefill
backend, against a float64 single-device reference, in bfloat16 at
Kimi-K3's latent sizes. A backend the device cannot run is skipped by name.

Run it on a machine with a GPU, from the repository root:

    python tests/gpu/test_gpu_kimi_k3.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.support.gpu import (  # noqa: E402
    MLA_TOLERANCE,
    gpu_marks,
    mla_shape,
    patched_vllm,  # noqa: F401
    require_backend,
    run_outside_suite,
)

pytestmark = [
    *gpu_marks(),
    pytest.mark.patches("worker.kimi_k3_mla", "worker.mla_attention", "worker.utils"),
]

BACKENDS = ("FLASH_ATTN_MLA", "FLASHINFER_MLA")
CASES = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (8, 2, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dcp", "k", "interleave"), CASES)
def test_kimi_k3_layer_on_compiled_backends(
    backend: str, dcp: int, k: int, interleave: int
) -> None:
    from tests.support.kimi_k3 import run_kimi_case

    require_backend(backend)
    report = run_kimi_case(
        dcp, k, interleave, patched=True, shape=mla_shape(backend), backend_name=backend
    )
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= MLA_TOLERANCE, (backend, dcp, k, key, report)
    assert report["layer_dcp_world_sizes"] == [1 if k == 1 else dcp] * dcp


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
