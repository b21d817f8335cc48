# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The contract inside vLLM's real KV-cache specs (this process is patched)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support.processes import run_python
from tests.support.specs import answers, build_specs, mamba_align
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import DcpGeometryError, with_dcp_kv_shard_count
from vllm_dcp_geometry import contract as c

pytestmark = pytest.mark.patches("common.kv_cache_interface")

L = 1_000_000
ATTN = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
MLA = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}


def full(block_size: int = 64, **kw: object) -> k.FullAttentionSpec:
    return k.FullAttentionSpec(block_size=block_size, **ATTN, **kw)  # type: ignore[arg-type]


def test_module_function_and_method_exist() -> None:
    assert k.get_kv_cache_dcp_shard_count(full(), 16) == 16  # type: ignore[attr-defined]
    for cls in (
        k.KVCacheSpec,
        k.AttentionSpec,
        k.MambaSpec,
        k.UniformTypeKVCacheSpecs,
        k.MLAAttentionSpec,
    ):
        assert callable(cls.dcp_shard_count)  # type: ignore[attr-defined]


def test_sharded_attention() -> None:
    spec = full()
    cfg = make_vllm_config(16)
    assert spec.dcp_shard_count(16) == 16  # type: ignore[attr-defined]
    assert spec.max_num_blocks_per_req(cfg, L) == 977


def test_replicated_attention_keeps_dcp1_geometry() -> None:
    spec = full(dcp_sharded=False)
    cfg = make_vllm_config(16)
    assert spec.dcp_shard_count(16) == 1  # type: ignore[attr-defined]
    assert spec.max_num_blocks_per_req(cfg, L) == 15625
    assert spec.max_memory_usage_bytes(cfg) == c.cdiv(L, 64) * spec.page_size_bytes


def test_mamba_state_is_one_shard_and_1310_columns() -> None:
    spec = mamba_align()
    cfg = make_vllm_config(16, mamba_cache_mode="align")
    assert k.get_kv_cache_dcp_shard_count(spec, 16) == 1  # type: ignore[attr-defined]
    width = spec.max_num_blocks_per_req(cfg, L)
    assert width == 1310
    assert width != c.cdiv(L, 768 * 16) + 7  # never the DCP-scaled 89


@pytest.mark.parametrize(
    ("count", "width", "aligned"),
    [
        (1, 15625, 15626),
        (2, 7813, 7814),
        (4, 3907, 3908),
        (8, 1954, 1954),
        (16, 977, 978),
    ],
)
def test_partial_shards_at_dcp16(count: int, width: int, aligned: int) -> None:
    from vllm_dcp_geometry.runtime.geometry import upstream_get_block_table_width

    # vLLM's own, from its home on the installed release.
    get_block_table_width = upstream_get_block_table_width()
    spec = full(dcp_kv_shard_count=count)
    cfg = make_vllm_config(16)
    assert spec.dcp_shard_count(16) == count  # type: ignore[attr-defined]
    assert spec.max_num_blocks_per_req(cfg, L) == width == c.cdiv(L, 64 * count)
    assert (
        get_block_table_width(
            width, spec.block_size, token_alignment=spec.block_table_token_alignment
        )
        == aligned
    )
    assert spec.max_memory_usage_bytes(cfg) == (
        c.cdiv(c.cdiv(L, count), 64) * spec.page_size_bytes
    )


def test_aggregate_spec_shares_one_count() -> None:
    four = full(dcp_kv_shard_count=4)
    agg = k.UniformTypeKVCacheSpecs(
        block_size=64, kv_cache_specs={"layers.0.attn": four, "layers.1.attn": four}
    )
    assert agg.dcp_shard_count(16) == 4  # type: ignore[attr-defined]
    assert agg.max_num_blocks_per_req(make_vllm_config(16), L) == 3907
    mixed = {"layers.0.attn": four, "layers.1.attn": full(dcp_kv_shard_count=8)}
    assert not k.UniformTypeKVCacheSpecs.is_uniform_type(mixed)
    assert k.UniformTypeKVCacheSpecs.from_specs(mixed) is None
    forced = k.UniformTypeKVCacheSpecs(block_size=64, kv_cache_specs=mixed)
    with pytest.raises(DcpGeometryError, match=r"K=4: layers\.0\.attn.*K=8"):
        forced.dcp_shard_count(16)  # type: ignore[attr-defined]


def test_aggregate_of_mamba_layers() -> None:
    agg = k.UniformTypeKVCacheSpecs(
        block_size=768, kv_cache_specs={"a": mamba_align(), "b": mamba_align()}
    )
    assert agg.dcp_shard_count(16) == 1  # type: ignore[attr-defined]
    assert agg.max_num_blocks_per_req(make_vllm_config(16), L) == 1310


@pytest.mark.parametrize("bad", [3, 32])
def test_invalid_counts_raise_naming_spec_k_and_d(bad: int) -> None:
    spec = full(dcp_kv_shard_count=bad)
    with pytest.raises(DcpGeometryError, match=rf"FullAttentionSpec.*K={bad}.*D=16"):
        k.get_kv_cache_dcp_shard_count(spec, 16)  # type: ignore[attr-defined]
    with pytest.raises(DcpGeometryError):
        spec.max_num_blocks_per_req(make_vllm_config(16), L)


def test_zero_is_rejected_at_construction() -> None:
    with pytest.raises(DcpGeometryError, match="must be >= 1"):
        full(dcp_kv_shard_count=0)
    with pytest.raises(DcpGeometryError, match="must be >= 1"):
        with_dcp_kv_shard_count(full(), 0)


