# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Operator overrides applied to the KV-cache specs a worker collects
(contract rule C1, the rules in ``vllm_dcp_geometry.contract.overrides``), and
the checks that need vLLM's specs: the engine core's check that every worker
applied them, and one K per DSA indexer cache and sparse index group (A5).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    TokenLayout,
    resolve_shard_count,
)
from vllm_dcp_geometry.contract.overrides import (
    LayerKind,
    SpecGeometry,
    check_indexer_caches,
    layer_geometry,
    match_layers,
    near_miss_sections,
    parse_overrides,
    with_indexer_caches,
)
from vllm_dcp_geometry.runtime.worker_admission import (
    check_sharding_of_replicated_layer,
)

logger = logging.getLogger("vllm_dcp_geometry")

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def index_groups(leaders: Mapping[str, bool]) -> list[list[str]]:
    """The sparse layers that share one top-k (vLLM's index groups): each
    layer with an indexer (``leaders[name]`` True) and the skip-top-k layers
    after it, in layer order. A name without a layer index puts every layer
    in one group (nothing is guessed)."""
    indexed = [(_LAYER_INDEX.search(name), name) for name in leaders]
    if not all(match for match, _ in indexed):
        return [sorted(leaders)]
    groups: list[list[str]] = []
    for _, name in sorted(indexed, key=lambda item: int(item[0].group(1))):  # type: ignore[union-attr]
        if leaders[name] or not groups:
            groups.append([])
        groups[-1].append(name)
    return groups


def check_index_groups(
    leaders: Mapping[str, bool], shard_counts: Mapping[str, int], dcp_world_size: int
) -> None:
    """The layers of one index group share one K (rule A5): at K = 1 vLLM
    converts the group's top-k to physical slots once, in its first layer,
    with that layer's block table, and every later layer reuses it."""
    for group in index_groups(leaders):
        counts = {name: shard_counts[name] for name in group}
        if len(set(counts.values())) > 1:
            first, other = (
                group[0],
                next(n for n in group if counts[n] != counts[group[0]]),
            )
            raise DcpGeometryError(
                f"layers {first!r} (K={counts[first]}) and {other!r} (K="
                f"{counts[other]}, D={dcp_world_size}) share one sparse top-k "
                "(an index group: a layer with an indexer and the skip-top-k "
                "layers after it) but not one K; vLLM reuses the group's "
                "physical top-k across its layers; give them the same "
                "dcp_geometry override"
            )


