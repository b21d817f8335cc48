# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Model Runner V2's ``BlockTables`` take their geometry from the spec (this
process is patched), built directly: upstream's path where every K is 1 or
D, one final launch per group, bad shard counts refused, a replicated
sliding window's null masking kept; and DFlash-family drafts' groups checked
against the kernel's CP size. Model Runner V1's tables are in
``test_worker_block_tables``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support import worker as h
from tests.support.specs import full_attention_spec as full
from tests.support.specs import mamba_align
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import DcpGeometryError
from vllm_dcp_geometry.patches.worker import (
    dflash_speculator as dflash_patch,
)
from vllm_dcp_geometry.patches.worker import (
    gpu_block_table as v2_patch,
)

pytestmark = pytest.mark.patches(
    "worker.gpu_block_table",
    "worker.gpu_model_runner_v2",
    "worker.dflash_speculator",
)

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
MLA = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}


# Model Runner V2 -------------------------------------------------------------------


def v2_tables(
    specs: list[tuple[str, Any]], dcp: int, rank: int, *, counts: bool = True
) -> Any:
    config = make_vllm_config(dcp)
    kv_config = h.kv_cache_config(specs)
    args = h.v2_table_args(kv_config, config, 4096)
    extra = {"dcp_shard_counts": h.v2_shard_counts(kv_config, config)} if counts else {}
    return h.build_v2_tables(
        args,
        cp_size=dcp,
        cp_rank=rank,
        cp_interleave=1,
        max_num_reqs=2,
        max_num_batched_tokens=512,
        **extra,
    )


def test_v2_hands_back_to_upstream_where_k_is_1_or_d(v2_on_cpu: None) -> None:
    upstream_like = v2_tables(
        [("a", full(16)), ("b", full(16, dcp_sharded=False)), ("m", mamba_align())],
        4,
        1,
    )
    assert upstream_like.dcp_shard_counts == (4, 1, 1)
    assert upstream_like._dcp_slot_launches is None
    partial = v2_tables(
        [("a", full(16)), ("b", full(16, dcp_kv_shard_count=2)), ("c", full(16))], 4, 3
    )
    assert partial.dcp_shard_counts == (4, 2, 4)
    launches = [
        (x.start, x.stop, x.shard_count, x.shard) for x in partial._dcp_slot_launches
    ]
    # One launch for K in {1, 4} over every group, one for the K=2 run.
    assert launches == [(0, 3, 4, 3), (1, 2, 2, 1)]
    assert partial._dcp_slot_launches[0].enabled.tolist() == [True, False, True]


def test_v2_plan_gives_every_group_one_final_launch() -> None:
    counts = [16, 1, 4, 4, 16, 2, 4, 1, 8]
    enabled = [True, True, True, True, True, True, True, False, True]
    plan = v2_patch.plan_slot_mapping_launches(counts, enabled)
    start, stop, main, on, sharded = plan[0]
    assert (start, stop, main) == (0, len(counts), 4)  # the most common K > 1
    assert sharded == [kk == 4 for kk in counts]
    # The launch that writes each enabled group last, and with which CP_SIZE;
    # K = 1 groups ride in the main launch, unsharded.
    written: dict[int, tuple[int, bool]] = {}
    for start, stop, kk, on, sharded in plan:
        for g, flag, sh in zip(range(start, stop), on, sharded, strict=True):
            if flag:
                written[g] = (kk, sh)
    assert written == {
        0: (16, True),
        1: (4, False),
        2: (4, True),
        3: (4, True),
        4: (16, True),
        5: (2, True),
        6: (4, True),
        8: (8, True),
    }
    # One extra launch per contiguous run of another K: [0], [4], [5], [8].
    assert [(a, b) for a, b, *_ in plan[1:]] == [(0, 1), (4, 5), (5, 6), (8, 9)]


def test_v2_rejects_bad_shard_counts(v2_on_cpu: None) -> None:
    config = make_vllm_config(4)
    specs = [("a", full(16)), ("b", full(16))]
    args = h.v2_table_args(h.kv_cache_config(specs), config, 1024)
    build = dict(
        cp_size=4, cp_rank=1, cp_interleave=1, max_num_reqs=1, max_num_batched_tokens=8
    )
    with pytest.raises(DcpGeometryError, match="2 KV-cache groups"):
        h.build_v2_tables(args, dcp_shard_counts=[4], **build)
    with pytest.raises(DcpGeometryError, match="group 1"):
        h.build_v2_tables(args, dcp_shard_counts=[4, 3], **build)


def window_specs() -> list[tuple[str, Any]]:
    return [
        ("model.layers.0.attn", full(16, dcp_kv_shard_count=2)),
        (
            "model.layers.1.attn",
            k.SlidingWindowSpec(
                block_size=16, sliding_window=64, dcp_sharded=False, **ATTN
            ),
        ),
    ]


def test_v2_keeps_sliding_window_masking_for_replicated_groups(v2_on_cpu: None) -> None:
    scenario = h.make_scenario(3, [900, 300], [32, 16], first_positions=[850, 10])
    gathered = {}
    for name, dcp, counts in (
        ("dcp1", 1, True),
        ("patched", 4, True),
        ("upstream", 4, False),
    ):
        specs = (
            window_specs()
            if dcp > 1
            else [
                (n, k.FullAttentionSpec(block_size=16, **ATTN)) if i == 0 else (n, s)
                for i, (n, s) in enumerate(window_specs())
            ]
        )
        tables = v2_tables(specs, dcp, 1 % dcp, counts=counts)
        h.run_v2(tables, scenario, [1, 0])
        gathered[name] = h.gather_with_window(tables, scenario, [1, 0])[1]
    # The replicated window group keeps DCP1's masking: leading entries are null.
    reach = 64 - 1
    nulled = (850 - reach) // 16
    assert (gathered["patched"][0][:nulled] == 0).all()
    assert gathered["patched"][0][nulled] != 0
    assert np.array_equal(gathered["patched"], gathered["dcp1"])
    # Without per-group counts the tables are upstream's: masking is off.
    assert (gathered["upstream"][0][:nulled] != 0).all()


# DFlash-family drafts -----------------------------------------------------------


def test_dflash_draft_groups_must_match_the_kernel_cp_size() -> None:
    kv_config = h.kv_cache_config(
        [
            ("model.layers.0.attn", full(64)),
            ("draft.layers.0.attn", full(64, dcp_sharded=False)),
            ("draft.layers.1.attn", full(64, dcp_kv_shard_count=4)),
        ]
    )
    # Draft at DCP 1: replicated groups are right, a sharded one is not.
    dflash_patch.check_draft_group_geometry(kv_config, [1], 1, 16)
    with pytest.raises(DcpGeometryError, match=r"KV-cache group 2.*K=4"):
        dflash_patch.check_draft_group_geometry(kv_config, [1, 2], 1, 16)
    # An MLA draft at DCP D: only K = D matches.
    dflash_patch.check_draft_group_geometry(kv_config, [0], 16, 16)
    with pytest.raises(DcpGeometryError, match="KV-cache group 1"):
        dflash_patch.check_draft_group_geometry(kv_config, [1], 16, 16)
