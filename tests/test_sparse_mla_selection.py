# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's top-k selection over a K-shard indexer cache.

D simulated ranks (``tests.support.sparse_mla``), rank r holding shard
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
wrapper is checked with a recording stand-in of the indexer op.

About 15 s on 2 cores (the unpatched process about 8 s of it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.processes import run_python
from tests.support.sparse_mla import (
    INDEXER_LAYER,
    has_repeated_ids,
    indexer_geometry,
    layer_shell,
    reference_topk,
    replica_selection_report,
    select_on_ranks,
    selection_lengths,
    selection_sets,
    selector_reads_rank_major,
    tied_scores,
)
from tests.support.sweeps import divisors
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.group_context import (
    current_indexer_geometry,
    use_indexer_geometry,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.tooling.sparse_stand_ins import stable_topk_stand_in

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
    from tests.support.sparse_mla import replica_selection_report
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
    from tests.support.mla import SimulatedReplica
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


# The DeepSeek-V3.2 call wrapper ---------------------------------------------------------


class _Recorder:
    """A stand-in of vLLM's ``sparse_attn_indexer`` op: records what it was
    called with and which indexer geometry was active."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any], Any]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        self.calls.append((args, dict(kwargs), current_indexer_geometry()))
        return "topk"


def _layer_call(
    call: Any, prefix: Any, *, dcp_rank: int, dcp_world_size: int, **extra: Any
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """Call ``call`` as ``DeepseekV32Attention._sparse_indexer_and_attn``
    calls ``sparse_attn_indexer`` (the tensors are placeholders), with
    ``extra`` keywords (vLLM 0.34's) after its own."""
    positional = (
        object(),  # q_c
        prefix,
        object(),  # kv_cache
        object(),  # index_q_fp8
        None,
        None,
        object(),  # index_weights_out
        128,
        None,  # scale_fmt
        TOPK,
        128,
        4096,
        8192,
        object(),  # topk_indices_buffer
    )
    keywords = {
        "skip_k_cache_insert": True,
        "use_pcp": False,
        "pcp_shard_decode_requests": False,
        "dense_mha_metadata_layer_name": "",
        "dcp_rank": dcp_rank,
        "dcp_world_size": dcp_world_size,
        "cp_kv_cache_interleave_size": 1,
        "skip_topk_buffer_clear": True,
        "topk_backend": "auto",
        **extra,
    }
    return call(*positional, **keywords), positional, keywords


@pytest.fixture
def indexer_call(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The patch's call wrapper around a ``_Recorder``, with this test's own
    list of bound caches."""
    from vllm_dcp_geometry.patches.worker import deepseek_v32_attention as patch

    monkeypatch.setattr(patch, "_bound_caches", [])
    recorder = _Recorder()
    return patch, recorder, patch._make_sparse_attn_indexer(recorder)


def _forward_context(layers: dict[str, Any]) -> Any:
    from vllm.forward_context import ForwardContext, override_forward_context

    return override_forward_context(
        ForwardContext(no_compile_layers=layers, attn_metadata={}, slot_mapping={})
    )


def _indexer_cache() -> Any:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    cache = layer_shell(DeepseekV32IndexerCache)
    cache.prefix = INDEXER_LAYER
    return cache


@pytest.mark.parametrize("encoded", [False, True], ids=["str", "LayerName"])
@pytest.mark.parametrize("k", [1, 2])
def test_indexer_call_takes_the_cache_shard_world(
    indexer_call: Any, k: int, encoded: bool
) -> None:
    """Rank 3 of D=4: the bound cache's ``(r % K, K)`` replaces the layer's
    ``(r, D)``; every other argument is passed on as given; the indexer
    geometry is active inside for K=2 only, and nothing after."""
    from vllm.utils.torch_utils import _encode_layer_name

    patch, recorder, call = indexer_call
    cache = _indexer_cache()
    geometry = indexer_geometry(4, k, 3, 1)
    patch.bind_indexer_cache(cache, geometry, INDEXER_LAYER)
    assert getattr(cache, BOUND_GEOMETRY_ATTR) is geometry
    prefix = _encode_layer_name(INDEXER_LAYER) if encoded else INDEXER_LAYER
    with _forward_context({INDEXER_LAYER: cache}):
        result, positional, keywords = _layer_call(
            call, prefix, dcp_rank=3, dcp_world_size=4
        )
    assert result == "topk"
    (args, kwargs, active) = recorder.calls[-1]
    assert len(args) == len(positional)
    assert all(a is b for a, b in zip(args, positional, strict=True))
    assert (kwargs["dcp_rank"], kwargs["dcp_world_size"]) == (3 % k, k)
    rest = {
        n: v for n, v in keywords.items() if n not in ("dcp_rank", "dcp_world_size")
    }
    assert {n: kwargs[n] for n in rest} == rest and kwargs.keys() == keywords.keys()
    assert active is (geometry if k == 2 else None)
    assert current_indexer_geometry() is None


def test_an_unbound_indexer_cache_passes_through(indexer_call: Any) -> None:
    """vLLM's own K = D binds nothing: with another cache bound in the
    process the call goes to upstream exactly as the layer made it; with
    none bound, without even looking at the forward context."""
    patch, recorder, call = indexer_call
    patch.bind_indexer_cache(
        _indexer_cache(), indexer_geometry(4, 2, 1, 1), "model.layers.1.self_attn.x"
    )
    with _forward_context({INDEXER_LAYER: _indexer_cache()}):
        _, positional, keywords = _layer_call(
            call, INDEXER_LAYER, dcp_rank=1, dcp_world_size=4
        )
    patch._bound_caches.clear()
    _, positional_2, keywords_2 = _layer_call(
        call, INDEXER_LAYER, dcp_rank=1, dcp_world_size=4
    )
    for (args, kwargs, active), (p, k) in zip(
        recorder.calls,
        [(positional, keywords), (positional_2, keywords_2)],
        strict=True,
    ):
        assert all(a is b for a, b in zip(args, p, strict=True)) and len(args) == len(p)
        assert kwargs == k and active is None


@pytest.mark.parametrize(
    ("dcp_rank", "dcp_world_size"), [(1, 2), (3, 2), (0, 4), (3, 8)], ids=str
)
def test_indexer_call_with_another_dcp_world_is_refused(
    indexer_call: Any, dcp_rank: int, dcp_world_size: int
) -> None:
    """The wrapper replaces only the layer's own ``(r, D)``: anything else
    (already a shard world, another rank) is refused before upstream runs."""
    patch, recorder, call = indexer_call
    cache = _indexer_cache()
    patch.bind_indexer_cache(cache, indexer_geometry(4, 2, 3, 1), INDEXER_LAYER)
    with _forward_context({INDEXER_LAYER: cache}), pytest.raises(DcpGeometryError):
        _layer_call(
            call, INDEXER_LAYER, dcp_rank=dcp_rank, dcp_world_size=dcp_world_size
        )
    assert recorder.calls == []


@pytest.mark.parametrize(("dcp_rank", "accepted"), [(1, True), (3, False)])
def test_a_cache_bound_in_its_replica_takes_the_replica_rank(
    indexer_call: Any, dcp_rank: int, accepted: bool
) -> None:
    """Bound in its replica (rule A6), the layer's DCP manager is the
    replica's, so the layer passes ``(r % K, D)``: that is replaced by the
    shard world and the call holds the replica; the D-wide rank ``r`` is
    then refused."""
    from tests.support.mla import SimulatedReplica
    from vllm_dcp_geometry.runtime.group_context import (
        current_replica_group,
        use_replica_group,
    )

    patch, recorder, call = indexer_call
    replica = SimulatedReplica(None, 4, 3, 2)
    seen: list[Any] = []
    recorder_call = recorder.__call__

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(current_replica_group())
        return recorder_call(*args, **kwargs)

    call = patch._make_sparse_attn_indexer(recording)
    cache = _indexer_cache()
    with use_replica_group(replica):
        patch.bind_indexer_cache(cache, indexer_geometry(4, 2, 3, 1), INDEXER_LAYER)
    assert getattr(cache, patch.REPLICA_ATTR) is replica
    with _forward_context({INDEXER_LAYER: cache}):
        if not accepted:
            with pytest.raises(DcpGeometryError, match=r"not \(1, 4\)"):
                _layer_call(call, INDEXER_LAYER, dcp_rank=dcp_rank, dcp_world_size=4)
            assert recorder.calls == []
            return
        _layer_call(call, INDEXER_LAYER, dcp_rank=dcp_rank, dcp_world_size=4)
    ((_, keywords, geometry),) = recorder.calls
    assert (keywords["dcp_world_size"], keywords["dcp_rank"]) == (2, 1)
    assert geometry.shard_world == (2, 1) and seen == [replica]
    assert current_replica_group() is None


@pytest.mark.parametrize("k", [1, 2])
def test_a_bound_cache_never_takes_the_direct_topk_exchange(
    indexer_call: Any, k: int
) -> None:
    """vLLM 0.34's keywords (``logits_dtype``, ``dcp_direct_topk_max_rows``)
    pass through; where the wrapper substitutes the cache's shard world the
    symmetric-memory top-k exchange (which packs with the DCP group's own
    ``(r, D)``) is off; an unbound cache (vLLM's own K = D) keeps it."""
    patch, recorder, call = indexer_call
    cache = _indexer_cache()
    patch.bind_indexer_cache(cache, indexer_geometry(4, k, 3, 1), INDEXER_LAYER)
    extra = {"logits_dtype": torch.bfloat16, "dcp_direct_topk_max_rows": 64}
    with _forward_context({INDEXER_LAYER: cache}):
        _layer_call(call, INDEXER_LAYER, dcp_rank=3, dcp_world_size=4, **extra)
    kwargs = recorder.calls[-1][1]
    assert (kwargs["dcp_world_size"], kwargs["dcp_rank"]) == (k, 3 % k)
    assert kwargs["logits_dtype"] is torch.bfloat16
    assert kwargs["dcp_direct_topk_max_rows"] == 0
    with _forward_context({INDEXER_LAYER: _indexer_cache()}):
        _, _, keywords = _layer_call(
            call, INDEXER_LAYER, dcp_rank=3, dcp_world_size=4, **extra
        )
    assert recorder.calls[-1][1] == keywords
