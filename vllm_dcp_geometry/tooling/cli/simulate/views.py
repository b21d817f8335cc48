# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``simulate``'s checks see: each cache group (``GroupInfo``), where
each rank sits for a shard count (``RankLayout``, from the contract's
``GroupGeometry``) and the engine's own blocks of each request
(``OwnRows``). The checks themselves are in ``checks``; what they find is
recorded in ``cli.common.violations``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import GroupGeometry

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group as the checks see it."""

    index: int
    name: str
    kind: str
    spec: Any
    block_size: int
    shard_count: int
    """K under the contract (the topology's)."""
    builder_shard_count: int
    """K the attention builder uses (the spec's patched, vLLM's default not)."""
    virtual_block_size: int
    slot_mapped: bool
    recurrent: bool
    append_only: bool
    """Its manager only ever appends to a request's row (full attention)."""


@dataclass(frozen=True)
class RankLayout:
    """Where each of the D ranks sits for a shard count K, from the
    contract's ``GroupGeometry``: its shard ``r % K`` and replica ``r // K``."""

    shard_count: int
    shards: np.ndarray
    """Per rank: the shard it stores."""
    membership: np.ndarray
    """``[replica, rank]``: 1 where the rank belongs to the replica."""

    @classmethod
    def of(cls, owner: str, shard_count: int, dcp_world_size: int) -> RankLayout:
        import numpy as np

        places = [
            GroupGeometry(owner, shard_count, dcp_world_size, rank)
            for rank in range(dcp_world_size)
        ]
        replicas = np.array([g.replica for g in places], dtype=np.int64)
        membership = np.arange(places[0].replica_count)[:, None] == replicas
        return cls(
            shard_count,
            np.array([g.shard for g in places], dtype=np.int64),
            membership.astype(np.int64),
        )

    def sum_by_replica(self, per_rank: np.ndarray) -> np.ndarray:
        """``per_rank`` (ranks on axis 0) summed over the ranks of each
        replica: ``[replica, ...]``."""
        import numpy as np

        flat: np.ndarray = per_rank.reshape(per_rank.shape[0], -1).astype(np.int64)
        summed = self.membership @ flat
        return summed.reshape(self.membership.shape[0], *per_rank.shape[1:])

    def describe_ranks(self, replica: int) -> str:
        ranks = [int(r) for r in self.membership[replica].nonzero()[0]]
        return (
            f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        )


class OwnRows:
    """The engine's blocks of each request per group, as numpy ids, read from
    vLLM's managers incrementally where a manager only appends."""

    def __init__(self, managers: list[Any], groups: list[GroupInfo], null_id: int):
        self.managers = managers
        self.groups = groups
        self.null_id = null_id
        self._cache: dict[tuple[str, int], tuple[int, int, np.ndarray]] = {}

    def ids(self, req_id: str, group: int) -> tuple[np.ndarray, np.ndarray]:
        """(non-null block ids now, ids dropped since last asked)."""
        import numpy as np

        blocks = self.managers[group].req_to_blocks.get(req_id, [])
        key = (req_id, group)
        cached = self._cache.get(key)
        empty: np.ndarray = np.zeros(0, dtype=np.int64)
        if (
            cached is not None
            and self.groups[group].append_only
            and cached[0] == id(blocks)
            and cached[1] <= len(blocks)
        ):
            tail = np.fromiter(
                (b.block_id for b in blocks[cached[1] :]), dtype=np.int64
            )
            ids = np.concatenate([cached[2], tail[tail != self.null_id]])
            dropped = empty
        else:
            every = np.fromiter((b.block_id for b in blocks), dtype=np.int64)
            ids = every[every != self.null_id]
            dropped = empty if cached is None else np.setdiff1d(cached[2], ids)
        self._cache[key] = (id(blocks), len(blocks), ids)
        return ids, dropped

    def forget(self, req_id: str) -> None:
        for group in range(len(self.groups)):
            self._cache.pop((req_id, group), None)
