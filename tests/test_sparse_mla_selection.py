# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's top-k selection over a K-shard indexer cache.

D simulated ranks (``tests.support.sparse_selection``), rank r holding shard
``r % K``: each takes the local top-k of its shard's logits and calls vLLM's
real ``_merge_dcp_topk_global`` (patched by ``worker.sparse_attn_indexer``)
as the DeepSeek-V3.2 call wrapper (``worker.deepseek_v32_attention``) has it
called: in the shard world ``(K, r % K)`` with ``use_indexer_geometry``
active for 1 < K < D, upstream's ``(D, r)`` for K = D, world 1 for K = 1.
vLLM's Triton pack kernel runs under the interpreter and the D-rank
all-gather over the simulated ranks; the CuteDSL selector (CUDA only) is
stood in for by a torch selector with its exact key contract, itself checked
here against a float64 top-k. Every rank must select exactly the float64
single-device top-k (ties to the smaller id) and the same set as every other
rank. Unpatched vLLM, in a fresh process, counts the replicas twice. The call
wrapper, checked with a recording stand-in of the indexer op, is in
``test_sparse_mla_indexer_call``.

About 15 s on 2 cores (the unpatched process about 8 s of it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.processes import run_python
from tests.support.sparse_mla import reference_topk, tied_scores
from tests.support.sparse_selection import (
    indexer_geometry,
    replica_selection_report,
    select_on_ranks,
    selection_lengths,
)
from tests.support.sweeps import divisors
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.group_context import (
    use_indexer_geometry,
)
from vllm_dcp_geometry.tooling.sparse_rank_run import has_repeated_ids, selection_sets
from vllm_dcp_geometry.tooling.sparse_stand_ins import (
    selector_reads_rank_major,
    stable_topk_stand_in,
)

pytestmark = pytest.mark.patches(
    "worker.sparse_attn_indexer", "worker.deepseek_v32_attention"
)

BLOCK_SIZE = 16
TOPK = 16
GRID = [
    (dcp, k, interleave)
    for dcp in (2, 4, 8)
    for k in divisors(dcp)
    for interleave in (1, BLOCK_SIZE)
]


# The selector stand-in -------------------------------------------------------------


def _float64_rule(candidates: torch.Tensor, topk: int) -> torch.Tensor:
    """Plain float64 top-k of ``(score, id)`` candidates: score descending,
    ties to the smaller id, padding (id < 0) never selected, -1 filling."""
    rows = []
    for row in candidates.double():
        picked = sorted(
            (-float(score), int(ident)) for score, ident in row.tolist() if ident >= 0
        )[:topk]
        ids = [ident for _, ident in picked]
        rows.append(ids + [-1] * (topk - len(ids)))
    return torch.tensor(rows, dtype=torch.int32)


def test_selector_stand_in_is_the_float64_topk() -> None:
    """Shuffled ids, many ties, padding candidates, a real -inf candidate
    (which still beats padding) and a row of padding only."""
    gen = torch.Generator().manual_seed(7)
    rows, width, topk = 5, 64, 40
    candidates = torch.zeros(rows, width, 2)
    candidates[..., 0] = (torch.randn(rows, width, generator=gen) * 2).round() / 2 + 0.0
    candidates[..., 1] = torch.stack(
        [torch.randperm(width, generator=gen) for _ in range(rows)]
    ).float()
    candidates[:, ::7, 1] = -1
    candidates[0, 3, 0] = float("-inf")
    candidates[1, :, 0] = 1.5  # one tie over the whole row
    candidates[4, :, 1] = -1
    got = stable_topk_stand_in(candidates, topk)
    want = _float64_rule(candidates, topk)
    assert torch.equal(got, want)
    out = torch.empty_like(got)
    assert stable_topk_stand_in(candidates, topk, out=out) is out
    assert torch.equal(out, want)
    # The real selector's key orders -0.0 below +0.0 (its sign flip), which a
    # float comparison calls a tie; the tests' scores carry no -0.0.
    signed_zeros = torch.tensor([[[-0.0, 1.0], [0.0, 5.0]]])
    assert stable_topk_stand_in(signed_zeros, 1).tolist() == [[5]]


def test_selector_stand_in_reads_either_releases_contract() -> None:
    """vLLM 0.34.0's layout and key: rank-major ``[W, rows, top-k, 2]``
    candidates select as 0.33.0's ``[rows, W * top-k, 2]``; 16 score bits
    tie scores that differ only in the low half (then the smaller id wins),
    which 32 bits tell apart; an id past ``id_bits`` is refused."""
    gen = torch.Generator().manual_seed(11)
    world, rows, topk = 4, 3, 8
    by_rank = torch.zeros(world, rows, topk, 2)
    by_rank[..., 0] = torch.randn(world, rows, topk, generator=gen)
    by_rank[..., 1] = (
        torch.randperm(world * rows * topk, generator=gen)
        .view(world, rows, topk)
        .float()
    )
    by_row = by_rank.permute(1, 0, 2, 3).reshape(rows, world * topk, 2)
    assert torch.equal(stable_topk_stand_in(by_rank, topk), _float64_rule(by_row, topk))
    close = torch.tensor([1.0, 1.0 + 2**-20])  # equal in their high 16 bits
    pair = torch.stack([close, torch.tensor([4.0, 9.0])], dim=-1).view(1, 2, 2)
    assert stable_topk_stand_in(pair, 1).tolist() == [[9]]
    assert stable_topk_stand_in(pair, 1, score_bits=16).tolist() == [[4]]
    assert stable_topk_stand_in(pair, 1, id_bits=4).tolist() == [[9]]
    with pytest.raises(ValueError, match="id_bits=3"):
        stable_topk_stand_in(pair, 1, id_bits=3)


# The merged selection ---------------------------------------------------------------


def _case(dcp: int, k: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = dcp * interleave + 2 * BLOCK_SIZE + 5
    lengths = torch.tensor(selection_lengths(dcp, interleave, BLOCK_SIZE, width))
    scores = tied_scores(lengths.numel(), width, seed=100 * dcp + 10 * k + interleave)
    return scores, lengths


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize(("dcp", "k", "interleave"), GRID)
def test_every_rank_selects_the_single_device_topk(
    dcp: int, k: int, interleave: int, prefill: bool
) -> None:
    """``prefill``: the prefill layout, each row's logits behind other rows'
    columns with ``row_starts`` pointing past them."""
    scores, lengths = _case(dcp, k, interleave)
    want = selection_sets(reference_topk(scores, lengths, TOPK))
    selections, calls = select_on_ranks(
        scores,
        lengths,
        dcp=dcp,
        shard_count=k,
        interleave=interleave,
        block_size=BLOCK_SIZE,
        topk=TOPK,
        row_start_pad=5 if prefill else 0,
    )
    for rank, selection in enumerate(selections):
        assert not has_repeated_ids(selection), (rank, selection.tolist())
        assert selection_sets(selection) == want, rank
    if k == 1:
        # World 1: the merge returns before packing or gathering anything;
        # every rank's local top-k over its replicated tokens is the global one.
        assert calls.selector_calls == []
    else:
        assert sorted(calls.selector_calls) == list(range(dcp))


@pytest.mark.unpatched_baseline
def test_unpatched_vllm_counts_replicas_twice() -> None:
    """The same selection in a fresh unpatched process: with D=4 and K=2,
    each shard's candidates arrive twice and displace real tokens (vLLM
    0.33), or the D ranks' candidates do not fit the view by K at all (0.34,
    which reshapes by the world it is passed); patched, every rank selects
    the single-device top-k."""
    code = """
    import json
    from tests.support.sparse_selection import replica_selection_report
    try:
        print(json.dumps(replica_selection_report(4, 2, 1)))
    except RuntimeError as exc:
        print(json.dumps({"error": str(exc)}))
    """
    unpatched = run_python(code, patched=False)
    if selector_reads_rank_major():
        assert "is invalid for input of size" in unpatched["error"], unpatched
    else:
        assert all(unpatched["repeats"]), unpatched
        assert not any(unpatched["matches"]), unpatched
    patched = replica_selection_report(4, 2, 1)
    assert not any(patched["repeats"]) and all(patched["matches"]), patched


# The merge wrapper -------------------------------------------------------------------


def _merge_wrapper(seen: list[dict[str, Any]]) -> Any:
    from vllm_dcp_geometry.patches.worker.sparse_attn_indexer import _make_merge

    def upstream(
        logits, topk_indices, topk_tokens, dcp_rank, dcp_world_size, interleave, rs
    ):  # fmt: skip
        seen.append(
            {"indices": topk_indices.clone(), "world": (dcp_world_size, dcp_rank)}
        )

    return _make_merge(upstream)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_merge_drops_the_other_replicas(rank: int) -> None:
    """D=4, K=2: replicas 1 (ranks 2, 3) send padding only, replicas 0 their
    top-k; upstream's merge gets the shard world."""
    seen: list[dict[str, Any]] = []
    merge = _merge_wrapper(seen)
    indices = torch.arange(8, dtype=torch.int32).view(2, 4)
    geometry = indexer_geometry(4, 2, rank, 1)
    with use_indexer_geometry(geometry):
        merge(torch.zeros(2, 8), indices, 4, rank % 2, 2, 1)
    sent = seen[0]["indices"]
    assert seen[0]["world"] == (2, rank % 2)
    if rank // 2 == 0:
        assert torch.equal(sent, torch.arange(8, dtype=torch.int32).view(2, 4))
    else:
        assert bool((sent == -1).all())
    # Outside a partial indexer call: upstream's, untouched.
    seen.clear()
    indices = torch.arange(8, dtype=torch.int32).view(2, 4)
    merge(torch.zeros(2, 8), indices, 4, rank, 4, 1)
    assert seen[0]["world"] == (4, rank)
    assert torch.equal(seen[0]["indices"], indices)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_merge_within_the_replica_sends_every_candidate(rank: int) -> None:
    """D=4, K=2 within its replica: every rank sends its top-k (nothing is
    padding), upstream's merge gets the shard world, and a replica group of
    another world or rank is refused."""
    from tests.support.simulated_collectives import SimulatedReplica
    from vllm_dcp_geometry.runtime.group_context import use_replica_group

    seen: list[dict[str, Any]] = []
    merge = _merge_wrapper(seen)
    indices = torch.arange(8, dtype=torch.int32).view(2, 4)
    geometry = indexer_geometry(4, 2, rank, 1)
    with (
        use_indexer_geometry(geometry),
        use_replica_group(SimulatedReplica(None, 4, rank, 2)),
    ):
        merge(torch.zeros(2, 8), indices, 4, rank % 2, 2, 1)
    assert seen[0]["world"] == (2, rank % 2)
    assert torch.equal(
        seen[0]["indices"], torch.arange(8, dtype=torch.int32).view(2, 4)
    )
    wrong = SimulatedReplica(None, 4, (rank + 1) % 4, 2)
    with (
        use_indexer_geometry(geometry),
        use_replica_group(wrong),
        pytest.raises(DcpGeometryError, match="replica group has"),
    ):
        merge(torch.zeros(2, 8), indices, 4, rank % 2, 2, 1)
    assert len(seen) == 1


@pytest.mark.parametrize(("rank", "world"), [(3, 4), (1, 4), (0, 2), (3, 2)], ids=str)
def test_merge_refuses_another_world_under_an_active_geometry(
    rank: int, world: int
) -> None:
    """Rank 3 of D=4, K=2 holds shard 1: only ``(dcp_rank, dcp_world_size) =
    (1, 2)`` is its shard world; vLLM's real merge refuses any other before
    it packs anything."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    geometry = indexer_geometry(4, 2, 3, 1)
    indices = torch.zeros(2, TOPK, dtype=torch.int32)
    with use_indexer_geometry(geometry), pytest.raises(DcpGeometryError) as excinfo:
        sai._merge_dcp_topk_global(torch.zeros(2, 32), indices, TOPK, rank, world, 1)
    assert "shard world (2, 1)" in str(excinfo.value)
    assert f"({world}, {rank})" in str(excinfo.value)
