# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention sinks on vLLM's compiled FlashAttention path at K = D, a
partial K and K = 1 (rule A7).

The CPU numerics of ``tests/test_attention_sinks.py`` on one CUDA device: D
simulated ranks (``tests.support.sinks``; only the DCP collectives are
simulated) run ``FlashAttentionImpl.forward`` of a layer with sinks, at
gpt-oss's head size in bfloat16, with the real FlashAttention kernels
(FA3 on Hopper takes ``s_aux``; the DCP path gets the sinks from the
plugin's fold), vLLM's compiled ``cp_lse_ag_out_rs`` and
``merge_attn_states``, against a float64 single-device reference with
sinks. vLLM's own DCP path without the fold misses them.

Run it on a machine with a GPU, from the repository root:

    python tests/gpu/test_gpu_sinks.py
    pytest --noconftest tests/gpu/test_gpu_sinks.py

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
    gpu_marks,
    patched_vllm,  # noqa: F401
    run_outside_suite,
)

pytestmark = [*gpu_marks(), pytest.mark.patches("worker.flash_attn")]

# bfloat16 inputs and caches: the kernels' rounding, not the geometry.
TOLERANCE = 3e-2
CASES = [(4, 4), (4, 2), (4, 1), (8, 8), (8, 2)]


def _require_sinks() -> None:
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_sinks

    if not flash_attn_supports_sinks():
        pytest.skip("this device's FlashAttention has no sinks (FA3 or FA4 needed)")


@pytest.mark.parametrize(("dcp", "shard_count"), CASES)
@pytest.mark.parametrize("requests", ["mixed", "first"])
def test_compiled_flash_attention_keeps_the_sinks(
    monkeypatch: pytest.MonkeyPatch, dcp: int, shard_count: int, requests: str
) -> None:
    from tests.support.sinks import (
        FIRST_CHUNKS,
        GPU,
        MIXED,
        make_batch,
        max_error,
        run_ranks,
    )

    _require_sinks()
    base = MIXED if requests == "mixed" else FIRST_CHUNKS
    batch = make_batch(dcp, GPU.requests(base), dcp + shard_count, GPU)
    outputs = run_ranks(monkeypatch, dcp, shard_count, batch, 1, GPU)
    error = max_error(outputs, batch, GPU)
    assert error <= TOLERANCE, (dcp, shard_count, requests, error)


def test_without_the_fold_the_compiled_path_misses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from tests.support.sinks import GPU, MIXED, make_batch, max_error, run_ranks
    from vllm_dcp_geometry.runtime.patching import original_of

    _require_sinks()
    monkeypatch.setattr(
        FlashAttentionImpl,
        "_forward_with_dcp",
        original_of(FlashAttentionImpl._forward_with_dcp),
    )
    batch = make_batch(4, GPU.requests(MIXED), 3, GPU)
    outputs = run_ranks(monkeypatch, 4, 4, batch, 1, GPU)
    assert max_error(outputs, batch, GPU) > 10 * TOLERANCE
    assert max_error(outputs, batch, GPU, sinks=False) <= TOLERANCE


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