def layer_kind(spec: Any) -> LayerKind:
    """Classify a vLLM KV-cache spec for override rules."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MambaSpec,
    )

    if isinstance(spec, MambaSpec):
        return LayerKind.RECURRENT
    if isinstance(spec, FullAttentionSpec):
        return LayerKind.FULL_ATTENTION
    if isinstance(spec, AttentionSpec):
        return LayerKind.OTHER_ATTENTION
    return LayerKind.UNSUPPORTED


def _context_parallel_sizes(parallel_config: Any) -> tuple[int, int]:
    return (
        parallel_config.decode_context_parallel_size,
        getattr(parallel_config, "prefill_context_parallel_size", 1),
    )


def apply_to_kv_cache_specs(
    kv_cache_spec: dict[str, Any], vllm_config: Any
) -> dict[str, Any]:
    """The worker's layer specs with the operator's overrides applied.

    Returns ``kv_cache_spec`` itself when there are no overrides, otherwise a
    new dict; the input is never modified.
    """
    overrides = parse_overrides(getattr(vllm_config, "additional_config", None))
    if not overrides:
        return kv_cache_spec
    import dataclasses

    parallel = vllm_config.parallel_config
    dcp, pcp = _context_parallel_sizes(parallel)
    # A pipeline stage only holds its own layers; the engine core checks the
    # union of every worker's layers instead.
    stage_holds_all_layers = getattr(parallel, "pipeline_parallel_size", 1) == 1
    matches = with_indexer_caches(
        match_layers(
            overrides, kv_cache_spec, require_every_pattern=stage_holds_all_layers
        ),
        kv_cache_spec,
    )
    result = dict(kv_cache_spec)
    for name, matching in matches.items():
        spec = kv_cache_spec[name]
        geometry = layer_geometry(
            name, matching, layer_kind(spec), dcp_world_size=dcp, pcp_world_size=pcp
        )
        if geometry is None:
            continue
        if geometry.dcp_sharded and not spec.dcp_sharded:
            shard_count = resolve_shard_count(
                owner=f"layer {name!r}",
                layout=TokenLayout.SHARDED,
                dcp_world_size=dcp,
                dcp_kv_shard_count=geometry.dcp_kv_shard_count,
            )
            check_sharding_of_replicated_layer(vllm_config, name, shard_count, dcp)
        result[name] = dataclasses.replace(
            spec,
            dcp_sharded=geometry.dcp_sharded,
            dcp_kv_shard_count=geometry.dcp_kv_shard_count,
        )
    shard_counts = {name: spec.dcp_shard_count(dcp) for name, spec in result.items()}
    check_indexer_caches(shard_counts, dcp)
    check_index_groups(
        {
            name: bool(spec.is_index_group_leader)
            for name, spec in result.items()
            if getattr(spec, "topk_buffer_width", None) is not None
        },
        shard_counts,
        dcp,
    )
    return result


def check_applied(worker_specs: Iterable[Mapping[str, Any]], vllm_config: Any) -> None:
    """Engine-core check that every worker applied the overrides.

    Every pattern must match a layer of some worker, and every matched layer
    must carry the geometry its override gives: a worker that did not load the
    plugin (or applied different overrides) fails here instead of silently
    running another geometry. A key that only resembles the plugin's section
    is warned about here, once per start-up (the engine core plans once).
    """
    additional_config = getattr(vllm_config, "additional_config", None)
    for warning in near_miss_sections(additional_config):
        logger.warning("%s", warning)
    overrides = parse_overrides(additional_config)
    if not overrides:
        return
    parallel = vllm_config.parallel_config
    dcp, pcp = _context_parallel_sizes(parallel)
    union: dict[str, list[Any]] = {}
    for specs in worker_specs:
        for name, spec in specs.items():
            union.setdefault(name, []).append(spec)
    matches = with_indexer_caches(match_layers(overrides, union), union)
    for name, matching in matches.items():
        for spec in union[name]:
            geometry = layer_geometry(
                name, matching, layer_kind(spec), dcp_world_size=dcp, pcp_world_size=pcp
            )
            if geometry is None:
                continue
            actual = SpecGeometry(
                dcp_sharded=bool(spec.dcp_sharded),
                dcp_kv_shard_count=getattr(spec, "dcp_kv_shard_count", None),
            )
            if actual != geometry:
                raise DcpGeometryError(
                    f"layer {name!r}: a worker reported dcp_sharded="
                    f"{actual.dcp_sharded}, dcp_kv_shard_count="
                    f"{actual.dcp_kv_shard_count}, but dcp_geometry override "
                    f"{matching[0].describe()} gives dcp_sharded="
                    f"{geometry.dcp_sharded}, dcp_kv_shard_count="
                    f"{geometry.dcp_kv_shard_count}: is the vllm-dcp-geometry "
                    "plugin loaded in every worker?"
                )


def make_get_kv_cache_spec(
    original: Callable[[Any], dict[str, Any]],
) -> Callable[[Any], dict[str, Any]]:
    """Wrapper factory for a model runner's ``get_kv_cache_spec``: the specs a
    worker collects get the operator's overrides, identically on every worker."""

    def get_kv_cache_spec(self: Any) -> dict[str, Any]:
        return apply_to_kv_cache_specs(original(self), self.vllm_config)

    return get_kv_cache_spec
