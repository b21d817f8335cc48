# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Kimi-K3's own MLA layer (``MultiHeadLatentAttention``: target, KimiK3MTP,
DSpark draft) with K shards over D simulated ranks equals float64
single-device attention on every rank (``tests.support.kimi_k3``): decode
through its DCP gate and ``impl.forward_mqa``, prefill through
``_forward_prefill_fused`` with the DCP1 or the context-parallel context
path, the real TRITON_MLA builder and impl, the real ``MLADCPManager``.

Cost on 2 cores: about 80 s for the patched cases, 30 s for the baseline.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.kimi_k3 import (
    FUSED_OPS,
    fused_op_stand_ins,
    make_kimi_ranks,
    run_kimi_case,
)
from tests.support.mla import CPU, concat_and_cache_mla, cpu_shims, make_batch, mla_spec
from tests.support.processes import run_python
from tests.support.simulated_collectives import CooperativeRanks
from vllm_dcp_geometry.contract import DcpGeometryError, local_seq_len

pytestmark = pytest.mark.patches(
    "worker.kimi_k3_mla",
    "worker.mla_attention",
    "worker.mla_dcp_manager",
    "worker.utils",
)

TOLERANCE = 1e-5
B = CPU.block_size
CASES = [
    (2, 1, 1),
    (2, 2, B),
    (4, 1, 1),
    (4, 2, B),
    (4, 4, 1),
    (8, 1, B),
    (8, 2, 1),
    (8, 4, 1),
    (8, 8, B),
]


# Stand-ins --------------------------------------------------------------------


def _cache_and_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens, heads, nope, rope, lora = 5, 3, 4, 2, 6
    return {
        "k_nope": torch.randn(tokens, heads, nope, generator=gen),
        "k_pe": torch.randn(tokens, 1, rope, generator=gen),
        "kv_c": torch.randn(tokens, lora, generator=gen),
        "ql_nope": torch.randn(tokens, heads, lora, generator=gen),
        "q_pe": torch.randn(tokens, heads, rope, generator=gen),
        "slots": torch.tensor([3, -1, 17, 8, 30]),
        "cache": torch.zeros(4, 8, lora + rope),
    }


def _expected_cache(x: dict[str, torch.Tensor]) -> torch.Tensor:
    cache = torch.zeros_like(x["cache"])
    flat = cache.view(-1, cache.shape[-1])
    for t, slot in enumerate(x["slots"].tolist()):
        if slot >= 0:
            flat[slot] = torch.cat([x["kv_c"][t], x["k_pe"][t, 0]])
    return cache


def _expected_key(x: dict[str, torch.Tensor]) -> torch.Tensor:
    tokens, heads, _ = x["k_nope"].shape
    return torch.stack(
        [
            torch.stack(
                [torch.cat([x["k_nope"][t, h], x["k_pe"][t, 0]]) for h in range(heads)]
            )
            for t in range(tokens)
        ]
    )


def test_fused_op_stand_ins_match_plain_torch() -> None:
    """Each stand-in, called through the layer's real Python wrapper, does
    what its kernel's docstring says, checked per token and head; the cache
    write agrees with the contract-checked KV-write stand-in too."""
    from vllm.models.kimi_k3.nvidia.ops import fused_mla_key_concat_kv_cache as ops

    x = _cache_and_inputs(0)
    with fused_op_stand_ins():
        cache = x["cache"].clone()
        q = torch.randn(5, 3, 6)
        key = ops.fused_mla_key_concat_kv_cache_insert(
            q, x["k_nope"], x["k_pe"], x["kv_c"], cache, x["slots"]
        )
        assert torch.equal(key, _expected_key(x))
        assert torch.equal(cache, _expected_cache(x))
        written = x["cache"].clone()
        concat_and_cache_mla(
            x["kv_c"], x["k_pe"][:, 0], written, x["slots"], "auto", None
        )
        assert torch.equal(cache, written)

        assert torch.equal(ops.fused_mla_kv_concat(x["k_nope"], x["k_pe"]), key)

        cache = x["cache"].clone()
        mqa_q = ops.fused_mla_decode_q_concat_kv_cache_insert(
            x["ql_nope"], x["q_pe"], x["kv_c"], x["k_pe"], cache, x["slots"]
        )
        for t in range(5):
            for h in range(3):
                assert torch.equal(
                    mqa_q[t, h], torch.cat([x["ql_nope"][t, h], x["q_pe"][t, h]])
                )
        assert torch.equal(cache, _expected_cache(x))
    for name in FUSED_OPS:
        assert name not in vars(torch.ops._C)


# Numerics ---------------------------------------------------------------------


@pytest.mark.parametrize(("dcp", "shard_count", "interleave"), CASES)
def test_kimi_k3_layer_matches_single_device(
    dcp: int, shard_count: int, interleave: int
) -> None:
    report = run_kimi_case(dcp, shard_count, interleave, patched=True)
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= TOLERANCE, (key, report)
    # The layer's own DCP gate: 1 for a replicated group, K for a partial
    # one within its replica (rule A6), D for a sharded one.
    gate = shard_count
    assert report["layer_dcp_world_sizes"] == [gate] * dcp
    for rank, lengths in enumerate(report["decode_seq_lens"]):
        shard = rank % shard_count
        assert lengths == [
            local_seq_len(c + n, B, shard_count, interleave, shard)
            for c, n in CPU.requests[: CPU.num_decodes]
        ], rank


