# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The benchmarks' pure parts: memory and capacity follow the contract, the
workloads drive vLLM's real manager as described, results are well-formed.

No timing is asserted here: timings are what ``python -m benchmarks`` reports.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import memory, scheduler
from benchmarks.__main__ import validate_results
from benchmarks.common import RESULTS_DIR, pair_summary
from tests.support.processes import run_python
from vllm_dcp_geometry.contract import (
    attention_block_table_width,
    cdiv,
    recurrent_align_block_table_width,
)
from vllm_dcp_geometry.tooling.topology import load_profile, profile_names

PROFILES = profile_names()


def _aligned(width: int, block_size: int, token_alignment: int | None) -> int:
    # The runner's rule, restated: whole multiples of token_alignment tokens.
    if token_alignment is None:
        return width
    step = token_alignment // math.gcd(token_alignment, block_size)
    return cdiv(width, step) * step


@pytest.mark.parametrize("name", PROFILES)
def test_block_table_memory_is_the_contract_minimum(name: str) -> None:
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    topology = load_profile(name)
    result = memory.block_table_memory(topology)
    dcp = topology.decode_context_parallel_size
    length = topology.max_model_len
    per_column = 4 * topology.max_num_seqs
    minimum = aligned = 0
    widths = []
    for group, row in zip(topology.groups, result["groups"], strict=True):
        spec = _vllm.build_spec(group, topology, patched=True)
        k = group.shard_count(dcp)
        if group.is_attention:
            need = cdiv(length, group.block_size * k)
        else:
            assert topology.mamba_cache_mode == "align"
            need = cdiv(length, group.block_size) + group.spec_fields.get(
                "num_speculative_blocks", 0
            )
        columns = _aligned(need, group.block_size, spec.block_table_token_alignment)
        assert row["shard_count"] == k
        assert row["minimum_width"] == row["width"] == need, group.name
        assert row["aligned_width"] == columns, group.name
        minimum += need
        aligned += columns
        widths.append(columns)
    assert result["minimum_bytes"] == per_column * minimum
    assert result["contract_bytes"] == per_column * aligned
    assert result["single_width_bytes"] == per_column * max(widths) * len(widths)
    assert result["minimum_bytes"] <= result["contract_bytes"]
    assert result["contract_bytes"] <= result["single_width_bytes"]


def test_default_profile_widths_follow_the_contract() -> None:
    # L = 1,000,000 at DCP16, every block 384 tokens (vLLM's hybrid rule).
    result = memory.block_table_memory(load_profile("kimi-k3-tp16-dcp16"))
    by_kind: dict[str, set[tuple[int, int, int]]] = {}
    for row in result["groups"]:
        by_kind.setdefault(row["kind"], set()).add(
            (row["shard_count"], row["minimum_width"], row["aligned_width"])
        )
    length = 1_000_000
    recurrent = recurrent_align_block_table_width(length, 384, 7)
    assert by_kind["mamba"] == {(1, recurrent, recurrent)} == {(1, 2612, 2612)}
    # Sharded MLA (K = 16): 163 columns; the replicated draft (K = 1): 2,605;
    # 384-token blocks are already aligned to the runner's 128 tokens.
    sharded = attention_block_table_width(length, 384, 16)
    replicated = attention_block_table_width(length, 384, 1)
    assert by_kind["mla"] == {(16, sharded, sharded), (1, replicated, replicated)}
    assert (sharded, replicated) == (163, 2605)


@pytest.mark.parametrize("name", PROFILES)
def test_kv_capacity_uses_vllm_pages_and_the_contract(name: str) -> None:
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    budget = 100 << 30
    result = memory.kv_capacity(load_profile(name), budget_bytes=budget)
    sized = load_profile(name).with_layout(max_model_len=result["request_tokens"])
    dcp = sized.decode_context_parallel_size
    config = _vllm.sizing_config(sized)
    expected_bytes = 0
    for group in sized.groups:
        spec = _vllm.build_spec(group, sized, patched=True)
        # vLLM's own per-request rule (patched: K-aware) for K as configured.
        pages = _vllm.pages_per_request(spec, config)
        if group.is_attention and not memory.is_windowed(group):
            k = group.shard_count(dcp)
            assert pages == cdiv(cdiv(result["request_tokens"], k), group.block_size)
        expected_bytes += len(group.layers) * pages * spec.page_size_bytes
    configured = result["configured"]
    assert configured["request_bytes_per_rank"] == expected_bytes
    assert configured["max_concurrent_requests"] == budget // expected_bytes
    replicated, sharded = result["replicated"], result["sharded"]
    for scenario in (replicated, sharded, configured):
        assert scenario["max_concurrent_requests"] == (
            budget // scenario["request_bytes_per_rank"]
        )
    assert (
        replicated["max_concurrent_requests"]
        <= configured["max_concurrent_requests"]
        <= sharded["max_concurrent_requests"]
    )
    for group in sized.groups:
        if not group.is_attention or memory.is_windowed(group):
            assert {
                s["shard_counts"][group.name] for s in (replicated, sharded, configured)
            } == {1}
        else:
            assert replicated["shard_counts"][group.name] == 1
            assert sharded["shard_counts"][group.name] == dcp


