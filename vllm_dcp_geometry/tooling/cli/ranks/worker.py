# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One DCP rank of ``vllm-dcp-geometry ranks``: a worker process.

``python -m vllm_dcp_geometry.tooling.cli.ranks.worker PLAN.json RESULT.json``. The
process loads the plugin through vLLM's own plugin loader
(``vllm.plugins.load_general_plugins``: the ``vllm.general_plugins`` entry
point; an unpatched baseline child has ``VLLM_PLUGINS=""``), stands in for
what a CPU lacks (``cpu_stand_ins``), initialises vLLM's real distributed
state (``init_distributed_environment``, ``initialize_model_parallel`` with
TP = DCP = D), installs its meters (``measuring``: torch's flight recorder sized before
the first process group, so every collective is recorded), makes the replica groups
with the very function every ``vllm serve`` worker calls
(``replica_groups.make_replica_groups``, on the config such a worker holds:
``vllm_setup.serving_config``), then runs every group of the plan at its
own shapes (its runner's ``run_group``) with vLLM's real collectives over
the real DCP ``GroupCoordinator``. The result file holds each group's errors
and bytes.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

from vllm_dcp_geometry.runtime.replica_groups import (
    destroy_replica_groups,
    make_replica_groups,
)
from vllm_dcp_geometry.tooling.cli.ranks.measuring import (
    enable_flight_recorder,
    install_meters,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners import RUNNERS_BY_NAME
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    PhaseCrashed,
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import (
    model_dir,
    serving_config,
    vllm_config,
)


def _init_distributed(plan: dict[str, Any], config: Any) -> None:
    """vLLM's real distributed state for this rank: TP = DCP = D."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    world, rank = plan["world"], plan["rank"]
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world,
            rank,
            init_method(plan),
            plan.get("local_rank", rank),
            backend=plan["backend"],
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=world,
            decode_context_model_parallel_size=world,
        )


def init_method(plan: dict[str, Any]) -> str:
    """Where the ranks meet: ``env://`` under torchrun (torch.distributed's
    environment variables), else the launcher's loopback port."""
    return plan.get("init_method") or f"tcp://127.0.0.1:{plan['port']}"


def _frame(frame: traceback.FrameSummary) -> str:
    """``path:line in function``, the path from vLLM's or this package's
    root."""
    path = frame.filename.rpartition(f"site-packages{os.sep}")[2]
    mine = path.rfind(f"vllm_dcp_geometry{os.sep}")
    return f"{path[mine:] if mine >= 0 else path}:{frame.lineno} in {frame.name}"


def _crash(exc: BaseException) -> str:
    """What a group raised, and where in vLLM (the innermost vLLM frame, else
    the innermost one); raised below that frame by this project's code (a
    stand-in refusing what vLLM handed it), the raising frame too."""
    frames = traceback.extract_tb(exc.__traceback__)
    in_vllm = [f for f in frames if f"{os.sep}vllm{os.sep}" in f.filename]
    where = (in_vllm or frames)[-1]
    raised = frames[-1]
    at = f"at {_frame(where)}"
    if raised is not where and f"{os.sep}vllm_dcp_geometry{os.sep}" in raised.filename:
        at = f"raised at {_frame(raised)}, called {at}"
    return f"{type(exc).__name__}: {exc} ({at})"


def run_planned(entry: dict[str, Any], run: RankRun) -> dict[str, Any]:
    """Run one planned group with the runner of its layer class (its
    ``run_group``)."""
    runner = RUNNERS_BY_NAME[entry["runner"]]
    try:
        return dict(runner.run_group(PlannedGroup.from_plan(entry), run))
    except PhaseCrashed as exc:
        # A built layer raised in a phase (0.34.0's unpatched replicated
        # MLA draft asserts in its chunked prefill): what it measured before.
        cause = exc.__cause__ or exc
        return {**exc.ran, "crashed": _crash(cause), "crashed_in": exc.phase}
    except Exception as exc:
        # What the layer raised is the group's result (unpatched vLLM's
        # replicated Kimi-K3 layer asserts, on every rank alike); a rank
        # left waiting in a collective is stopped by the launcher's timeout.
        return {"name": entry["name"], "crashed": _crash(exc)}


def run_rank(plan: dict[str, Any]) -> Any:
    """This rank's whole run, from its plan; a JSON-ready result. With
    ``plan["gather"]`` (torchrun: no launcher reads result files) every
    rank's result is gathered over the world group before it is torn down:
    rank 0 returns the list of all of them, the others None."""
    import torch
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_dcp_geometry.tooling import cpu_stand_ins, vllm_objects

    patched = vllm_objects.is_vllm_patched()
    world, rank = plan["world"], plan["rank"]
    # The run's config sizes TP and DCP only: any group's shape serves.
    shape = Shape(**plan["groups"][0]["shape"])
    device = plan["device"]
    stand_ins = cpu_stand_ins.install_cpu_stand_ins() if device == "cpu" else []
    if device != "cpu":
        local = plan.get("local_rank", rank)
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    path = model_dir(world, shape)
    enable_flight_recorder()
    _init_distributed(plan, vllm_config(path, world, 1, 16, shape, device))
    meters = install_meters(plan["backend"])
    dcp = parallel_state.get_dcp_group()
    made = (
        make_replica_groups(serving_config(plan, shape, path, device))
        if patched
        else ()
    )
    run = RankRun(
        world=world,
        rank=rank,
        device=device,
        seed=plan["seed"],
        patched=patched,
        partial_collectives=plan["partial_collectives"] if patched else None,
        meters=meters,
        cuda_graph=bool(plan.get("cuda_graph", False)),
    )
    groups = [run_planned(g, run) for g in plan["groups"]]
    result = {
        "rank": rank,
        "patched": patched,
        "dcp_group": {
            "class": type(dcp).__name__,
            "world_size": dcp.world_size,
            "rank_in_group": dcp.rank_in_group,
            "backend": plan["backend"],
        },
        "stand_ins": stand_ins,
        "replica_groups": list(made),
        "groups": groups,
        "device_name": torch.cuda.get_device_name(device) if device != "cpu" else "cpu",
    }
    gathered = _gathered(result) if plan.get("gather") else result
    if patched:
        destroy_replica_groups()
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    return gathered


def _gathered(result: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's result on rank 0 (None elsewhere), over the world
    group's CPU (gloo) group."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    world = parallel_state.get_world_group()
    results: list[Any] | None = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(result, results, dst=world.ranks[0], group=world.cpu_group)
    return results


def main(argv: list[str]) -> int:
    plan_path, result_path = argv
    with open(plan_path, encoding="utf-8") as fh:
        plan = json.load(fh)
    result = run_rank(plan)
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
