# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.models.kimi_k3.nvidia.mla``: Kimi-K3's MLA layer follows its
group's K.

What: registers the binder of ``MultiHeadLatentAttention`` (the Kimi-K3 and
Kimi-Linear target, KimiK3MTP and the DSpark draft) for
``layer_classes.LayerBinding.KIMI_K3_MLA``; the MLA builder patch calls it for
every layer of the class in a group with K < D. The binder does what the
generic MLA binding does to the layer's impl and DCP manager
(``mla_geometry.bind_mla_layer``) and sets the layer's own DCP gate,
``layer.dcp_world_size``: 1 for K = 1 (decode without query all-gather or
LSE combine, prefill context through the layer's DCP1
``_compute_prefill_context`` over the DCP1 chunk plan the local builder
makes); for 1 < K < D, K within its replica (the replica manager's K-rank
gather and combine, and the impl's context-parallel prefill path over K,
exactly as ``MLAAttention``) or D on the D-wide group (the D-wide gather and
the replica-masked combine).
Nothing is wrapped; the layer's forward methods it relies on are pinned.

vLLM 0.34.0: under ``dcp_comm_backend="a2a"`` ``_attention`` combines and
up-projects in one step wherever the layer holds a ``W_UV_dcp`` (its
``W_UV`` gathered at load over its manager's group, the D ranks); a partial
layer is bound without it and without its manager's ``v_up_proj_combine``
(``mla_geometry.drop_fused_up_projection``, through ``bind_mla_layer``), so
it combines with the replica manager or the masked combine, then runs
``_v_up_proj`` on its own heads. The binder checks that it did.
``process_weights_after_loading`` (the gather) is relied on there.

Why: the class is not vLLM's ``MLAAttention``: it decides its DCP path on its
own ``dcp_world_size`` (from the parallel config), so a local impl alone
leaves it all-gathering D*H query heads and asserting on a missing LSE.

Remove with: ``patches.worker.mla_attention`` (its builder patch is the only
caller of this binder). Remove when: the layer takes its group's DCP shard
count (or vLLM's MLA does).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.layer_classes import (
    KIMI_K3_MLA,
    LAYER_BINDERS,
    LayerBinding,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.runtime.mla_geometry import bind_mla_layer
from vllm_dcp_geometry.runtime.patching import Patch, Pin, set_item
from vllm_dcp_geometry.runtime.upstream_symbols import require_class_path


def bind_kimi_k3_layer(layer: Any, geometry: GroupGeometry, layer_name: str) -> None:
    """Bind one ``MultiHeadLatentAttention`` to its group (idempotent): the
    layer's gate follows its impl's bound world (1, K within the replica, or
    D on the D-wide group)."""
    bound = getattr(layer.impl, BOUND_GEOMETRY_ATTR, None) is not None
    if not bound and layer.dcp_world_size not in (1, geometry.dcp_world_size):
        raise DcpGeometryError(
            f"{geometry.describe()}: layer {layer_name} ({KIMI_K3_MLA}) gates DCP "
            f"on a world size of {layer.dcp_world_size}, not the group's D"
        )
    bind_mla_layer(layer, geometry, layer_name)
    layer.dcp_world_size = layer.impl.dcp_world_size
    if geometry.is_partial and getattr(layer, "W_UV_dcp", None) is not None:
        # _attention takes the fused a2a up-projection on this attribute alone.
        raise DcpGeometryError(
            f"{geometry.describe()}: layer {layer_name} ({KIMI_K3_MLA}) kept "
            "W_UV_dcp, the up-projection of all D ranks' heads, after binding"
        )


def apply(module: ModuleType) -> None:
    require_class_path(module, "MultiHeadLatentAttention", KIMI_K3_MLA)
    set_item(LAYER_BINDERS, LayerBinding.KIMI_K3_MLA, (__name__, bind_kimi_k3_layer))


PATCH = Patch(
    upstream_module="vllm.models.kimi_k3.nvidia.mla",
    relies_on=(
        # Relied on: the three places the layer reads its own dcp_world_size;
        # on 0.34.0 _attention also takes the fused a2a up-projection wherever
        # W_UV_dcp is set (cleared for a partial group).
        Pin(
            "MultiHeadLatentAttention._attention",
            "self, positions, q, kv_c_normed, k_pe, attn_out",
        ),
        Pin(
            "MultiHeadLatentAttention._forward_prefill_fused",
            "self, q, kv_c_normed, k_pe, positions, cos_sin_cache, slot_mapping, "
            "attn_metadata, out",
        ),
        Pin(
            "MultiHeadLatentAttention._compute_prefill_context",
            "self, q, attn_metadata",
        ),
        # Relied on (0.34.0): W_UV_dcp is gathered at load only where the
        # layer's manager has a v_up_proj_combine (see the binding).
        Pin(
            "MultiHeadLatentAttention.process_weights_after_loading",
            {"0.34.0": "self"},
        ),
    ),
    remove_with=("worker.mla_attention",),
    why=(
        "Kimi-K3's MLA layer gates its query all-gather, LSE combine and prefill "
        "context path on its own dcp_world_size, not its impl's."
    ),
    remove_when="Kimi-K3's MLA layer takes its group's DCP shard count",
    related="none upstream: the layer reads the parallel config's DCP size",
    apply=apply,
)
