# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s scheduler check (``capacity_proof``): vLLM's real
scheduler, on start-up's pool for a budget, holds exactly the target-context
requests vLLM's rule predicts at the edges of small pools (at least them
where sliding windows make the rule a lower bound), on Kimi-K3 (Mamba/KDA
groups, MLA, a draft) and DeepSeek-V3.2 (latent and indexer caches) at the
recommended point and K=max, and a prediction off by one either way exits 1
naming both numbers."""

from __future__ import annotations

import json

import pytest

from vllm_dcp_geometry.tooling.cli.plan import optimize as opt
from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import scheduler_admission
from vllm_dcp_geometry.tooling.topology import load_profile


def _pool_of(topology, num_blocks: int) -> opt.Pool:
    """Start-up's pool with exactly ``num_blocks`` blocks (the null block
    included): vLLM sizes it as the budget over its bytes per block."""
    probe = opt.vllm_pool(topology, set(), 1 << 30)
    per_block = probe.kv_cache_config.kv_cache_tensors[0].size // probe.num_blocks
    pool = opt.vllm_pool(topology, set(), num_blocks * per_block)
    assert pool.num_blocks == num_blocks
    return pool


@pytest.mark.parametrize(
    ("profile", "rule"),
    [
        ("dense-gqa-tp8-dcp8", "exact"),
        ("mla-mixed-tp4-dcp4", "exact"),
        ("mamba-hybrid-tp4-dcp4", "exact"),
        ("gpt-oss-tp32-dcp4", "lower bound"),
    ],
)
@pytest.mark.parametrize("requests", [1, 3])
def test_the_scheduler_holds_what_the_rule_predicts_at_the_edges(
    profile: str, rule: str, requests: int
) -> None:
    """A pool of exactly ``requests`` peaks plus the null block holds
    ``requests``; one block fewer holds one fewer (vLLM's scheduler,
    exactly, where the rule is exact; at least, where a sliding window makes
    it a lower bound)."""
    topology = load_profile(profile)
    per_request = opt.vllm_pool(topology, set(), 1 << 30).blocks_per_request
    for num_blocks, expected in (
        (requests * per_request + 1, requests),
        (requests * per_request, requests - 1),
    ):
        pool = _pool_of(topology, num_blocks)
        assert pool.requests == expected
        admission = scheduler_admission(topology, pool)
        assert admission.as_json()["rule"] == rule
        assert admission.agrees, admission
        assert admission.scheduler == "AsyncScheduler"
        assert admission.batches_in_flight == 2
        if rule == "exact":
            assert admission.admitted == expected
            assert admission.submitted == expected + 1
        else:
            assert expected <= admission.admitted < admission.submitted


def test_the_request_past_a_mamba_pool_is_preempted_not_counted() -> None:
    """In Mamba align mode vLLM's admission gate counts one state block for
    a request not yet started while its prefill takes two: with one block
    short of another request, the one past the prediction is admitted and
    preempted over and over; the count stops there, at the prediction."""
    topology = load_profile("mamba-hybrid-tp4-dcp4")
    per_request = opt.vllm_pool(topology, set(), 1 << 30).blocks_per_request
    pool = _pool_of(topology, 3 * per_request)
    admission = scheduler_admission(topology, pool)
    assert admission.predicted == 2
    assert admission.admitted == 2
    assert admission.cycling
    assert admission.preempted == (3,)
    assert admission.preemptions >= 2
    assert admission.agrees


def test_more_requests_than_vllm_runs_at_once_fail_the_check() -> None:
    """vLLM runs at most ``max_num_batched_tokens`` requests at once
    (``max_num_seqs`` may not exceed it): a pool predicted to hold that many
    fails, naming why, without building a scheduler."""
    topology = load_profile("dense-gqa-tp8-dcp8")
    per_request = opt.vllm_pool(topology, set(), 1 << 30).blocks_per_request
    pool = _pool_of(topology, 2048 * per_request + 1)
    admission = scheduler_admission(topology, pool)
    assert (admission.predicted, admission.admitted) == (2048, None)
    assert not admission.agrees
    assert "at most max_num_batched_tokens (2,048)" in (admission.reason or "")


@pytest.mark.parametrize(
    ("profile", "weight_gib"),
    [("kimi-k3-tp16-dcp16", "70"), ("deepseek-v32-tp8-dcp8", "80")],
)
def test_recommended_and_largest_k_hold_exactly_the_prediction(
    run_cli, profile: str, weight_gib: str
) -> None:
    code, out, err = run_cli(
        "plan", "--optimize", "-p", profile, "--device", "H200",
        "--weight-gib", weight_gib, "--json",
    )  # fmt: skip
    assert code == 0, err
    check = json.loads(out)["capacity_check"]
    assert check["holds"]
    for point in (check["recommended"], check["largest_k"]):
        assert point["rule"] == "exact"
        assert point["admitted_requests"] == point["predicted_requests"] > 0
        assert point["submitted_requests"] == point["predicted_requests"] + 1
        assert point["agrees"]
    code, out, _ = run_cli(
        "plan", "--optimize", "-p", profile, "--device", "H200",
        "--weight-gib", weight_gib,
    )  # fmt: skip
    assert code == 0
    predicted = check["recommended"]["predicted_requests"]
    assert f"vLLM's rule {predicted:,}, vLLM's scheduler held {predicted:,}" in out
    assert "MISMATCH" not in out


@pytest.mark.parametrize("offset", [1, -1])
@pytest.mark.parametrize(
    ("profile", "weight_gib"),
    [("dense-gqa-tp8-dcp8", "100"), ("kimi-k3-tp16-dcp16", "70")],
)
def test_a_prediction_off_by_one_exits_1_naming_both(
    run_cli, monkeypatch, profile: str, weight_gib: str, offset: int
) -> None:
    """vLLM's rule, deliberately off by one either way: the scheduler holds
    what the pool holds, and the command exits 1 naming both numbers."""
    flags = ("-p", profile, "--device", "H200", "--weight-gib", weight_gib)
    code, out, err = run_cli("plan", "--optimize", *flags, "--json")
    assert code == 0, err
    held = json.loads(out)["capacity_check"]["recommended"]["admitted_requests"]
    true_count = opt.Pool.requests
    monkeypatch.setattr(
        opt.Pool,
        "requests",
        property(lambda pool: true_count.fget(pool) + offset),  # type: ignore[union-attr]
    )
    code, out, err = run_cli("plan", "--optimize", *flags)
    assert code == 1, err
    assert f"MISMATCH, predicted {held + offset:,}, admitted {held:,}" in out
    code, out, _ = run_cli("plan", "--optimize", *flags, "--json")
    assert code == 1
    check = json.loads(out)["capacity_check"]
    assert not check["holds"]
    point = check["recommended"]
    assert (point["predicted_requests"], point["admitted_requests"]) == (
        held + offset,
        held,
    )


def test_a_pool_sized_by_another_config_than_the_schedulers_is_refused() -> None:
    """The scheduler's config must give the blocks per request the pool was
    sized with; a pool claiming another count stops the check, naming both."""
    import dataclasses as dc

    from vllm_dcp_geometry.tooling.topology import TopologyError

    topology = load_profile("dense-gqa-tp8-dcp8")
    pool = opt.vllm_pool(topology, set(), 4 << 30)
    wrong = dc.replace(pool, blocks_per_request=pool.blocks_per_request + 1)
    with pytest.raises(TopologyError) as excinfo:
        scheduler_admission(topology, wrong)
    assert str(excinfo.value) == (
        f"--optimize: the scheduler's config gives {pool.blocks_per_request:,} "
        f"blocks per request by vLLM's rule, start-up's "
        f"{wrong.blocks_per_request:,}"
    )
