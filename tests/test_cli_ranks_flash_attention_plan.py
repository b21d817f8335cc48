# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' FlashAttention runner with no process: the checker failing a
kernel one position off (window or causal edge), the FlashAttention
stand-ins pinned and refusing what they do not run, the planning of gpt-oss's
profiles, and what the runner does not run, named with its reason. The real
runs are in ``test_cli_ranks_flash_attention``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.gpt_oss_groups import HEAD_SIZE, WINDOW, gpt_oss_group
from vllm_dcp_geometry.contract import reference_slot_mapping
from vllm_dcp_geometry.tooling.cli.ranks import cases
from vllm_dcp_geometry.tooling.cli.ranks.runners.flash_attention_inputs import (
    AttentionBatch,
    attention_reference,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.cli.ranks.verdict import tolerance
from vllm_dcp_geometry.tooling.flash_attn_stand_ins import (
    STAND_IN_SYMBOLS,
    reshape_and_cache_flash,
    varlen_attention,
)
from vllm_dcp_geometry.tooling.topology import load_profile, topology_from_mapping

pytestmark = pytest.mark.patches("worker.flash_attn")


# With no new process ---------------------------------------------------------


def _paged(
    batch: AttentionBatch, block: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position of the batch in a paged cache (K = 1), written by the
    KV-write stand-in at the contract's slots; the key and value caches."""
    key_cache = torch.zeros(num_blocks, block, 1, HEAD_SIZE, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)
    for i, (c, n) in enumerate(batch.requests):
        slots = reference_slot_mapping(
            range(c + n),
            batch.rows[i],
            block_size=block,
            shard_count=1,
            interleave_size=1,
            shard=0,
        )
        reshape_and_cache_flash(
            batch.keys[i][:, None, :],
            batch.values[i][:, None, :],
            key_cache,
            value_cache,
            torch.as_tensor(slots),
            "auto",
            torch.ones(()),
            torch.ones(()),
        )
    return key_cache, value_cache


@pytest.mark.parametrize("window", [None, 24])
def test_the_checker_fails_a_kernel_one_position_off(window: int | None) -> None:
    """The float64 stand-in over a paged cache equals the reference
    (local attention with sinks, causal, a window); the same kernel with its
    window, or its causal edge, one position off is beyond the tolerance
    the checker holds a run to."""
    gen = torch.Generator().manual_seed(5)
    requests = [(40, 1), (17, 3), (0, 4)]
    heads = 4
    shape = Shape(
        heads, 0, 0, "float32", 64, head_size=HEAD_SIZE, sliding_window=window
    )
    blocks = torch.randperm(32, generator=gen)
    batch = AttentionBatch(
        requests,
        [torch.randn(c + n, HEAD_SIZE, generator=gen).double() for c, n in requests],
        [torch.randn(c + n, HEAD_SIZE, generator=gen).double() for c, n in requests],
        torch.randn(8, heads, HEAD_SIZE, generator=gen).double(),
        [blocks[i * 8 : (i + 1) * 8] for i in range(3)],
    )
    sinks = torch.randn(heads, generator=gen).double() * 2
    want = attention_reference(batch, shape, sinks)["out"]
    allowed = tolerance("float32", float(want.abs().max()), (HEAD_SIZE, 44))
    key_cache, value_cache = _paged(batch, 8, 32)
    query_lens = torch.tensor([n for _, n in requests])
    common = {
        "q": batch.queries,
        "k": key_cache,
        "v": value_cache,
        "cu_seqlens_q": torch.cat([torch.zeros(1), query_lens.cumsum(0)]).int(),
        "seqused_k": torch.tensor([c + n for c, n in requests]),
        "block_table": torch.stack(batch.rows).int(),
        "softmax_scale": shape.scale,
        "s_aux": sinks,
    }
    left = -1 if window is None else window - 1
    exact = varlen_attention(**common, causal=True, window_size=[left, 0])
    assert (exact - want).abs().max() <= allowed
    off = (
        varlen_attention(**common, causal=False, window_size=[-1, 1])
        if window is None
        else varlen_attention(**common, causal=True, window_size=[left - 1, 0])
    )
    assert (off - want).abs().max() > 10 * allowed


def test_the_stand_ins_are_pinned_and_refuse_what_they_do_not_run() -> None:
    from vllm_dcp_geometry.runtime.patching import verify_symbol
    from vllm_dcp_geometry.tooling.cpu_stand_ins import KernelNotHere

    for symbol in STAND_IN_SYMBOLS:
        verify_symbol(symbol)
    q = torch.zeros(2, 1, 8)
    common = {
        "q": q,
        "k": q,
        "v": q,
        "cu_seqlens_q": torch.tensor([0, 2]),
        "cu_seqlens_k": torch.tensor([0, 2]),
        "softmax_scale": 1.0,
        "causal": True,
    }
    out, lse = varlen_attention(**common, return_softmax_lse=True, fa_version=3)
    assert out.shape == q.shape and lse.shape == (1, 2)
    for refused in ({"softcap": 30.0}, {"mask_mod": object()}, {"page_table": 1}):
        with pytest.raises(KernelNotHere):
            varlen_attention(**common, **refused)
    with pytest.raises(KernelNotHere):
        varlen_attention(**common, k_descale=torch.full((1, 1), 2.0))


def _planned(topology: Any, **kwargs: Any) -> dict[str, dict[str, Any]]:
    return {
        g["name"]: g
        for g in cases.plan_groups(
            topology,
            gpu=kwargs.pop("gpu", False),
            scale=1,
            partial_collectives="replica",
            **kwargs,
        )
    }


def test_gpt_oss_plans_both_groups_on_flash_attention() -> None:
    """gpt-oss at TP32/DCP4 with its full layers at K = 2 (an operator's
    override): both groups run on FLASH_ATTN at the profile's shapes, the
    sliding one replicated; at TP64/DCP8, one query head per rank."""
    from vllm_dcp_geometry.tooling.topology.overrides import apply_additional_config

    topology = apply_additional_config(
        load_profile("gpt-oss-tp32-dcp4"),
        {"dcp_geometry": {"layers": {"model.layers.*[13579].attn.attn": 2}}},
    )
    planned = _planned(topology, backend="TRITON_MLA")
    for name, k in (("sliding", 1), ("full", 2)):
        g = planned[name]
        assert g["run"] is True, g
        assert (g["runner"], g["backend"]) == ("flash_attention", "FLASH_ATTN")
        assert g["shard_count"] == k
        assert g["shape"]["sinks"] is True and g["shape"]["heads_per_rank"] == 2
    assert planned["sliding"]["shape"]["sliding_window"] == WINDOW
    assert planned["full"]["shape"]["sliding_window"] is None
    eight = _planned(load_profile("gpt-oss-tp64-dcp8"))
    assert eight["full"]["run"] is True
    assert eight["full"]["shape"]["heads_per_rank"] == 1


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"query_heads": None}, "the topology gives no query_heads"),
        ({"attention_features": ["rswa_mask"]}, "attention features ['rswa_mask']"),
        ({"head_size_v": 32}, "spec field head_size_v needs a kernel"),
        ({"head_size": 72}, "head size 72 under DCP"),
        ({"sliding_window": WINDOW}, "a full-attention spec with a sliding window"),
    ],
)
def test_what_the_runner_does_not_run_is_named(
    fields: dict[str, Any], reason: str
) -> None:
    group = {
        k: v
        for k, v in {**gpt_oss_group("g", 0, None, 4), **fields}.items()
        if v is not None
    }
    topology = topology_from_mapping(
        {
            "name": "t",
            "parallel": {"tensor_parallel_size": 32, "decode_context_parallel_size": 4},
            "limits": {"max_model_len": 4096, "max_num_seqs": 8},
            "groups": [group],
        },
        source="test",
    )
    (planned,) = _planned(topology).values()
    assert planned["run"] is False and reason in planned["reason"], planned


def test_float32_runs_on_a_cpu_only() -> None:
    from vllm_dcp_geometry.tooling.cli.ranks.runners import flash_attention

    shape = Shape(2, 0, 0, "float32", 64, head_size=HEAD_SIZE, backend="FLASH_ATTN")
    assert flash_attention.flash_shape_refused(shape, 4, False) is None
    refused = flash_attention.flash_shape_refused(shape, 4, True)
    assert refused is not None and "float32" in refused
