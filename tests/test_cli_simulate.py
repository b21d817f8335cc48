# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry simulate``: vLLM's real scheduler feeding all D ranks.

Small hybrid topologies (a sharded, a partially sharded, a recurrent and a
replicated group; ``tests.support.simulate``) on both model runners and
both workloads. In this process vLLM's Triton kernels run under the
interpreter, so every simulation also cross-checks its vectorized slot
mappings against them on sampled steps, and Model Runner V2 runs its real
``BlockTables`` (the ``v2_on_cpu`` fixture). Unpatched runs are fresh
processes (``--baseline``).

Cost: about 60 s on 2 cores (each simulation 1-8 s, each baseline ~15 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.simulate import (
    MODEL_RUNNER_V1,
    RUNNERS,
    SimulationOptions,
    group_index,
    hybrid,
    hybrid_mapping,
)
from vllm_dcp_geometry.tooling.cli import main
from vllm_dcp_geometry.tooling.cli.simulate.checks import KINDS
from vllm_dcp_geometry.tooling.cli.simulate.run import run_simulation

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "worker.block_table",
        "worker.gpu_block_table",
        "engine_core.kv_cache_utils",
        "engine_core.single_type_kv_cache_manager",
        "engine_core.kv_cache_coordinator",
    ),
]

JSON_KEYS = (
    "runner",
    "ranks",
    "steps",
    "scheduled_tokens",
    "slot_writes_checked",
    "violations",
    "preemptions",
    "prefix_hit_tokens",
    "draft_tokens",
    "events",
    "missing_events",
)
MIXED = {"requests": 32, "step_tokens": 1024}
"""The default pool, which the wave's prompts fill (at most 1,024 tokens per
step keeps them at 511 tokens): vLLM admits a request only when its whole
prompt fits, so the wave's first decode step into a new block preempts."""


LIGHT = {"requests": 12, "step_tokens": 1024}
"""A lighter mixed workload for the in-process runs, whose sampled steps
also run vLLM's kernels under the interpreter; it still preempts, hits the
prefix cache and accepts drafts at every D."""


def _simulate(dcp: int, runner: str, workload: str, **options) -> dict:
    extra = LIGHT if workload == "mixed" else {}
    return run_simulation(
        hybrid(dcp),
        SimulationOptions(
            runner=runner, workload=workload, progress=False, **extra, **options
        ),
    )


def _clean(report: dict) -> None:
    assert report["violations"] == dict.fromkeys(KINDS, 0), report["violation_items"]
    assert report["ok"]
    assert report["finished_requests"] == report["requests"]
    assert report["slot_mapping"]["cross_checked_steps"] > 0
    assert report["slot_writes_checked"] > 0


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("workload", ["replay", "mixed"])
def test_patched_simulation_is_clean_at_dcp4(v2_on_cpu, runner, workload):
    report = _simulate(4, runner, workload)
    _clean(report)
    assert report["ranks"] == 4
    if runner == "v2":
        assert report["worker_tables"] == "vLLM BlockTables per rank"
    if workload == "replay":
        # The prompt plus its one generated token fill the replay's tokens.
        assert report["scheduled_tokens"] == 2048 - 1
    else:
        assert report["preemptions"] > 0
        assert report["prefix_hit_tokens"] > 0
        assert report["draft_tokens"] > 0
        assert 0 < report["accepted_draft_tokens"] < report["draft_tokens"]


@pytest.mark.parametrize(
    ("dcp", "runner"),
    [
        pytest.param(2, "v1", marks=MODEL_RUNNER_V1),
        (2, "v2"),
        pytest.param(1, "v1", marks=MODEL_RUNNER_V1),
        # D = 1 on the one runner a release without V1 has.
        pytest.param(1, "v2", marks=pytest.mark.vllm_releases("0.34.0")),
    ],
)
def test_patched_mixed_simulation_is_clean_at_dcp1_and_2(v2_on_cpu, dcp, runner):
    report = _simulate(dcp, runner, "mixed")
    _clean(report)
    assert report["ranks"] == dcp


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_shifted_shard_is_caught(v2_on_cpu, runner):
    topology = hybrid(4)
    broken = group_index(topology, "attn.k2")
    report = run_simulation(
        topology,
        SimulationOptions(
            runner=runner, workload="replay", progress=False, shift_shard=(broken, 3)
        ),
    )
    assert not report["ok"]
    by_group = {g["name"]: g["violations"] for g in report["groups"]}
    # Rank 3 now writes shard 0 of replica 1 (ranks 2-3), so in replica 1 the
    # 1,024 even positions of 0..2046 are written twice and the 1,023 odd ones
    # by nobody; no other group is touched.
    assert by_group["attn.k2"]["written_twice"] == 1024
    assert by_group["attn.k2"]["unwritten"] == 1023
    assert {g for g, v in by_group.items() if v} == {"attn.k2"}
    assert report["first_violation"]["step"] == 1
    if runner == "v2":
        # V2's real tables were not shifted: the kernel cross-check disagrees.
        assert by_group["attn.k2"]["kernel_mismatch"] > 0


