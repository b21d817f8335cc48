# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``simulate`` restates instead of running vLLM's worker code, checked
against vLLM's own code on inputs where both run (this process: CPU, the
Triton interpreter, pinned memory off).

- Model Runner V1 (vLLM 0.33.0 only; 0.34.0 removed it): the same ``SchedulerOutput``s of a mixed workload (chunked
  prefill, prefix hits, preemption, drafts) go to the simulator's tables and
  to vLLM's real ``GPUModelRunner._update_states`` driving a real
  ``InputBatch`` built by the real ``may_reinitialize_input_batch``: the
  batch order, every request's row in every group, the tables' geometry and
  the runner's positions (``_get_cumsum_and_arange`` over the input batch's
  ``num_computed_tokens_cpu``) agree at every step.
- Model Runner V2: the request-state indices agree with vLLM's
  ``RequestState`` under the runner's call order (rows and slots are compared
  with the real ``BlockTables`` inside every V2 simulation).
- The vectorized slot-mapping twin equals vLLM's kernels with an interleave
  size above 1 (the simulations' cross-check covers I = 1).

Cost: about 20 s on 2 cores.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.support import worker
from tests.support.simulate import (
    MODEL_RUNNER_V1,
    RUNNERS,
    SimulationOptions,
    hybrid,
)
from vllm_dcp_geometry.tooling.cli.simulate.checks import KINDS
from vllm_dcp_geometry.tooling.cli.simulate.run import run_simulation

pytestmark = pytest.mark.patches(
    "worker.block_table", "worker.gpu_model_runner", "worker.gpu_block_table"
)

MIXED = {"requests": 12, "step_tokens": 1024}


class _OnePipelineStage:
    """vLLM's pipeline-parallel group of a single-stage engine: this rank is
    the last stage. (``_update_states`` asks; no process group exists here.)"""

    is_last_rank = True


def _runner_shell(
    engine_vllm_config: Any,
    kv_cache_config: Any,
    rank: int,
    max_len: int,
    max_num_reqs: int,
    max_tokens: int,
) -> Any:
    """A real ``GPUModelRunner`` (no model) whose input batch the real
    ``may_reinitialize_input_batch`` built, with the state ``_update_states``
    reads."""
    from vllm.v1.pool.late_interaction_runner import LateInteractionRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    state = worker.v1_runner_input_batch(
        kv_cache_config,
        engine_vllm_config,
        max_model_len=max_len,
        dcp_rank=rank,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_tokens,
    )
    runner = GPUModelRunner.__new__(GPUModelRunner)
    runner.__dict__.update(vars(state))
    runner.__dict__.update(
        requests={},
        num_prompt_logprobs={},
        encoder_cache={},
        late_interaction_runner=LateInteractionRunner(),
        speculative_config=None,
        uses_mrope=False,
        use_async_spec_decode=False,
        use_async_scheduling=False,
        reorder_batch_threshold=None,
        kv_cache_config=kv_cache_config,
        kv_caches=[],  # no KV data here: block copies and zeroing have nothing to do
        arange_np=np.arange(max(max_tokens, max_num_reqs) + 1, dtype=np.int64),
    )
    return runner


def _compare_v1_step(
    runner: Any, workers: Any, rank: int, output: Any, batch: Any
) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # Every worker process gets its own copy of the scheduler output.
    runner._update_states(copy.deepcopy(output))
    real = runner.input_batch
    count = real.num_reqs
    assert real.req_ids[:count] == batch.req_ids
    mine = workers.ranks[rank].block_tables
    for group, table in enumerate(real.block_table.block_tables):
        ours = mine[group]
        assert (
            table.dcp_world_size,
            table.dcp_rank,
            table.max_num_blocks_per_req,
            table.slot_mapping_mode,
        ) == (
            ours.dcp_world_size,
            ours.dcp_rank,
            ours.max_num_blocks_per_req,
            ours.slot_mapping_mode,
        )
        for row in range(count):
            n = int(table.num_blocks_per_row[row])
            assert n == int(ours.num_blocks_per_row[row])
            assert np.array_equal(
                table.block_table.np[row, :n], ours.block_table.np[row, :n]
            )
    if count:
        scheduled = np.array([output.num_scheduled_tokens[r] for r in batch.req_ids])
        arange = np.zeros(int(scheduled.sum()), dtype=np.int64)
        cumsum = GPUModelRunner._get_cumsum_and_arange(runner, scheduled, arange)
        req_indices = np.repeat(np.arange(count), scheduled)
        positions = real.num_computed_tokens_cpu[req_indices] + arange
        assert np.array_equal(positions, batch.positions)
        assert np.array_equal(cumsum, batch.query_start_loc[1:])


@MODEL_RUNNER_V1
@pytest.mark.parametrize("dcp", [1, 4])
def test_v1_bookkeeping_matches_update_states(monkeypatch, dcp):
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    monkeypatch.setattr(gpu_model_runner, "get_pp_group", _OnePipelineStage)
    shells: dict[int, Any] = {}
    seen = SimpleNamespace(steps=0, preempted=0, resumed=0)

    def on_step(view: Any) -> None:
        output, batch, workers = view.scheduler_output, view.batch, view.workers
        setup = workers.setup
        for rank in sorted({0, setup.dcp_world_size - 1}):
            if rank not in shells:
                shells[rank] = _runner_shell(
                    setup.vllm_config,
                    setup.kv_cache_config,
                    rank,
                    setup.max_len,
                    setup.max_num_reqs,
                    setup.max_num_batched_tokens,
                )
            _compare_v1_step(shells[rank], workers, rank, output, batch)
        seen.steps += 1
        seen.preempted += len(output.preempted_req_ids or ())
        seen.resumed += len(output.scheduled_cached_reqs.resumed_req_ids)

    report = run_simulation(
        hybrid(dcp),
        SimulationOptions(
            runner="v1",
            workload="mixed",
            progress=False,
            on_step=on_step,
            **MIXED,
        ),
    )
    assert report["ok"], report["violation_items"]
    assert seen.steps == report["steps"]
    # The comparison went through preemption and resumption.
    assert seen.preempted > 0 and seen.resumed > 0


def test_v2_request_indices_match_request_state(v2_on_cpu):
    import torch
    from vllm.v1.worker.gpu.states import RequestState

    states: dict[str, Any] = {}

    def on_step(view: Any) -> None:
        output, batch, workers = view.scheduler_output, view.batch, view.workers
        if "real" not in states:
            setup = workers.setup
            states["real"] = RequestState(
                setup.max_num_reqs,
                setup.max_len,
                setup.max_num_batched_tokens,
                0,
                64,
                torch.device("cpu"),
            )
        real = states["real"]
        # GPUModelRunner.finish_requests, then add_requests (V2's order).
        for req_id in sorted(
            set(output.finished_req_ids) | set(output.preempted_req_ids or ())
        ):
            real.remove_request(req_id)
        for new in output.scheduled_new_reqs:
            real.remove_request(new.req_id)
            real.add_request(
                new.req_id,
                new.prompt_len,
                new.prefill_token_ids,
                new.num_computed_tokens,
                1,
            )
        assert real.req_id_to_index == workers.book.index_of
        assert [real.req_id_to_index[r] for r in batch.req_ids] == list(batch.rows)

    report = run_simulation(
        hybrid(2),
        SimulationOptions(
            runner="v2", workload="mixed", progress=False, on_step=on_step, **MIXED
        ),
    )
    assert report["ok"], report["violation_items"]


@pytest.mark.parametrize("runner", RUNNERS)
def test_twin_matches_vllm_kernels_with_interleave(v2_on_cpu, runner):
    topology = hybrid(4).with_layout(interleave=8)
    report = run_simulation(
        topology,
        SimulationOptions(
            runner=runner, workload="replay", progress=False, tokens=1024
        ),
    )
    assert report["violations"] == dict.fromkeys(KINDS, 0), report["violation_items"]
    assert report["slot_mapping"]["cross_checked_steps"] > 0
