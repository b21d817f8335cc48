# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The pure contract: rules, formulas and errors, with no vLLM involved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp_geometry import contract as c
from vllm_dcp_geometry.contract import DcpGeometryError, TokenLayout

SHARDED, REPLICATED, RECURRENT = (
    TokenLayout.SHARDED,
    TokenLayout.REPLICATED,
    TokenLayout.RECURRENT,
)


def shard_count(layout: TokenLayout, dcp: int, k: int | None = None) -> int:
    return c.resolve_shard_count(
        owner="layers.0.attn", layout=layout, dcp_world_size=dcp, dcp_kv_shard_count=k
    )


@pytest.mark.parametrize("dcp", [0, -1])
def test_rule1_world_size_must_be_positive(dcp: int) -> None:
    with pytest.raises(DcpGeometryError, match="DCP world size must be >= 1"):
        shard_count(SHARDED, dcp)


@pytest.mark.parametrize("layout", list(TokenLayout))
@pytest.mark.parametrize("k", [None, 1, 4, 3])
def test_rule2_dcp1_is_never_changed(layout: TokenLayout, k: int | None) -> None:
    assert shard_count(layout, 1, k) == 1


def test_rule3_recurrent_state_is_never_token_sharded() -> None:
    assert shard_count(RECURRENT, 16) == 1
    with pytest.raises(DcpGeometryError, match="never token-sharded"):
        shard_count(RECURRENT, 16, 4)


def test_rule4_replicated_attention() -> None:
    assert shard_count(REPLICATED, 16) == 1
    assert shard_count(REPLICATED, 16, 1) == 1
    with pytest.raises(DcpGeometryError, match=r"layers\.0\.attn.*replicated"):
        shard_count(REPLICATED, 16, 4)


def test_rule5_sharded_defaults_to_world_size() -> None:
    assert [shard_count(SHARDED, d) for d in (2, 4, 8, 16)] == [2, 4, 8, 16]


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_rule6_partial_counts_that_divide(k: int) -> None:
    assert shard_count(SHARDED, 16, k) == k


@pytest.mark.parametrize("k", [3, 32, 5, 12])
def test_rule6_rejects_counts_that_do_not_divide(k: int) -> None:
    with pytest.raises(DcpGeometryError, match=rf"layers\.0\.attn.*K={k}.*D=16"):
        shard_count(SHARDED, 16, k)


@pytest.mark.parametrize("k", [0, -4, 2.0, True])
def test_rule6_rejects_non_positive_or_non_integer(k: object) -> None:
    with pytest.raises(DcpGeometryError, match=r"layers\.0\.attn"):
        shard_count(SHARDED, 16, k)  # type: ignore[arg-type]


def test_rule7_aggregate_needs_one_count() -> None:
    assert c.resolve_uniform_shard_count("g", {"a": 4, "b": 4}) == 4
    with pytest.raises(DcpGeometryError, match=r"K=4: a.*K=16: b"):
        c.resolve_uniform_shard_count("g", {"a": 4, "b": 16})


def rank_geometry(rank: int, k: int, dcp: int, default: int | None = None):
    return c.GroupGeometry("layers.0", k, dcp, rank, default_shard_count=default)


def test_shard_and_replica_of_a_rank() -> None:
    assert (rank_geometry(5, 4, 16).shard, rank_geometry(5, 4, 16).replica) == (1, 1)
    assert rank_geometry(15, 16, 16).shard_world == (16, 15)
    assert (rank_geometry(15, 1, 16).shard, rank_geometry(15, 1, 16).replica) == (0, 15)
    with pytest.raises(DcpGeometryError, match=r"layers\.0.*outside"):
        rank_geometry(16, 4, 16)
    with pytest.raises(DcpGeometryError, match=r"layers\.0.*must divide"):
        rank_geometry(1, 3, 16)
    with pytest.raises(DcpGeometryError, match="interleave"):
        c.GroupGeometry("g", 4, 16, 0, interleave_size=0)


def test_group_geometry_kinds() -> None:
    assert (
        rank_geometry(3, 1, 4).is_replicated and not rank_geometry(3, 1, 4).is_partial
    )
    assert rank_geometry(3, 2, 4).is_partial
    assert rank_geometry(3, 2, 8).replica_count == 4
    assert rank_geometry(3, 8, 8).replica_count == 1
    assert not rank_geometry(3, 4, 4).is_partial
    assert rank_geometry(3, 4, 4, default=4).matches_default
    assert not rank_geometry(3, 1, 4, default=4).matches_default
    assert "K=2, D=4, rank 3: shard 1, replica 1" in rank_geometry(3, 2, 4).describe()


def test_prefill_context_parallel_refuses_only_partial_k() -> None:
    for k in (1, 16):
        c.check_prefill_context_parallel("g", k, 16, 2)
    c.check_prefill_context_parallel("g", 4, 16, 1)
    with pytest.raises(DcpGeometryError, match=r"g: .*K=4 \(D=16\).*PCP=2"):
        c.check_prefill_context_parallel("g", 4, 16, 2)


