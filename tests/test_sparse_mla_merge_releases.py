# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The DSA top-k merge wrapper across vLLM releases.

vLLM 0.34's ``_merge_dcp_topk_global`` takes three more keywords
(``logits_dtype``, ``num_positions``, ``direct_max_rows``), gathers the
packed candidates on dim 0 and views them by the world it is passed, and
takes a symmetric-memory "direct" exchange for batches of at most
``direct_max_rows`` rows, whose workspace packs ids with the DCP group's own
``(r, D)``. For a partial indexer cache (1 < K < D) the wrapper must pass
the keywords on, never take the direct path, and, on the D-wide group
(``partial_collectives: "dcp"``), hand the selector the K shards once
(``FirstReplicaGather``): the D-rank gather no longer fits the view by K.

- With a stand-in upstream (any release): what the wrapper passes on, and
  which group the module's ``get_dcp_group`` answers while it runs.
- On 0.34 (``vllm_releases``): vLLM's real merge on D simulated ranks
  (``tests.support.sparse_selection``), asked for the direct path, within the
  replica and D-wide, against the float64 single-device top-k; without the
  first-replica view the D-wide merge fails vLLM's view.

About 20 s on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.mla import replaced
from tests.support.simulated_collectives import SimulatedReplica
from tests.support.sparse_mla import reference_topk, tied_scores
from tests.support.sparse_selection import (
    indexer_geometry,
    select_on_ranks,
    selection_lengths,
)
from vllm_dcp_geometry.patches.worker.sparse_attn_indexer import (
    FirstReplicaGather,
    _make_merge,
    make_indexer_group_getter,
)
from vllm_dcp_geometry.runtime.group_context import (
    use_indexer_geometry,
    use_replica_group,
)
from vllm_dcp_geometry.tooling.sparse_rank_run import has_repeated_ids, selection_sets

pytestmark = pytest.mark.patches("worker.sparse_attn_indexer")

NEW_KEYWORDS = {
    "logits_dtype": torch.bfloat16,
    "num_positions": 4096,
    "direct_max_rows": 64,
}
"""What vLLM 0.34's indexer op passes its merge (``direct_max_rows`` > 0:
the symmetric-memory workspace exists)."""


# With a stand-in upstream ------------------------------------------------------------


class _Upstream:
    """A stand-in of 0.34's merge: records its arguments, the indices it was
    handed and the group the module's ``get_dcp_group`` answers inside."""

    def __init__(self, dcp_group: Any) -> None:
        self.get_dcp_group = make_indexer_group_getter(lambda: dcp_group)
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self,
        logits: Any,
        topk_indices: Any,
        topk_tokens: int,
        dcp_rank: int,
        dcp_world_size: int,
        cp_interleave: int,
        row_starts: Any = None,
        logits_dtype: Any = torch.float32,
        num_positions: int | None = None,
        direct_max_rows: int = 0,
    ) -> None:
        self.calls.append(
            {
                "world": (dcp_world_size, dcp_rank),
                "row_starts": row_starts,
                "keywords": {
                    "logits_dtype": logits_dtype,
                    "num_positions": num_positions,
                    "direct_max_rows": direct_max_rows,
                },
                "indices": topk_indices.clone(),
                "group": self.get_dcp_group(),
            }
        )


def _call(merge: Any, rank: int, world: int, **keywords: Any) -> None:
    indices = torch.arange(8, dtype=torch.int32).view(2, 4)
    row_starts = torch.zeros(2, dtype=torch.int32)
    merge(torch.zeros(2, 8), indices, 4, rank, world, 1, row_starts, **keywords)


