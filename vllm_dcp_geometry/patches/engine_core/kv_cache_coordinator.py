# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.core.kv_cache_coordinator``: admit partial full-attention
groups, reject what vLLM cannot run with a clear error.

What: wraps ``KVCacheCoordinator.__init__`` (every coordinator calls it) to
check each group whose shard count K differs from vLLM's flag-derived value
before any manager is built: only plain full-attention groups (the kind
``HybridKVCacheCoordinator.__init__`` admits as DCP-sharded) may carry one; a
partial K with PCP > 1 is rejected. The coordinators' later reads of the
managers' ``block_size``/``dcp_world_size`` (``group_block_sizes``, the
unitary coordinator's block size, the cache-hit lookups in
``find_longest_cache_hit``) follow K through the single-type manager patch.
Groups vLLM already understands go to the original unchanged, including its
own assertions.

Why: vLLM's admission check reads the boolean ``dcp_sharded``; other kinds
(sliding window, chunked local, Mamba) assert ``dcp_world_size == 1`` only
when the first request is looked up, and a non-full-attention spec flagged
sharded with K = 1 would trip an assertion without a useful message.

Remove when: vLLM's coordinators validate per-spec DCP shard counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    check_prefill_context_parallel,
)
from vllm_dcp_geometry.runtime.geometry import (
    kv_cache_group_name,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap

_INIT_PARAMETERS = (
    "self, kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, "
    "enable_caching, enable_kv_cache_events, dcp_world_size, pcp_world_size, "
    "scheduler_block_size, hash_block_size, metrics_collector=, "
    "num_prefill_lookahead=, num_hash_lookahead_tokens="
)


def check_groups_admissible(
    groups: Any, dcp_world_size: int, pcp_world_size: int
) -> None:
    """Reject groups with a non-upstream K that vLLM's managers cannot run."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        owner = kv_cache_group_name(group.layer_names, index)
        k = shard_count_unless_default(spec, dcp_world_size, owner=owner)
        if k is None:
            continue
        layers = (
            list(spec.kv_cache_specs.values())
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else [spec]
        )
        for layer in layers:
            if not isinstance(layer, FullAttentionSpec):
                what = (
                    f"a partial shard count K={k}"
                    if k > 1
                    else "K=1 while flagged dcp_sharded=True"
                )
                raise DcpGeometryError(
                    f"{owner}: {type(layer).__name__} with {what} "
                    f"(D={dcp_world_size}) cannot be scheduled: vLLM's managers "
                    "only split full attention over DCP ranks; declare the "
                    "layer replicated (dcp_sharded=False) or use full attention"
                )
        check_prefill_context_parallel(owner, k, dcp_world_size, pcp_world_size)


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(
        self: Any,
        kv_cache_config: Any,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        check_groups_admissible(
            kv_cache_config.kv_cache_groups, dcp_world_size, pcp_world_size
        )
        original(
            self,
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens,
            use_eagle,
            enable_caching,
            enable_kv_cache_events,
            dcp_world_size,
            pcp_world_size,
            *args,
            **kwargs,
        )

    return __init__


PATCH = Patch(
    upstream_module="vllm.v1.core.kv_cache_coordinator",
    replaces=(Wrap("KVCacheCoordinator.__init__", _INIT_PARAMETERS, _make_init),),
    relies_on=(
        # Relied on: its DCP admission check is left to run for upstream geometry.
        Pin("HybridKVCacheCoordinator.__init__"),
    ),
    why="admission of DCP groups is decided from the boolean dcp_sharded",
    remove_when="vLLM coordinators validate per-spec DCP shard counts",
    related="none upstream: admission reads only dcp_sharded",
)
