# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The vLLM-facing half of the admission rule, on the worker.

``attention_admission`` is the rule itself, on plain values; this module reads
those values off vLLM's objects for one group (its kind from the spec, its
backend's label, each layer's class, impl world and dropped features, MLA
query replication, Kimi-K3's specialized decode) and admits it, once per layer
class. A local or partial admission also needs the patch that teaches the
backend's builder to be applied.

No vLLM import at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.attention_admission import (
    AttentionAdmission,
    AttentionMode,
    admit_attention,
    impl_world_refusal,
)
from vllm_dcp_geometry.contract.attention_backends import (
    DCP_DROPPED_FEATURES,
    REFUSED_BACKENDS,
    TAUGHT_BACKENDS,
    AttentionKind,
    taught_backend_name,
    teaching_patch,
    vllm_shard_count,
)
from vllm_dcp_geometry.contract.layer_classes import layer_class_path
from vllm_dcp_geometry.runtime import patching
from vllm_dcp_geometry.runtime.geometry import default_shard_count


def attention_kind(kv_cache_spec: Any, backend: Any = None) -> AttentionKind:
    """The admission kind of a group from its spec (and backend class)."""
    from vllm.v1.kv_cache_interface import (
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        UniformTypeKVCacheSpecs,
    )

    spec = kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    if isinstance(spec, MambaSpec):
        return AttentionKind.NONE
    if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)) or (
        backend is not None and backend.is_mla()
    ):
        return AttentionKind.MLA
    return AttentionKind.ATTENTION


def upstream_read_shard_count(kv_cache_spec: Any, dcp_world_size: int) -> int | None:
    """The K unpatched vLLM's attention reads a group's cache with (None: no
    attention reads it): MLA always D, other backends D or 1 from
    ``dcp_sharded`` (``attention_backends.vllm_shard_count``, which says why
    that holds on 0.34.0 too)."""
    kind = attention_kind(kv_cache_spec)
    if kind is AttentionKind.NONE:
        return None
    return vllm_shard_count(
        kind, dcp_world_size, default_shard_count(kv_cache_spec, dcp_world_size)
    )


def backend_label(backend_name: str, builder_cls: type) -> str:
    """The backend's name where its builder is the exact class the plugin
    taught (or the backend is not taught at all), else the name with the
    builder: a subclass or a re-registered backend is not taught (unless it
    is one of ``attention_backends.LOCAL_ONLY_BUILDERS``). A builder refused
    by name (``attention_backends.REFUSED_BACKENDS``) is named too, so the
    refusal says whose it is (DASHAttention's has TRITON_ATTN's name)."""
    path = f"{builder_cls.__module__}.{builder_cls.__qualname__}"
    taught = TAUGHT_BACKENDS.get(backend_name)
    if path in REFUSED_BACKENDS:
        return f"{backend_name} ({path})"
    if taught is None or taught.builder == path:
        return backend_name
    return f"{backend_name} ({path})"


def layers_replicate_queries(vllm_config: Any, layer_names: Sequence[str]) -> bool:
    """Whether any layer of the group runs MLA's DCP query replication."""
    context = vllm_config.compilation_config.static_forward_context
    return any(
        getattr(context.get(name), "dcp_q_replicate", False) for name in layer_names
    )


SPECIALIZED_DECODE_BACKEND = "latency_specialized"
"""``additional_config["decode_backend"]`` that turns Kimi-K3's specialized
decode on."""


def specialized_decode_enabled(vllm_config: Any) -> bool:
    additional = getattr(vllm_config, "additional_config", None) or {}
    return additional.get("decode_backend") == SPECIALIZED_DECODE_BACKEND


@dataclasses.dataclass(frozen=True)
class LayerFacts:
    """What admission reads of one layer of a group."""

    name: str
    layer_class: str
    impl_dcp_world_size: int | None
    features: frozenset[str]


def model_attention_features(vllm_config: Any) -> frozenset[str]:
    """Model-wide features a FlashAttention builder turns into a mask_mod
    (the R-SWA window, a multimodal prefix LM), as the builder reads them."""
    model_config = vllm_config.model_config
    features = set()
    # Read as the builder reads them (no default: a rename fails loudly
    # instead of turning the check off).
    if model_config.rswa_window is not None:
        features.add("rswa_mask")
    if model_config.is_mm_prefix_lm:
        features.add("mm_prefix_mask")
    return frozenset(features)