@MODEL_RUNNER_V1
def test_cli_json_receipt_and_unpatched_baseline_on_model_runner_v1(
    capsys, tmp_path: Path
):
    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(4)))
    receipt = tmp_path / "receipt.json"
    argv = ["simulate", "-t", str(topology), "--runner", "v1", "--json"]
    argv += ["--no-progress", "--baseline", "--receipt", str(receipt)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    for key in JSON_KEYS:
        assert key in report
    assert report["runner"] == "v1" and report["ok"]
    assert set(report["violations"]) == set(KINDS)
    # Unpatched Model Runner V1 gives the replicated draft group a sharded slot
    # mapping (and the K = 2 group the D = 4 one) from the very first step.
    baseline = report["baseline"]
    assert baseline["mode"] == "unpatched" and not baseline["ok"]
    first = report["comparison"]["first_break"]
    assert (first["step"], first["position"], first["kind"]) == (1, 0, "unwritten")
    by_group = {g["name"]: g["violations"] for g in baseline["groups"]}
    assert by_group["draft"]["unwritten"] == 3 * (2048 - 1)
    assert by_group["attn.k2"]["unwritten"] > 0
    # Its attention builder's local lengths (D shards) do not add up per
    # replica of the K = 2 geometry either.
    assert by_group["attn.k2"]["local_lengths"] > 0
    assert not by_group["attn.kD"] and not by_group["state"]
    written = json.loads(receipt.read_text())
    assert written["receipt"] == "vllm-dcp-geometry simulate"
    assert written["argv"][1:] == argv
    assert written["inputs"]["topology"] == hybrid(4).to_dict()


def test_unpatched_model_runner_v2_breaks_only_the_partial_group(capsys, tmp_path):
    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(4)))
    argv = ["simulate", "-t", str(topology), "--runner", "v2", "--json"]
    assert main([*argv, "--no-progress", "--baseline"]) == 0
    baseline = json.loads(capsys.readouterr().out)["baseline"]
    by_group = {g["name"]: g["violations"] for g in baseline["groups"]}
    # vLLM's V2 tables (0.33.0 and 0.34.0) already honour dcp_sharded=False;
    # only the K = 2 group, which vLLM cannot express, breaks.
    assert by_group["attn.k2"]["unwritten"] > 0
    assert not by_group["draft"] and not by_group["attn.kD"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_dcp1_patched_and_unpatched_runs_are_identical(capsys, tmp_path, runner):
    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(1)))
    argv = ["simulate", "-t", str(topology), "--runner", runner, "--json"]
    argv += ["--workload", "mixed", "--no-progress", "--baseline"]
    argv += [f"--{k.replace('_', '-')}={v}" for k, v in MIXED.items()]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["baseline"]["ok"]
    assert report["comparison"]["same_scheduler_outputs"]
    assert report["comparison"]["same_slot_mappings"]
    assert report["scheduler_digest"] == report["baseline"]["scheduler_digest"]
    assert report["preemptions"] > 0 and report["draft_tokens"] > 0


@pytest.mark.parametrize(
    ("runner", "dcp"),
    [
        # V1 gives the replicated draft group a sharded slot mapping.
        pytest.param("v1", 2, marks=MODEL_RUNNER_V1),
        # V2 cannot express the K = 2 group of D = 4.
        ("v2", 4),
    ],
)
def test_unpatched_run_exits_1(tmp_path, runner, dcp):
    from vllm_dcp_geometry.tooling.fresh_process import run_fresh_python

    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(dcp)))
    argv = ["-m", "vllm_dcp_geometry", "simulate", "-t", str(topology), "--json"]
    argv += ["--runner", runner, "--no-progress", "--unpatched-baseline"]
    argv += ["--tokens", "512"]
    # Exit status 1, nothing else, is accepted: a violation was found.
    report = run_fresh_python(argv, patched=False, ok_returncodes=(1,))
    if runner == "v1":
        assert report["violations"]["unwritten"] == 511
    else:
        by_group = {g["name"]: g["violations"] for g in report["groups"]}
        assert by_group["attn.k2"]["unwritten"] > 0


@pytest.mark.vllm_releases("0.34.0")
def test_model_runner_v1_is_refused_where_vllm_removed_it(capsys):
    assert main(["simulate", "--runner", "v1", "--tokens", "512"]) == 2
    err = capsys.readouterr().err
    assert "vLLM 0.34.0 removed Model Runner V1" in err
    assert len(err.strip().splitlines()) == 1


def test_the_text_names_the_vllm_release(capsys, tmp_path):
    from vllm_dcp_geometry._version import installed_vllm_version

    topology = tmp_path / "hybrid.json"
    topology.write_text(json.dumps(hybrid_mapping(2)))
    argv = ["simulate", "-t", str(topology), "--tokens", "256", "--no-progress"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert f"on patched vLLM {installed_vllm_version()}, Model Runner" in first


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runner", "v3"], "invalid choice: 'v3'"),
        (["--workload", "mixed", "--tokens", "100"], "--tokens applies to"),
        (["--requests", "4"], "--requests applies to --workload mixed only"),
        (["--step-tokens", "100"], "multiple of B=384"),
        (["--seed", "-1"], "--seed"),
        (["--dcp", "3"], "must divide"),
    ],
)
def test_bad_simulate_input_exits_2(capsys, args, message):
    assert main(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
