# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Worker block tables take their geometry from the spec (this process is patched).

Model Runner V1's real ``may_reinitialize_input_batch`` runs on a runner state
without a model (V2's ``BlockTables``, built directly, and DFlash-family
drafts are in ``test_worker_block_tables_v2``). Slot mappings themselves are
checked rank by rank in ``test_worker_slot_mapping.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support import worker as h
from tests.support.specs import full_attention_spec as full
from tests.support.specs import mamba_align
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import DcpGeometryError, plugin
from vllm_dcp_geometry import contract as c
from vllm_dcp_geometry.patches.worker import (
    block_table as v1_patch,
)
from vllm_dcp_geometry.patches.worker import (
    dflash_speculator as dflash_patch,
)
from vllm_dcp_geometry.patches.worker import (
    gpu_block_table as v2_patch,
)
from vllm_dcp_geometry.patches.worker import (
    gpu_model_runner as v1_runner_patch,
)
from vllm_dcp_geometry.patches.worker import (
    gpu_model_runner_v2 as v2_runner_patch,
)
from vllm_dcp_geometry.runtime.geometry import (
    block_table_layout,
    input_batch_layout,
    upstream_get_block_table_width,
)
from vllm_dcp_geometry.runtime.patching import original_of

pytestmark = pytest.mark.patches(
    "worker.block_table",
    "worker.gpu_model_runner",
    "worker.gpu_block_table",
    "worker.gpu_model_runner_v2",
    "worker.dflash_speculator",
)

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
MLA = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
L = 1_000_000


MODEL_RUNNER_V1 = pytest.mark.vllm_releases("0.33.0")
"""Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it)."""


def _assert_wrapped(rows: Any) -> None:
    for patch, upstream, owner, name in rows:
        assert plugin.applied_patches()[patch.__name__] == upstream.__name__
        assert original_of(owner.__dict__[name]) is not owner.__dict__[name]


@MODEL_RUNNER_V1
def test_v1_worker_patches_apply_and_wrap_upstream() -> None:
    import vllm.v1.worker.block_table as bt
    import vllm.v1.worker.gpu_model_runner as mr

    _assert_wrapped(
        (
            (v1_patch, bt, bt.BlockTable, "__init__"),
            (v1_patch, bt, bt.MultiGroupBlockTable, "__init__"),
            (v1_runner_patch, mr, mr.GPUModelRunner, "may_reinitialize_input_batch"),
        )
    )


def test_worker_patches_apply_and_wrap_upstream() -> None:
    import vllm.v1.worker.gpu.block_table as gbt
    import vllm.v1.worker.gpu.model_runner as gmr
    import vllm.v1.worker.gpu.spec_decode.dflash.speculator as dfs

    _assert_wrapped(
        (
            (v2_patch, gbt, gbt.BlockTables, "__init__"),
            (v2_patch, gbt, gbt.BlockTables, "compute_slot_mappings"),
            (v2_runner_patch, gmr, gmr.GPUModelRunner, "initialize_kv_cache"),
            (dflash_patch, dfs, dfs.DFlashSpeculator, "set_attn"),
        )
    )


# Model Runner V1 -------------------------------------------------------------------


def v1_specs() -> list[tuple[str, Any]]:
    return [
        ("model.layers.0.self_attn.attn", k.MLAAttentionSpec(block_size=64, **MLA)),
        (
            "model.encoder.layers.0.attn",
            k.EncoderOnlyAttentionSpec(block_size=16, **ATTN),
        ),
        ("model.layers.3.self_attn.attn", full(dcp_kv_shard_count=4)),
        ("model.layers.61.draft.attn", full(dcp_sharded=False)),
        ("model.layers.1.linear_attn", mamba_align()),
    ]


def registered_slot_warmups(runner: Any) -> list[dict[str, Any]]:
    import vllm.v1.worker.block_table as bt

    registrations = runner.jit_warmup_registry._registrations
    return [kw for _, kw in registrations.get(bt._COMPUTE_SLOT_MAPPING_KERNEL, [])]


