# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A replicated sliding-window group keeps its null masking at every D.

Model Runner V2's ``gather_block_tables`` replaces the block-table entries
wholly below a request's window with the null block (the blocks may have been
freed and reused; a NaN there reaches the attention output). Upstream turns
that off for every group once D > 1, which is right only for sharded groups:
a replicated group's columns still cover contiguous tokens. Where every K is
vLLM's default the patched runner used to hand back to upstream, and the
masking was lost (issue 17). The tables here are vLLM's real ``BlockTables``,
built by the real (patched) ``GPUModelRunner.initialize_kv_cache``.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support import worker as h
from tests.support.specs import mamba_align
from tests.support.vllm_configs import make_vllm_config

pytestmark = pytest.mark.patches(
    "worker.block_table",
    "worker.gpu_model_runner",
    "worker.gpu_block_table",
    "worker.gpu_model_runner_v2",
)

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
B = 16
WINDOW = 64
MAX_MODEL_LEN = 4096


def window() -> k.SlidingWindowSpec:
    return k.SlidingWindowSpec(
        block_size=B, sliding_window=WINDOW, dcp_sharded=False, **ATTN
    )


def topology(with_window: bool = True) -> list[tuple[str, Any]]:
    """Sharded and replicated full attention, Mamba and (optionally) a
    replicated sliding window: every K is vLLM's own default."""
    specs = [
        ("model.layers.0.attn", k.FullAttentionSpec(block_size=B, **ATTN)),
        (
            "model.layers.1.draft.attn",
            k.FullAttentionSpec(block_size=B, dcp_sharded=False, **ATTN),
        ),
        ("model.layers.2.linear_attn", mamba_align()),
    ]
    if with_window:
        specs.append(("model.layers.3.attn", window()))
    return specs


def runner_tables(specs: list[tuple[str, Any]], dcp: int, rank: int) -> Any:
    return h.v2_runner_block_tables(
        h.kv_cache_config(specs),
        make_vllm_config(dcp),
        dcp_rank=rank,
        max_model_len=MAX_MODEL_LEN,
        max_num_reqs=2,
        max_num_tokens=128,
    )


def gathered_rows(tables: Any, dcp: int, computed: int, seq_len: int) -> list:
    """Per group, (row written, row gathered) of one request at state index 1
    with ``computed`` of ``seq_len`` tokens computed."""
    virtual = [B * dcp, B, mamba_align().block_size, B]
    scenario = h.make_scenario(
        17, [seq_len], virtual[: tables.num_kv_cache_groups], first_positions=[computed]
    )
    tables.append_block_ids(1, tuple(rows[0] for rows in scenario.rows), True)
    tables.apply_staged_writes()
    gathered = h.gather_with_window(tables, scenario, [1])
    return [
        (np.asarray(rows[0]), g[0][: len(rows[0])])
        for rows, g in zip(scenario.rows, gathered, strict=True)
    ]


@pytest.mark.parametrize("dcp", [2, 3, 4])
def test_v2_masks_a_replicated_window_on_every_rank(v2_on_cpu: None, dcp: int) -> None:
    reach = k.SlidingWindowSpec(
        block_size=B, sliding_window=WINDOW, **ATTN
    ).num_retained_tokens
    nulled = (850 - reach) // B
    assert nulled == 49
    for rank in range(dcp):
        tables = runner_tables(topology(), dcp, rank)
        rows = gathered_rows(tables, dcp, 850, 900)
        written, window_row = rows[3]
        got = int((window_row[:nulled] == 0).sum())
        assert got == nulled, f"D={dcp} rank {rank}: {got} of {nulled} nulled"
        assert np.array_equal(window_row[nulled:], written[nulled:])
        # No other group is masked.
        for written, got_row in rows[:3]:
            assert np.array_equal(got_row, written)
        # Every K is the default, yet the patched path ran; the slot mappings
        # stay upstream's own kernel launch.
        assert tables.dcp_shard_counts == (dcp, 1, 1, 1)
        assert tables._dcp_slot_launches is None


def test_v2_window_masking_matches_dcp1(v2_on_cpu: None) -> None:
    """The same entries are nulled as at D = 1, for every first position."""
    for computed in (0, 62, 63, 64, 79, 80, 850, 899):
        single = gathered_rows(runner_tables(topology(), 1, 0), 1, computed, 900)[3]
        for dcp in (2, 4):
            written, got = gathered_rows(
                runner_tables(topology(), dcp, dcp - 1), dcp, computed, 900
            )[3]
            assert np.array_equal(got == 0, single[1] == 0), (computed, dcp)
            assert np.array_equal(got[got != 0], written[got != 0])


def test_v2_without_a_replicated_window_hands_back(v2_on_cpu: None) -> None:
    """Where upstream is right, its own tables: no shard counts taken."""
    for dcp, rank in ((1, 0), (4, 1)):
        assert (
            runner_tables(topology(with_window=False), dcp, rank).dcp_shard_counts
            is None
        )
    # At D = 1 upstream masks by itself.
    assert runner_tables(topology(), 1, 0).dcp_shard_counts is None


def test_v2_replicated_window_inside_uniform_type_specs(v2_on_cpu: None) -> None:
    """The window is read as upstream reads it: from the group's first layer."""
    uniform = k.UniformTypeKVCacheSpecs(
        block_size=B, kv_cache_specs={"a": window(), "b": window()}
    )
    specs = [*topology(with_window=False), ("model.layers.3.attn", uniform)]
    tables = runner_tables(specs, 4, 2)
    assert tables.dcp_shard_counts == (4, 1, 1, 1)
    assert tables.has_sliding_window_groups


# Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it).
@pytest.mark.vllm_releases("0.33.0")
@pytest.mark.parametrize("dcp", [2, 3, 4])
def test_v1_replicated_window_keeps_its_dcp1_table(dcp: int) -> None:
    """Model Runner V1 of vLLM 0.33.0 has no sliding-window null masking at
    any D, D = 1 included; a replicated window group gets exactly its D = 1
    table (K = 1, the same width) on every rank."""
    from vllm.v1.worker import block_table

    upstream = inspect.getsource(block_table.BlockTable) + inspect.getsource(
        block_table.MultiGroupBlockTable
    )
    assert "sliding" not in upstream.lower()

    def window_table(d: int, rank: int) -> Any:
        runner = h.v1_runner_input_batch(
            h.kv_cache_config(topology()),
            make_vllm_config(d, real=True),
            max_model_len=MAX_MODEL_LEN,
            dcp_rank=rank,
            max_num_reqs=2,
            max_num_tokens=64,
        )
        return runner.input_batch.block_table.block_tables[3]

    single = window_table(1, 0)
    for rank in range(dcp):
        table = window_table(dcp, rank)
        assert (table.dcp_world_size, table.dcp_rank) == (1, 0)
        assert table.max_num_blocks_per_req == single.max_num_blocks_per_req
