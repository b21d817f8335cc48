# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's call wrapper around the indexer op
(``worker.deepseek_v32_attention``), checked with a recording stand-in of the
op: a bound indexer cache's call takes its shard world, an unbound one passes
through untouched, another DCP world is refused, a cache bound in its replica
takes the replica rank, and a bound cache never takes 0.34.0's direct top-k
exchange. The selection itself is in ``test_sparse_mla_selection``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.sparse_mla import INDEXER_LAYER, layer_shell
from tests.support.sparse_selection import indexer_geometry
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.group_context import (
    current_indexer_geometry,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR

pytestmark = pytest.mark.patches(
    "worker.sparse_attn_indexer", "worker.deepseek_v32_attention"
)

TOPK = 16


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
    from tests.support.simulated_collectives import SimulatedReplica
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
