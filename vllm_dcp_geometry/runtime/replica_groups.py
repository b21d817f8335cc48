# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The replica process groups of partial groups on this worker (rule A6): the
MLA (dense, sparse, indexer) and FlashAttention groups collective within them.

Every worker calls ``make_replica_groups`` right after vLLM initialises its
distributed state (``Worker.init_device``), before the memory profile, whose
CUDA-graph pass already builds attention metadata builders. The shard counts
come from the configuration alone (``replica_shard_counts``: every partial K
the operator's overrides name), so every worker of the world asks for the
same groups in the same order without a collective of its own; the groups are
then made in lockstep: for each K, ascending, one vLLM ``GroupCoordinator``
over every replica rank list of every DCP group (the DCP group's
``group_ranks``, split by ``collectives.replica_rank_lists``), made by vLLM's
own ``init_model_parallel_group`` with the DCP group's backend, so it has the
device communicator a DCP group has. This rank's replica is kept per K for
the MLA and FlashAttention builders and layers of partial groups
(``replica_group``), which
check it against their geometry. A K no override names (a model setting
``dcp_kv_shard_count`` itself) has no replica group: its builder refuses to
start, naming the way out. vLLM's ``destroy_model_parallel`` (wrapped by
``worker.parallel_state``) destroys and forgets them first
(``destroy_replica_groups``), so a re-initialisation makes fresh ones.

vLLM is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.collectives import (
    DCP_GROUP,
    REPLICA,
    replica_rank_lists,
)
from vllm_dcp_geometry.contract.overrides import (
    CONFIG_KEY,
    PARTIAL_COLLECTIVES_KEY,
    partial_collectives,
)

_REPLICA_GROUPS: dict[int, Any] = {}
"""K -> this rank's replica ``GroupCoordinator``."""

MADE_FOR_ATTR = "_vllm_dcp_geometry_dcp_group"
"""Set on a replica group to the DCP ``GroupCoordinator`` it was made from:
a group made before vLLM re-initialised its model parallel state is stale."""


def replica_process_group_name(shard_count: int) -> str:
    """The ``GroupCoordinator`` name of the K-shard replica groups."""
    return f"dcp_replica_k{shard_count}"


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
    dcp_groups = [list(ranks) for ranks in dcp.group_ranks]
    backend = str(dist.get_backend(dcp.device_group))
    local_rank = parallel_state.get_world_group().local_rank
    for shard_count in wanted:
        coordinator = parallel_state.init_model_parallel_group(
            replica_rank_lists(dcp_groups, shard_count),
            local_rank,
            backend,
            group_name=replica_process_group_name(shard_count),
        )
        _check_member(coordinator, dcp, shard_count)
        setattr(coordinator, MADE_FOR_ATTR, dcp)
        _REPLICA_GROUPS[shard_count] = coordinator
    return dict(_REPLICA_GROUPS)


def replica_shard_counts(vllm_config: Any) -> tuple[int, ...]:
    """The partial K (1 < K < D) the operator's overrides can give a layer,
    ascending, where partial groups collective within their replica;
    empty at D = 1, without such an override, or with
    ``partial_collectives: "dcp"``. Read from the configuration alone, so
    the same on every worker; a K only FlashInfer layers take gets a group
    that nothing uses."""
    from vllm_dcp_geometry.contract.overrides import parse_overrides

    dcp = vllm_config.parallel_config.decode_context_parallel_size
    if dcp == 1:
        return ()
    additional = vllm_config.additional_config
    counts = {
        o.value
        for o in parse_overrides(additional)
        if isinstance(o.value, int) and 1 < o.value < dcp
    }
    if not counts or partial_collectives(additional) != REPLICA:
        return ()
    return tuple(sorted(counts))


def make_replica_groups(vllm_config: Any) -> tuple[int, ...]:
    """What every worker does once its distributed state exists: make the
    replica groups of ``replica_shard_counts`` (every worker in lockstep);
    the K made for (empty: none needed, and nothing else is read)."""
    counts = replica_shard_counts(vllm_config)
    if not counts:
        return ()
    if getattr(vllm_config.parallel_config, "enable_elastic_ep", False):
        raise DcpGeometryError(
            f"partial shard counts {list(counts)} within their replica need "
            "replica process groups, which elastic expert parallelism's "
            "stateless groups cannot hold; set "
            f"additional_config[{CONFIG_KEY!r}][{PARTIAL_COLLECTIVES_KEY!r}] to "
            f"{DCP_GROUP!r}"
        )
    create_replica_groups(counts)
    return counts


def _check_member(coordinator: Any, dcp: Any, shard_count: int) -> None:
    geometry = GroupGeometry(
        "replica group", shard_count, dcp.world_size, dcp.rank_in_group
    )
    expected = [dcp.ranks[i] for i in geometry.replica_dcp_ranks]
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
    name = replica_process_group_name(geometry.shard_count)
    stale = getattr(coordinator, MADE_FOR_ATTR, None) is not parallel_state._DCP
    if coordinator is None or stale:
        raise DcpGeometryError(
            f"{geometry.describe()}: its replica process groups "
            f"({name}) were not made at KV-cache "
            "initialisation, so its collectives cannot stay within its replica; "
            f"set additional_config[{CONFIG_KEY!r}][{PARTIAL_COLLECTIVES_KEY!r}] "
            f"to {DCP_GROUP!r} to run them on the whole DCP group"
        )
    if (coordinator.world_size, coordinator.rank_in_group) != geometry.shard_world:
        raise DcpGeometryError(
            f"{geometry.describe()}: replica group {name} "
            f"has world {coordinator.world_size} and rank "
            f"{coordinator.rank_in_group}, not the group's (K, r % K)="
            f"{geometry.shard_world}"
        )
    return coordinator


def operator_replica_group(geometry: GroupGeometry, vllm_config: Any) -> Any:
    """The replica ``GroupCoordinator`` a partial group's collectives stay
    within (rule A6), or None where the operator chose the D-wide group
    (``partial_collectives: "dcp"``); an error naming the group where the
    replica groups were not made."""
    if partial_collectives(vllm_config.additional_config) != REPLICA:
        return None
    return replica_group(geometry)


def made_replica_groups() -> dict[int, Any]:
    """K -> this rank's replica ``GroupCoordinator``, for every K made."""
    return dict(_REPLICA_GROUPS)


def destroy_replica_groups() -> None:
    """Destroy and forget every replica group this process made; run by the
    wrapped ``destroy_model_parallel`` before vLLM destroys its own groups
    (nothing done where none was made)."""
    while _REPLICA_GROUPS:
        _, coordinator = _REPLICA_GROUPS.popitem()
        coordinator.destroy()
