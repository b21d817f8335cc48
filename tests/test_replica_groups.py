# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Rule A6: a partial MLA group's collectives stay within its replica.

The replica grouping (``collectives.replica_rank_lists``) and its check,
which refuses every wrong grouping; the start-up step that makes the groups
(``replica_groups.make_replica_groups``, called by the ``Worker.init_device``
patch), which takes the shard counts from the configuration alone and hands
back where no partial override exists; and, on D simulated ranks, that a rank given a wrong replica group is
refused at start-up while the right one runs exactly (the real processes run
in ``test_cli_ranks``).
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.collectives import (
    attention_work_ratio,
    check_replica_grouping,
    collective_world_size,
    replica_rank_lists,
)

pytestmark = pytest.mark.patches(
    "worker.gpu_worker", "worker.mla_attention", "worker.mla_dcp_manager"
)

DCP_GROUPS = [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_replicas_are_contiguous_runs_of_k_dcp_ranks() -> None:
    assert replica_rank_lists(DCP_GROUPS, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert replica_rank_lists(DCP_GROUPS, 4) == DCP_GROUPS
    assert replica_rank_lists(DCP_GROUPS, 1) == [[r] for r in range(8)]
    # DCP groups need not be contiguous global ranks (DCP over TP x PCP).
    assert replica_rank_lists([[0, 2, 4, 6]], 2) == [[0, 2], [4, 6]]
    with pytest.raises(DcpGeometryError, match="must divide"):
        replica_rank_lists(DCP_GROUPS, 3)


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ([[0, 2], [1, 3], [4, 5], [6, 7]], "count a shard twice"),
        ([[1, 0], [2, 3], [4, 5], [6, 7]], "not each of 0..1 once in order"),
        ([[0, 1], [2, 3], [4, 5]], r"ranks \[6, 7\] are in none"),
        ([[0, 1], [0, 1], [4, 5], [6, 7]], "in another replica"),
        ([[0, 1], [2, 4], [3, 5], [6, 7]], "spans several DCP groups"),
        ([[0, 1, 2], [4, 5], [6, 7]], "not K"),
        ([[0, 1], [2, 9]], r"ranks \[9\] are in no DCP group"),
    ],
)
def test_a_wrong_replica_grouping_is_refused(
    replicas: list[list[int]], message: str
) -> None:
    with pytest.raises(DcpGeometryError, match=message):
        check_replica_grouping(replicas, DCP_GROUPS, 2)


def test_collective_world_and_work() -> None:
    assert collective_world_size(1, 8, replica_collectives=True) == 1
    assert collective_world_size(8, 8, replica_collectives=True) == 8
    assert collective_world_size(2, 8, replica_collectives=True) == 2
    assert collective_world_size(2, 8, replica_collectives=False) == 8
    assert attention_work_ratio(2, 2, 8) == 1.0
    assert attention_work_ratio(8, 2, 8) == 4.0
    assert attention_work_ratio(1, 1, 8) == 1.0


# Start-up ------------------------------------------------------------------------


class _Config:
    """What ``replica_groups`` reads of a ``VllmConfig``."""

    def __init__(
        self,
        layers: dict[str, Any] | None = None,
        partial_collectives: str | None = None,
        dcp: int = 8,
        elastic: bool = False,
    ) -> None:
        section: dict[str, Any] = {}
        if layers is not None:
            section["layers"] = layers
        if partial_collectives is not None:
            section["partial_collectives"] = partial_collectives
        self.additional_config = {"dcp_geometry": section} if section else {}
        self.parallel_config = type(
            "Parallel",
            (),
            {"decode_context_parallel_size": dcp, "enable_elastic_ep": elastic},
        )()


OVERRIDES = {"*.layers.1.*": 2, "*.layers.2.*": 4, "*.layers.3.*": 2, "x": "sharded"}


