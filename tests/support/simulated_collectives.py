# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""D simulated DCP ranks in one process: ``CooperativeRanks`` runs one
function per rank in threads that take turns (only inside a collective do
they hand over), ``SimulatedGroup`` stands in for what vLLM reads of a
``GroupCoordinator`` over them, ``SimulatedReplica`` for a partial group's
replica group (rule A6), ``replica_groups_of`` installs the plugin's replica
groups for a rank, and ``simulated_collectives`` the torch.distributed calls
the MLA path makes (context KV all-gather, all-to-all combine) over them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced


class CooperativeRanks:
    """Runs one function per rank in threads that take turns: a thread gives
    up its turn only while it waits for its peers inside ``exchange``, so
    vLLM's Triton interpreter never runs in two threads at once."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(world_size, timeout=300)
        self.slots: list[Any] = [None] * world_size
        self.local = threading.local()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self._give_turn()
        self.barrier.wait()
        with self.turn:
            everything = list(self.slots)
        self.barrier.wait()
        self._take_turn()
        return everything

    def _take_turn(self) -> None:
        self.turn.acquire()
        self.local.has_turn = True

    def _give_turn(self) -> None:
        # A thread whose peer failed leaves ``exchange`` without its turn: it
        # must not release the one another thread holds.
        if getattr(self.local, "has_turn", False):
            self.local.has_turn = False
            self.turn.release()

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self.local.rank = rank
            self._take_turn()
            try:
                results[rank] = fn(rank)
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()
            finally:
                self._give_turn()

        threads = [
            threading.Thread(target=body, args=(r,)) for r in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real or errors:
            raise (real or errors)[0]
        return results


class SimulatedGroup:
    """What vLLM reads of a ``GroupCoordinator`` here, over ``CooperativeRanks``."""

    def __init__(self, ranks: CooperativeRanks | None, world_size: int, rank: int):
        self.coop = ranks
        self.world_size = world_size
        self.rank_in_group = rank
        self.rank = rank
        self.ranks = list(range(world_size))
        self.device_group = self

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        assert self.coop is not None, "collective outside a simulated forward"
        return self.coop.exchange(self.rank_in_group, tensor.clone())

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = torch.stack(self._exchange(tensor)).sum(dim=0)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor)).sum(dim=0)

    def all_gather_into_tensor(self, out: torch.Tensor, local: torch.Tensor) -> None:
        out.copy_(torch.cat(self._exchange(local), dim=0))


class SimulatedReplica(SimulatedGroup):
    """A partial group's replica group (rule A6) of DCP rank ``dcp_rank``:
    the K ranks ``q*K .. q*K + K - 1``. Every DCP rank takes part in each
    exchange (they all run the same collectives at once); a rank keeps its
    replica's tensors."""

    def __init__(
        self,
        ranks: CooperativeRanks | None,
        dcp_world: int,
        dcp_rank: int,
        shard_count: int,
    ) -> None:
        geometry = GroupGeometry("replica", shard_count, dcp_world, dcp_rank)
        super().__init__(ranks, shard_count, geometry.shard)
        self.dcp_rank = dcp_rank
        self.ranks = list(geometry.replica_dcp_ranks)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        assert self.coop is not None, "collective outside a simulated forward"
        everything = self.coop.exchange(self.dcp_rank, tensor.clone())
        return [everything[r] for r in self.ranks]


@contextmanager
def replica_groups_of(
    dcp: SimulatedGroup, shard_counts: Sequence[int], make: Any = None
) -> Iterator[None]:
    """The plugin's replica groups of this DCP rank (``make(k)``, by default
    ``SimulatedReplica``s), made for ``dcp``, while its builders are made
    (what ``create_replica_groups`` makes at KV-cache initialisation in a
    real worker)."""
    from vllm_dcp_geometry.runtime import replica_groups

    def replica(k: int) -> SimulatedGroup:
        group = (
            SimulatedReplica(dcp.coop, dcp.world_size, dcp.rank_in_group, k)
            if make is None
            else make(k)
        )
        setattr(group, replica_groups.MADE_FOR_ATTR, dcp)
        return group

    made = replica_groups._REPLICA_GROUPS
    saved = dict(made)
    made.update({k: replica(k) for k in shard_counts})
    try:
        yield
    finally:
        made.clear()
        made.update(saved)


class _Done:
    def wait(self) -> None:
        pass


def all_to_all_single(
    out: Any, local: Any, group: Any = None, async_op: bool = False, **_: Any
) -> Any:
    """Stand-in for ``torch.distributed.all_to_all_single`` (the MLA combine
    with ``dcp_comm_backend="a2a"``) over a ``SimulatedGroup``: chunk ``j`` of
    every rank's input lands, in rank order, in rank ``j``'s output."""
    assert isinstance(group, SimulatedGroup), group
    sent = group._exchange(local)
    me = group.rank_in_group
    out.copy_(torch.cat([s.chunk(group.world_size)[me] for s in sent]))
    return _Done() if async_op else None


def all_gather_into_tensor(out: Any, local: Any, group: Any = None, **_: Any) -> None:
    """Stand-in for ``torch.distributed.all_gather_into_tensor`` (the MLA
    context KV gather) over a ``SimulatedGroup``."""
    assert isinstance(group, SimulatedGroup), group
    group.all_gather_into_tensor(out, local)


@contextmanager
def simulated_collectives() -> Iterator[None]:
    """The MLA context KV gather (captured when a builder is made, so hold
    this around ``make_ranks`` too) and the all-to-all combine over a
    ``SimulatedGroup``."""
    with (
        replaced(torch.distributed, "all_gather_into_tensor", all_gather_into_tensor),
        replaced(torch.distributed, "all_to_all_single", all_to_all_single),
    ):
        yield
