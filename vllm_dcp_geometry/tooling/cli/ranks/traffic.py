# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The bytes a ``ranks`` worker's collectives move (``Traffic``), counted
where they happen, not where an API issues them.

torch's flight recorder keeps every collective of every process group (gloo
and NCCL, whether ``GroupCoordinator``, ``torch.distributed`` or the
functional collectives issued it), and vLLM's own NCCL communicators
(``PyNcclCommunicator``, outside torch's process groups) are wrapped
(``count_pynccl_call``, installed by ``measuring.install_meters``). So a
collective a patch or vLLM adds anywhere in the forward is seen, on the DCP
group, a replica group or any other group. Each is counted as the ring
model's bytes sent plus received (``collectives.collective_bytes``); one the
model has no formula for is kept as unmodeled.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.contract.collectives import collective_bytes
from vllm_dcp_geometry.runtime.patching import UpstreamSymbol

PYNCCL = "vllm.distributed.device_communicators.pynccl"
PYNCCL_OPS = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "all_gatherv": None,
    "reduce_scatterv": None,
    "reduce": None,
    "scatter": None,
    "broadcast": None,
    "send": None,
    "recv": None,
    "batch_isend_irecv": None,
}
"""``PyNcclCommunicator`` methods (vLLM's own NCCL communicators, outside
torch's process groups) and the collective each models, None where the
ring model has no formula: such a call is counted as unmodeled."""

PYNCCL_METERED = (
    UpstreamSymbol(
        PYNCCL,
        "PyNcclCommunicator.all_reduce",
        "self, in_tensor, out_tensor=, op=, stream=",
    ),
    UpstreamSymbol(
        PYNCCL,
        "PyNcclCommunicator.all_gather",
        "self, output_tensor, input_tensor, stream=",
    ),
    UpstreamSymbol(
        PYNCCL,
        "PyNcclCommunicator.reduce_scatter",
        "self, output_tensor, input_tensor, op=, stream=",
    ),
)
"""The modeled ``PyNcclCommunicator`` methods, pinned to the parameters the
byte count reads (the input is the rank's own tensor of ``all_gather`` and
the whole tensor of the others); the unmodeled ones are counted by name."""


# Collective traffic, counted where it happens ----------------------------------

FLIGHT_RECORDER_ENV = "TORCH_FR_BUFFER_SIZE"
FLIGHT_RECORDER_ENTRIES = 1 << 16
"""Collectives torch's flight recorder keeps per process: far more than one
forward issues (``Traffic.counted`` fails loudly if it ever dropped one)."""

SCALAR_TYPE_BYTES = {
    "Double": 8,
    "Float": 4,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "Float8_e4m3fnuz": 1,
    "Float8_e5m2fnuz": 1,
}
"""Element sizes by the name torch's flight recorder gives a dtype (c10's
``ScalarType``)."""

RECORDED_OPS = (
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("alltoall", "all_to_all_single"),
)
"""How a recorded collective's name (``gloo:all_gather``,
``nccl:_reduce_scatter_base``, ``nccl:all_gather_into_tensor_coalesced``)
starts, without its backend and underscores, for each modeled collective."""


@dataclass(frozen=True)
class Collective:
    """One collective this rank issued: what the ring model calls it (None:
    no formula), the name it was recorded by, the group it ran on and the
    bytes of its input."""

    op: str | None
    recorded_as: str
    group: str
    world: int
    input_bytes: int

    @property
    def moved(self) -> int:
        if self.op is None:
            return 0
        return collective_bytes(self.op, self.world, self.input_bytes)


def recorded_op(name: str) -> str | None:
    """The modeled collective a flight-recorder entry named ``name`` is
    (None: one the ring model has no formula for, a broadcast or a send)."""
    bare = name.rpartition(":")[2].lower().replace("_", "")
    return next((op for prefix, op in RECORDED_OPS if bare.startswith(prefix)), None)


def entry_input_bytes(entry: dict[str, Any]) -> int:
    """The bytes of a recorded collective's inputs, from its sizes and dtypes."""
    total = 0
    for sizes, dtype in zip(entry["input_sizes"], entry["input_dtypes"], strict=True):
        if dtype not in SCALAR_TYPE_BYTES:
            raise RuntimeError(
                f"ranks: a collective {entry['profiling_name']} of dtype {dtype} "
                "this meter has no element size for"
            )
        total += math.prod(sizes) * SCALAR_TYPE_BYTES[dtype]
    return total


