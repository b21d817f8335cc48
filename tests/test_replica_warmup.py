# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Start-up warms the replica's LSE combine (rule A6).

vLLM's ``MLADCPManager`` registers the JIT warm-up of the LSE-combine kernel
with the config's DCP size D while the model is built (the window in which
the runner's ``JitWarmupRegistry`` collects). With a replica group of K made
(``Worker.init_device``, before the model), the layer's manager also
registers K (``mla_geometry.register_replica_warmups``): vLLM's real
registry, filled while a real ``MLAAttention`` is built, then holds the K
keys as it would for a DCP world of K, and D's unchanged. With no replica
group (K = D) it holds upstream's registration alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support import mla

pytestmark = pytest.mark.patches("worker.mla_dcp_manager")

DCP = 4


def _registry_of_a_rank(
    monkeypatch: pytest.MonkeyPatch, shard_count: int, **options: Any
) -> tuple[Any, Any]:
    """Rank 0's registry and config: the layer built (its manager made)
    inside an active registry, as the runners load the model; the builders
    (and the replica manager) outside it, as Model Runner V1 makes them."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    seen: dict[str, Any] = {}
    build_layer: Callable[..., Any] = mla.make_layer

    def make_layer(vllm_config: Any, *args: Any) -> Any:
        seen["registry"] = registry = JitWarmupRegistry(vllm_config)
        seen["config"] = vllm_config
        with registry.activate():
            return build_layer(vllm_config, *args)

    monkeypatch.setattr(mla, "make_layer", make_layer)
    batch = mla.make_batch(DCP, shard_count, 0, mla.CPU)
    with mla.cpu_shims():
        mla.make_ranks(
            batch,
            DCP,
            shard_count,
            1,
            spec=mla.mla_spec(shard_count),
            only=[0],
            **options,
        )
    return seen["registry"], seen["config"]


def _combine_keys(registry: Any) -> dict[int, set[Any]]:
    """n_rounded (the combine's world) -> the LSE-combine compile keys."""
    from vllm.v1.attention.ops import dcp

    kernel = dcp._CORRECT_ATTN_CP_OUT_KERNEL
    assert set(registry._registrations) <= {kernel}
    keys: dict[int, set[Any]] = {}
    for args, kwargs in registry._registrations.get(kernel, []):
        for key in kernel.get_warmup_keys(*args, **kwargs):
            keys.setdefault(key.n_rounded, set()).add(key)
    return keys


def _upstream_registration(registry: Any, config: Any) -> dict[str, Any]:
    """The keyword arguments of upstream's own registration (the layer's
    config, D): its dtype, heads, head size and LSE base."""
    from vllm.v1.attention.ops import dcp

    registrations = registry._registrations[dcp._CORRECT_ATTN_CP_OUT_KERNEL]
    upstream = [kwargs for args, kwargs in registrations if args == (config,)]
    assert len(upstream) == 1
    return upstream[0]


def _keys_at(config: Any, world: int, kwargs: dict[str, Any]) -> set[Any]:
    """What vLLM's manager registers for this layer in a DCP world of ``world``."""
    from vllm.v1.attention.ops import dcp

    from vllm_dcp_geometry.runtime.hand_back import config_with_dcp_size

    kernel = dcp._CORRECT_ATTN_CP_OUT_KERNEL
    return set(kernel.get_warmup_keys(config_with_dcp_size(config, world), **kwargs))


def test_a_replica_group_registers_its_k_beside_d(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry, config = _registry_of_a_rank(monkeypatch, 2)
    keys = _combine_keys(registry)
    assert sorted(keys) == [2, DCP]
    upstream = _upstream_registration(registry, config)
    assert keys[DCP] == _keys_at(config, DCP, upstream)
    assert keys[2] == _keys_at(config, 2, upstream)
    assert keys[2]


def test_k_equal_d_registers_upstreams_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    registry, config = _registry_of_a_rank(monkeypatch, DCP)
    from vllm.v1.attention.ops import dcp

    registrations = registry._registrations[dcp._CORRECT_ATTN_CP_OUT_KERNEL]
    assert registrations == [((config,), _upstream_registration(registry, config))]
    assert sorted(_combine_keys(registry)) == [DCP]


def test_the_d_wide_channel_and_a2a_register_no_replica_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``partial_collectives: "dcp"`` makes no replica group; under the a2a
    combine vLLM registers no warm-up, so neither does the replica."""
    registry, _ = _registry_of_a_rank(monkeypatch, 2, partial_collectives="dcp")
    assert sorted(_combine_keys(registry)) == [DCP]
    registry, _ = _registry_of_a_rank(monkeypatch, 2, comm_backend="a2a")
    assert _combine_keys(registry) == {}