def test_partial_on_replicated_spec_is_rejected() -> None:
    spec = full(dcp_sharded=False, dcp_kv_shard_count=4)
    with pytest.raises(DcpGeometryError, match="replicated"):
        k.get_kv_cache_dcp_shard_count(spec, 16)  # type: ignore[attr-defined]
    with pytest.raises(DcpGeometryError, match="replicated"):
        spec.max_num_blocks_per_req(make_vllm_config(16), L)


def test_world_size_below_one_is_rejected() -> None:
    with pytest.raises(DcpGeometryError, match=">= 1"):
        k.get_kv_cache_dcp_shard_count(full(), 0)  # type: ignore[attr-defined]


def test_unknown_spec_type_is_an_error_not_a_guess() -> None:
    @dataclasses.dataclass(frozen=True)
    class OddSpec(k.KVCacheSpec):
        pass

    odd = OddSpec(block_size=16)
    assert k.get_kv_cache_dcp_shard_count(odd, 1) == 1  # type: ignore[attr-defined]
    with pytest.raises(DcpGeometryError, match=r"OddSpec.*does not know"):
        k.get_kv_cache_dcp_shard_count(odd, 16)  # type: ignore[attr-defined]


def test_with_dcp_kv_shard_count() -> None:
    spec = full()
    four = with_dcp_kv_shard_count(spec, 4)
    assert four.dcp_kv_shard_count == 4
    assert four != spec
    assert dataclasses.replace(four, dcp_kv_shard_count=None) == spec
    assert with_dcp_kv_shard_count(four, None) == spec
    assert with_dcp_kv_shard_count(four, None).dcp_kv_shard_count is None
    with pytest.raises(DcpGeometryError, match="MambaSpec has no token-position"):
        with_dcp_kv_shard_count(mamba_align(), 4)


def test_shard_count_survives_every_path() -> None:
    spec = k.MLAAttentionSpec(block_size=64, dcp_kv_shard_count=4, **MLA)  # type: ignore[arg-type]
    assert dataclasses.replace(spec, block_size=32).dcp_kv_shard_count == 4
    assert spec.copy_with_new_block_size(16).dcp_kv_shard_count == 4
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert pickle.loads(pickle.dumps(spec)).dcp_kv_shard_count == 4
    assert copy.deepcopy(spec).dcp_kv_shard_count == 4
    assert "dcp_kv_shard_count=4" in repr(spec)
    assert "dcp_kv_shard_count" in {f.name for f in dataclasses.fields(spec)}
    merged = k.MLAAttentionSpec.merge([spec, spec])
    assert merged.dcp_kv_shard_count == 4
    assert merged == spec


@pytest.mark.parametrize(
    "make",
    [
        lambda **kw: k.FullAttentionSpec(block_size=16, **ATTN, **kw),
        lambda **kw: k.MLAAttentionSpec(block_size=64, **MLA, **kw),
        lambda **kw: k.RSWASpec(block_size=16, rswa_window=64, **ATTN, **kw),
        lambda **kw: k.SinkFullAttentionSpec(block_size=16, sink_len=4, **ATTN, **kw),
        lambda **kw: k.SlidingWindowMLASpec(
            block_size=64, sliding_window=128, dcp_sharded=False, **MLA, **kw
        ),
    ],
)
def test_merge_keeps_count_and_refuses_mixed_counts(make: object) -> None:
    four, eight, bare = make(dcp_kv_shard_count=4), make(dcp_kv_shard_count=8), make()  # type: ignore[operator]
    merged = type(four).merge([four, four])
    assert merged.dcp_kv_shard_count == 4
    assert type(bare).merge([bare, bare]).dcp_kv_shard_count is None
    with pytest.raises(DcpGeometryError, match="different dcp_kv_shard_count"):
        type(four).merge([four, eight])
    with pytest.raises(DcpGeometryError, match="different dcp_kv_shard_count"):
        type(four).merge([four, bare])


def test_subclass_defined_after_register_gets_the_field() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class LateSpec(k.FullAttentionSpec):
        extra: int = 0

        @classmethod
        def merge(cls, specs):  # type: ignore[no-untyped-def]
            # An explicit field list, as upstream writes them; drops K.
            base = specs[0]
            return cls(block_size=base.block_size, **ATTN, extra=base.extra)

    late = LateSpec(block_size=16, **ATTN, dcp_kv_shard_count=2)  # type: ignore[arg-type]
    assert late.dcp_shard_count(8) == 2  # type: ignore[attr-defined]
    assert late != dataclasses.replace(late, dcp_kv_shard_count=None)
    assert LateSpec.merge([late, late]).dcp_kv_shard_count == 2


def test_resolve_dcp_kv_cache_spec_keeps_the_count() -> None:
    from vllm.v1.core import kv_cache_utils

    spec = full(dcp_kv_shard_count=4)
    resolved = kv_cache_utils.resolve_dcp_kv_cache_spec(spec, 16)
    assert resolved.dcp_kv_shard_count == 4  # type: ignore[attr-defined]


def test_specs_without_a_count_answer_as_unpatched_vllm() -> None:
    """Differential: every spec type at D=1 and D=16 (no K set) against a
    fresh, unpatched vLLM 0.33.0 process. Widths, memory, page sizes, merge,
    repr and pickled bytes must all be identical."""
    script = """
import json
from tests.support.specs import answers
print(json.dumps({"1": answers(1), "16": answers(16)}))
"""
    unpatched = run_python(script, patched=False)
    patched = {"1": answers(1), "16": answers(16)}
    assert set(patched["1"]) == set(build_specs())
    for dcp in ("1", "16"):
        for name, row in unpatched[dcp].items():
            assert patched[dcp][name] == row, (dcp, name)
