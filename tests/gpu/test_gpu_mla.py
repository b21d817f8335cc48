# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""MLA groups with K = 1, a partial K and K = D on vLLM's compiled MLA backends.

The CPU numerics of ``tests/test_mla_numerics.py`` on one CUDA device: D
simulated ranks (``tests.support.mla``; only the DCP collectives are
simulated, the ``vllm._C`` cache ops and every kernel are the real ones) run
``MLAAttention.forward_impl`` with FLASHMLA, FLASH_ATTN_MLA, FLASHINFER_MLA,
CUTLASS_MLA and TRITON_MLA and their own prefill backend, against a float64
single-device reference, in bfloat16 at DeepSeek-V3's latent sizes. A
backend the device cannot run (FLASHINFER_MLA and CUTLASS_MLA need SM100,
FLASH_ATTN_MLA FA3) is skipped by name.

Run it on a machine with a GPU, from the repository root:

    python tests/gpu/test_gpu_mla.py
    pytest --noconftest tests/gpu/test_gpu_mla.py

``tests/conftest.py`` hides every GPU and turns the Triton interpreter on, so
under a plain ``pytest tests`` these tests are skipped.
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
    pytest.mark.patches("worker.mla_attention", "worker.utils"),
]

BACKENDS = ("FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA")
# (D, K, I): replicated, partial, sharded at D = 4 (I = 1: FLASHINFER_MLA
# refuses any other interleave under DCP), and a partial K with I = B.
CASES = [(4, 1, 1), (4, 2, 1), (4, 4, 1), (8, 2, "B")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dcp", "k", "interleave"), CASES)
def test_compiled_mla_backend_follows_the_group(
    backend: str, dcp: int, k: int, interleave: int | str
) -> None:
    from tests.support.mla_forward import run_case

    require_backend(backend)
    shape = mla_shape(backend)
    i = shape.block_size if interleave == "B" else int(interleave)
    if backend == "FLASHINFER_MLA" and i != 1:
        pytest.skip("FLASHINFER_MLA refuses an interleave other than 1 under DCP")
    report = run_case(dcp, k, i, patched=True, shape=shape, backend_name=backend)
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= MLA_TOLERANCE, (backend, dcp, k, i, key, report)


def test_plan_defaults_are_vllms_first_choice_on_sm90() -> None:
    from vllm.platforms.cuda import _get_backend_priorities
    from vllm.platforms.interface import DeviceCapability

    from vllm_dcp_geometry.tooling.cli.plan.attention import DEFAULT_ATTENTION_BACKENDS

    hopper = DeviceCapability(9, 0)
    assert DEFAULT_ATTENTION_BACKENDS["mla"] == (
        _get_backend_priorities(True, hopper)[0].name
    )
    assert DEFAULT_ATTENTION_BACKENDS["full_attention"] == (
        _get_backend_priorities(False, hopper)[0].name
    )


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
