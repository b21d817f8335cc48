# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What unpatched vLLM computes for the slot-mapping cases of
``slot_mapping``, shared by ``tests/test_worker_slot_mapping.py`` and
``tests/gpu/test_gpu_slot_mapping.py``: the mixed D = 16 topology's slots as
unpatched vLLM computes them (``unpatched_mixed``, run in a fresh unpatched
process from ``unpatched_mixed_data``), the check that they break the
contract for the replicated and partial groups, and the D = 1 outputs that
must be byte-identical to unpatched vLLM (``dcp1_outputs``). Importable
unpatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support import worker as h
from tests.support.slot_mapping import (
    ATTN,
    D16,
    MLA,
    L,
    check_group,
    mixed_scenario,
    mixed_specs,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import contract as c
from vllm_dcp_geometry.runtime.geometry import (
    block_table_layout,
)
from vllm_dcp_geometry.tooling.cli.simulate.workers import emulate_dcp_group

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
