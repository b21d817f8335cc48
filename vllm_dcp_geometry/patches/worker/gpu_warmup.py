# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.warmup``: Model Runner V2's warm-up reserves
what the scheduler reserves, with each group's shard count.

What: wraps ``_reserved_block_count``, which vLLM 0.34.0's warm-up calls (from
``_warmup_block_counter``, through the module's globals) for every group of
the hand-built requests it runs before serving. Upstream sizes a block as
``block_size * D`` when the spec is flagged sharded; for a group of K shards
the wrapper calls upstream with ``dcp_world_size=K``, so the block spans
``block_size * K`` tokens as the group's slot mapping addresses them. Where the
spec's K is vLLM's own (``hand_back``: no explicit shard count) it calls
upstream before reading anything else.

Why: upstream restates ``block_size * D`` from the boolean ``dcp_sharded``.
A partial group (1 < K < D) would get ``cdiv(tokens, B * D)`` blocks where
its slot mapping addresses ``cdiv(tokens, B * K)``: warm-up requests would
write and read through block-table entries that are zero (the null block).

Remove when: warm-up asks the spec for its DCP block span.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.geometry import get_kv_cache_dcp_shard_count
from vllm_dcp_geometry.runtime.hand_back import follows_vllm_default
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call


def _make_reserved_block_count(original: Callable[..., int]) -> Callable[..., int]:
    def _reserved_block_count(num_tokens: int, kvcache_spec: Any, **kwargs: Any) -> int:
        if follows_vllm_default(kvcache_spec):
            return original(num_tokens, kvcache_spec, **kwargs)
        dcp_world_size = kwargs.get("dcp_world_size", 1)
        kwargs["dcp_world_size"] = get_kv_cache_dcp_shard_count(
            kvcache_spec, dcp_world_size, owner="Model Runner V2's warm-up"
        )
        return original(num_tokens, kvcache_spec, **kwargs)

    return _reserved_block_count


def _apply(module: ModuleType) -> None:
    # The block counter must reach the wrapper through the module globals.
    require_global_call(module, "_warmup_block_counter", "_reserved_block_count")


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu.warmup",
    # Model Runner V2's warm-up with hand-built requests is new in 0.34.0.
    releases=("0.34.0",),
    replaces=(
        Wrap(
            "_reserved_block_count",
            "num_tokens, kvcache_spec, *, vllm_config, num_lookahead_tokens, "
            "max_model_len, max_encoder_len, dcp_world_size=",
            _make_reserved_block_count,
        ),
    ),
    relies_on=(Pin("_warmup_block_counter", "model_runner"),),
    apply=_apply,
    why=(
        "Model Runner V2's warm-up reserves block_size * D tokens per block for "
        "a group flagged sharded; a partial group's block spans block_size * K"
    ),
    remove_when="warm-up asks the spec for its DCP block span",
    related="vllm 0.34.0 v1/worker/gpu/warmup.py (extensible KV cache warm-up)",
)
