# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Per-cache decode-context-parallel (DCP) geometry for vLLM.

Importing this package does not import vLLM. ``register()`` (the
``vllm.general_plugins`` entry point) installs the contract into vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import DcpGeometryError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheSpec

__all__ = [
    "DcpGeometryError",
    "get_kv_cache_dcp_shard_count",
    "register",
    "with_dcp_kv_shard_count",
]


def register() -> None:
    """Install the DCP geometry contract into vLLM (idempotent)."""
    from vllm_dcp_geometry.plugin import register as _register

    _register()


def get_kv_cache_dcp_shard_count(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """Token-position shard count K of ``spec`` under DCP world size D."""
    register()
    import vllm.v1.kv_cache_interface as kv_cache_interface

    return kv_cache_interface.get_kv_cache_dcp_shard_count(  # type: ignore[attr-defined]
        spec, dcp_world_size
    )


def with_dcp_kv_shard_count(spec: Any, dcp_kv_shard_count: int | None) -> Any:
    """An otherwise equal attention spec carrying K (None clears it)."""
    register()
    import dataclasses

    from vllm.v1.kv_cache_interface import AttentionSpec

    if not isinstance(spec, AttentionSpec):
        raise DcpGeometryError(
            f"{type(spec).__name__} has no token-position shard count to set: "
            "only attention specs can be partially sharded (recurrent state is "
            "never token-sharded)"
        )
    return dataclasses.replace(spec, dcp_kv_shard_count=dcp_kv_shard_count)
