# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The operator's ``--additional-config '{"dcp_geometry": {...}}'`` applied to
a topology's groups, by the functions start-up applies to vLLM's specs.

``contract.overrides`` parses the section (``parse_overrides``,
``partial_collectives``), matches the patterns against every layer of the
topology (``match_layers``: a pattern matching no layer fails as start-up
fails), hands an indexer cache its latent cache's overrides
(``with_indexer_caches``) and gives each matched layer its DCP fields
(``layer_geometry``), as ``runtime.spec_overrides.apply_to_kv_cache_specs``
does to the specs a worker collects. A group's layer kind is the one its spec
class has (``GROUP_LAYER_KINDS``; a test checks it against
``spec_overrides.layer_kind`` of the specs vLLM builds).

The layers of one topology group share one spec and block table, so they end
with one K: overrides that give the layers of one group different K fail
closed, naming the group and its layers per K (no group is split: which
groups vLLM would form is its planner's choice, which a topology file states
by hand). Two start-up checks need what a topology does not hold: whether a
layer vLLM built replicated runs an impl for fewer than D ranks
(``check_sharding_of_replicated_layer``, built layers) and one K per sparse
index group (``check_index_groups``, the specs' top-k buffers).

Nothing here imports vLLM.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from vllm_dcp_geometry.contract.overrides import (
    CONFIG_KEY,
    PARTIAL_COLLECTIVES_KEY,
    LayerKind,
    LayerOverride,
    SpecGeometry,
    layer_geometry,
    match_layers,
    near_miss_sections,
    parse_overrides,
    partial_collectives,
    with_indexer_caches,
)
from vllm_dcp_geometry.tooling.topology.limits import TopologyError
from vllm_dcp_geometry.tooling.topology.model import CacheGroup, Topology

GROUP_LAYER_KINDS = {
    "mla": LayerKind.FULL_ATTENTION,
    "full_attention": LayerKind.FULL_ATTENTION,
    "sliding_window": LayerKind.OTHER_ATTENTION,
    "mamba": LayerKind.RECURRENT,
}
"""What an override may do to a group's layers, by the group's kind: the
kind ``spec_overrides.layer_kind`` gives the spec vLLM builds for it (MLA and
full attention with a window are ``FullAttentionSpec`` subclasses)."""

_SHOWN_LAYERS = 4


def _shard_count(geometry: SpecGeometry, dcp_world_size: int) -> int:
    if not geometry.dcp_sharded:
        return 1
    return geometry.dcp_kv_shard_count or dcp_world_size


def _group_geometry(group: CacheGroup) -> SpecGeometry:
    return SpecGeometry(
        dcp_sharded=group.dcp_sharded, dcp_kv_shard_count=group.dcp_kv_shard_count
    )


def _show_layers(layers: list[str]) -> str:
    shown = ", ".join(layers[:_SHOWN_LAYERS])
    more = len(layers) - _SHOWN_LAYERS
    return shown + (f" and {more} more" if more > 0 else "")


def _one_k_per_group(
    group: CacheGroup, geometries: Mapping[str, SpecGeometry], dcp: int
) -> None:
    by_k: dict[int, list[str]] = {}
    for layer in group.layers:
        by_k.setdefault(_shard_count(geometries[layer], dcp), []).append(layer)
    if len(by_k) > 1:
        split = "; ".join(
            f"K={k}: {_show_layers(layers)}" for k, layers in sorted(by_k.items())
        )
        raise TopologyError(
            f"group {group.name!r}: the dcp_geometry overrides give its layers "
            f"different shard counts (D={dcp}; {split}); the layers of one "
            "KV-cache group share one spec and block table, so one K: give every "
            "layer of the group the same value, or split the group in the "
            "topology file"
        )


def _layer_geometries(
    topology: Topology, matches: Mapping[str, tuple[LayerOverride, ...]]
) -> dict[str, SpecGeometry | None]:
    """Each matched layer's DCP fields, checked in start-up's order (so the
    first bad layer is the one start-up names)."""
    kinds = {
        layer: GROUP_LAYER_KINDS[group.kind]
        for group in topology.groups
        for layer in group.layers
    }
    dcp = topology.decode_context_parallel_size
    return {
        layer: layer_geometry(layer, matching, kinds[layer], dcp_world_size=dcp)
        for layer, matching in matches.items()
    }


def _overridden_group(
    group: CacheGroup, geometries: Mapping[str, SpecGeometry | None], dcp: int
) -> CacheGroup:
    """The group with the DCP fields its layers' overrides give them (the
    group itself where no override changes a layer)."""
    current = _group_geometry(group)
    given = {layer: geometries.get(layer) for layer in group.layers}
    overridden = [geometry for geometry in given.values() if geometry is not None]
    _one_k_per_group(
        group, {layer: geometry or current for layer, geometry in given.items()}, dcp
    )
    if not overridden or overridden[0] == current:
        return group
    fields = dict(group.spec_fields)
    fields["dcp_sharded"] = overridden[0].dcp_sharded
    fields.pop("dcp_kv_shard_count", None)
    if overridden[0].dcp_kv_shard_count is not None:
        fields["dcp_kv_shard_count"] = overridden[0].dcp_kv_shard_count
    return replace(group, spec_fields=fields)


def warn_near_miss_sections(additional_config: Any) -> None:
    """Start-up's warning for a key that only resembles the plugin's section
    (``near_miss_sections``), on standard error: the same words, nothing
    refused."""
    for warning in near_miss_sections(additional_config):
        print(f"warning: {warning}", file=sys.stderr)


def apply_additional_config(topology: Topology, additional_config: Any) -> Topology:
    """``topology`` with the ``dcp_geometry`` section of ``additional_config``
    (``VllmConfig.additional_config``, as ``--additional-config`` gives it)
    applied: its layer overrides to the groups and its
    ``partial_collectives``, where it names one, to the layout. Bad input
    raises start-up's ``DcpGeometryError``, message for message."""
    warn_near_miss_sections(additional_config)
    overrides = parse_overrides(additional_config)
    where = partial_collectives(additional_config)
    changes: dict[str, Any] = {}
    section = (
        additional_config.get(CONFIG_KEY, {})
        if isinstance(additional_config, Mapping)
        else {}
    )
    if PARTIAL_COLLECTIVES_KEY in section:
        changes["partial_collectives"] = where
    if overrides:
        names = [layer for group in topology.groups for layer in group.layers]
        matches = with_indexer_caches(match_layers(overrides, names), names)
        geometries = _layer_geometries(topology, matches)
        dcp = topology.decode_context_parallel_size
        changes["groups"] = tuple(
            _overridden_group(group, geometries, dcp) for group in topology.groups
        )
    if not changes:
        return topology
    updated = replace(topology, **changes)
    updated.validate()
    return updated
