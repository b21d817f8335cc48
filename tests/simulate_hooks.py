# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The tests' ``SimulationOptions``: the command's, plus two test-only hooks.

- ``on_step(view)``: called after each step's checks, with the step's
  ``StepView``: lets a test feed the same outputs to vLLM's own worker code,
  or hand a check a deliberately wrong input;
- ``shift_shard=(group, rank)``: that rank's table of that group stores the
  next shard instead of its own, a deliberately broken geometry the checks
  must catch.

Both go through the simulation's extension point
(``vllm_dcp_geometry.cli.simulate.options.SimulationHooks``); the command's
own options have neither.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from vllm_dcp_geometry.cli.simulate import options


@dataclass(frozen=True)
class SimulationOptions(options.SimulationOptions):
    """``options.SimulationOptions`` with the tests' hooks."""

    shift_shard: tuple[int, int] | None = None
    """(group, rank) whose shard is shifted by one."""
    on_step: Callable[[options.StepView], None] | None = None
    """Called after each step's checks."""

    def hooks(self) -> options.SimulationHooks:
        return _TestHooks(self.shift_shard, self.on_step)


class _TestHooks(options.SimulationHooks):
    def __init__(
        self,
        shift_shard: tuple[int, int] | None,
        on_step: Callable[[options.StepView], None] | None,
    ) -> None:
        self.shift_shard = shift_shard
        self.on_step = on_step

    def shard(self, group: int, rank: int, shard: int, shard_count: int) -> int:
        if self.shift_shard != (group, rank):
            return shard
        if shard_count == 1:
            raise ValueError("shifting a shard needs a group with K > 1")
        return (shard + 1) % shard_count

    def step_checked(self, view: options.StepView) -> None:
        if self.on_step is not None:
            self.on_step(view)
