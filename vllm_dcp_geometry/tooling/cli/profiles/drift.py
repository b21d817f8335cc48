# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``profiles --check``: a built-in profile against what vLLM's model code
builds for the model folder and serve flags it stands for
(``model_configs/profiles.toml``).

The two agree when they hold the same layers in the same groups and, group
by group, the same vLLM spec (built from each), layer class, draft flag,
heads, latent rank and activation dtype, and the same ``plan`` row (K,
attention mode and backend, widths, bytes, collectives); group names and
sources may differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

TOPOLOGY_FIELDS = (
    "tensor_parallel_size",
    "decode_context_parallel_size",
    "interleave_size",
    "partial_collectives",
    "max_model_len",
    "max_num_seqs",
    "mamba_cache_mode",
    "scheduler_cache_block_size",
)
GROUP_FIELDS = (
    "kind",
    "block_size",
    "draft",
    "layer_class",
    "attention_features",
    "query_heads",
    "kv_lora_rank",
    "activation_dtype",
)
_PLAN_ROW_NAMES = frozenset({"name", "source", "layers"})  # layers: compared as sets


def _few(items: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _same_field(name: str, profile_spec: Any, model_spec: Any) -> bool:
    if getattr(profile_spec, name) == getattr(model_spec, name):
        return True
    # vLLM 0.34.0's recurrent layers state an alignment of 1 that 0.33.0 left
    # unset; the spec reads both as the stride it aligns to, so compare that.
    return name == "block_stride_alignment" and (
        profile_spec.get_block_stride_alignment()
        == model_spec.get_block_stride_alignment()
    )


def _spec_difference(profile_spec: Any, model_spec: Any) -> str:
    if type(profile_spec) is not type(model_spec):
        return (
            f"{type(profile_spec).__name__} in the profile, "
            f"{type(model_spec).__name__} in the model"
        )
    return "; ".join(
        f"{f.name} {getattr(profile_spec, f.name)!r} in the profile, "
        f"{getattr(model_spec, f.name)!r} in the model"
        for f in dataclasses.fields(model_spec)
        if not _same_field(f.name, profile_spec, model_spec)
    )


def _plan_rows(topology: Topology) -> dict[str, dict[str, Any]]:
    from vllm_dcp_geometry.tooling.cli.plan.document import build_plan

    return {row["name"]: row for row in build_plan(topology, None)["groups"]}


def _group_drift(
    mine: CacheGroup,
    built: CacheGroup,
    profile: Topology,
    model: Topology,
    rows: tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]],
) -> list[str]:
    from vllm_dcp_geometry.tooling.vllm_objects import build_spec

    where = f"profile group {mine.name!r} (model group {built.name})"
    if set(mine.layers) != set(built.layers):
        return [
            f"{where}: the model groups {_few(built.layers)} "
            f"({len(built.layers)} layers), the profile {_few(mine.layers)} "
            f"({len(mine.layers)} layers)"
        ]
    drift = [
        f"{where}: {name} {getattr(mine, name)!r} in the profile, "
        f"{getattr(built, name)!r} in the model"
        for name in GROUP_FIELDS
        if getattr(mine, name) != getattr(built, name)
    ]
    difference = _spec_difference(
        build_spec(mine, profile, patched=True), build_spec(built, model, patched=True)
    )
    if difference:
        drift.append(f"{where}: spec: {difference}")
    profile_row, model_row = rows[0][mine.name], rows[1][built.name]
    drift += [
        f"{where}: plan's {key} {profile_row.get(key)!r} in the profile, "
        f"{model_row.get(key)!r} in the model"
        for key in sorted((set(profile_row) | set(model_row)) - _PLAN_ROW_NAMES)
        if profile_row.get(key) != model_row.get(key)
    ]
    return drift


def profile_drift(profile: Topology, model: Topology) -> list[str]:
    """Every way ``profile`` differs from ``model`` (the topology vLLM's
    model code built); empty when they agree. Needs vLLM imported and the
    plugin registered (``runs.prepare_vllm``)."""
    drift = [
        f"{name}: {getattr(profile, name)!r} in the profile, "
        f"{getattr(model, name)!r} in the model"
        for name in TOPOLOGY_FIELDS
        if getattr(profile, name) != getattr(model, name)
    ]
    by_layer = {layer: g for g in profile.groups for layer in g.layers}
    model_layers = [layer for g in model.groups for layer in g.layers]
    missing = [layer for layer in model_layers if layer not in by_layer]
    extra = sorted(set(by_layer) - set(model_layers))
    if missing:
        drift.append(f"layers of the model the profile lacks: {_few(missing)}")
    if extra:
        drift.append(f"layers of the profile the model lacks: {_few(extra)}")
    rows = (_plan_rows(profile), _plan_rows(model))
    for built in model.groups:
        mine = by_layer.get(built.layers[0])
        if mine is not None:
            drift += _group_drift(mine, built, profile, model, rows)
    return drift
