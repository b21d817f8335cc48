# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every check of ``simulate`` fails on a deliberately wrong input.

Inside a real simulation (``hybrid(4)``: K = 4, K = 2, recurrent and K = 1
groups; vLLM's scheduler with several requests live), one step's real slot
mappings, rows and geometry are handed to each check with one thing broken;
the check must report it. The shifted-shard hook (``test_cli_simulate``)
covers ``unwritten``/``written_twice`` and V2's ``kernel_mismatch``; the
unpatched baselines there show ``local_lengths`` on real vLLM. The runs use
the installed release's default runner (V1 on 0.33.0, V2 on 0.34.0, which
removed V1): the checks are the same on both.

Cost: about 15 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from tests.support.simulate import SimulationOptions, group_index, hybrid
from vllm_dcp_geometry.tooling.cli.simulate.checks import Checker
from vllm_dcp_geometry.tooling.cli.simulate.run import run_simulation
from vllm_dcp_geometry.tooling.cli.simulate.workers import V1Workers
from vllm_dcp_geometry.tooling.cli.simulate.workers_v2 import V2Workers

# Model Runner V2's real BlockTables build on CPU where V2 is the runner.
pytestmark = pytest.mark.usefixtures("v2_on_cpu")

LIGHT = {"requests": 12, "step_tokens": 1024}


def _first_busy_step(probe: Any, **options: Any) -> dict:
    """Run ``probe(view)`` once, at the first step with two or more requests
    scheduled; return the report."""
    done: dict[str, Any] = {}

    def on_step(view: Any) -> None:
        if "probed" in done or len(view.batch.req_ids) < 2:
            return
        done["probed"] = probe(view)

    options = {**LIGHT, **options}
    report = run_simulation(
        hybrid(4),
        SimulationOptions(workload="mixed", progress=False, on_step=on_step, **options),
    )
    assert done["probed"] is None
    return report


def _counts(view: Any) -> dict[str, int]:
    return dict(view.checker.violations.counts)


def _group(view: Any, name: str) -> Any:
    topology_groups = view.checker.groups
    return topology_groups[group_index(hybrid(4), name)]


def test_a_slot_in_another_requests_block_is_foreign() -> None:
    def probe(view: Any) -> None:
        group = _group(view, "draft")
        batch = view.batch
        slots = view.workers.twin_slot_mappings(batch, group.index)
        # Request 0's first token written to request 1's first slot.
        slots[:, 0] = slots[:, int(batch.query_start_loc[1])]
        view.checker.check_slots(view.step, group, batch, slots)
        assert _counts(view)["foreign_slot"] == view.checker.dcp

    report = _first_busy_step(probe)
    assert report["violations"]["foreign_slot"] == 4
    assert report["violations"]["shared_slot"] == 0


def test_a_block_written_for_a_released_request_is_shared(monkeypatch) -> None:
    # A checker never told that requests finished or were preempted sees their
    # reused blocks written for a second live request.
    monkeypatch.setattr(Checker, "release", lambda self, req_ids: None)
    report = run_simulation(
        hybrid(4),
        SimulationOptions(workload="mixed", progress=False, **LIGHT),
    )
    assert report["violations"]["shared_slot"] > 0
    assert report["violations"]["foreign_slot"] == 0


def test_a_recurrent_index_outside_the_requests_blocks() -> None:
    def probe(view: Any) -> None:
        group = _group(view, "state")
        rows = [
            view.workers.rows(r, group.index, view.batch).copy()
            for r in range(view.checker.dcp)
        ]
        rows[2][:] = 0  # the null block everywhere on rank 2
        view.checker.check_recurrent(view.step, group, view.batch, rows)
        assert _counts(view)["recurrent_index"] > 0

    report = _first_busy_step(probe)
    items = [i for i in report["violation_items"] if i["kind"] == "recurrent_index"]
    assert items and items[0]["rank"] == 2


def test_a_row_past_its_table_is_a_width_violation() -> None:
    seen: list[int] = []

    def on_step(view: Any) -> None:
        if view.step != 1:
            return
        # The first scheduler output again, on tables sized for 64 tokens.
        setup = dataclasses.replace(view.workers.setup, max_len=64)
        if view.workers.runner == "v1":
            narrow: Any = V1Workers(setup)
        else:
            narrow = V2Workers(setup, real=False)
        narrow.update(view.scheduler_output)
        view.checker.check_overflows(view.step, narrow.overflows, narrow.widths)
        seen.append(len(narrow.overflows))

    report = run_simulation(
        hybrid(4),
        SimulationOptions(workload="mixed", progress=False, on_step=on_step, **LIGHT),
    )
    assert seen and seen[0] > 0
    assert report["violations"]["table_width"] == seen[0]


def test_local_lengths_of_the_wrong_shard_count() -> None:
    def probe(view: Any) -> None:
        group = dataclasses.replace(_group(view, "attn.k2"), builder_shard_count=4)
        view.checker.check_local_lengths(view.step, group, view.batch)
        assert _counts(view)["local_lengths"] > 0

    assert _first_busy_step(probe)["violations"]["local_lengths"] > 0


def test_block_sizes_that_do_not_tile_a_group() -> None:
    def probe(view: Any) -> None:
        scheduler = view.engine.scheduler
        # A scheduler block of 48 tokens does not hold V = 16 * 4 = 64.
        view.checker.check_block_sizes(view.step, 48, 16)
        assert _counts(view)["block_sizes"] > 0
        before = _counts(view)["block_sizes"]
        view.checker.check_block_sizes(
            view.step, scheduler.block_size, scheduler.hash_block_size
        )
        assert _counts(view)["block_sizes"] == before

    assert _first_busy_step(probe)["violations"]["block_sizes"] > 0


def test_a_kernel_that_disagrees_with_the_twin() -> None:
    def probe(view: Any) -> None:
        group = _group(view, "attn.kD")
        twin = view.workers.twin_slot_mappings(view.batch, group.index)
        real = twin.copy()
        real[1, np.nonzero(real[1] >= 0)[0][0]] += 1
        view.checker.compare_kernel(view.step, group, view.batch, twin, real)
        assert _counts(view)["kernel_mismatch"] == 1

    assert _first_busy_step(probe)["violations"]["kernel_mismatch"] == 1
