# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.core.kv_cache_planning``: memory planning keeps groups with
different K apart and checks the operator's overrides reached every worker.

What:
- ``unify_hybrid_kv_cache_specs`` (hybrid manager disabled) splits layers
  replicated vs sharded; layers are first partitioned by their
  ``dcp_kv_shard_count`` and the original runs on each part, so layers with
  different K are never promoted into one type.
- ``_layer_tp_replicas`` asks the spec: a spec flagged sharded whose
  K is 1 is replicated over DCP ranks and gets vLLM's replicated answer;
  otherwise the original (K > 1 ranks hold different shards).
- ``get_global_kv_cache_groups`` first runs
  ``vllm_dcp_geometry.runtime.spec_overrides.check_applied`` over every
  worker's specs: an override pattern that matches no layer of any worker,
  or a worker whose specs miss the override (plugin not loaded), fails at
  start-up.
Per-request memory (``max_memory_usage_bytes``, ``max_memory_usage_pages``,
max concurrency, max-model-len estimates) goes through the spec methods the
common ``kv_cache_interface`` patch makes K-aware; nothing here restates it.

Why: vLLM 0.33.0 keys these decisions on the boolean ``dcp_sharded``.

Remove when: vLLM plans KV memory from a per-spec DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.geometry import (
    explicit_shard_count,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.spec_overrides import check_applied


def _make_unify(original: Callable[[dict[str, Any]], None]) -> Callable[..., None]:
    def unify_hybrid_kv_cache_specs(kv_cache_spec: dict[str, Any]) -> None:
        parts: dict[int | None, dict[str, Any]] = {}
        for name, spec in kv_cache_spec.items():
            parts.setdefault(explicit_shard_count(spec), {})[name] = spec
        if set(parts) <= {None}:
            original(kv_cache_spec)
            return
        # The original promotes in place; run it per part and write back.
        for part in parts.values():
            original(part)
            kv_cache_spec.update(part)

    return unify_hybrid_kv_cache_specs


def _make_layer_tp_replicas(
    original: Callable[[Any, int, int], int],
) -> Callable[[Any, int, int], int]:
    from vllm.v1.kv_cache_interface import AttentionSpec

    def _layer_tp_replicas(spec: Any, tp_size: int, dcp_size: int) -> int:
        if not isinstance(spec, AttentionSpec):
            return original(spec, tp_size, dcp_size)
        k = shard_count_unless_default(spec, dcp_size)
        if k is None or k > 1:
            return original(spec, tp_size, dcp_size)
        # K = 1: every DCP rank holds the same tokens, as for a replicated spec.
        return original(spec, tp_size, 1)

    return _layer_tp_replicas


def _make_get_global_kv_cache_groups(
    original: Callable[[Any, list[dict[str, Any]]], Any],
) -> Callable[[Any, list[dict[str, Any]]], Any]:
    def get_global_kv_cache_groups(
        vllm_config: Any, kv_cache_specs: list[dict[str, Any]]
    ) -> Any:
        check_applied(kv_cache_specs, vllm_config)
        return original(vllm_config, kv_cache_specs)

    return get_global_kv_cache_groups


PATCH = Patch(
    upstream_module="vllm.v1.core.kv_cache_planning",
    replaces=(
        Wrap(
            "unify_hybrid_kv_cache_specs",
            "kv_cache_spec",
            _make_unify,
            rebind_copies=True,
        ),
        Wrap(
            "_layer_tp_replicas",
            "spec, tp_size, dcp_size",
            _make_layer_tp_replicas,
            rebind_copies=True,
        ),
        Wrap(
            "get_global_kv_cache_groups",
            "vllm_config, kv_cache_specs",
            _make_get_global_kv_cache_groups,
            rebind_copies=True,
        ),
    ),
    why=(
        "KV memory planning splits and deduplicates layers by the boolean dcp_sharded"
    ),
    remove_when="vLLM plans KV memory from a per-spec DCP shard count",
    related="none upstream: planning keys on the boolean dcp_sharded",
)
