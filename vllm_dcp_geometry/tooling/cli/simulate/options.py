# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What one simulation runs (``SimulationOptions``), and the extension point
where a caller looks into or alters a run (``SimulationHooks``).

The command runs with the no-op ``SimulationHooks``. A caller that needs
more subclasses ``SimulationOptions`` and returns its own hooks from
``hooks()``: the tests do (``tests/support/simulate.py``), to feed every step's
scheduler output to vLLM's own worker code, to hand a check a deliberately
wrong input, to shift one rank's shard so that the checks must catch a
broken geometry, and to cross-check small runs under the interpreter as a
GPU run does. Nothing a hook does is part of the command's behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.tooling.vllm_release import default_runner

if TYPE_CHECKING:
    from vllm_dcp_geometry.tooling.cli.simulate.checks import Checker
    from vllm_dcp_geometry.tooling.cli.simulate.engine import Engine
    from vllm_dcp_geometry.tooling.cli.simulate.workers import ScheduledBatch


@dataclass(frozen=True)
class StepView:
    """One simulated step, as ``SimulationHooks.step_checked`` sees it."""

    step: int
    scheduler_output: Any
    batch: ScheduledBatch
    workers: Any
    checker: Checker
    engine: Engine


class SimulationHooks:
    """Where a run calls out (the extension point); these do nothing."""

    def shard(self, group: int, rank: int, shard: int, shard_count: int) -> int:
        """The shard of group ``group`` that rank ``rank``'s table stores and
        its slot-mapping launch writes: given the runner's own ``shard`` of
        ``shard_count``, the one the workers use."""
        return shard

    def step_checked(self, view: StepView) -> None:
        """Called after each step's checks, before the stand-in model's
        output goes back to the scheduler."""

    def cross_checks_as_on_a_gpu(self) -> bool:
        """Whether, under the Triton interpreter, the run still feeds vLLM's
        tables every step and cross-checks the steps a GPU run does (every
        64th and every virtual-block crossing) rather than steps 1, 2, 4, ...
        (``kernels.interpreted_check_due``)."""
        return False


@dataclass(frozen=True)
class SimulationOptions:
    """What one simulation runs: the model runner (the installed release's
    default), the workload and its sizes (None: the workload's default)."""

    runner: str = field(default_factory=default_runner)
    workload: str = "replay"
    tokens: int | None = None
    step_tokens: int | None = None
    num_pages: int | None = None
    requests: int | None = None
    seed: int = 0
    progress: bool = True
    verbose: bool = False

    def hooks(self) -> SimulationHooks:
        """The hooks the run calls (a subclass returns its own)."""
        return SimulationHooks()
