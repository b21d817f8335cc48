# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every scheduler-side copy of the DCP rule asks the spec, or refuses K.

Admission checks, the block-size helpers (and the modules that imported them
by name), memory planning, capacity and KV connectors, on real vLLM objects.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support import scheduler as topo
from tests.support.processes import run_python
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import DcpGeometryError, contract
from vllm_dcp_geometry.runtime.patching import original_of

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "engine_core.kv_cache_utils",
    "engine_core.single_type_kv_cache_manager",
    "engine_core.kv_cache_coordinator",
    "engine_core.kv_cache_planning",
    "engine_core.kv_connector_base",
    "benchmarks.forward_batch",
)

B = topo.ATTENTION_BLOCK


def sliding(**kwargs):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=B,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        sliding_window=1024,
        **kwargs,
    )


def mla(**kwargs):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=B, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, **kwargs
    )


# Block-size helpers ------------------------------------------------------------


def test_resolve_dcp_kv_block_size_and_spec_follow_k() -> None:
    from vllm.v1.core.kv_cache_utils import (
        resolve_dcp_kv_block_size,
        resolve_dcp_kv_cache_spec,
    )
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    partial = topo.attention_spec(dcp_kv_shard_count=4)
    assert resolve_dcp_kv_block_size(partial, 16) == B * 4
    assert resolve_dcp_kv_block_size(partial, 1) == B
    assert resolve_dcp_kv_block_size(topo.attention_spec(), 16) == B * 16
    assert resolve_dcp_kv_block_size(topo.attention_spec(dcp_kv_shard_count=1), 16) == B
    assert resolve_dcp_kv_block_size(topo.mamba_spec(), 16) == topo.MAMBA_BLOCK
    resolved = resolve_dcp_kv_cache_spec(partial, 16)
    assert resolved.block_size == B * 4
    assert resolved.dcp_kv_shard_count == 4
    uniform = UniformTypeKVCacheSpecs(
        block_size=B, kv_cache_specs={"a": partial, "b": partial}
    )
    resolved = resolve_dcp_kv_cache_spec(uniform, 16)
    assert resolved.block_size == B * 4
    assert {s.block_size for s in resolved.kv_cache_specs.values()} == {B * 4}
    with pytest.raises(DcpGeometryError, match="K=3"):
        resolve_dcp_kv_block_size(topo.attention_spec(dcp_kv_shard_count=3), 16)


@pytest.mark.parametrize(
    ("spec_kwargs", "expected"),
    [
        ({}, B * 16),
        ({"dcp_kv_shard_count": 4}, B * 4),
        ({"dcp_sharded": False}, B),
        ({"dcp_kv_shard_count": 1}, B),
    ],
)
def test_single_group_block_sizes(spec_kwargs: dict, expected: int) -> None:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = topo.make_kv_cache_config({"only": topo.attention_spec(**spec_kwargs)}, 8)
    for caching in (True, False):
        vllm_config = topo.scheduler_config(16, enable_prefix_caching=caching)
        assert resolve_kv_cache_block_sizes(config, vllm_config) == (
            expected,
            expected,
        )


def test_single_group_prefix_match_unit_checked_against_virtual_block() -> None:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = topo.make_kv_cache_config(
        {"only": topo.attention_spec(dcp_kv_shard_count=4)}, 8
    )
    vllm_config = topo.scheduler_config(16)
    vllm_config.cache_config.prefix_match_unit = B * 16
    with pytest.raises(ValueError, match=f"block size \\({B * 4}\\)"):
        resolve_kv_cache_block_sizes(config, vllm_config)


def test_invalid_shard_count_fails_at_start_up() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    specs = topo.topology_specs(partial=False)
    specs["partial"] = topo.attention_spec(dcp_kv_shard_count=3)
    config = topo.make_kv_cache_config(specs, 64)
    with pytest.raises(DcpGeometryError, match=r"group 1 .*K=3.*D=16"):
        resolve_kv_cache_block_sizes(config, topo.scheduler_config(16))
    with pytest.raises(DcpGeometryError, match="K=3"):
        KVCacheManager(config, 4096, 3072, 64, enable_caching=True, dcp_world_size=16)


def test_partial_k_with_pcp_rejected() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = topo.make_kv_cache_config(topo.topology_specs(partial=True), 64)
    with pytest.raises(DcpGeometryError, match=r"group 1 .*K=4.*PCP=2"):
        resolve_kv_cache_block_sizes(config, topo.scheduler_config(16, pcp=2))
    # Upstream geometry with PCP still resolves.
    plain = topo.make_kv_cache_config(topo.topology_specs(partial=False), 64)
    assert resolve_kv_cache_block_sizes(plain, topo.scheduler_config(16, pcp=2))
    with pytest.raises(DcpGeometryError, match="PCP=2"):
        KVCacheManager(
            config,
            4096,
            3072,
            64,
            enable_caching=True,
            dcp_world_size=16,
            pcp_world_size=2,
        )


