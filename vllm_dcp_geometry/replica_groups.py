# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The replica process groups of partial MLA groups on this worker (rule A6).

At KV-cache initialisation every worker of the torch world calls
``create_replica_groups`` with the same shard counts (every worker's KV-cache
config holds every group's spec: vLLM projects the global groups onto each
worker, keeping their specs), so the groups are made in lockstep: first the
DCP groups of the whole world are gathered over the world's CPU group, then
for each partial K, in ascending order, one vLLM ``GroupCoordinator`` over
all replica rank lists (``collectives.replica_rank_lists``), made by vLLM's
own ``init_model_parallel_group`` with the DCP group's backend, so it has
the same device communicator (pynccl, symmetric memory where vLLM enables
it) a DCP group has. This rank's replica is kept per K for the MLA builders
and layers of partial groups (``replica_group``), which check it against
their geometry.

vLLM is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm_dcp_geometry.collectives import DCP_GROUP, REPLICA, replica_rank_lists
from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.overrides import (
    CONFIG_KEY,
    PARTIAL_COLLECTIVES_KEY,
    partial_collectives,
)

_REPLICA_GROUPS: dict[int, Any] = {}
"""K -> this rank's replica ``GroupCoordinator``."""

MADE_FOR_ATTR = "_vllm_dcp_geometry_dcp_group"
"""Set on a replica group to the DCP ``GroupCoordinator`` it was made from:
a group made before vLLM re-initialised its model parallel state is stale."""


def group_name(shard_count: int) -> str:
    """The ``GroupCoordinator`` name of the K-shard replica groups."""
    return f"dcp_replica_k{shard_count}"


def partial_shard_counts(kv_cache_specs: Iterable[Any]) -> tuple[int, ...]:
    """The distinct partial K (an explicit ``dcp_kv_shard_count``, which only
    1 < K < D sets) of the MLA specs among ``kv_cache_specs``, ascending;
    specs of a ``UniformTypeKVCacheSpecs`` are looked into."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, UniformTypeKVCacheSpecs

    counts: set[int] = set()
    pending = list(kv_cache_specs)
    while pending:
        spec = pending.pop()
        if isinstance(spec, UniformTypeKVCacheSpecs):
            pending.extend(spec.kv_cache_specs.values())
            continue
        count = getattr(spec, "dcp_kv_shard_count", None)
        if isinstance(spec, MLAAttentionSpec) and count is not None:
            counts.add(count)
    return tuple(sorted(counts))


def world_dcp_groups() -> list[list[int]]:
    """Every DCP group of the torch world (global ranks in DCP-rank order),
    gathered from every rank over the world's CPU group: a collective."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    dcp = parallel_state.get_dcp_group()
    world = parallel_state.get_world_group()
    gathered: list[Any] = [None] * world.world_size
    dist.all_gather_object(gathered, list(dcp.ranks), group=world.cpu_group)
    distinct = {tuple(ranks) for ranks in gathered}
    return [list(ranks) for ranks in sorted(distinct, key=lambda ranks: ranks[0])]


def create_replica_groups(shard_counts: Sequence[int]) -> dict[int, Any]:
    """Make (once per K, every rank in lockstep) the replica groups of each
    partial K in ``shard_counts``; this rank's replica per K."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    dcp = parallel_state.get_dcp_group()
    for k, coordinator in list(_REPLICA_GROUPS.items()):
        if getattr(coordinator, MADE_FOR_ATTR, None) is not dcp:
            # Made for a DCP group vLLM has since destroyed and remade.
            del _REPLICA_GROUPS[k]
    wanted = sorted({k for k in shard_counts if k not in _REPLICA_GROUPS})
    if not wanted:
        return dict(_REPLICA_GROUPS)
    dcp_groups = world_dcp_groups()
    backend = str(dist.get_backend(dcp.device_group))
    local_rank = parallel_state.get_world_group().local_rank
    for shard_count in wanted:
        coordinator = parallel_state.init_model_parallel_group(
            replica_rank_lists(dcp_groups, shard_count),
            local_rank,
            backend,
            group_name=group_name(shard_count),
        )
        _check_member(coordinator, dcp, shard_count)
        setattr(coordinator, MADE_FOR_ATTR, dcp)
        _REPLICA_GROUPS[shard_count] = coordinator
    return dict(_REPLICA_GROUPS)


def make_replica_groups(vllm_config: Any, kv_cache_config: Any) -> tuple[int, ...]:
    """What every worker does at KV-cache initialisation: make the replica
    groups its config's partial MLA groups need (in lockstep); the shard
    counts made (empty: none needed, and then nothing else is read)."""
    counts = partial_shard_counts(
        group.kv_cache_spec for group in kv_cache_config.kv_cache_groups
    )
    if not counts:
        return ()
    if partial_collectives(vllm_config.additional_config) != REPLICA:
        return ()
    create_replica_groups(counts)
    return counts


def _check_member(coordinator: Any, dcp: Any, shard_count: int) -> None:
    start = dcp.rank_in_group // shard_count * shard_count
    expected = list(dcp.ranks[start : start + shard_count])
    if list(coordinator.ranks) != expected or coordinator.world_size != shard_count:
        raise DcpGeometryError(
            f"the K={shard_count} replica group of DCP rank {dcp.rank_in_group} "
            f"holds ranks {list(coordinator.ranks)}, not its replica {expected}"
        )


def replica_group(geometry: GroupGeometry) -> Any:
    """This rank's replica ``GroupCoordinator`` for a partial group, checked
    against its geometry (K ranks, this rank at ``r % K``); an error naming
    the group where none was made at KV-cache initialisation (or it was made
    for a DCP group vLLM has since remade)."""
    from vllm.distributed import parallel_state

    coordinator = _REPLICA_GROUPS.get(geometry.shard_count)
    stale = getattr(coordinator, MADE_FOR_ATTR, None) is not parallel_state._DCP
    if coordinator is None or stale:
        raise DcpGeometryError(
            f"{geometry.describe()}: its replica process groups "
            f"({group_name(geometry.shard_count)}) were not made at KV-cache "
            "initialisation, so its collectives cannot stay within its replica; "
            f"set additional_config[{CONFIG_KEY!r}][{PARTIAL_COLLECTIVES_KEY!r}] "
            f"to {DCP_GROUP!r} to run them on the whole DCP group"
        )
    if (coordinator.world_size, coordinator.rank_in_group) != geometry.shard_world:
        raise DcpGeometryError(
            f"{geometry.describe()}: replica group {group_name(geometry.shard_count)} "
            f"has world {coordinator.world_size} and rank "
            f"{coordinator.rank_in_group}, not the group's (K, r % K)="
            f"{geometry.shard_world}"
        )
    return coordinator


def made_replica_groups() -> dict[int, Any]:
    """K -> this rank's replica ``GroupCoordinator``, for every K made."""
    return dict(_REPLICA_GROUPS)


def destroy_replica_groups() -> None:
    """Destroy every replica group this process made (before vLLM's own
    ``destroy_model_parallel``)."""
    while _REPLICA_GROUPS:
        _, coordinator = _REPLICA_GROUPS.popitem()
        coordinator.destroy()
