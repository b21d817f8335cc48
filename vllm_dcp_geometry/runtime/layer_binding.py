# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Binding every layer of a group with K < D through its layer class.

Each layer of the group is found in the forward context and bound as its
class's ``layer_classes.LayerBinding`` says: the impl (``Attention``), impl
and DCP manager (``MLAAttention``), a model patch's binder (Kimi-K3), or
nothing (a layer without impl, K = 1 only). A layer of a class the plugin did
not teach is bound as vLLM's generic layer of its kind, which admission
allows only at the K vLLM itself reads the cache with. A layer that is
missing, or whose binder's patch is not applied, is an error naming it.

No vLLM import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.layer_classes import (
    BINDING_PATCHES,
    LAYER_BINDERS,
    LayerBinder,
    LayerBinding,
    layer_class_path,
    reader_refusal,
    taught_layer,
)
from vllm_dcp_geometry.runtime.impl_binding import bind_impl_to_group
from vllm_dcp_geometry.runtime.mla_geometry import bind_mla_layer


def group_layers(
    vllm_config: Any, layer_names: Sequence[str], geometry: GroupGeometry
) -> list[tuple[str, Any]]:
    """(name, layer) of every layer of the group in the forward context."""
    context = vllm_config.compilation_config.static_forward_context
    layers = []
    for name in layer_names:
        layer = context.get(name)
        if layer is None:
            raise DcpGeometryError(
                f"{geometry.describe()}: layer {name} is not in the forward "
                "context, so it cannot be bound to the group's shard count"
            )
        layers.append((name, layer))
    return layers


def layer_binding(layer: Any, mla: bool) -> LayerBinding:
    """How a layer of this kind is bound: its class's binding, or the
    generic one (``Attention``/``MLAAttention``) for an untaught class."""
    taught = taught_layer(layer_class_path(layer), mla)
    if taught is not None:
        return taught.binding
    return LayerBinding.MLA if mla else LayerBinding.IMPL


def _require_impl(layer: Any, name: str, geometry: GroupGeometry) -> None:
    if getattr(layer, "impl", None) is None:
        raise DcpGeometryError(
            f"{geometry.describe()}: layer {name} ({layer_class_path(layer)}) has "
            "no attention impl in the forward context, so it cannot be bound "
            "to the group's shard count"
        )


def check_reader(
    layer: Any, name: str, geometry: GroupGeometry, context: dict[str, Any]
) -> None:
    """A layer whose cache another layer reads (``TaughtLayer.read_by``) is
    bound only where that reader is the taught class."""

    def find_class(reader_name: str) -> str | None:
        reader = context.get(reader_name)
        return None if reader is None else layer_class_path(reader)

    refusal = reader_refusal(layer_class_path(layer), name, find_class)
    if refusal is not None:
        raise DcpGeometryError(f"{geometry.describe()}: {refusal}")


def layer_binder(
    layer: Any, name: str, geometry: GroupGeometry, mla: bool
) -> LayerBinder | None:
    """How to bind one layer of a group with K < D (None: nothing to bind);
    an error where the layer cannot be bound."""
    binding = layer_binding(layer, mla)
    if binding is LayerBinding.NONE:
        if not geometry.is_replicated:
            raise DcpGeometryError(
                f"{geometry.describe()}: layer {name} ({layer_class_path(layer)}) "
                "has no attention impl and runs only K=1"
            )
        return None
    if binding is not LayerBinding.SPARSE_INDEXER_CACHE:
        _require_impl(layer, name, geometry)
    if binding is LayerBinding.IMPL:
        return _bind_impl
    if binding is LayerBinding.MLA:
        return bind_mla_layer
    registered = LAYER_BINDERS.get(binding)
    if registered is None:
        raise DcpGeometryError(
            f"{geometry.describe()}: layer {name} ({layer_class_path(layer)}) "
            f"needs the binder of vllm_dcp_geometry.{BINDING_PATCHES[binding]}, "
            "which is not applied"
        )
    return registered[1]


def _bind_impl(layer: Any, geometry: GroupGeometry, name: str) -> None:
    bind_impl_to_group(layer.impl, geometry, name)


def bind_group_layers(
    vllm_config: Any,
    layer_names: Sequence[str],
    geometry: GroupGeometry,
    *,
    mla: bool,
) -> None:
    """Bind every layer of a group with K < D (K = D needs nothing). Every
    layer is checked before any is bound."""
    if geometry.is_sharded:
        return
    context = vllm_config.compilation_config.static_forward_context
    plan = []
    for name, layer in group_layers(vllm_config, layer_names, geometry):
        check_reader(layer, name, geometry, context)
        plan.append((layer, name, layer_binder(layer, name, geometry, mla)))
    for layer, name, binder in plan:
        if binder is not None:
            binder(layer, geometry, name)