# Coordinator admission -------------------------------------------------------------


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (lambda: sliding(dcp_kv_shard_count=4), "SlidingWindowSpec with a partial"),
        (lambda: sliding(dcp_kv_shard_count=1), "K=1 while flagged dcp_sharded"),
    ],
)
def test_coordinator_rejects_what_managers_cannot_run(spec, message, caching) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    for specs in ({"x": spec()}, {"full": topo.attention_spec(), "x": spec()}):
        config = topo.make_kv_cache_config(specs, 64)
        with pytest.raises(DcpGeometryError, match=message):
            KVCacheManager(
                config, 4096, B * 16, B, enable_caching=caching, dcp_world_size=16
            )


def test_coordinator_admits_partial_full_attention_and_mla() -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    specs = {
        "full": topo.attention_spec(),
        "partial": topo.attention_spec(dcp_kv_shard_count=4),
        "mla_partial": mla(dcp_kv_shard_count=2),
        "replicated_window": sliding(dcp_sharded=False),
    }
    config = topo.make_kv_cache_config(specs, 64)
    manager = KVCacheManager(
        config, 4096, B * 16, B, enable_caching=True, dcp_world_size=16
    )
    assert [m.block_size for m in manager.coordinator.single_type_managers] == [
        B * 16,
        B * 4,
        B * 2,
        B,
    ]


# Memory planning and capacity ------------------------------------------------------


def test_max_concurrency_counts_pages_by_k() -> None:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    length = 1_000_000
    specs = topo.topology_specs(partial=True)
    config = topo.make_kv_cache_config(specs, 100_000)
    vllm_config = topo.scheduler_config(16, max_model_len=length)
    mamba_pages = 2 + topo.SPECULATIVE_BLOCKS
    attention_pages = sum(
        contract.full_attention_pages_per_request(length, B, k) for k in (16, 4, 1)
    )
    expected = 100_000 / (attention_pages + mamba_pages)
    assert get_max_concurrency_for_kv_cache_config(vllm_config, config) == expected


def test_layer_tp_replicas_asks_the_spec() -> None:
    from vllm.v1.core.kv_cache_planning import _layer_tp_replicas

    # MLA latent fits one TP shard: replicated layers repeat over TP ranks.
    replicated = mla(dcp_sharded=False, max_tp_shards=1)
    flagged_k1 = mla(dcp_kv_shard_count=1, max_tp_shards=1)
    partial = mla(dcp_kv_shard_count=4, max_tp_shards=1)
    sharded = mla(max_tp_shards=1)
    assert _layer_tp_replicas(replicated, 16, 16) == 16
    assert _layer_tp_replicas(flagged_k1, 16, 16) == 16
    assert _layer_tp_replicas(partial, 16, 16) == 1
    assert _layer_tp_replicas(sharded, 16, 16) == 1
    assert original_of(_layer_tp_replicas)(flagged_k1, 16, 16) == 1


def test_unify_hybrid_keeps_shard_counts_apart() -> None:
    from vllm.v1.core import kv_cache_planning
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    specs = {
        "a.full": topo.attention_spec(dcp_kv_shard_count=4),
        "a.window": sliding(dcp_kv_shard_count=4),
        "b.full": topo.attention_spec(),
        "b.window": sliding(),
    }
    unpartitioned = dict(specs)
    # Upstream promotes all of them as one set, which K keeps from unifying.
    with pytest.raises(ValueError, match="Failed to promote local KV cache specs"):
        original_of(kv_cache_planning.unify_hybrid_kv_cache_specs)(unpartitioned)
    kv_cache_planning.unify_hybrid_kv_cache_specs(specs)
    assert all(type(s) is FullAttentionSpec for s in specs.values())
    assert specs["a.window"].dcp_kv_shard_count == 4
    assert specs["b.window"].dcp_kv_shard_count is None
    assert specs["a.window"].sliding_window == 1024


def test_a_uniform_model_with_two_ks_gets_a_group_per_k() -> None:
    """Layers that differ only in K do not merge, and vLLM's planner must
    learn that as it learns it from its own ``merge`` (an AssertionError):
    ``is_kv_cache_spec_uniform`` says no and the layers go to one group per
    K. (The refusal used to be a plain ValueError, which escaped
    ``is_kv_cache_spec_uniform`` and failed start-up for a dense model with
    a partial half.)"""
    from vllm.v1.core import kv_cache_planning

    specs = {
        f"model.layers.{i}.attn": topo.attention_spec(
            dcp_kv_shard_count=4 if i >= 2 else None
        )
        for i in range(4)
    }
    with pytest.raises(AssertionError, match="different dcp_kv_shard_count"):
        next(iter(specs.values())).merge(list(specs.values()))
    assert not kv_cache_planning.is_kv_cache_spec_uniform(specs)
    config = make_vllm_config(8, real=True)
    config.cache_config.kv_cache_layout = "LBNHC"
    groups = kv_cache_planning.get_kv_cache_groups(config, specs)
    assert sorted(
        (g.layer_names, g.kv_cache_spec.dcp_kv_shard_count) for g in groups
    ) == [
        (["model.layers.0.attn", "model.layers.1.attn"], None),
        (["model.layers.2.attn", "model.layers.3.attn"], 4),
    ]


