# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Replica groups live and die with vLLM's model-parallel state (rule A6).

``destroy_model_parallel`` (wrapped by ``worker.parallel_state``) destroys
and forgets every replica group before vLLM's own groups; where none was
made it is upstream's call alone. On 8 real ranks over gloo (one process per
rank, vLLM's real ``GroupCoordinator``s) one process initialises DCP 8 with
partial K = 2 and 4, tears down, re-initialises DCP 4 with K = 2, and can
reach none of the first groups.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.processes import run_python

pytestmark = pytest.mark.patches("worker.parallel_state", "worker.gpu_worker")


def test_teardown_is_wrapped_and_every_copy_points_at_the_wrapper() -> None:
    import vllm.distributed as distributed
    from vllm.distributed import parallel_state
    from vllm.v1.executor import multiproc_executor

    from vllm_dcp_geometry.runtime.patching import FACTORY_ATTR

    wrapper = parallel_state.destroy_model_parallel
    assert getattr(wrapper, FACTORY_ATTR) == (
        "vllm_dcp_geometry.patches.worker.parallel_state._make_destroy_model_parallel"
    )
    assert distributed.destroy_model_parallel is wrapper
    assert multiproc_executor.destroy_model_parallel is wrapper


class _Coordinator:
    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def destroy(self) -> None:
        self.calls.append(f"destroy {self.name}")


def test_replica_groups_go_first_and_are_forgotten(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_dcp_geometry.patches.worker.parallel_state import (
        _make_destroy_model_parallel,
    )
    from vllm_dcp_geometry.runtime import replica_groups

    calls: list[str] = []
    made = {2: _Coordinator(calls, "k2"), 4: _Coordinator(calls, "k4")}
    monkeypatch.setattr(replica_groups, "_REPLICA_GROUPS", dict(made))
    teardown = _make_destroy_model_parallel(lambda: calls.append("upstream"))
    teardown()
    assert sorted(calls[:2]) == ["destroy k2", "destroy k4"]
    assert calls[2:] == ["upstream"]
    assert replica_groups.made_replica_groups() == {}
    # Nothing made (D = 1, no partial override): upstream's call alone.
    calls.clear()
    teardown()
    assert calls == ["upstream"]


_REINITIALISE = """
import gc, json, multiprocessing, socket, weakref

WORLD = 8
INITS = [(8, {"*.layers.1.*": 2, "*.layers.2.*": 4}), (4, {"*.layers.1.*": 2})]


def init(dcp, layers, rank, port):
    from vllm.config import (
        DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config,
    )
    from vllm.distributed import parallel_state

    config = VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=WORLD, decode_context_parallel_size=dcp
        ),
        device_config=DeviceConfig(device="cpu"),
        additional_config={"dcp_geometry": {"layers": layers}},
    )
    with set_current_vllm_config(config):
        # Kept across the re-initialisation, as vLLM's teardown keeps it.
        parallel_state.init_distributed_environment(
            WORLD, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=WORLD,
            decode_context_model_parallel_size=dcp,
        )
    return config


def rank_main(rank, port, out):
    import torch
    from vllm.distributed import destroy_model_parallel, parallel_state
    from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
    from vllm_dcp_geometry.runtime import replica_groups

    seen = []
    old = []
    for dcp, layers in INITS:
        config = init(dcp, layers, rank, port)
        made = replica_groups.make_replica_groups(config)
        dcp_group = parallel_state.get_dcp_group()
        groups = replica_groups.made_replica_groups()
        probe = torch.ones(1) * (rank + 1)
        sums = {}
        for k, group in groups.items():
            sums[k] = int(group.all_reduce(probe.clone()).item())
            geometry = GroupGeometry("g", k, dcp, dcp_group.rank_in_group)
            assert replica_groups.replica_group(geometry) is group
        seen.append({
            "dcp": dcp,
            "made": list(made),
            "ranks": {k: list(g.ranks) for k, g in groups.items()},
            "dcp_ranks": list(dcp_group.ranks),
            "sums": sums,
            "new_objects": all(
                g is not ref() for g in groups.values() for ref in old
            ),
        })
        if dcp == INITS[-1][0]:
            break
        old = [weakref.ref(g) for g in groups.values()]
        old_groups = list(groups.values())
        del groups, group
        destroy_model_parallel()
        left = replica_groups.made_replica_groups()
        destroyed = [
            not hasattr(g, "cpu_group") and not hasattr(g, "device_group")
            for g in old_groups
        ]
        del old_groups
    stale = GroupGeometry("g", 4, 8, rank % 4)
    try:
        replica_groups.replica_group(stale)
        refused = False
    except DcpGeometryError:
        refused = True
    gc.collect()
    destroy_model_parallel()
    after = replica_groups.made_replica_groups()
    parallel_state.destroy_distributed_environment()
    out.put({
        "rank": rank,
        "inits": seen,
        "left_after_destroy": len(left),
        "destroyed": destroyed,
        "old_alive": [ref() is not None for ref in old],
        "stale_k4_refused": refused,
        "left_at_end": len(after),
    })


with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ctx = multiprocessing.get_context("fork")
out = ctx.Queue()
procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(WORLD)]
for p in procs:
    p.start()
results = [out.get(timeout=400) for _ in procs]
for p in procs:
    p.join(60)
print(json.dumps(sorted(results, key=lambda r: r["rank"])))
"""


def _expected(rank: int, dcp: int, k: int) -> list[int]:
    first_in_dcp = rank // dcp * dcp
    offset = rank - first_in_dcp
    return [first_in_dcp + offset // k * k + i for i in range(k)]


def test_a_reinitialisation_with_another_d_leaves_no_old_group() -> None:
    results: list[dict[str, Any]] = run_python(_REINITIALISE, patched=True)
    assert [r["rank"] for r in results] == list(range(8))
    for r in results:
        rank = r["rank"]
        first, second = r["inits"]
        assert first["made"] == [2, 4]
        assert second["made"] == [2]
        assert first["ranks"] == {str(k): _expected(rank, 8, k) for k in (2, 4)}
        assert second["ranks"] == {"2": _expected(rank, 4, 2)}
        assert second["dcp_ranks"] == _expected(rank, 4, 4)
        # Each group really collectives over its own ranks.
        for init, ks in ((first, (2, 4)), (second, (2,))):
            for k in ks:
                members = init["ranks"][str(k)]
                assert init["sums"][str(k)] == sum(m + 1 for m in members)
        assert second["new_objects"], rank
        assert r["left_after_destroy"] == 0, rank
        assert r["destroyed"] == [True, True], rank
        assert r["old_alive"] == [False, False], rank
        assert r["stale_k4_refused"], rank
        assert r["left_at_end"] == 0, rank