# The worked examples of the contract document.


def test_recurrent_width_regression_1310() -> None:
    width = c.recurrent_align_block_table_width(1_000_000, 768, 7)
    assert width == 1310
    # A DCP-scaled table runs out at the checkpoint boundary after 63,744 tokens.
    dcp_scaled = c.cdiv(1_000_000, 768 * 16) + 7
    assert dcp_scaled == 89
    assert (dcp_scaled - 6) * 768 == 63_744


@pytest.mark.parametrize(
    ("k", "width", "aligned"),
    [(16, 977, 978), (4, 3907, 3908), (1, 15625, 15626)],
)
def test_attention_widths(k: int, width: int, aligned: int) -> None:
    assert c.attention_block_table_width(1_000_000, 64, k) == width
    from vllm.v1.worker.block_table import get_block_table_width

    assert get_block_table_width(width, 64, token_alignment=128) == aligned


def test_full_attention_pages() -> None:
    assert c.full_attention_pages_per_request(1_000_000, 64, 16) == c.cdiv(
        c.cdiv(1_000_000, 16), 64
    )
    assert c.full_attention_pages_per_request(1000, 16, 1) == 63


def test_scheduler_block_size_is_lcm_of_virtual_blocks() -> None:
    sizes = [c.virtual_block_size(64, 16), c.virtual_block_size(64, 4), 768]
    assert c.scheduler_block_size(sizes) == 3072
    with pytest.raises(DcpGeometryError):
        c.scheduler_block_size([])


def test_slot_mapping_worked_example() -> None:
    slots = c.reference_slot_mapping(
        np.arange(10),
        [10, 11, 12],
        block_size=4,
        shard_count=4,
        interleave_size=1,
        shard=rank_geometry(5, 4, 16).shard,
    )
    assert slots.tolist() == [-1, 40, -1, -1, -1, 41, -1, -1, -1, 42]


def test_slot_mapping_replicated_maps_every_token() -> None:
    slots = c.reference_slot_mapping(
        np.arange(9), [3, 7, 9], block_size=4, shard_count=1, interleave_size=1, shard=0
    )
    assert slots.tolist() == [12, 13, 14, 15, 28, 29, 30, 31, 36]


def test_slot_mapping_rejects_positions_beyond_the_row() -> None:
    with pytest.raises(DcpGeometryError, match="column 3"):
        c.reference_slot_mapping(
            [48], [1, 2, 3], block_size=4, shard_count=4, interleave_size=1, shard=0
        )


def test_interleave_must_divide_block_size() -> None:
    with pytest.raises(DcpGeometryError, match="divisible by the interleave"):
        c.local_seq_len(10, 16, 4, 3, 0)


geometry = st.sampled_from([1, 2, 4, 8, 16]).flatmap(
    lambda dcp: st.tuples(
        st.just(dcp),
        st.sampled_from([k for k in (1, 2, 4, 8, 16) if dcp % k == 0]),
        st.sampled_from([4, 16, 64]),
    )
)


@settings(max_examples=150, deadline=None)
@given(
    geometry,
    st.integers(min_value=0, max_value=3000),
    st.sampled_from(["one", "mid", "block"]),
)
def test_slot_mapping_invariants(
    dkb: tuple[int, int, int], seq_len: int, interleave_kind: str
) -> None:
    """Within every replica group each position gets exactly one slot, inside
    the request's blocks; no two positions of a rank share a slot; local
    lengths agree with the slots."""
    dcp, k, block = dkb
    interleave = {"one": 1, "mid": max(block // 4, 1), "block": block}[interleave_kind]
    rng = np.random.default_rng(seq_len * 31 + dcp)
    columns = c.attention_block_table_width(max(seq_len, 1), block, k)
    row = rng.permutation(10 * columns + 10)[:columns]
    positions = np.arange(seq_len)
    for replica in range(dcp // k):
        owners = np.full(seq_len, -1)
        for shard in range(k):
            rank = replica * k + shard
            assert rank_geometry(rank, k, dcp).shard == shard
            slots = c.reference_slot_mapping(
                positions,
                row,
                block_size=block,
                shard_count=k,
                interleave_size=interleave,
                shard=shard,
            )
            mine = slots != c.PAD_SLOT_ID
            assert int(mine.sum()) == c.local_seq_len(
                seq_len, block, k, interleave, shard
            )
            assert np.all(owners[mine] == -1), "a position got two slots"
            owners[mine] = shard
            assert set((slots[mine] // block).tolist()) <= set(row.tolist())
            assert len(set(slots[mine].tolist())) == int(mine.sum())
        assert np.all(owners >= 0), "a position got no slot"


def test_contract_module_imports_no_vllm() -> None:
    import ast
    from pathlib import Path

    source = Path(c.__file__).read_text()
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom)
    }
    assert "vllm" not in imported
    assert "torch" not in imported