def _flight_recorder_dumps(backend: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every recorder's entries: gloo's (torch's generic recorder) and, on
    NCCL, NCCL's own."""
    import torch._C._distributed_c10d as c10d

    dumps = [("gloo", c10d._dump_fr_trace_json)]
    if backend == "nccl":
        dumps.append(("nccl", c10d._dump_nccl_trace_json))
    return [
        (
            name,
            json.loads(dump(includeCollectives=True, onlyActive=False)).get(
                "entries", []
            ),
        )
        for name, dump in dumps
    ]


def _named_coordinators() -> list[tuple[str, Any]]:
    """The DCP ``GroupCoordinator`` and this rank's replica groups, by the
    label their traffic is counted under."""
    from vllm.distributed import parallel_state

    from vllm_dcp_geometry.runtime.replica_groups import made_replica_groups

    named = [("dcp", parallel_state._DCP)]
    named += [("replica", g) for g in made_replica_groups().values()]
    return [(label, g) for label, g in named if g is not None]


def _group_label(process_group_name: str) -> tuple[str, int]:
    """Which group a recorded process group is (``dcp``, ``replica``, or
    ``other:`` and the vLLM group or process group it is) and its world
    size."""
    import torch.distributed.distributed_c10d as c10d
    from vllm.distributed import parallel_state

    others = [(name, ref()) for name, ref in parallel_state._groups.items()]
    named = _named_coordinators()
    named += [(f"other:{name}", g) for name, g in others if g is not None]
    for label, coordinator in named:
        for group in (coordinator.device_group, coordinator.cpu_group):
            if c10d._get_process_group_name(group) == process_group_name:
                return label, coordinator.world_size
    group = c10d._resolve_process_group(process_group_name)
    return f"other:{group.group_desc}", group.size()


@dataclass
class Traffic:
    """Every collective this rank issued while ``counted`` ran, and the bytes
    it sent plus received (``collectives.collective_bytes``): whatever API
    issued it, as torch's process groups recorded it (gloo and NCCL, through
    the flight recorder), and vLLM's own NCCL communicators' calls
    (``PyNcclCommunicator``, which bypass torch's process groups). A
    collective with no formula is kept as ``unmodeled``; one on a group
    other than the DCP and replica groups is counted too, under its group's
    name."""

    backend: str = "gloo"
    counting: bool = False
    collectives: list[Collective] = field(default_factory=list)
    _marks: dict[str, int] = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return sum(c.moved for c in self.collectives)

    @property
    def calls(self) -> int:
        return len(self.collectives)

    @property
    def by_op(self) -> dict[str, int]:
        moved: dict[str, int] = {}
        for c in self.collectives:
            key = c.op or c.recorded_as
            moved[key] = moved.get(key, 0) + c.moved
        return moved

    @property
    def by_group(self) -> dict[str, int]:
        moved: dict[str, int] = {}
        for c in self.collectives:
            moved[c.group] = moved.get(c.group, 0) + c.moved
        return moved

    @property
    def worlds(self) -> set[int]:
        return {c.world for c in self.collectives}

    @property
    def unmodeled(self) -> list[str]:
        return sorted(
            {f"{c.recorded_as} on {c.group}" for c in self.collectives if c.op is None}
        )

    def add(self, collective: Collective) -> None:
        if self.counting:
            self.collectives.append(collective)

    def _mark(self) -> None:
        self._marks = {
            source: max((e["record_id"] for e in entries), default=-1)
            for source, entries in _flight_recorder_dumps(self.backend)
        }

    def _read_recorded(self) -> list[Collective]:
        found = []
        for source, entries in _flight_recorder_dumps(self.backend):
            mark = self._marks.get(source, -1)
            new = sorted(
                (e for e in entries if e["record_id"] > mark and not e["is_p2p"]),
                key=lambda e: e["record_id"],
            )
            if new and new[0]["record_id"] != mark + 1:
                raise RuntimeError(
                    f"ranks: torch's {source} flight recorder dropped collectives "
                    f"{mark + 1}..{new[0]['record_id'] - 1} (more than "
                    f"{FLIGHT_RECORDER_ENTRIES} in one forward)"
                )
            for e in new:
                label, world = _group_label(e["process_group"][0])
                found.append(
                    Collective(
                        op=recorded_op(e["profiling_name"]),
                        recorded_as=e["profiling_name"],
                        group=label,
                        world=world,
                        input_bytes=entry_input_bytes(e),
                    )
                )
        return found

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count from zero while the block runs."""
        self.collectives = []
        self._mark()
        self.counting = True
        try:
            yield
        finally:
            self.counting = False
        self.collectives = self._read_recorded() + self.collectives


def _pynccl_group(comm: Any) -> tuple[str, int]:
    """Which group owns a ``PyNcclCommunicator`` and its world size."""
    for label, coordinator in _named_coordinators():
        device_comm = getattr(coordinator, "device_communicator", None)
        if getattr(device_comm, "pynccl_comm", None) is comm:
            return label, coordinator.world_size
    return "other:pynccl", comm.world_size


def count_pynccl_call(
    original: Callable[..., Any], traffic: Traffic, method: str
) -> Callable[..., Any]:
    """``PyNcclCommunicator.method`` adding each call to ``traffic`` while it
    counts (a disabled communicator moves nothing)."""
    op = PYNCCL_OPS[method]

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if traffic.counting and not getattr(self, "disabled", False):
            own = args[1] if method in ("all_gather", "reduce_scatter") else args[0]
            group, world = _pynccl_group(self)
            traffic.add(
                Collective(
                    op=op,
                    recorded_as=f"pynccl:{method}",
                    group=group,
                    world=world,
                    input_bytes=own.numel() * own.element_size()
                    if op is not None
                    else 0,
                )
            )
        return original(self, *args, **kwargs)

    return counted
