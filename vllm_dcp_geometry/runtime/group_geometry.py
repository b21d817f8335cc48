# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A KV-cache group's DCP geometry on this worker.

A metadata builder is built per KV-cache group from the group's spec, so it is
the one place on the worker that knows the group's shard count K: this module
resolves the group's ``contract.GroupGeometry`` from its spec and vLLM's DCP
process group, and marks the builders and impls bound to it. The side channel
that lets upstream builder code see the group's geometry is
``group_context.use_group_geometry``.

No vLLM import at module level.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    GroupGeometry,
    check_interleave,
    check_prefill_context_parallel,
)
from vllm_dcp_geometry.runtime.geometry import (
    default_shard_count,
    get_kv_cache_dcp_shard_count,
    kv_cache_group_name,
)

BOUND_GEOMETRY_ATTR = "_vllm_dcp_geometry_group"
"""Set on every builder and attention impl bound to a group's geometry."""


def resolve_group_geometry(
    kv_cache_spec: Any,
    layer_names: Sequence[str],
    vllm_config: Any,
    index: int | None = None,
) -> GroupGeometry | None:
    """The group's geometry on this rank, or None when DCP is off (D == 1).

    D and r come from vLLM's DCP process group, as upstream builders and impls
    take them (so at D == 1 nothing else is read); K from the spec through the
    contract. A partial K with prefill context parallelism is refused (the
    contract's PCP rule).
    """
    from vllm.distributed import parallel_state

    dcp_world_size, dcp_rank = parallel_state.get_dcp_world_size_and_rank(True)
    if dcp_world_size == 1:
        return None
    parallel_config = vllm_config.parallel_config
    owner = kv_cache_group_name(layer_names, index)
    shard_count = get_kv_cache_dcp_shard_count(
        kv_cache_spec, dcp_world_size, owner=owner
    )
    interleave_size = parallel_config.cp_kv_cache_interleave_size
    geometry = GroupGeometry(
        owner=owner,
        shard_count=shard_count,
        dcp_world_size=dcp_world_size,
        dcp_rank=dcp_rank,
        interleave_size=interleave_size,
        default_shard_count=default_shard_count(kv_cache_spec, dcp_world_size),
    )
    if not geometry.matches_default:
        try:
            check_interleave(kv_cache_spec.block_size, shard_count, interleave_size)
        except DcpGeometryError as exc:
            raise DcpGeometryError(f"{geometry.describe()}: {exc}") from exc
    check_prefill_context_parallel(
        geometry.describe(),
        shard_count,
        dcp_world_size,
        parallel_config.prefill_context_parallel_size,
    )
    return geometry


def check_rebind(obj: Any, geometry: GroupGeometry, what: str) -> bool:
    """True if ``obj`` is already bound to ``geometry``; error if to another."""
    bound = getattr(obj, BOUND_GEOMETRY_ATTR, None)
    if bound is None:
        return False
    if bound.shard_world != geometry.shard_world or bound.dcp_rank != (
        geometry.dcp_rank
    ):
        raise DcpGeometryError(
            f"{what} is bound to {bound.describe()} and cannot also serve "
            f"{geometry.describe()}"
        )
    return True
