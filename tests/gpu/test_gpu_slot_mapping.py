# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The slot-mapping checks with compiled Triton kernels on a real GPU.

Same cases as ``tests/test_worker_slot_mapping.py`` (``tests.support.slot_mapping``:
every rank of every K | D, the mixed D = 16 topology, unpatched vLLM failing,
D = 1 byte-identical), but with CUDA tensors and no interpreter.

Run it on a machine with a GPU, from the repository root, either way:

    python tests/gpu/test_gpu_slot_mapping.py
    pytest --noconftest tests/gpu/test_gpu_slot_mapping.py

``tests/conftest.py`` hides every GPU and turns the Triton interpreter on, so
under a plain ``pytest tests`` these tests are skipped; ``--noconftest`` (which
the first form passes) keeps that set-up out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.support.gpu import gpu_marks, run_outside_suite  # noqa: E402

pytestmark = [
    *gpu_marks(),
    pytest.mark.patches(
        "worker.block_table", "worker.gpu_model_runner", "worker.gpu_block_table"
    ),
]

DEVICE = "cuda"


def _has_model_runner_v1() -> bool:
    from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1

    return has_model_runner_v1()


# Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it). The skipif
# repeats the marker because ``--noconftest`` runs skip conftest's hook.
MODEL_RUNNER_V1 = [
    pytest.mark.vllm_releases("0.33.0"),
    pytest.mark.skipif(
        not _has_model_runner_v1(), reason="Model Runner V1: vLLM 0.33.0 only"
    ),
]


def model_runner_v1(test: Any) -> Any:
    for mark in MODEL_RUNNER_V1:
        test = mark(test)
    return test


UNPATCHED_CODE = """
import json, sys
sys.path.insert(0, ROOT)
from tests.support.unpatched_slots import dcp1_outputs, unpatched_mixed
data = json.loads(DATA)
print(json.dumps({
    "mixed": unpatched_mixed(data, "cuda"),
    "dcp1": dcp1_outputs(patched=False, device="cuda"),
}))
"""


@pytest.fixture(scope="module")
def sm() -> Any:
    """The slot-mapping cases the CPU tests run, in a patched process."""
    import vllm_dcp_geometry

    vllm_dcp_geometry.register()
    from tests.support import slot_mapping

    return slot_mapping


@pytest.fixture(scope="module")
def unpatched(sm: Any) -> dict[str, Any]:
    """Both unpatched baselines from a fresh process that never registers."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["VLLM_PLUGINS"] = ""  # the entry point must not load the plugin
    env["VLLM_LOGGING_LEVEL"] = "ERROR"
    source = (
        f"ROOT = {str(ROOT)!r}\n"
        f"DATA = {json.dumps(json.dumps(sm.unpatched_mixed_data()))}\n" + UNPATCHED_CODE
    )
    result = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@model_runner_v1
def test_gpu_v1_every_rank_matches_reference(sm: Any) -> None:
    for dcp, interleave in sm.SWEEP:
        slots, scenario = sm.v1_sweep(dcp, interleave, DEVICE)
        sm.check_sweep(slots, scenario, dcp, interleave, "GPU V1")


def test_gpu_v2_every_rank_matches_reference(sm: Any) -> None:
    for dcp, interleave in sm.SWEEP:
        slots, scenario = sm.v2_sweep(dcp, interleave, DEVICE)
        sm.check_sweep(slots, scenario, dcp, interleave, "GPU V2")


@model_runner_v1
def test_gpu_mixed_topology_v1_every_rank(sm: Any) -> None:
    scenario = sm.mixed_scenario()
    sm.check_mixed(sm.mixed_v1_slots(scenario, DEVICE), scenario, 3, "GPU V1 mixed")


def test_gpu_mixed_topology_v2_every_rank(sm: Any) -> None:
    scenario = sm.mixed_scenario()
    sm.check_mixed(sm.mixed_v2_slots(scenario, DEVICE), scenario, 4, "GPU V2 mixed")


@model_runner_v1
def test_gpu_unpatched_vllm_fails_the_same_checks(
    sm: Any, unpatched: dict[str, Any]
) -> None:
    sm.check_unpatched_mixed_fails(unpatched["mixed"])


@model_runner_v1
def test_gpu_dcp1_is_byte_identical_to_unpatched(
    sm: Any, unpatched: dict[str, Any]
) -> None:
    patched = sm.dcp1_outputs(patched=True, device=DEVICE)
    baseline = unpatched["dcp1"]
    assert patched.pop("v1_layout") == baseline["v1_runner"]
    assert patched == baseline


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
