# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Rule A6: a partial MLA group's collectives stay within its replica.

The replica grouping (``collectives.replica_rank_lists``) and its check,
which refuses every wrong grouping; the start-up step that makes the groups
(``replica_groups.make_replica_groups``, called by the
``Worker.initialize_from_config`` patch), which hands back where no partial MLA group
exists; and, on D simulated ranks, that a rank given a wrong replica group is
refused at start-up while the right one runs exactly (the real processes run
in ``test_cli_ranks``).
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_dcp_geometry.collectives import (
    attention_work_ratio,
    check_replica_grouping,
    collective_world_size,
    replica_rank_lists,
)
from vllm_dcp_geometry.contract import DcpGeometryError

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


def _kv_cache_config(*shard_counts: int | None) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    groups = [
        KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn"],
            MLAAttentionSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=576,
                dtype=torch.bfloat16,
                **({} if k is None else {"dcp_kv_shard_count": k}),
            ),
        )
        for i, k in enumerate(shard_counts)
    ]
    # A partial FlashAttention group stays on the D-wide group: no replica.
    groups.append(
        KVCacheGroupSpec(
            ["model.layers.9.attn"],
            FullAttentionSpec(
                block_size=16,
                num_kv_heads=1,
                head_size=64,
                dtype=torch.bfloat16,
                dcp_kv_shard_count=4,
            ),
        )
    )
    return KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups)


class _Config:
    def __init__(self, partial_collectives: str | None = None) -> None:
        section = (
            {}
            if partial_collectives is None
            else {"dcp_geometry": {"partial_collectives": partial_collectives}}
        )
        self.additional_config = section


def test_start_up_makes_the_partial_mla_groups_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_dcp_geometry import replica_groups as startup

    made: list[tuple[int, ...]] = []
    monkeypatch.setattr(
        startup, "create_replica_groups", lambda counts: made.append(counts)
    )
    config = _kv_cache_config(None, 2, 4, 2)
    assert startup.make_replica_groups(_Config(), config) == (2, 4)
    assert made == [(2, 4)]
    # Kept on the D-wide group by the operator: none made.
    assert startup.make_replica_groups(_Config("dcp"), config) == ()
    assert made == [(2, 4)]


def test_start_up_hands_back_without_a_partial_mla_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every group at vLLM's own K: nothing made, and the plugin's config
    section is not read (a malformed one would raise)."""
    from vllm_dcp_geometry import replica_groups as startup

    def refuse(counts: Any) -> None:
        raise AssertionError(counts)

    monkeypatch.setattr(startup, "create_replica_groups", refuse)
    bad = _Config()
    bad.additional_config = {"dcp_geometry": {"partial_collectives": "nope"}}
    assert startup.make_replica_groups(bad, _kv_cache_config(None, None)) == ()
    with pytest.raises(DcpGeometryError, match="partial_collectives"):
        startup.make_replica_groups(bad, _kv_cache_config(2))


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

    batch = mla.make_batch(4, 2, 0, mla.CPU)
    # DCP rank 2 in {0, 2}: rank 1 of a 2-rank group.
    strided = mla.SimulatedGroup(None, 2, 1)
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

    batch = mla.make_batch(4, 2, 0, mla.CPU)
    earlier = mla.SimulatedGroup(None, 4, 0)
    with (
        mla.cpu_shims(),
        mla.replica_groups_of(earlier, [2]),
        pytest.raises(DcpGeometryError, match="were not made at KV-cache"),
    ):
        mla.make_ranks(
            batch, 4, 2, 1, spec=mla.mla_spec(2), only=[0], replicas_made=False
        )


def test_the_worker_makes_them_before_upstream_builds_its_backends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Worker.initialize_from_config`` (both model runners start here) is
    wrapped, and the wrapper makes the groups before upstream's method."""
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dcp_geometry._patching import FACTORY_ATTR
    from vllm_dcp_geometry.patches.worker import gpu_worker

    assert getattr(Worker.initialize_from_config, FACTORY_ATTR).startswith(
        "vllm_dcp_geometry.patches.worker.gpu_worker."
    )
    calls: list[str] = []
    monkeypatch.setattr(
        gpu_worker, "make_replica_groups", lambda config, kv: calls.append("groups")
    )
    wrapped = gpu_worker._make_initialize_from_config(
        lambda self, kv: calls.append("upstream")
    )
    worker = type("FakeWorker", (), {"vllm_config": _Config()})()
    wrapped(worker, _kv_cache_config(2))
    assert calls == ["groups", "upstream"]
    # No partial MLA group: upstream alone, the worker's config unread.
    calls.clear()
    wrapped(object(), _kv_cache_config(None))
    assert calls == ["upstream"]