@MODEL_RUNNER_V1
def test_v1_runner_builds_tables_from_the_specs() -> None:
    config = make_vllm_config(16, real=True)
    kv_config = h.kv_cache_config(v1_specs())
    runner = h.v1_runner_input_batch(
        kv_config,
        config,
        max_model_len=L,
        dcp_rank=6,
        max_num_reqs=2,
        max_num_tokens=64,
    )
    tables = runner.input_batch.block_table.block_tables
    # The encoder-only group (group 1) has no table: table index != group index.
    assert [t.block_size for t in tables] == [64, 64, 64, 768]
    assert [t.max_num_blocks_per_req for t in tables] == [978, 3908, 15626, 1310]
    assert [(t.dcp_world_size, t.dcp_rank) for t in tables] == [
        (16, 6),
        (4, 2),
        (1, 0),
        (1, 0),
    ]
    modes = [t.slot_mapping_mode.name for t in tables]
    assert modes == ["TOKEN_TO_KV_SLOT"] * 3 + ["NONE"]
    layout = runner.dcp_geometry_layout
    assert [t.owner.split(" (")[0] for t in layout.tables] == [
        "KV-cache group 0",
        "KV-cache group 2",
        "KV-cache group 3",
        "KV-cache group 4",
    ]
    # Warmup compiles the kernels the tables launch, with the group's K.
    warm = {
        (w["total_cp_world_size"], w["total_cp_rank"])
        for w in registered_slot_warmups(runner)
    }
    assert warm == {(16, 6), (4, 2), (1, 0)}


@MODEL_RUNNER_V1
def test_v1_runner_rebuilds_where_upstream_sees_no_change() -> None:
    # One replicated group whose block size and width equal the placeholder
    # the runner starts with: upstream keeps its placeholder tables, which use
    # the global DCP size.
    config = make_vllm_config(4, real=True)
    kv_config = h.kv_cache_config(
        [("model.layers.0.attn", full(16, dcp_sharded=False))]
    )
    runner = h.v1_runner_input_batch(
        kv_config,
        config,
        max_model_len=4096,
        dcp_rank=3,
        max_num_reqs=2,
        max_num_tokens=64,
    )
    (table,) = runner.input_batch.block_table.block_tables
    assert (table.dcp_world_size, table.dcp_rank) == (1, 0)
    assert table.max_num_blocks_per_req == 4096 // 16
    batch = runner.input_batch
    import vllm.v1.worker.gpu_model_runner as mr

    mr.GPUModelRunner.may_reinitialize_input_batch(runner, kv_config)
    assert runner.input_batch is batch  # nothing changed: no second rebuild


@MODEL_RUNNER_V1
def test_v1_runner_at_dcp1_calls_upstream_unchanged() -> None:
    config = make_vllm_config(1, real=True)
    kv_config = h.kv_cache_config(v1_specs())
    runner = h.v1_runner_input_batch(
        kv_config,
        config,
        max_model_len=4096,
        dcp_rank=0,
        max_num_reqs=2,
        max_num_tokens=64,
    )
    assert not hasattr(runner, "dcp_geometry_layout")
    assert not hasattr(runner.input_batch.block_table, "dcp_geometry_layout")


