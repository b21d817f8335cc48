# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``simulate --workload mixed`` proves what it promises on every profile.

The mixed workload is shaped by each profile's geometry
(``workloads.mixed_shape``): a wave of prompts one token short of a
scheduler-block boundary fills the pool, so the scheduler must preempt;
shared prefixes of whole scheduler blocks hit the prefix cache (on the
hybrids, across a recurrent-state boundary); drafts are accepted where the
profile drafts. A run that misses one of them exits 1 naming it. The small
pool also reuses blocks a sliding window drops at once, which the ownership
check must not take for a block shared by two live requests.

Cost: the every-profile run about 45 s on 2 cores (the default profile
alone about 20 s), so it is ``slow`` and runs on the default release only;
the rest a few seconds (vLLM's kernels are not run here: the other simulate
tests cross-check the slot mappings against them).
"""

from __future__ import annotations

import json

import pytest

from tests.support.simulate import MODEL_RUNNER_V1
from vllm_dcp_geometry.tooling.cli import main
from vllm_dcp_geometry.tooling.cli.simulate import run
from vllm_dcp_geometry.tooling.cli.simulate.workloads import (
    MIXED_REQUESTS,
    make_workload,
)
from vllm_dcp_geometry.tooling.topology import load_profile, profile_names

SIMULATE_PATCHES = pytest.mark.patches(
    "engine_core.kv_cache_utils",
    "engine_core.single_type_kv_cache_manager",
    "engine_core.kv_cache_coordinator",
)
"""The engine-core patches a mixed run's scheduler goes through (cheap
tests: they run on every release's leg)."""

PROFILES = profile_names()


@pytest.fixture(autouse=True)
def _no_kernels(monkeypatch):
    """What these tests check is the workload's events; vLLM's kernels under
    the interpreter (this process) would multiply their cost, and the other
    simulate tests cross-check the slot mappings against them."""
    monkeypatch.setattr(
        run,
        "probe_real_kernels",
        lambda device: (False, "vLLM's Triton kernels not run (events checked)"),
    )


def _mixed(capsys, *args: str) -> tuple[int, dict]:
    argv = ["simulate", "--workload", "mixed", "--json", "--no-progress", *args]
    status = main(argv)
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("profile", PROFILES)
def test_the_workload_is_shaped_by_the_scheduler_block(profile):
    topology = load_profile(profile)
    workload = make_workload(
        topology, "mixed", tokens=0, step_tokens=None, num_requests=None, seed=0
    )
    block = workload.scheduler_block
    wave = workload.requests[: workload.wave]
    assert len(wave) >= 2 and len(workload.requests) == MIXED_REQUESTS
    # Each wave prompt ends one token short of a block boundary, and the
    # whole wave fits one step's token budget.
    assert all((r.prompt_len + 1) % block == 0 for r in wave)
    assert sum(r.prompt_len for r in wave) <= workload.step_tokens
    # The longest request at full length is no longer than the whole wave.
    longest = max(
        r.prompt_len + r.max_tokens + workload.num_speculative_tokens + 1
        for r in workload.requests
    )
    assert longest <= sum(r.prompt_len for r in wave)
    prefixes = [n for n in workload.prefixes if n]
    assert len(prefixes) == 3 and all(n % block == 0 for n in prefixes)
    # A recurrent group in align mode caches state at its block boundaries,
    # which the scheduler block is a multiple of.
    for group in topology.groups:
        if not group.is_attention:
            assert block % group.block_size == 0


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES)
def test_mixed_run_preempts_hits_and_drafts_on_every_profile(capsys, profile):
    status, report = _mixed(capsys, "-p", profile)
    assert status == 0, (report["violation_items"], report["missing_events"])
    assert report["ok"] and report["missing_events"] == []
    assert report["violations"] == dict.fromkeys(report["violations"], 0)
    assert report["preemptions"] >= 1
    # Hits land on whole scheduler blocks: on a hybrid, across the recurrent
    # state cached at a block boundary.
    assert report["prefix_hit_tokens"] >= report["scheduler_block_size"]
    expected = {"preemptions", "prefix_hit_tokens"}
    if report["num_speculative_tokens"]:
        assert report["accepted_draft_tokens"] > 0
        expected.add("accepted_draft_tokens")
    assert set(report["events"]) == expected
    assert report["finished_requests"] == report["requests"]


@SIMULATE_PATCHES
@pytest.mark.parametrize(
    ("args", "missing"),
    [
        # One request: no wave to preempt, no second request to hit a prefix.
        (["--requests", "1"], ["preemptions", "prefix_hit_tokens"]),
        # A pool that holds every request at once never preempts.
        (["--num-pages", "5000"], ["preemptions"]),
    ],
)
def test_a_mixed_run_that_misses_an_event_exits_1(capsys, args, missing):
    status, report = _mixed(capsys, "-p", "dense-gqa-tp8-dcp8", *args)
    assert status == 1
    assert report["missing_events"] == missing
    assert not report["ok"]
    # Nothing else is wrong: no violation, every request finished.
    assert not any(report["violations"].values())
    assert report["finished_requests"] == report["requests"]
    assert all(report["events"][name] == 0 for name in missing)


@SIMULATE_PATCHES
def test_the_text_names_the_missing_event(capsys):
    argv = ["simulate", "-p", "dense-gqa-tp8-dcp8", "--workload", "mixed"]
    assert main([*argv, "--no-progress", "--num-pages", "5000"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "FAILED"
    events = next(line for line in lines if line.startswith("mixed workload's events"))
    assert "preemptions 0 (missing)" in events
    assert "prefix-hit tokens" in events and "accepted draft tokens" in events
    assert "promised preemptions and the run had none" in lines[-2]
    assert "a workload that proves nothing is a failure" in lines[-2]


@MODEL_RUNNER_V1
def test_a_block_a_sliding_window_dropped_is_free_for_the_next_request(capsys):
    # With seed 11 (from step 15 on), Model Runner V1 puts a new request in
    # the row of one that finished, ahead in the batch of a request whose
    # sliding window dropped a block in the same step, a block the scheduler
    # hands the new request: the checker releases every request's dropped
    # blocks before it checks any write (it once reported 4,760 shared_slot).
    status, report = _mixed(
        capsys, "-p", "gpt-oss-tp64-dcp8", "--runner", "v1", "--seed", "11"
    )
    assert status == 0
    assert report["violations"]["shared_slot"] == 0