def test_start_up_makes_a_replica_group_per_partial_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the configuration alone (so every worker asks the same): each
    partial K the overrides name, ascending; K = 1, K = D and strings are
    not partial."""
    from vllm_dcp_geometry.runtime import replica_groups as startup

    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(startup, "create_replica_groups", made.append)
    layers = {**OVERRIDES, "*.layers.4.*": 1, "*.layers.5.*": 8, "y": "replicated"}
    assert startup.make_replica_groups(_Config(layers)) == (2, 4)
    assert made == [(2, 4)]
    # Kept on the D-wide group by the operator, or DCP off: none made.
    assert startup.make_replica_groups(_Config(layers, "dcp")) == ()
    assert startup.make_replica_groups(_Config({"*": 1}, dcp=1)) == ()
    assert made == [(2, 4)]
    with pytest.raises(DcpGeometryError, match="elastic expert parallelism"):
        startup.make_replica_groups(_Config(layers, elastic=True))


def test_start_up_hands_back_without_a_partial_override(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D = 1 reads nothing but D (a malformed section is not even parsed);
    no partial override makes nothing."""
    from vllm_dcp_geometry.runtime import replica_groups as startup

    def refuse(counts: Any) -> None:
        raise AssertionError(counts)

    monkeypatch.setattr(startup, "create_replica_groups", refuse)
    bad = _Config(dcp=1)
    bad.additional_config = {"dcp_geometry": {"partial_collectives": "nope"}}
    assert startup.make_replica_groups(bad) == ()
    assert startup.make_replica_groups(_Config({"*": "sharded"})) == ()
    assert startup.make_replica_groups(_Config()) == ()
    with pytest.raises(DcpGeometryError, match="partial_collectives"):
        startup.make_replica_groups(_Config({"*": 2}, "nope"))


def test_a_builder_without_its_replica_group_is_refused() -> None:
    """A partial MLA group whose replica groups were not made (not started
    through a worker) fails at start-up naming the group and the way out."""
    from tests.support.mla import CPU, cpu_shims, make_batch, make_ranks, mla_spec

    batch = make_batch(4, 2, 0, CPU)
    with (
        cpu_shims(),
        pytest.raises(DcpGeometryError, match="were not made at KV-cache") as info,
    ):
        make_ranks(batch, 4, 2, 1, spec=mla_spec(2), only=[0], replicas_made=False)
    assert "K=2, D=4" in str(info.value)
    assert "'partial_collectives'" in str(info.value)


def test_a_wrong_replica_group_is_refused_by_the_builder() -> None:
    """DCP rank 2 given the strided group (where it would sit at rank 1 of
    {0, 2}, holding shard 0 like rank 0): the builder checks the group's
    world and rank against (K, r % K) and refuses."""
    from tests.support import mla
    from tests.support.simulated_collectives import SimulatedGroup

    batch = mla.make_batch(4, 2, 0, mla.CPU)
    # DCP rank 2 in {0, 2}: rank 1 of a 2-rank group.
    strided = SimulatedGroup(None, 2, 1)
    with (
        mla.cpu_shims(),
        pytest.raises(DcpGeometryError, match=r"not the group's \(K, r % K\)"),
    ):
        mla.make_ranks(
            batch,
            4,
            2,
            1,
            spec=mla.mla_spec(2),
            only=[2],
            make_replica=lambda k: strided,
        )


def test_a_stale_replica_group_is_refused_by_the_builder() -> None:
    """A replica group made for an earlier DCP group (vLLM re-initialised
    its model parallel state) is not used."""
    from tests.support import mla
    from tests.support.simulated_collectives import SimulatedGroup, replica_groups_of

    batch = mla.make_batch(4, 2, 0, mla.CPU)
    earlier = SimulatedGroup(None, 4, 0)
    with (
        mla.cpu_shims(),
        replica_groups_of(earlier, [2]),
        pytest.raises(DcpGeometryError, match="were not made at KV-cache"),
    ):
        mla.make_ranks(
            batch, 4, 2, 1, spec=mla.mla_spec(2), only=[0], replicas_made=False
        )