def group_layer_facts(
    vllm_config: Any, layer_names: Sequence[str], backend: str
) -> list[LayerFacts]:
    """The facts of the first layer of each (class, features) in the group;
    a layer missing from the forward context is named as such (no taught
    class, so only vLLM's K runs). Features are read only for a backend
    whose DCP path does not keep them (``DCP_DROPPED_FEATURES``)."""
    context = vllm_config.compilation_config.static_forward_context
    model_features: frozenset[str] = frozenset()
    # FlashAttentionImpl and FlashInferImpl always set ``sinks``; a layer
    # without an impl (Inkling) has none to drop.
    dropped = DCP_DROPPED_FEATURES.get(backend, frozenset())
    reads_sinks = "sinks" in dropped
    if dropped - {"sinks"}:
        model_features = model_attention_features(vllm_config)
    seen: dict[tuple[str, frozenset[str]], LayerFacts] = {}
    for name in layer_names:
        layer = context.get(name)
        if layer is None:
            facts = LayerFacts(name, "not in the forward context", None, frozenset())
        else:
            impl = getattr(layer, "impl", None)
            features = set(model_features)
            # Read without a default: a rename fails loudly.
            if reads_sinks and impl is not None and impl.sinks is not None:
                features.add("sinks")
            facts = LayerFacts(
                name,
                layer_class_path(layer),
                getattr(impl, "dcp_world_size", None),
                frozenset(features),
            )
        seen.setdefault((facts.layer_class, facts.features), facts)
    return list(seen.values())


def admit_group(
    geometry: GroupGeometry,
    *,
    kind: AttentionKind,
    backend: str,
    vllm_config: Any,
    layer_names: Sequence[str],
) -> AttentionAdmission:
    """``attention_admission.admit_attention`` for a group on this worker,
    once per layer class (and feature set) of the group; the first refusal
    wins."""
    parallel_config = vllm_config.parallel_config
    default = geometry.default_shard_count
    replicate = layers_replicate_queries(vllm_config, layer_names)
    specialized = specialized_decode_enabled(vllm_config)
    admission = None
    for facts in group_layer_facts(vllm_config, layer_names, backend):
        admission = admit_attention(
            owner=geometry.owner,
            kind=kind,
            backend=backend,
            shard_count=geometry.shard_count,
            dcp_world_size=geometry.dcp_world_size,
            default_shard_count=geometry.dcp_world_size if default is None else default,
            pcp_world_size=parallel_config.prefill_context_parallel_size,
            interleave_size=geometry.interleave_size,
            dcp_q_replicate=replicate,
            layer_class=facts.layer_class,
            layer_name=facts.name,
            impl_dcp_world_size=facts.impl_dcp_world_size,
            specialized_decode=specialized,
            layer_features=facts.features,
        )
        if admission.refused:
            return admission
    if admission is None:
        raise DcpGeometryError(f"{geometry.describe()}: the group has no layers")
    return _require_teaching_patch(admission, geometry, backend)


def _require_teaching_patch(
    admission: AttentionAdmission, geometry: GroupGeometry, backend: str
) -> AttentionAdmission:
    """A local or partial admission relies on the patch that teaches the
    backend's builder; without it (removed, or its module never imported)
    the builder would run vLLM's D-wide path on this cache."""
    if admission.mode not in (AttentionMode.LOCAL, AttentionMode.DCP_PARTIAL):
        return admission
    patch = teaching_patch(backend)
    if patch is None:
        return admission
    if patching.patch_applied(patch):
        return admission
    return AttentionAdmission(
        AttentionMode.REFUSED,
        f"{geometry.describe()}: attention backend {backend} runs K="
        f"{geometry.shard_count} only through the patch "
        f"{patching.patch_module_name(patch)}, which is not applied in this process",
    )


def check_sharding_of_replicated_layer(
    vllm_config: Any, layer_name: str, shard_count: int, dcp_world_size: int
) -> None:
    """An override shards (K > 1) a layer vLLM built replicated: refuse it
    where the layer's attention impl runs for fewer than D ranks (the dense
    drafts Model Runner V2 builds at DCP 1), naming layer, class, backend,
    K and D."""
    context = vllm_config.compilation_config.static_forward_context
    layer = context.get(layer_name)
    impl = getattr(layer, "impl", None)
    impl_world = getattr(impl, "dcp_world_size", None)
    if impl_world is None or impl_world == dcp_world_size:
        return
    backend = type(impl).__name__
    with contextlib.suppress(AttributeError, NotImplementedError):
        backend = layer.get_attn_backend().get_name()
    head = (
        f"layer {layer_name} ({layer_class_path(layer)}), attention backend "
        f"{backend}, K={shard_count}, D={dcp_world_size}"
    )
    impl_world_refusal(head, impl_world).check()


def admit_builder(
    builder: Any,
    geometry: GroupGeometry,
    kv_cache_spec: Any,
    vllm_config: Any,
    layer_names: Sequence[str],
) -> AttentionAdmission:
    """Admission of a group whose builder is being constructed (builders are
    also made outside ``AttentionGroup``); raises when refused. A builder
    class the plugin did not teach is named by its class."""
    builder_cls = type(builder)
    path = f"{builder_cls.__module__}.{builder_cls.__qualname__}"
    return admit_group(
        geometry,
        kind=attention_kind(kv_cache_spec),
        backend=taught_backend_name(path) or path,
        vllm_config=vllm_config,
        layer_names=layer_names,
    ).check()
