# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``simulate`` holds its slot mappings to vLLM's own slot-mapping kernel.

On a machine with no GPU the command runs in a CPU process of its own, with
the tooling's CPU switches, so vLLM's Triton kernels run under the
interpreter there: shown from a process started without any switch, as an
operator starts it. In this process (the suite's switches are on) the same
cross-check runs in-process, and a twin one slot off is caught on every
slot-mapped group, on both model runners.

Cost: about 60 s on 2 cores (the fresh process imports vLLM twice).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.simulate import RUNNERS, SimulationOptions, hybrid, hybrid_mapping
from vllm_dcp_geometry.tooling import cpu_stand_ins
from vllm_dcp_geometry.tooling.cli.simulate import workers, workers_v2
from vllm_dcp_geometry.tooling.cli.simulate.run import run_simulation

pytestmark = pytest.mark.patches("worker.block_table", "worker.gpu_block_table")

REPO = Path(__file__).resolve().parents[1]


def test_this_process_runs_the_kernels_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The suite starts with the switches: no CPU process is needed; without
    them, on this machine with no GPU, one is."""
    assert cpu_stand_ins.interpreting_on_cpu()
    assert not cpu_stand_ins.kernels_need_a_cpu_process()
    monkeypatch.delenv(cpu_stand_ins.INTERPRETER)
    assert not cpu_stand_ins.interpreting_on_cpu()
    assert cpu_stand_ins.kernels_need_a_cpu_process()


def test_an_operators_simulate_cross_checks_against_vllms_kernel(
    tmp_path: Path,
) -> None:
    """``simulate`` started with no CPU switch in its environment: its report
    says vLLM's kernels ran under the interpreter and were compared on
    N > 0 steps, and it is clean."""
    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(4)))
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (cpu_stand_ins.INTERPRETER, cpu_stand_ins.VISIBLE_DEVICES)
    }
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    argv = ["simulate", "-t", str(topology), "--json", "--no-progress"]
    result = subprocess.run(
        [sys.executable, "-m", "vllm_dcp_geometry", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    slots = report["slot_mapping"]
    assert "Triton interpreter" in slots["real_kernels"], slots
    assert slots["cross_checked_steps"] > 0
    assert report["violations"]["kernel_mismatch"] == 0
    assert report["ok"]


def _one_slot_off(twin: Any) -> Any:
    def off(*args: Any, **kwargs: Any) -> Any:
        slots = twin(*args, **kwargs)
        return np.where(slots >= 0, slots + 1, slots)

    return off


def _replay(runner: str, as_on_a_gpu: bool) -> dict[str, Any]:
    return run_simulation(
        hybrid(4),
        SimulationOptions(
            runner=runner, workload="replay", progress=False, as_on_a_gpu=as_on_a_gpu
        ),
    )


@pytest.mark.parametrize("runner", RUNNERS)
def test_the_interpreter_checks_steps_one_two_four_and_on(runner: str) -> None:
    """Under the interpreter the command checks steps 1, 2, 4, 8, ... of its
    run (every replay step has work: floor(log2(S)) + 1 of S steps), and
    Model Runner V2's tables take the batch's rows on those steps only."""
    report = _replay(runner, as_on_a_gpu=False)
    assert report["ok"], report["violation_items"]
    steps = report["steps"]
    assert report["slot_mapping"]["cross_checked_steps"] == steps.bit_length()
    if runner == "v2":
        assert report["worker_tables"].endswith(
            "given the batch's rows on each cross-checked step"
        )


@pytest.mark.parametrize("as_on_a_gpu", [True, False], ids=["every_step", "sampled"])
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_twin_one_slot_off_is_caught_by_vllms_kernel(
    v2_on_cpu: None, monkeypatch: pytest.MonkeyPatch, runner: str, as_on_a_gpu: bool
) -> None:
    for module in (workers, workers_v2):
        monkeypatch.setattr(
            module, "twin_slot_mapping", _one_slot_off(module.twin_slot_mapping)
        )
    report = _replay(runner, as_on_a_gpu)
    assert not report["ok"]
    assert report["slot_mapping"]["cross_checked_steps"] > 0
    slot_mapped = [g for g in report["groups"] if g["slot_mapped"]]
    assert slot_mapped
    for group in slot_mapped:
        assert group["violations"]["kernel_mismatch"] > 0, group["name"]