def test_the_worker_makes_them_once_its_distributed_state_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Worker.init_device`` (both model runners start here; the memory
    profile and the KV cache come later) is wrapped, and the wrapper makes
    the groups right after upstream's method has made vLLM's groups."""
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dcp_geometry.patches.worker import gpu_worker
    from vllm_dcp_geometry.runtime.patching import FACTORY_ATTR

    assert getattr(Worker.init_device, FACTORY_ATTR).startswith(
        "vllm_dcp_geometry.patches.worker.gpu_worker."
    )
    calls: list[str] = []
    monkeypatch.setattr(
        gpu_worker, "make_replica_groups", lambda config: calls.append("groups")
    )
    wrapped = gpu_worker._make_init_device(lambda self: calls.append("upstream"))
    worker = type("FakeWorker", (), {"vllm_config": _Config(OVERRIDES)})()
    wrapped(worker)
    assert calls == ["upstream", "groups"]


# The checks that a reader took the replica channel ---------------------------------


def _partial_geometry() -> Any:
    from vllm_dcp_geometry.contract import GroupGeometry

    return GroupGeometry("group g", 2, 4, 3, default_shard_count=4)


def test_replica_dcp_ranks_are_the_contracts() -> None:
    from vllm_dcp_geometry.contract import GroupGeometry

    assert [list(GroupGeometry("g", 2, 8, r).replica_dcp_ranks) for r in (0, 3, 7)] == [
        [0, 1],
        [2, 3],
        [6, 7],
    ]
    assert list(GroupGeometry("g", 1, 4, 2).replica_dcp_ranks) == [2]


def test_a_replica_manager_that_ignores_the_replica_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``replica_manager`` remakes a layer's ``MLADCPManager`` with vLLM's
    constructor; a manager made without the patch, or a constructor that no
    longer asks ``get_dcp_group``, is refused."""
    from vllm.v1.attention.ops import dcp

    from vllm_dcp_geometry.runtime.mla_geometry import (
        MANAGER_ARGS_ATTR,
        replica_manager,
    )

    replica = object()
    blank = dcp.MLADCPManager.__new__(dcp.MLADCPManager)
    with pytest.raises(DcpGeometryError, match="mla_dcp_manager applied"):
        replica_manager(blank, replica, "layer L")

    class Manager:
        def __init__(self, group: Any) -> None:
            self.group = group

    ignoring = Manager("the D-wide group")
    setattr(ignoring, MANAGER_ARGS_ATTR, (("the D-wide group",), {}))
    with pytest.raises(DcpGeometryError, match="no longer ask get_dcp_group"):
        replica_manager(ignoring, replica, "layer L")


def test_a_builder_that_ignores_the_replica_is_refused() -> None:
    """The MLA builder patch's finishing step: a builder that took D (not
    the replica's K) or another manager is refused."""
    from vllm_dcp_geometry.patches.worker.mla_attention import (
        _finish_partial_builder,
    )
    from vllm_dcp_geometry.runtime.group_context import use_replica_group

    replica = object()
    manager = type("Manager", (), {"group": replica})()
    builder = type(
        "Builder",
        (),
        {"dcp_world_size": 4, "dcp_manager": manager, "page_size": 16},
    )()
    with (
        use_replica_group(replica),
        pytest.raises(DcpGeometryError, match="no longer asks get_dcp_group"),
    ):
        _finish_partial_builder(builder, _partial_geometry(), None, None)


def test_a_d_wide_context_plan_within_a_replica_is_refused() -> None:
    """Within its replica the chunk planner must see the replica's (K, I,
    I*K); the builder's D-wide arguments are refused, not rewritten."""
    from vllm_dcp_geometry.runtime.group_context import use_replica_group
    from vllm_dcp_geometry.runtime.mla_geometry import group_context_chunk_kwargs

    kwargs = {
        "dcp_world_size": 4,
        "dcp_local_block_size": 1,
        "dcp_virtual_block_size": 4,
        "chunked_prefill_workspace_size": 64,
    }
    with use_replica_group(object()):
        with pytest.raises(DcpGeometryError, match="not the replica's"):
            group_context_chunk_kwargs(kwargs, _partial_geometry())
        within = {**kwargs, "dcp_world_size": 2, "dcp_virtual_block_size": 2}
        assert group_context_chunk_kwargs(within, _partial_geometry()) == within