@MODEL_RUNNER_V1
def test_v1_slot_mode_and_alignment_come_from_the_spec() -> None:
    config = make_vllm_config(4)
    specs = [
        ("ring", k.CircularBufferSpec(block_size=8, **ATTN)),
        ("hot", k.HiSparseHotSpec(block_size=64, page_size=4096, blocks_per_request=3)),
        ("full", full(16)),
    ]
    layout = block_table_layout(specs, config, 8192, 4, 1)
    ring, hot, plain = layout.tables
    # Specs that address their own pages: no slot mapping, no token alignment.
    assert (ring.uses_slot_mapping, ring.width) == (False, 1)
    assert (hot.uses_slot_mapping, hot.width) == (False, 3)
    assert plain.uses_slot_mapping
    assert plain.width == upstream_get_block_table_width()(
        8192 // 64, 16, token_alignment=128
    )
    tables = h.build_v1_tables(
        [t.block_size for t in layout.tables],
        [t.max_num_blocks_per_req for t in layout.tables],
        [True] * 3,  # upstream's kind-based choice; the layout overrides it
        1,
        max_num_reqs=2,
        max_num_batched_tokens=32,
        dcp_layout=layout,
    )
    assert [t.slot_mapping_mode.name for t in tables.block_tables] == [
        "NONE",
        "NONE",
        "TOKEN_TO_KV_SLOT",
    ]
    assert [t.max_num_blocks_per_req for t in tables.block_tables] == [
        1,
        3,
        plain.width,
    ]


@MODEL_RUNNER_V1
def test_v1_layout_must_match_the_runner_arguments() -> None:
    layout = block_table_layout(
        [("a", full(16)), ("b", full(16, dcp_sharded=False))],
        make_vllm_config(2),
        1024,
        2,
        0,
    )
    with pytest.raises(DcpGeometryError, match="2 tables"):
        h.build_v1_tables(
            [16],
            [layout.tables[0].max_num_blocks_per_req],
            [True],
            1,
            max_num_reqs=1,
            max_num_batched_tokens=8,
            dcp_layout=layout,
        )
    with pytest.raises(DcpGeometryError, match="blocks per request"):
        h.build_v1_tables(
            [16, 16],
            [7, 7],
            [True, True],
            1,
            max_num_reqs=1,
            max_num_batched_tokens=8,
            dcp_layout=layout,
        )


def test_group_geometry_rejects_a_k_that_does_not_divide_d() -> None:
    with pytest.raises(DcpGeometryError, match="divide"):
        c.GroupGeometry("g", shard_count=3, dcp_world_size=4, dcp_rank=1)
    with pytest.raises(DcpGeometryError, match="outside"):
        c.GroupGeometry("g", shard_count=2, dcp_world_size=4, dcp_rank=4)


def test_layout_errors_name_the_group() -> None:
    config = make_vllm_config(4)
    with pytest.raises(DcpGeometryError, match="KV-cache group 1"):
        input_batch_layout(
            h.kv_cache_config([("a", full(16)), ("b", full(16, dcp_kv_shard_count=3))]),
            config,
            1024,
            4,
            0,
        )
    with pytest.raises(DcpGeometryError, match=r"only: B=16 .* I=24|I=24"):
        block_table_layout(
            [("only", full(16))], make_vllm_config(4, interleave=24), 1024, 4, 0
        )


def test_partial_k_with_pcp_is_rejected() -> None:
    from vllm.config import CacheConfig, ParallelConfig

    # DCP spanning TP x PCP, as vLLM allows with PCP on.
    parallel = ParallelConfig(
        tensor_parallel_size=4,
        prefill_context_parallel_size=2,
        decode_context_parallel_size=8,
    )
    config = SimpleNamespace(parallel_config=parallel, cache_config=CacheConfig())
    specs = [("layers.0", full(16)), ("layers.1", full(16, dcp_kv_shard_count=2))]
    with pytest.raises(DcpGeometryError, match=r"layers.1.*PCP=2"):
        block_table_layout(specs, config, 1024, 8, 0)
    with pytest.raises(DcpGeometryError, match=r"group 1.*PCP=2"):
        h.v2_shard_counts(h.kv_cache_config(specs), config)
    # K in {1, D} keeps upstream's PCP behaviour.
    ok = [("layers.0", full(16)), ("layers.1", full(16, dcp_sharded=False))]
    assert h.v2_shard_counts(h.kv_cache_config(ok), config) == [8, 1]
