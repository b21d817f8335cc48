# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The slot-mapping cases of every DCP rank and their checks, shared by
``tests/test_worker_slot_mapping.py`` (CPU, the Triton interpreter) and
``tests/gpu/test_gpu_slot_mapping.py`` (compiled kernels): the sweep (D in
{1, 2, 4, 8, 16}, every K | D, I in {1, 16, B}) and the mixed D = 16 topology
on Model Runner V1's and V2's real block tables (``v1_sweep``, ``v2_sweep``,
``mixed_v1_slots``, ``mixed_v2_slots``) and the contract's invariants over
all D ranks of a group (``check_group`` and the checks built on it). What
unpatched vLLM computes is in ``unpatched_slots``. Every ``device`` argument
is ``"cpu"`` or ``"cuda"``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support import worker as h
from tests.support.sweeps import divisors
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import contract as c
from vllm_dcp_geometry.runtime.geometry import (
    block_table_layout,
    upstream_get_block_table_width,
)

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
MLA = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}


def attention(block_size: int, shard_count: int, dcp: int) -> k.FullAttentionSpec:
    """Full attention with K shards under DCP ``dcp``, the way a model says it."""
    if shard_count == 1 and dcp > 1:
        return k.FullAttentionSpec(block_size=block_size, dcp_sharded=False, **ATTN)
    if shard_count == dcp:
        return k.FullAttentionSpec(block_size=block_size, **ATTN)
    return k.FullAttentionSpec(
        block_size=block_size,
        dcp_kv_shard_count=shard_count,  # type: ignore[call-arg]
        **ATTN,
    )


# Checks ---------------------------------------------------------------------------


