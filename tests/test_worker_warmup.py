# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Model Runner V2's warm-up (vLLM 0.34.0) reserves each group's blocks with
its shard count K, as the scheduler and the slot mapping do."""

from __future__ import annotations

import dataclasses

import pytest

from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.runtime.patching import original_of

pytestmark = [
    pytest.mark.patches("worker.gpu_warmup", "common.kv_cache_interface"),
    pytest.mark.vllm_releases("0.34.0"),
]

BLOCK = 16
D = 4


def _spec(shard_count: int | None, *, sharded: bool = True):  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16
    )
    return dataclasses.replace(
        spec, dcp_sharded=sharded, dcp_kv_shard_count=shard_count
    )


def _reserved(function, spec, tokens: int, config) -> int:  # type: ignore[no-untyped-def]
    return function(
        tokens,
        spec,
        vllm_config=config,
        num_lookahead_tokens=0,
        max_model_len=1_000_000,
        max_encoder_len=0,
        dcp_world_size=D,
    )


@pytest.mark.parametrize("tokens", [1, 100, 1000, 4097])
def test_a_partial_group_reserves_its_k_shard_blocks(tokens: int) -> None:
    from vllm.v1.worker.gpu import warmup

    config = make_vllm_config(D)
    patched = warmup._reserved_block_count
    upstream = original_of(patched)
    assert upstream is not patched
    partial = _spec(2)
    assert _reserved(patched, partial, tokens, config) == cdiv(tokens, BLOCK * 2)
    # Upstream (and the plugin before this patch) spans B * D per block: a
    # partial group's warm-up would address null blocks past that.
    assert _reserved(upstream, partial, tokens, config) == cdiv(tokens, BLOCK * D)
    if tokens > BLOCK * 2:
        assert _reserved(upstream, partial, tokens, config) < cdiv(tokens, BLOCK * 2)


@pytest.mark.parametrize("sharded", [True, False])
def test_vllm_default_groups_take_upstreams_count(sharded: bool) -> None:
    from vllm.v1.worker.gpu import warmup

    config = make_vllm_config(D)
    spec = _spec(None, sharded=sharded)
    patched = warmup._reserved_block_count
    upstream = original_of(patched)
    for tokens in (1, 100, 1000):
        assert _reserved(patched, spec, tokens, config) == _reserved(
            upstream, spec, tokens, config
        )
    expected = cdiv(1000, BLOCK * (D if sharded else 1))
    assert _reserved(patched, spec, 1000, config) == expected