def test_replay_workload_drives_the_real_manager() -> None:
    result = scheduler.measure("replay", 16, repeats=1)
    assert result["mode"] == "patched"
    assert result["best"]["allocations"] == cdiv(
        scheduler.REPLAY_TOKENS, scheduler.REPLAY_STEP_TOKENS
    )
    assert result["best"]["calls"]["free"] == 1
    # The default profile: sharded MLA 384 x 16, recurrent and draft 384.
    assert result["scheduler_block_size"] == math.lcm(384 * 16, 384)


def test_many_request_prompts_share_prefixes_and_fit() -> None:
    prompts = scheduler.many_request_tokens()
    lengths = scheduler.many_request_lengths()
    assert [len(p) for p in prompts] == lengths
    assert len(prompts) == scheduler.MANY_REQUESTS
    longest = scheduler.MANY_MAX_MODEL_LEN - scheduler.MANY_DECODE_STEPS
    assert all(scheduler.MANY_MIN_PROMPT <= n < longest for n in lengths)
    groups = len(scheduler.MANY_PREFIXES)
    for i in range(groups, len(prompts)):
        shared = min(
            scheduler.MANY_PREFIXES[i % groups],
            lengths[i] // 2,
            lengths[i - groups] // 2,
        )
        assert prompts[i][:shared] == prompts[i - groups][:shared]
    assert scheduler.many_request_tokens() == prompts  # deterministic


def test_pair_summary() -> None:
    summary = pair_summary([10.0, 20.0, 40.0], [11.0, 20.0, 38.0])
    assert summary["unpatched_median"] == 20.0
    assert summary["patched_median"] == 20.0
    assert summary["ratio_min"] == pytest.approx(0.95)
    assert summary["ratio_max"] == pytest.approx(1.1)
    assert summary["ratio_median"] == 1.0
    with pytest.raises(ValueError):
        pair_summary([1.0], [])


def test_entry_points_import_without_vllm() -> None:
    out = run_python(
        """
        import json, sys
        import benchmarks.__main__, benchmarks.common, benchmarks.memory
        import benchmarks.scheduler, benchmarks.gpu_slot_mapping
        print(json.dumps(sorted(m for m in ("vllm", "torch") if m in sys.modules)))
        """,
        patched=False,
        cpu_prelude=False,
    )
    assert out == []


def _recorded() -> list[Path]:
    return sorted(RESULTS_DIR.glob("*-cpu.json"))


@pytest.mark.skipif(not _recorded(), reason="no recorded CPU results")
@pytest.mark.parametrize("path", _recorded(), ids=lambda p: p.name)
def test_recorded_results_are_well_formed_and_current(path: Path) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert validate_results(doc) == []
    assert {"scheduler", "startup", "memory"} <= set(doc["sections"])
    assert {(r["workload"], r["dcp"]) for r in doc["scheduler"]} == {
        ("replay", 16),
        ("many", 1),
        ("many", 16),
    }
    for row in doc["scheduler"]:
        assert row["pairs"] >= 5
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    # A record covers the profiles built in when it was made (a profile added
    # later is not in it); each recorded figure is what the current code gives.
    recorded_profiles = {m["profile"] for m in doc["memory"]}
    assert recorded_profiles <= set(PROFILES)
    assert "kimi-k3-tp16-dcp16" in recorded_profiles
    # The recorded block-table bytes are what the current code computes, for
    # every profile whose groups (K, widths) are still the ones recorded. Two
    # have changed since, and their old records are history: the default
    # profile was rebuilt from vLLM's model code (20 groups, not the
    # hand-written 17), and the Mamba hybrid took the block sizes start-up
    # sets for its shapes (2,080, not 64 and 256).
    history = []
    for recorded in doc["memory"]:
        fresh = memory.block_table_memory(load_profile(recorded["profile"]))
        if recorded["groups"] != fresh["groups"]:
            history.append(recorded["profile"])
            continue
        for key in ("contract_bytes", "minimum_bytes", "single_width_bytes"):
            assert recorded[key] == fresh[key], (recorded["profile"], key)
    assert history == ["kimi-k3-tp16-dcp16", "mamba-hybrid-tp4-dcp4"]


def test_the_optimize_search_benchmark_merges_instead_of_enumerating() -> None:
    """Eight groups of three admitted K: 6,561 assignments, a few dozen plans
    (each choice's candidates, the topology, the frontier's points)."""
    from benchmarks import optimize_search

    topology = optimize_search.wide_topology(groups=8, dcp=4)
    row = optimize_search.measure(topology)
    assert (row["choices"], row["candidates"], row["assignments"]) == (8, 24, 3**8)
    assert row["frontier_points"] >= 1
    assert 8 * 3 + 1 + row["frontier_points"] <= row["plans_run"] < 100
    assert 0 < row["seconds_in_plans"] <= row["search_seconds"]
    assert row["capacity_holds"]


def test_the_recorded_optimize_search_is_the_benchmarks_shape() -> None:
    recorded = json.loads(
        (RESULTS_DIR / "2026-12-06-optimize-search.json").read_text(encoding="utf-8")
    )
    rows = {row["topology"]: row for row in recorded["rows"]}
    assert set(rows) == {"kimi-k3-tp16-dcp16", "mla-60-groups-dcp32"}
    assert rows["kimi-k3-tp16-dcp16"]["assignments"] == 5**5
    assert rows["mla-60-groups-dcp32"]["assignments"] == 6**60
    for row in rows.values():
        assert row["plans_run"] < 1000
        assert row["capacity_holds"]