def check_group(
    slots_by_rank: dict[int, np.ndarray],
    scenario: h.Scenario,
    group: int,
    *,
    block_size: int,
    shard_count: int,
    interleave: int,
    dcp: int,
    label: str,
) -> None:
    """The contract's invariants for one group over all D ranks."""
    n = scenario.num_tokens
    bounds = np.cumsum(
        [0]
        + [
            s - f
            for s, f in zip(scenario.seq_lens, scenario.first_positions, strict=True)
        ]
    )
    for rank in range(dcp):
        slots = slots_by_rank[rank]
        where = f"{label}, group {group}, K={shard_count}, rank {rank}/{dcp}"
        assert (slots[n:] == c.PAD_SLOT_ID).all(), f"{where}: padding is not -1"
        live_all = []
        for req, (seq_len, first) in enumerate(
            zip(scenario.seq_lens, scenario.first_positions, strict=True)
        ):
            row = scenario.rows[group][req]
            got = slots[bounds[req] : bounds[req + 1]]
            ref = c.reference_slot_mapping(
                np.arange(first, seq_len),
                row,
                block_size=block_size,
                shard_count=shard_count,
                interleave_size=interleave,
                shard=rank % shard_count,
            )
            assert np.array_equal(got, ref), f"{where}, request {req}: != reference"
            live = got[got != c.PAD_SLOT_ID]
            assert np.isin(live // block_size, row).all(), (
                f"{where}, request {req}: slot outside the request's blocks"
            )
            live_all.append(live)
        live_all_arr = np.concatenate(live_all)
        assert np.unique(live_all_arr).size == live_all_arr.size, (
            f"{where}: two positions share a slot"
        )
    for replica in range(dcp // shard_count):
        ranks = [replica * shard_count + s for s in range(shard_count)]
        owners = sum((slots_by_rank[r][:n] != c.PAD_SLOT_ID).astype(int) for r in ranks)
        assert (owners == 1).all(), (
            f"{label}, group {group}, K={shard_count}, replica {replica}: a "
            "position is stored by no rank or by several"
        )


# The sweep: D in {1, 2, 4, 8, 16}, every K | D, I in {1, 16, B} -----------------

BLOCK = 32
MAX_LEN = 1024


def sweep_case(dcp: int, interleave: int) -> tuple[list[int], h.Scenario, Any, Any]:
    counts = divisors(dcp)
    if len(counts) > 2:
        # A K again, apart from its first group: V2 launches per contiguous run.
        counts.append(counts[1])
    specs = [
        (f"layers.{i}.attn", attention(BLOCK, kk, dcp)) for i, kk in enumerate(counts)
    ]
    config = make_vllm_config(dcp, interleave=interleave, real=True)
    rng = np.random.default_rng(1000 * dcp + interleave)
    seq_lens = [MAX_LEN, *rng.integers(1, MAX_LEN, size=2).tolist()]
    scenario = h.make_scenario(
        dcp * 7 + interleave, seq_lens, [BLOCK * kk for kk in counts]
    )
    return counts, scenario, specs, config


Slots = dict[int, dict[int, np.ndarray]]
"""``slots[group][rank]``: the slot-mapping buffer of one group on one rank."""


def v1_sweep(
    dcp: int, interleave: int, device: str = "cpu"
) -> tuple[Slots, h.Scenario]:
    """Model Runner V1 tables of every rank for the sweep case."""
    counts, scenario, specs, config = sweep_case(dcp, interleave)
    slots: Slots = {g: {} for g in range(len(counts))}
    for rank in range(dcp):
        layout = block_table_layout(specs, config, MAX_LEN, dcp, rank)
        assert [t.shard_count for t in layout.tables] == counts
        tables = h.build_v1_tables(
            [t.block_size for t in layout.tables],
            [t.max_num_blocks_per_req for t in layout.tables],
            [True] * len(counts),
            interleave,
            max_num_reqs=4,
            max_num_batched_tokens=scenario.num_tokens + 64,
            device=device,
            dcp_layout=layout,
        )
        for table, kk in zip(tables.block_tables, counts, strict=True):
            assert (table.dcp_world_size, table.dcp_rank) == (kk, rank % kk)
            assert table.max_num_blocks_per_req == upstream_get_block_table_width()(
                c.attention_block_table_width(MAX_LEN, BLOCK, kk),
                BLOCK,
                token_alignment=128,
            )
        result = h.run_v1(tables, scenario)
        for g in range(len(counts)):
            slots[g][rank] = result["slots"][g]
    return slots, scenario


def v2_sweep(
    dcp: int, interleave: int, device: str = "cpu"
) -> tuple[Slots, h.Scenario]:
    """Model Runner V2 ``BlockTables`` of every rank for the sweep case."""
    counts, scenario, specs, config = sweep_case(dcp, interleave)
    kv_config = h.kv_cache_config(specs)
    shard_counts = h.v2_shard_counts(kv_config, config)
    assert shard_counts == counts
    args = h.v2_table_args(kv_config, config, MAX_LEN)
    states = [2, 0, 3]  # request i lives in state row states[i]
    slots: Slots = {g: {} for g in range(len(counts))}
    first = None
    for rank in range(dcp):
        tables = h.build_v2_tables(
            args,
            cp_size=dcp,
            cp_rank=rank,
            cp_interleave=interleave,
            max_num_reqs=4,
            max_num_batched_tokens=scenario.num_tokens + 64,
            device=device,
            dcp_shard_counts=shard_counts,
        )
        result = h.run_v2(tables, scenario, states, rows_from=first)
        if first is None:
            first = tables
            for g in range(len(counts)):
                row = np.asarray(scenario.rows[g][0])
                assert np.array_equal(result["tables"][g][0][: row.size], row)
        for g in range(len(counts)):
            slots[g][rank] = result["slots"][g]
    return slots, scenario


def check_sweep(
    slots: Slots, scenario: h.Scenario, dcp: int, interleave: int, label: str
) -> None:
    counts = sweep_case(dcp, interleave)[0]
    for g, kk in enumerate(counts):
        check_group(
            slots[g],
            scenario,
            g,
            block_size=BLOCK,
            shard_count=kk,
            interleave=interleave,
            dcp=dcp,
            label=f"{label} D={dcp} I={interleave}",
        )


SWEEP = [(dcp, i) for dcp in (1, 2, 4, 8, 16) for i in (1, 16, BLOCK)]


# Mixed topology at D = 16 ---------------------------------------------------------

D16 = 16
L = 1_000_000


def mixed_specs() -> list[tuple[str, Any]]:
    return [
        ("model.layers.0.self_attn.attn", k.MLAAttentionSpec(block_size=64, **MLA)),
        (
            "model.layers.3.self_attn.attn",
            k.FullAttentionSpec(block_size=64, dcp_kv_shard_count=4, **ATTN),  # type: ignore[call-arg]
        ),
        (
            "model.layers.61.draft.attn",
            k.FullAttentionSpec(block_size=64, dcp_sharded=False, **ATTN),
        ),
        (
            "model.layers.1.linear_attn",
            k.MambaSpec(
                block_size=768,
                shapes=((4, 2048),),
                dtypes=(torch.bfloat16,),
                mamba_cache_mode="align",
                num_speculative_blocks=7,
            ),
        ),
    ]


MIXED_COUNTS = [16, 4, 1, 1]
MIXED_BLOCKS = [64, 64, 64, 768]


def mixed_scenario() -> h.Scenario:
    # A request at the very end of max_model_len (its last 640 positions
    # scheduled) and a short full prefill.
    return h.make_scenario(
        16,
        [L, 2_345],
        [b * kk for b, kk in zip(MIXED_BLOCKS, MIXED_COUNTS, strict=True)],
        first_positions=[L - 640, 0],
    )


def mixed_v1_slots(scenario: h.Scenario, device: str = "cpu") -> Slots:
    config = make_vllm_config(D16, interleave=1, real=True)
    out: Slots = {g: {} for g in range(4)}
    for rank in range(D16):
        layout = block_table_layout(mixed_specs(), config, L, D16, rank)
        tables = h.build_v1_tables(
            [t.block_size for t in layout.tables],
            [t.max_num_blocks_per_req for t in layout.tables],
            [True] * 4,
            1,
            max_num_reqs=2,
            max_num_batched_tokens=scenario.num_tokens + 16,
            device=device,
            dcp_layout=layout,
        )
        result = h.run_v1(tables, scenario)
        assert result["slots"][3] is None  # recurrent state maps no slots
        for g in range(4):
            out[g][rank] = result["slots"][g]
    return out


def mixed_v2_slots(scenario: h.Scenario, device: str = "cpu") -> Slots:
    config = make_vllm_config(D16, interleave=1, real=True)
    kv_config = h.kv_cache_config(mixed_specs())
    counts = h.v2_shard_counts(kv_config, config)
    assert counts == MIXED_COUNTS
    args = h.v2_table_args(kv_config, config, L)
    out: Slots = {g: {} for g in range(4)}
    first = None
    for rank in range(D16):
        tables = h.build_v2_tables(
            args,
            cp_size=D16,
            cp_rank=rank,
            cp_interleave=1,
            max_num_reqs=2,
            max_num_batched_tokens=scenario.num_tokens + 16,
            device=device,
            dcp_shard_counts=counts,
        )
        result = h.run_v2(tables, scenario, [1, 0], rows_from=first)
        if first is None:
            first = tables
        for g in range(4):
            out[g][rank] = result["slots"][g]
    return out


def check_mixed(slots: Slots, scenario: h.Scenario, groups: int, label: str) -> None:
    for g in range(groups):
        check_group(
            slots[g],
            scenario,
            g,
            block_size=MIXED_BLOCKS[g],
            shard_count=MIXED_COUNTS[g],
            interleave=1,
            dcp=D16,
            label=label,
        )
