# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.distributed.kv_transfer.kv_connector.v1.base``: KV connectors
that restate the DCP rule refuse partial shard counts.

What: wraps ``KVConnectorBase_V1.__init__`` (every v1 connector, and every
child of ``MultiConnector``, runs it). Filed under the engine core because
the scheduler-side connector is where start-up fails first; workers build
their connector through the same constructor and are checked too.
If a KV-cache group's shard count K differs from what vLLM derives from
``dcp_sharded`` and the connector is not one whose DCP handling follows K, it
raises ``DcpGeometryError`` naming the connector and the groups. Connectors
that follow K: ``SimpleCPUOffloadConnector`` (block spans from
``resolve_dcp_kv_block_size``, K-aware managers), ``DecodeBenchConnector``
(block spans from ``resolve_dcp_kv_block_size``), ``UMBPStoreConnector``
(block spans from ``resolve_dcp_kv_block_size``; its namespace fingerprints
every spec field, K included) and ``MultiConnector`` (each child is checked
itself). Refused: MoRIIO (inline ``block_size * D``), Offloading (canonical
mapping and store masks use the global D), NIXL (remote rank mapping assumes
D-sharded groups), Mooncake / Mooncake store (per-rank keys that do not name
K), LMCache, FlexKV, HF3FS, HiSparse, Example* and third-party connectors (not
audited). Where every group keeps vLLM's geometry the original runs unchanged.

Why: a connector that moves or addresses KV as if every sharded group were
split over all D ranks would silently transfer the wrong tokens.

Remove when: vLLM connectors read a per-spec DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.geometry import (
    kv_cache_group_name,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.hand_back import groups_follow_vllm_default
from vllm_dcp_geometry.runtime.patching import Patch, Wrap

_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
SHARD_COUNT_AWARE_CONNECTORS: frozenset[str] = frozenset(
    {
        f"{_V1}.simple_cpu_offload_connector.SimpleCPUOffloadConnector",
        f"{_V1}.decode_bench_connector.DecodeBenchConnector",
        f"{_V1}.umbp.connector.UMBPStoreConnector",
        f"{_V1}.multi_connector.MultiConnector",
    }
)
"""Connectors (``module.qualname``) whose DCP handling follows each group's K."""


def deviating_groups(kv_cache_config: Any, dcp_world_size: int) -> list[str]:
    """Groups whose K differs from vLLM's flag-derived value, with their K."""
    found = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        owner = kv_cache_group_name(group.layer_names, index)
        k = shard_count_unless_default(spec, dcp_world_size, owner=owner)
        if k is not None:
            found.append(f"{owner}: K={k}")
    return found


def check_connector(
    connector_cls: type, vllm_config: Any, kv_cache_config: Any
) -> None:
    """Refuse a connector that cannot follow the groups' shard counts."""
    if kv_cache_config is None or groups_follow_vllm_default(
        kv_cache_config.kv_cache_groups
    ):
        return
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp == 1:
        return
    groups = deviating_groups(kv_cache_config, dcp)
    if not groups:
        return
    # Exact classes only: a subclass may override what was audited.
    if f"{connector_cls.__module__}.{connector_cls.__qualname__}" in (
        SHARD_COUNT_AWARE_CONNECTORS
    ):
        return
    aware = ", ".join(
        sorted(name.rsplit(".", 1)[1] for name in SHARD_COUNT_AWARE_CONNECTORS)
    )
    raise DcpGeometryError(
        f"KV connector {connector_cls.__name__} addresses KV as if every sharded "
        f"group were split over all D={dcp} DCP ranks, but "
        f"{'; '.join(groups)} (partial DCP shard counts). Use a connector that "
        f"follows per-group shard counts ({aware}) or give these layers K=1 "
        "or K=D."
    )


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        check_connector(type(self), vllm_config, kv_cache_config)
        original(self, vllm_config, role, kv_cache_config)

    return __init__


PATCH = Patch(
    upstream_module="vllm.distributed.kv_transfer.kv_connector.v1.base",
    replaces=(
        Wrap(
            "KVConnectorBase_V1.__init__",
            "self, vllm_config, role, kv_cache_config",
            _make_init,
        ),
    ),
    why="several KV connectors restate block_size * D from the boolean dcp_sharded",
    remove_when="vLLM KV connectors read a per-spec DCP shard count",
    related="vllm#50611 (NIXL DCP for MLA assumes K in {1, D} per side)",
)
