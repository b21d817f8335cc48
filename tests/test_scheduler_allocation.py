# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM's real KVCacheManager allocates, hashes and sizes every group by its K.

Topology (``tests.support.scheduler``): sharded full attention (K = D), partial
full attention (K = 4), replicated draft attention (K = 1), Mamba align
(B = 768, 7 speculative blocks), at D in {1, 4, 16}. Unpatched baselines run
in one subprocess with the partial group left sharded (unpatched vLLM has no
shard count).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.support import scheduler as topo
from tests.support.processes import run_python
from vllm_dcp_geometry import contract
from vllm_dcp_geometry.contract import cdiv

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "engine_core.kv_cache_utils",
    "engine_core.single_type_kv_cache_manager",
    "engine_core.kv_cache_coordinator",
)

DCP_SIZES = (1, 4, 16)
ATTENTION_GROUPS = ("sharded", "partial", "draft")


def expected_k(group: str, dcp: int) -> int:
    """K from the contract's rules, written out for this topology."""
    if dcp == 1 or group in ("draft", "mamba"):
        return 1
    if group == "partial":
        return topo.PARTIAL_K
    return dcp


def virtual(group: str, dcp: int) -> int:
    block = topo.MAMBA_BLOCK if group == "mamba" else topo.ATTENTION_BLOCK
    return contract.virtual_block_size(block, expected_k(group, dcp))


@pytest.fixture(scope="module")
def patched() -> dict[int, dict[str, Any]]:
    return {dcp: topo.allocation_scenario(dcp, partial=True) for dcp in DCP_SIZES}


@pytest.fixture(scope="module")
def unpatched() -> dict[str, Any]:
    return run_python(
        """
        import json
        from tests.support import scheduler as topo
        out = {
            "alloc": {
                str(d): topo.allocation_scenario(d, partial=False)
                for d in (1, 4, 16)
            },
            "long": topo.long_request_scenario(16, partial=False),
        }
        print(json.dumps(out))
        """,
        patched=False,
    )


@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_managers_and_block_sizes_follow_k(dcp: int) -> None:
    from vllm.v1.kv_cache_interface import get_kv_cache_dcp_shard_count

    specs = topo.topology_specs(partial=True)
    manager, _, scheduler_block, hash_block = topo.make_manager(
        specs, dcp, num_blocks=64, enable_caching=True
    )
    sizes = [virtual(name, dcp) for name in specs]
    managers = manager.coordinator.single_type_managers
    for (name, spec), mgr, size in zip(specs.items(), managers, sizes, strict=True):
        k = get_kv_cache_dcp_shard_count(spec, dcp)
        assert k == expected_k(name, dcp), name
        assert mgr.block_size == size == spec.block_size * k, name
        assert mgr.dcp_world_size == k, name
    assert manager.coordinator.group_block_sizes == tuple(sizes)
    assert scheduler_block == contract.scheduler_block_size(sizes)
    # Hashing unit: vLLM's GCD rule, applied to the virtual block sizes.
    assert hash_block == math.gcd(*sizes)
    assert all(size % hash_block == 0 for size in sizes)


@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_allocation_hits_and_preemption(
    dcp: int, patched: dict[int, dict[str, Any]]
) -> None:
    result = patched[dcp]
    scheduler_block = result["scheduler_block"]
    prompt_len = 5 * scheduler_block + 123
    second_len = 3 * scheduler_block + 17 + 200
    for g, name in enumerate(topo.GROUP_NAMES):
        if name in ATTENTION_GROUPS:
            assert len(result["first_ids"][g]) == cdiv(prompt_len, virtual(name, dcp))
            assert len(result["second_ids"][g]) == cdiv(second_len, virtual(name, dcp))
    hit = result["second_hit"]
    # The shared prefix covers three scheduler blocks and a bit: the hit is
    # the three whole blocks, a boundary of every group's virtual block.
    assert hit == 3 * scheduler_block
    for g, name in enumerate(topo.GROUP_NAMES):
        assert hit % virtual(name, dcp) == 0, name
        if name in ATTENTION_GROUPS:
            assert result["second_hit_blocks"][g] == hit // virtual(name, dcp)
    # The hit's blocks are the first request's blocks for those positions.
    for g, name in enumerate(topo.GROUP_NAMES):
        if name in ATTENTION_GROUPS:
            n = hit // virtual(name, dcp)
            assert result["second_ids"][g][:n] == result["first_ids"][g][:n]
    # Preempted and re-admitted: same hit on the same blocks, rows of the same
    # length (the uncached tail comes fresh from the pool); nothing leaks.
    assert result["readmit_hit"] == hit
    for g, name in enumerate(topo.GROUP_NAMES):
        assert len(result["readmit_ids"][g]) == len(result["second_ids"][g]), name
        if name in ATTENTION_GROUPS:
            n = hit // virtual(name, dcp)
            assert result["readmit_ids"][g][:n] == result["second_ids"][g][:n]
    assert result["first_hit"] == 0
    assert result["free_after_free"] == result["free_at_start"]
    assert result["free_at_end"] == result["free_at_start"]


def test_dcp1_identical_to_unpatched(
    patched: dict[int, dict[str, Any]], unpatched: dict[str, Any]
) -> None:
    baseline = unpatched["alloc"]["1"]
    assert patched[1] == baseline
    assert topo.allocation_scenario(1, partial=False) == baseline


@pytest.mark.parametrize("dcp", (4, 16))
def test_upstream_geometry_handed_back(dcp: int, unpatched: dict[str, Any]) -> None:
    assert topo.allocation_scenario(dcp, partial=False) == unpatched["alloc"][str(dcp)]


def test_other_groups_as_upstream_next_to_a_partial_group(
    patched: dict[int, dict[str, Any]], unpatched: dict[str, Any]
) -> None:
    # D = 16: the LCM is 3072 with or without the K = 4 group, so every other
    # group must behave exactly as unpatched vLLM (block ids differ: one pool).
    mine, base = patched[16], unpatched["alloc"]["16"]
    assert mine["scheduler_block"] == base["scheduler_block"] == 3072
    for key in ("first_hit", "second_hit", "readmit_hit"):
        assert mine[key] == base[key]
    for g, name in enumerate(topo.GROUP_NAMES):
        if name == "partial":
            continue
        for key in ("first_ids", "second_ids", "readmit_ids"):
            assert len(mine[key][g]) == len(base[key][g]), (name, key)
        assert mine["second_hit_blocks"][g] == base["second_hit_blocks"][g], name


def test_million_token_request_fits_every_row(unpatched: dict[str, Any]) -> None:
    result = topo.long_request_scenario(16, partial=True)
    length = 1_000_000
    for g, name in enumerate(topo.GROUP_NAMES):
        assert result["widest"][g] <= result["widths"][g], name
    # The contract's worked examples.
    assert result["widths"] == [977, 3907, 15625, 1310]
    for g, name in enumerate(topo.GROUP_NAMES):
        if name in ATTENTION_GROUPS:
            assert result["final"][g] == cdiv(length, virtual(name, dcp=16))
    base = unpatched["long"]
    assert base["widths"][3] == result["widths"][3]
    assert result["widest"][3] == base["widest"][3]
    assert result["widest"][0] == base["widest"][0]
    assert result["widest"][2] == base["widest"][2]
