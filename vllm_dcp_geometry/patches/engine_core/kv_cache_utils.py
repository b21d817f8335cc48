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
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.geometry import (
    differs_from_default,
    group_shard_counts,
    make_virtual_block_size_resolver,
)
from vllm_dcp_geometry.runtime.hand_back import groups_follow_vllm_default
from vllm_dcp_geometry.runtime.patching import (
    UpstreamSymbol,
    wrap_module_functions,
)

UPSTREAM_MODULE = "vllm.v1.core.kv_cache_utils"
RUNS_IN = "engine_core"
WHY = (
    "scheduler and hashing block sizes restate B * D from the boolean "
    "dcp_sharded; they must use each group's shard count K"
)
REMOVE_WHEN = "vLLM resolves DCP block spans through a per-spec shard count"
RELATED = "vllm#40996 (review: the B * D rule is spread across the code base)"

_M = UPSTREAM_MODULE
REPLACES: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(_M, "resolve_dcp_kv_block_size", "spec, dcp_world_size"),
    UpstreamSymbol(_M, "resolve_kv_cache_block_sizes", "kv_cache_config, vllm_config"),
)
RELIES_ON: tuple[UpstreamSymbol, ...] = (
    # Relied on: they call the module's resolve_dcp_kv_block_size.
    UpstreamSymbol(_M, "resolve_dcp_kv_cache_spec", "spec, dcp_world_size"),
    UpstreamSymbol(
        _M,
        "partial_hash_hits_enabled",
        "kv_cache_groups, hash_block_size, dcp_world_size=, manager_classes=",
    ),
)
ADDS: tuple[str, ...] = ()
REMOVE_WITH: tuple[str, ...] = ()
PATCHED_SYMBOLS = REPLACES + RELIES_ON


class _ParallelConfigView:
    """A parallel config that reports another DCP size; all else delegates."""

    def __init__(self, parallel_config: Any, dcp_world_size: int) -> None:
        self._parallel_config = parallel_config
        self.decode_context_parallel_size = dcp_world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parallel_config, name)


class _VllmConfigView:
    """A vLLM config whose parallel config reports a group's K as DCP size."""

    def __init__(self, vllm_config: Any, dcp_world_size: int) -> None:
        self._vllm_config = vllm_config
        self.parallel_config = _ParallelConfigView(
            vllm_config.parallel_config, dcp_world_size
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._vllm_config, name)


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
        if len(groups) != 1 or not differs_from_default(groups[0].kv_cache_spec, dcp):
            return original(kv_cache_config, vllm_config)
        return original(kv_cache_config, _VllmConfigView(vllm_config, counts[0]))

    return resolve_kv_cache_block_sizes


def apply(module: ModuleType) -> None:
    wrap_module_functions(
        module,
        {
            "resolve_dcp_kv_block_size": make_virtual_block_size_resolver,
            "resolve_kv_cache_block_sizes": _make_resolve_kv_cache_block_sizes,
        },
    )
