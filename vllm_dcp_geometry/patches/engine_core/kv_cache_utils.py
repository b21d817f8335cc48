# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.core.kv_cache_utils``: the scheduler's block sizes ask the spec.

What: replaces ``resolve_dcp_kv_block_size`` (``B * K`` instead of
``B * (D if dcp_sharded else 1)``) and wraps ``resolve_kv_cache_block_sizes``.
``resolve_dcp_kv_cache_spec``, ``partial_hash_hits_enabled`` and the
multi-group path of ``resolve_kv_cache_block_sizes`` call the module's
``resolve_dcp_kv_block_size`` and so follow it unchanged. The single-group
path, which reads ``D`` from the config and the group's boolean flag, runs the
original against a view of the config whose DCP size is the group's K. Where
every group's K follows its spec's flag (``hand_back``) the wrapper calls the
original before reading anything. Otherwise every group's K is resolved (an
invalid K fails here) and a partial K with prefill context parallelism is
rejected. Modules that imported these
functions by name before the patch (``vllm.v1.engine.core``, KV connectors:
offloading, simple_kv_offload, umbp, mooncake store, decode_bench) are
rebound; modules imported later get the patched functions from this module.

Why: vLLM 0.33.0 restates the DCP rule from the boolean ``dcp_sharded``, so a
group with a partial shard count would be scheduled, hashed and sized as if
sharded over all D ranks.

Remove when: vLLM derives block spans from a per-spec DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.geometry import (
    group_shard_counts,
    make_virtual_block_size_resolver,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.hand_back import (
    config_with_dcp_size,
    groups_follow_vllm_default,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


def _make_resolve_kv_cache_block_sizes(
    original: Callable[[Any, Any], tuple[int, int]],
) -> Callable[[Any, Any], tuple[int, int]]:
    def resolve_kv_cache_block_sizes(
        kv_cache_config: Any, vllm_config: Any
    ) -> tuple[int, int]:
        groups = kv_cache_config.kv_cache_groups
        if groups_follow_vllm_default(groups):
            return original(kv_cache_config, vllm_config)
        parallel = vllm_config.parallel_config
        dcp = parallel.decode_context_parallel_size
        counts = group_shard_counts(
            groups, dcp, pcp_world_size=parallel.prefill_context_parallel_size
        )
        # Several groups: the LCM runs over resolve_dcp_kv_block_size, which is
        # K-aware. One group: the original reads D and the group's flag itself,
        # so it runs against the group's geometry.
        if (
            len(groups) != 1
            or shard_count_unless_default(groups[0].kv_cache_spec, dcp) is None
        ):
            return original(kv_cache_config, vllm_config)
        return original(kv_cache_config, config_with_dcp_size(vllm_config, counts[0]))

    return resolve_kv_cache_block_sizes


PATCH = Patch(
    upstream_module="vllm.v1.core.kv_cache_utils",
    replaces=(
        Wrap(
            "resolve_dcp_kv_block_size",
            "spec, dcp_world_size",
            make_virtual_block_size_resolver,
            rebind_copies=True,
        ),
        Wrap(
            "resolve_kv_cache_block_sizes",
            "kv_cache_config, vllm_config",
            _make_resolve_kv_cache_block_sizes,
            rebind_copies=True,
        ),
    ),
    relies_on=(
        # Relied on: they call the module's resolve_dcp_kv_block_size.
        Pin("resolve_dcp_kv_cache_spec", "spec, dcp_world_size"),
        Pin(
            "partial_hash_hits_enabled",
            "kv_cache_groups, hash_block_size, dcp_world_size=, manager_classes=",
        ),
    ),
    why=(
        "scheduler and hashing block sizes restate B * D from the boolean "
        "dcp_sharded; they must use each group's shard count K"
    ),
    remove_when="vLLM resolves DCP block spans through a per-spec shard count",
    related="vllm#40996 (review: the B * D rule is spread across the code base)",
)