def test_kimi_k3_partial_group_on_the_dcp_group_matches_single_device() -> None:
    """``partial_collectives: "dcp"``: the layer gates on D, gathers over all
    D ranks and its combine masks duplicate replicas; exact too."""
    report = run_kimi_case(4, 2, 1, patched=True, partial_collectives="dcp")
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= TOLERANCE, (key, report)
    assert report["layer_dcp_world_sizes"] == [4] * 4


def test_kimi_k3_layer_without_its_binder_is_refused() -> None:
    """Without the Kimi-K3 patch's binder (the layer bound like vLLM's
    ``MLAAttention``, impl only), start-up refuses naming the patch."""
    from vllm_dcp_geometry.contract.layer_classes import LAYER_BINDERS, LayerBinding

    saved = LAYER_BINDERS.pop(LayerBinding.KIMI_K3_MLA)
    try:
        with pytest.raises(DcpGeometryError, match=r"patches\.worker\.kimi_k3_mla"):
            _build(4, 1)
    finally:
        LAYER_BINDERS[LayerBinding.KIMI_K3_MLA] = saved


def test_impl_only_binding_crashes_the_layer() -> None:
    """What the binder prevents: bound impl-only (the plugin before it knew
    the class), a replicated Kimi-K3 layer all-gathers D*H query heads and
    asserts on the missing LSE - the reported crash."""
    from vllm_dcp_geometry.contract.layer_classes import LAYER_BINDERS, LayerBinding
    from vllm_dcp_geometry.runtime.mla_geometry import bind_mla_layer

    saved = LAYER_BINDERS[LayerBinding.KIMI_K3_MLA]
    LAYER_BINDERS[LayerBinding.KIMI_K3_MLA] = ("impl-only", bind_mla_layer)
    try:
        with pytest.raises(AssertionError):
            run_kimi_case(2, 1, 1, patched=True)
    finally:
        LAYER_BINDERS[LayerBinding.KIMI_K3_MLA] = saved


def _build(dcp: int, shard_count: int, **kwargs: Any) -> Any:
    batch = make_batch(dcp, shard_count, 0)
    spec = mla_spec(shard_count if shard_count != dcp else None)
    with cpu_shims(), fused_op_stand_ins():
        return make_kimi_ranks(
            batch, dcp, shard_count, 1, spec=spec, coop=CooperativeRanks(dcp), **kwargs
        )


@pytest.mark.parametrize("shard_count", [1, 2])
def test_specialized_decode_is_refused_below_d(shard_count: int) -> None:
    """Kimi-K3's specialized decode runs its own DCP mailboxes on the global
    D: a group with K < D is refused at start-up, naming it."""
    config = {"decode_backend": "latency_specialized"}
    with pytest.raises(DcpGeometryError) as excinfo:
        _build(4, shard_count, additional_config=config)
    message = str(excinfo.value)
    assert "vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention" in message
    assert f"K={shard_count}, D=4" in message
    assert "specialized decode" in message


def test_the_specialized_decode_switch_is_vllms() -> None:
    """Admission reads the switch Kimi-K3's own runtime reads (a rename in
    vLLM fails here instead of turning the refusal off)."""
    import inspect

    from vllm.models.kimi_k3.nvidia.specialized_decode import runtime

    from vllm_dcp_geometry.runtime.worker_admission import SPECIALIZED_DECODE_BACKEND

    source = inspect.getsource(runtime)
    assert 'extra.get("decode_backend"' in source
    assert f'"{SPECIALIZED_DECODE_BACKEND}"' in source


def test_specialized_decode_keeps_k_equal_d() -> None:
    _, layers = _build(
        2, 2, additional_config={"decode_backend": "latency_specialized"}
    )
    assert [layer.dcp_world_size for layer in layers] == [2, 2]


BASELINE = """
import json
from tests.support.kimi_k3 import run_kimi_case
print(json.dumps({
    "replicated": run_kimi_case(4, 1, 1, patched=False),
    "partial": run_kimi_case(4, 2, 1, patched=False),
    "sharded": run_kimi_case(4, 4, 1, patched=False),
}))
"""


@pytest.mark.unpatched_baseline
def test_unpatched_vllm_reads_kimi_k3_replicated_and_partial_wrongly() -> None:
    """vLLM 0.33.0 alone runs the layer on its D-wide path whatever the
    cache holds: replicated and partial caches come out wrong, no error; its
    own sharded case is exact (the harness is fair)."""
    got = run_python(BASELINE, patched=False)
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert got["sharded"][key] <= TOLERANCE, (key, got["sharded"])
    for case in ("replicated", "partial"):
        report = got[case]
        assert report["layer_dcp_world_sizes"] == [4] * 4
        assert report["decode_out"] > 1e-2, (case, report)
        assert report["context_lse"] > 1e-2, (case, report)