def test_vllms_own_k_passes_every_keyword_through() -> None:
    """No partial indexer call (K = D): upstream gets exactly what the op
    passed, the direct path included, and the DCP group itself."""
    dcp_group = object()
    upstream = _Upstream(dcp_group)
    _call(_make_merge(upstream), 3, 4, **NEW_KEYWORDS)
    (call,) = upstream.calls
    assert call["world"] == (4, 3) and call["keywords"] == NEW_KEYWORDS
    assert torch.equal(call["indices"], torch.arange(8, dtype=torch.int32).view(2, 4))
    assert call["group"] is dcp_group


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_merge_within_its_replica_never_takes_the_direct_path(rank: int) -> None:
    """D=4, K=2 within the replica: the shard world, 0.34's keywords passed
    on but ``direct_max_rows`` 0, every candidate sent, the replica group."""
    upstream = _Upstream(object())
    replica = SimulatedReplica(None, 4, rank, 2)
    with (
        use_indexer_geometry(indexer_geometry(4, 2, rank, 1)),
        use_replica_group(replica),
    ):
        _call(_make_merge(upstream), rank % 2, 2, **NEW_KEYWORDS)
    (call,) = upstream.calls
    assert call["world"] == (2, rank % 2)
    assert call["keywords"] == {**NEW_KEYWORDS, "direct_max_rows": 0}
    assert not bool((call["indices"] == -1).any())
    assert call["group"] is replica


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_d_wide_merge_reads_the_first_replica(rank: int) -> None:
    """D=4, K=2 on the D-wide group: no direct path, duplicate replicas send
    padding, and while upstream runs (only then) the module's group is the
    DCP group seen through ``FirstReplicaGather`` of K."""
    dcp_group = object()
    upstream = _Upstream(dcp_group)
    with use_indexer_geometry(indexer_geometry(4, 2, rank, 1)):
        _call(_make_merge(upstream), rank % 2, 2, **NEW_KEYWORDS)
    (call,) = upstream.calls
    assert call["keywords"] == {**NEW_KEYWORDS, "direct_max_rows": 0}
    assert bool((call["indices"] == -1).all()) == (rank >= 2)
    group = call["group"]
    assert isinstance(group, FirstReplicaGather)
    assert group.group is dcp_group and group.shard_count == 2
    assert upstream.get_dcp_group() is dcp_group


def test_the_first_replica_gather_keeps_ranks_0_to_k() -> None:
    """A dim-0 gather over D=4 keeps the first K=2 ranks' rows (shards 0, 1
    once); a gather on another dim (0.33's) is handed whole."""

    class _Group:
        world_size = 4

        def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
            return torch.cat([tensor + 10 * r for r in range(4)], dim=dim)

    view = FirstReplicaGather(_Group(), 2)
    packed = torch.arange(6.0).view(3, 2)
    kept = view.all_gather(packed, dim=0)
    assert torch.equal(kept, torch.cat([packed, packed + 10]))
    assert view.all_gather(packed, dim=1).shape == (3, 8)
    assert view.world_size == 4


# vLLM 0.34's real merge ---------------------------------------------------------------

BLOCK_SIZE = 16
TOPK = 16
PARTIAL = [
    (dcp, k, interleave)
    for dcp in (4, 8)
    for k in (2, 4)
    if k < dcp
    for interleave in (1, BLOCK_SIZE)
]


def _case(dcp: int, k: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = dcp * interleave + 2 * BLOCK_SIZE + 5
    lengths = torch.tensor(selection_lengths(dcp, interleave, BLOCK_SIZE, width))
    return tied_scores(lengths.numel(), width, seed=dcp + 7 * k + interleave), lengths


def _no_direct_workspace(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a partial merge asked for the direct top-k workspace")


@pytest.mark.vllm_releases("0.34.0")
@pytest.mark.parametrize("within_replica", [True, False], ids=["replica", "d-wide"])
@pytest.mark.parametrize(("dcp", "k", "interleave"), PARTIAL)
def test_a_partial_merge_on_034_selects_the_single_device_topk(
    dcp: int, k: int, interleave: int, within_replica: bool
) -> None:
    """The op asks for the direct path (``direct_max_rows`` above the rows);
    the partial merge takes vLLM's all-gather path, and the selector reads K
    shards' candidates once per row, on every rank."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    scores, lengths = _case(dcp, k, interleave)
    want = selection_sets(reference_topk(scores, lengths, TOPK))
    with replaced(sai, "_get_direct_dcp_topk_workspace", _no_direct_workspace):
        selections, calls = select_on_ranks(
            scores,
            lengths,
            dcp=dcp,
            shard_count=k,
            interleave=interleave,
            block_size=BLOCK_SIZE,
            topk=TOPK,
            within_replica=within_replica,
            direct_max_rows=4 * lengths.numel(),
        )
    for rank, selection in enumerate(selections):
        assert not has_repeated_ids(selection), (rank, selection.tolist())
        assert selection_sets(selection) == want, rank
    assert sorted(calls.selector_calls) == list(range(dcp))
    assert calls.gathered_widths == [k * TOPK] * dcp


@pytest.mark.vllm_releases("0.34.0")
def test_a_d_wide_merge_without_the_first_replica_view_fails_vllms_view() -> None:
    """D=4, K=2 on the D-wide group with the module's ``get_dcp_group`` the
    bare DCP group: vLLM 0.34 views D ranks' candidates by K and fails."""
    scores, lengths = _case(4, 2, 1)
    with pytest.raises(RuntimeError, match="shape"):
        select_on_ranks(
            scores,
            lengths,
            dcp=4,
            shard_count=2,
            interleave=1,
            block_size=BLOCK_SIZE,
            topk=TOPK,
            plugin_getter=False,
        )
