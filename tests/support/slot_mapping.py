# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The slot-mapping cases of every DCP rank and their checks, shared by
``tests/test_worker_slot_mapping.py`` (CPU, the Triton interpreter) and
``tests/gpu/test_gpu_slot_mapping.py`` (compiled kernels): the sweep (D in
{1, 2, 4, 8, 16}, every K | D, I in {1, 16, B}) and the mixed D = 16 topology
on Model Runner V1's and V2's real block tables (``v1_sweep``, ``v2_sweep``,
``mixed_v1_slots``, ``mixed_v2_slots``), the contract's invariants over all D
ranks of a group (``check_group`` and the checks built on it), the same
topology as unpatched vLLM computes it (``unpatched_mixed``, run in a fresh
unpatched process from ``unpatched_mixed_data``) and the D = 1 outputs that
must be byte-identical to unpatched vLLM (``dcp1_outputs``). Every ``device``
argument is ``"cpu"`` or ``"cuda"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
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
from vllm_dcp_geometry.tooling.cli.simulate.workers import emulate_dcp_group

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


# Unpatched vLLM gets the replicated and partial groups wrong ----------------------


def unpatched_mixed(data: dict[str, Any], device: str = "cpu") -> dict[str, Any]:
    """Slots of every rank as unpatched vLLM computes them for the mixed
    topology: every table and ``BlockTables`` on the global DCP geometry."""
    scenario = mixed_scenario()
    out: dict[str, Any] = {"v1": {}, "v2": {}}
    first = None
    for rank in range(data["dcp"]):
        tables = h.build_v1_tables(
            data["block_sizes"],
            data["widths"],
            data["token_slots"],
            1,
            max_num_reqs=2,
            max_num_batched_tokens=data["max_tokens"],
            device=device,
        )
        emulate_dcp_group(tables, data["dcp"], rank)
        out["v1"][rank] = h.jsonable(h.run_v1(tables, scenario))["slots"]
        v2 = h.build_v2_tables(
            data["v2_args"],
            cp_size=data["dcp"],
            cp_rank=rank,
            cp_interleave=1,
            max_num_reqs=2,
            max_num_batched_tokens=data["max_tokens"],
            device=device,
        )
        result = h.run_v2(v2, scenario, [1, 0], rows_from=first)
        out["v2"][rank] = h.jsonable(result)["slots"]
        if first is None:
            first = v2
    return out


def mismatching_ranks(
    slots_by_rank: dict[int, Sequence[int]],
    scenario: h.Scenario,
    group: int,
    block_size: int,
    shard_count: int,
) -> list[int]:
    """Ranks whose slots differ from the contract's reference."""
    bad = []
    for rank, slots in sorted(slots_by_rank.items()):
        ref = np.concatenate(
            [
                c.reference_slot_mapping(
                    np.arange(first, seq_len),
                    scenario.rows[group][req],
                    block_size=block_size,
                    shard_count=shard_count,
                    interleave_size=1,
                    shard=rank % shard_count,
                )
                for req, (seq_len, first) in enumerate(
                    zip(scenario.seq_lens, scenario.first_positions, strict=True)
                )
            ]
        )
        if not np.array_equal(np.asarray(slots)[: scenario.num_tokens], ref):
            bad.append(rank)
    return bad


def unpatched_mixed_data() -> dict[str, Any]:
    """What the unpatched run needs from the patched side."""
    scenario = mixed_scenario()
    config = make_vllm_config(D16, interleave=1, real=True)
    layout = block_table_layout(mixed_specs(), config, L, D16, 0)
    v2_args = h.v2_table_args(h.kv_cache_config(mixed_specs()), config, L)
    data = {
        "dcp": D16,
        "block_sizes": [t.block_size for t in layout.tables],
        # The patched widths, so only the slot mapping differs.
        "widths": [t.max_num_blocks_per_req for t in layout.tables],
        # What unpatched V1 picks from the cache kind: NONE only for Mamba.
        "token_slots": [True, True, True, False],
        "v2_args": v2_args,
        "max_tokens": scenario.num_tokens + 16,
    }
    return data


