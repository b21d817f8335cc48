# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.core.single_type_kv_cache_manager``: managers allocate in
units of ``V = B * K``.

What: wraps ``SingleTypeKVCacheManager.__init__``. Where the group's shard
count K differs from what vLLM derives from ``dcp_sharded`` (a partial K, or
K = 1 on a spec still flagged sharded), the original runs with the group's
geometry as its DCP world size: ``dcp_world_size = K``, ``block_size = B * K``
and no PCP (PCP with a partial K is rejected). Everything the coordinator and
the managers derive later - ``group_block_sizes``, cache-hit lookups
(``find_longest_cache_hit(..., dcp_world_size=manager.dcp_world_size)``),
reachable-block masks, cached-block bookkeeping - reads these attributes, so it
follows K unchanged. Where K equals vLLM's value the original runs as is.

Why: vLLM 0.33.0 sets ``dcp_world_size = D if dcp_sharded else 1`` per
manager, so a partial group would allocate one block per ``B * D`` tokens and
run out of KV slots (silent under-allocation).

Remove when: vLLM managers take the group's shard count from the spec.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import check_prefill_context_parallel
from vllm_dcp_geometry.runtime.geometry import (
    kv_cache_group_name,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.patching import Patch, Wrap


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = signature.bind(self, *args, **kwargs)
        spec = bound.arguments["kv_cache_spec"]
        dcp = bound.arguments.get("dcp_world_size", 1)
        owner = kv_cache_group_name(index=bound.arguments.get("kv_cache_group_id"))
        k = shard_count_unless_default(spec, dcp, owner=owner)
        if k is None:
            original(self, *args, **kwargs)
            return
        check_prefill_context_parallel(
            owner, k, dcp, bound.arguments.get("pcp_world_size", 1)
        )
        bound.arguments["dcp_world_size"] = k
        # K = 1 is replicated geometry, which vLLM runs without PCP sharding.
        bound.arguments["pcp_world_size"] = 1
        original(*bound.args, **bound.kwargs)

    return __init__


PATCH = Patch(
    upstream_module="vllm.v1.core.single_type_kv_cache_manager",
    replaces=(
        Wrap(
            "SingleTypeKVCacheManager.__init__",
            "self, kv_cache_spec, block_pool, enable_caching, kv_cache_group_id, "
            "scheduler_block_size, dcp_world_size=, pcp_world_size=, "
            "needs_kv_cache_zeroing=, max_admission_blocks_per_request=",
            _make_init,
        ),
    ),
    why="managers scale block_size by D from the boolean dcp_sharded, not by K",
    remove_when="vLLM managers read a per-spec DCP shard count",
    related="vllm#40996 (Mamba managers undo the DCP block-size scaling)",
)
