# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a runner is: the one interface every layer class ``ranks`` builds
implements (``LayerRunner``), and what its workers are handed.

A runner answers for the groups of its layer class at three moments, each a
field of its ``LayerRunner``:

- before any process starts (``cases.plan_groups``, ``resources``): ``plan``,
  the shapes it runs a group at (``GroupCase``, with any entries it adds to
  the group's plan) or why not; ``refuse_shape``, why those shapes cannot run
  here; ``worker_bytes``, what one worker allocates for the group;
- on every worker (``worker``): ``run_group``, which builds the layer for
  the group (a ``PlannedGroup``) in the rank's run (a ``RankRun``) and runs
  it, returning the rank's row (errors, LSEs, the bytes its collectives
  moved); a phase that raises is a ``PhaseCrashed``;
- in the report (``results.merge``): ``measure``, the group's row from every
  rank's.

Its data says what it runs: the spec values (``spec_values``), the backends,
the group kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.tooling.cli.ranks.shapes import (
    BACKEND,
    CUDA_MLA_BACKENDS,
    Shape,
)

if TYPE_CHECKING:
    from vllm_dcp_geometry.tooling.cli.ranks.measuring import Meters
    from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

TIMED_STEPS = 3
"""Decode steps timed per group after the counted one; the median is
reported."""


@dataclass(frozen=True)
class GroupCase:
    """What a runner runs one group at: its shapes, and the entries the
    runner adds to the group's plan for its workers (fields of
    ``PlannedGroup`` with a default)."""

    shape: Shape
    plan: Mapping[str, Any] = field(default_factory=dict)


PlanCase = Callable[
    ["Topology", "CacheGroup", int, str, "str | None"], "GroupCase | str"
]
"""``plan(topology, group, scale, backend, dtype)``: the case ``group`` runs
at (its query heads per rank divided by ``scale``, on ``backend``, in
``dtype`` where given instead of its own), or why not."""

RefuseShape = Callable[[Shape, int, bool], "str | None"]
"""``refuse_shape(shape, world, gpu)``: why the planned shapes cannot run
over a collective world of ``world`` ranks on this machine (None: they
can)."""

WorkerBytes = Callable[[GroupCase, int, int, int], int]
"""``worker_bytes(case, world, block_size, shard_count)``: the bytes one
worker allocates for the group at its case (``resources.check_memory``)."""

RunGroup = Callable[["PlannedGroup", "RankRun"], dict[str, Any]]
"""``run_group(group, run)``: build and run the group on this rank; its
row."""

Measure = Callable[..., dict[str, Any]]
"""``measure(g, ranks, *, dcp, patched, backend)``: the fields a run group's
report row gets from its plan entry ``g`` and every rank's row (none
crashed), on the run's collective ``backend``."""


@dataclass(frozen=True)
class LayerRunner:
    """How ``ranks`` runs the groups of one layer class (the module doc):
    ``spec_values`` are the values it runs of each spec field whose value
    changes the attention (beyond the layout every runner takes)."""

    name: str
    spec_values: Mapping[str, Container[Any]]
    plan: PlanCase
    refuse_shape: RefuseShape
    worker_bytes: WorkerBytes
    run_group: RunGroup
    measure: Measure
    cpu_backend: str = BACKEND
    """The backend the runner runs without a GPU (Triton kernels, interpreted)."""
    cuda_backends: tuple[str, ...] = CUDA_MLA_BACKENDS
    """The compiled backends it runs on a GPU."""
    fixed_backend: bool = False
    """The layer fixes its backend (``--attention-backend`` does not reach
    it): ``cpu_backend``, on any device."""
    kinds: frozenset[str] = frozenset({"mla"})
    """The group kinds it runs (``CacheGroup.kind``)."""

    @property
    def backends(self) -> tuple[str, ...]:
        return (self.cpu_backend, *self.cuda_backends)


@dataclass(frozen=True)
class RankRun:
    """What every group this worker runs shares, fixed once its distributed
    state exists."""

    world: int
    rank: int
    device: str
    seed: int
    patched: bool
    partial_collectives: str | None
    """Where partial groups run their collectives; None when unpatched."""
    meters: Meters
    cuda_graph: bool = False
    """Also capture each group's decode step in a CUDA graph and replay it
    (``--cuda-graph``; a GPU run only)."""


@dataclass(frozen=True)
class PlannedGroup:
    """One group of the plan, as the launcher wrote it (``cases.plan_groups``;
    only the fields a worker reads), with the shapes it runs at."""

    index: int
    name: str
    block_size: int
    shard_count: int
    interleave: int
    dcp_sharded: bool
    draft: bool
    dcp_kv_shard_count: int | None
    non_causal: bool
    """The layer decodes a multi-token block non-causally (a DSpark draft)."""
    shape: Shape
    sparse_latent: str | None = None
    """A DeepSeek-V3.2 layer's latent cache group (both its groups run
    together, ``runners.sparse_mla``); None for other layer classes."""
    sparse_indexer: str | None = None
    """That layer's indexer cache group."""
    indexer_topk: int | None = None
    """The top-k its indexer selects."""

    @classmethod
    def from_plan(cls, entry: dict[str, Any]) -> PlannedGroup:
        # Fields with a default may be absent (a plan written before them).
        values = {
            f.name: entry[f.name]
            for f in fields(cls)
            if f.name in entry or f.default is MISSING
        }
        return cls(**{**values, "shape": Shape(**entry["shape"])})


OPTIONAL_PLAN_ENTRIES = {
    f.name: f.default for f in fields(PlannedGroup) if f.default is not MISSING
}
"""The plan entries a runner may add for its workers (``GroupCase.plan``),
as a group that has none of them reads them."""


class PhaseCrashed(Exception):
    """A phase of a built group raised (its ``__cause__``): what the group
    had measured before it (``ran``: at least its layer class and the world
    its impl attends over) and the phase."""

    def __init__(self, ran: dict[str, Any], phase: str) -> None:
        super().__init__(phase)
        self.ran, self.phase = ran, phase


def run_every_phase(
    set_up: Any, run: RankRun, run_phase: Callable[..., dict[str, Any]]
) -> dict[str, Any]:
    """Run every phase of a group built on this rank (``set_up``: its group,
    layer and phase cases; ``run_phase(phase, requests, set_up, run)``: one
    phase's report entries): its errors and traffic, the class it ran and the
    world its impl attends over (read from the bound impl). A phase that
    raises is a ``PhaseCrashed`` carrying what ran before it."""
    layer = type(set_up.layer)
    report: dict[str, Any] = {
        "name": set_up.group.name,
        "layer_class_run": f"{layer.__module__}.{layer.__qualname__}",
        "impl_dcp_world_size": int(set_up.layer.impl.dcp_world_size),
    }
    for phase, requests in set_up.cases.items():
        try:
            report.update(run_phase(phase, requests, set_up, run))
        except Exception as exc:
            raise PhaseCrashed(report, phase) from exc
    return report