def check_unpatched_mixed_fails(out: dict[str, Any]) -> None:
    """Unpatched slots break the contract for the partial group (both runners)
    and the replicated group (V1), while the sharded group is right."""
    scenario = mixed_scenario()

    def group_slots(side: str, g: int) -> dict[int, list[int]]:
        return {int(r): v[g] for r, v in out[side].items()}

    # The sharded group is right upstream too: the harness itself is sound.
    for side in ("v1", "v2"):
        assert mismatching_ranks(group_slots(side, 0), scenario, 0, 64, 16) == []
        with pytest.raises(AssertionError):
            check_group(
                {r: np.asarray(s) for r, s in group_slots(side, 1).items()},
                scenario,
                1,
                block_size=64,
                shard_count=4,
                interleave=1,
                dcp=D16,
                label=f"unpatched {side} partial",
            )
    # V1 gives the replicated draft group the 16-shard mapping: 15 of 16
    # positions never stored, the rest in the wrong slots.
    assert mismatching_ranks(group_slots("v1", 2), scenario, 2, 64, 1) == list(
        range(D16)
    )
    with pytest.raises(AssertionError):
        check_group(
            {r: np.asarray(s) for r, s in group_slots("v1", 2).items()},
            scenario,
            2,
            block_size=64,
            shard_count=1,
            interleave=1,
            dcp=D16,
            label="unpatched v1 replicated",
        )
    # The partial group is wrong on every rank in both runners.
    for side in ("v1", "v2"):
        assert len(mismatching_ranks(group_slots(side, 1), scenario, 1, 64, 4)) > 0
    # Upstream V2 already maps replicated groups locally (its dcp_sharded bool).
    assert mismatching_ranks(group_slots("v2", 2), scenario, 2, 64, 1) == []


# D = 1 is byte-identical to unpatched vLLM ----------------------------------------


def dcp1_specs() -> list[tuple[str, Any]]:
    return [
        ("model.layers.0.attn", k.FullAttentionSpec(block_size=16, **ATTN)),
        (
            "model.encoder.layers.0.attn",
            k.EncoderOnlyAttentionSpec(block_size=16, **ATTN),
        ),
        (
            "model.layers.1.attn",
            k.SlidingWindowSpec(block_size=16, sliding_window=128, **ATTN),
        ),
        ("model.layers.2.attn", k.MLAAttentionSpec(block_size=64, **MLA)),
        (
            "model.layers.3.mixer",
            k.MambaSpec(
                block_size=256,
                shapes=((4, 256),),
                dtypes=(torch.bfloat16,),
                mamba_cache_mode="align",
                num_speculative_blocks=2,
            ),
        ),
    ]


DCP1_LEN = 3000
DCP1_LENS = [3000, 1234, 77]
DCP1_FIRST = [2900, 0, 40]


def dcp1_outputs(patched: bool, device: str = "cpu") -> dict[str, Any]:
    """Block tables and slot mappings at D = 1, through the real V1 runner
    method and V2 ``BlockTables`` (and, patched, the explicit-layout path)."""
    specs = dcp1_specs()
    config = make_vllm_config(1, interleave=1, real=True)
    kv_config = h.kv_cache_config(specs)
    runner = h.v1_runner_input_batch(
        kv_config,
        config,
        max_model_len=DCP1_LEN,
        dcp_rank=0,
        max_num_reqs=4,
        max_num_tokens=2048,
        device=device,
    )
    v1_groups = [0, 2, 3, 4]  # the encoder-only group has no table
    scenario = h.make_scenario(
        7,
        DCP1_LENS,
        [specs[g][1].block_size for g in v1_groups],
        first_positions=DCP1_FIRST,
    )
    out = {"v1_runner": h.jsonable(h.run_v1(runner.input_batch.block_table, scenario))}
    if patched:
        layout = block_table_layout(
            [specs[g] for g in v1_groups], config, DCP1_LEN, 1, 0
        )
        tables = h.build_v1_tables(
            [t.block_size for t in layout.tables],
            [t.max_num_blocks_per_req for t in layout.tables],
            [True] * 4,
            1,
            max_num_reqs=4,
            max_num_batched_tokens=2048,
            device=device,
            dcp_layout=layout,
        )
        out["v1_layout"] = h.jsonable(h.run_v1(tables, scenario))
    args = h.v2_table_args(kv_config, config, DCP1_LEN)
    v2_scenario = h.make_scenario(
        8, DCP1_LENS, [s.block_size for _, s in specs], first_positions=DCP1_FIRST
    )
    extra = (
        {"dcp_shard_counts": h.v2_shard_counts(kv_config, config)} if patched else {}
    )
    v2 = h.build_v2_tables(
        args,
        cp_size=1,
        cp_rank=0,
        cp_interleave=1,
        max_num_reqs=4,
        max_num_batched_tokens=2048,
        device=device,
        **extra,
    )
    out["v2"] = h.jsonable(h.run_v2(v2, v2_scenario, [3, 1, 0]))
    out["v2_window"] = [
        t.tolist() for t in h.gather_with_window(v2, v2_scenario, [3, 1, 0])
    ]
    out["v1_widths"] = [
        t.max_num_blocks_per_req for t in runner.input_batch.block_table.block_tables
    ]
    out["v2_widths"] = args["max_num_blocks_per_group"]
    return out