# KV connectors and benchmark -------------------------------------------------------


def _connector_config(dcp: int):
    from vllm.config import KVTransferConfig

    config = topo.scheduler_config(dcp)
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="DecodeBenchConnector", kv_role="kv_both"
    )
    return config


@pytest.mark.parametrize(
    "module_and_class",
    [
        ("offloading_connector", "OffloadingConnector"),
        ("nixl", "NixlConnector"),
        ("mooncake.store.connector", "MooncakeStoreConnector"),
    ],
)
def test_unaudited_connectors_refuse_partial_k(module_and_class) -> None:
    import importlib

    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )

    module, name = module_and_class
    cls = getattr(
        importlib.import_module(
            f"vllm.distributed.kv_transfer.kv_connector.v1.{module}"
        ),
        name,
    )
    partial = topo.make_kv_cache_config(topo.topology_specs(partial=True), 64)
    connector = object.__new__(cls)
    with pytest.raises(DcpGeometryError, match=rf"{cls.__name__} .*group 1 .*K=4"):
        KVConnectorBase_V1.__init__(
            connector, _connector_config(16), KVConnectorRole.SCHEDULER, partial
        )
    # Upstream geometry, or D = 1: the connector's own __init__ logic runs.
    plain = topo.make_kv_cache_config(topo.topology_specs(partial=False), 64)
    for config, kv in ((_connector_config(16), plain), (_connector_config(1), partial)):
        KVConnectorBase_V1.__init__(connector, config, KVConnectorRole.SCHEDULER, kv)
        assert connector._kv_cache_config is kv


def test_decode_bench_connector_follows_k() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    config = topo.make_kv_cache_config(topo.topology_specs(partial=True), 64)
    connector = DecodeBenchConnector(
        _connector_config(16), KVConnectorRole.SCHEDULER, config
    )
    sizes = connector.connector_scheduler.group_block_sizes
    assert sizes == (B * 16, B * 4, B, topo.MAMBA_BLOCK)


def test_forward_benchmark_block_counts_follow_k() -> None:
    from vllm.benchmarks.forward import batch

    partial = topo.attention_spec(dcp_kv_shard_count=4)
    assert batch.kv_block_size(partial, 16) == B * 4
    assert batch._num_blocks(partial, 0, 10_000, 16) == (0, math.ceil(10_000 / (B * 4)))
    assert batch.kv_block_size(topo.attention_spec(), 16) == B * 16


def test_name_imports_rebound_and_later_imports_patched() -> None:
    """Modules holding the helpers by name use the patched ones, whether they
    were loaded before ``register()`` or after the patch applied."""
    result = run_python(
        """
        import importlib, json
        names = {
            "vllm.v1.engine.core": ["resolve_kv_cache_block_sizes"],
            "vllm.v1.simple_kv_offload.manager": ["resolve_dcp_kv_block_size"],
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.config": [
                "resolve_dcp_kv_block_size", "resolve_kv_cache_block_sizes"],
            "vllm.distributed.kv_transfer.kv_connector.v1.umbp.scheduler": [
                "resolve_dcp_kv_block_size", "resolve_kv_cache_block_sizes"],
            "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator":
                ["resolve_dcp_kv_cache_spec"],
            "vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector": [
                "resolve_dcp_kv_block_size"],
        }
        import sys
        early = [m for m in names if m.endswith(("core", "manager", "config"))]
        for m in early:
            importlib.import_module(m)
        import vllm_dcp_geometry.plugin as plugin
        plugin.register()
        import vllm.v1.core.kv_cache_utils as u
        out = {}
        for m, attrs in names.items():
            mod = importlib.import_module(m)
            for a in attrs:
                out[m + "." + a] = [m in early, getattr(mod, a) is getattr(u, a)]
        out["patched"] = hasattr(
            u.resolve_dcp_kv_block_size, "__vllm_dcp_geometry_original__")
        print(json.dumps(out))
        """,
        patched=False,
    )
    assert result.pop("patched") is True
    assert any(early for early, _ in result.values())
    assert any(not early for early, _ in result.values())
    assert all(same for _, same in result.values()), result
