# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention-side DCP geometry of one KV-cache group.

A metadata builder is built per KV-cache group from the group's spec, so it is
the one place on the worker that knows the group's shard count K. This module
holds what the attention patches share: resolving the group's geometry
(``contract.GroupGeometry``) from its spec and the DCP process group, binding
the group's attention impls to it, the exact partial-group LSE combine
(duplicate replicas masked to -inf), a partial group's local lengths and the
wrapper of upstream's ``build`` for it (FlashInfer and MLA), the K
unpatched vLLM reads a cache with, and the vLLM-facing half of the admission
rule (``attention_admission``: a group's kind, its backend's label, its MLA
query replication). The side channel that lets upstream builder code see the
group's geometry is ``group_context.use_group_geometry``.

No vLLM import at module level; the few functions that need vLLM (resolving a
group from its spec, finding a group's layers) import it when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.attention_admission import (
    DCP_DROPPED_FEATURES,
    TAUGHT_BACKENDS,
    AttentionAdmission,
    AttentionKind,
    AttentionMode,
    admit_attention,
    impl_world_refusal,
    taught_backend_name,
    teaching_patch,
    vllm_shard_count,
)
from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    GroupGeometry,
    check_interleave,
    check_prefill_context_parallel,
)
from vllm_dcp_geometry.geometry import (
    default_shard_count,
    get_kv_cache_dcp_shard_count,
    group_name,
)
from vllm_dcp_geometry.group_context import use_group_geometry
from vllm_dcp_geometry.layer_classes import layer_class_path

if TYPE_CHECKING:
    import torch

BOUND_GEOMETRY_ATTR = "_vllm_dcp_geometry_group"
"""Set on every builder and attention impl bound to a group's geometry."""

LOCAL_SEQ_LENS_BUFFER_ATTR = "_vllm_dcp_geometry_local_seq_lens"
"""A partial group's builder: persistent buffer of the group's local lengths."""


def resolve_group_geometry(
    kv_cache_spec: Any,
    layer_names: Sequence[str],
    vllm_config: Any,
    index: int | None = None,
) -> GroupGeometry | None:
    """The group's geometry on this rank, or None when DCP is off (D == 1).

    D and r come from vLLM's DCP process group, as upstream builders and impls
    take them (so at D == 1 nothing else is read); K from the spec through the
    contract. A partial K with prefill context parallelism is refused (the
    contract's PCP rule).
    """
    from vllm.distributed import parallel_state

    dcp_world_size, dcp_rank = parallel_state.get_dcp_world_size_and_rank(True)
    if dcp_world_size == 1:
        return None
    parallel_config = vllm_config.parallel_config
    owner = group_name(layer_names, index)
    shard_count = get_kv_cache_dcp_shard_count(
        kv_cache_spec, dcp_world_size, owner=owner
    )
    interleave_size = parallel_config.cp_kv_cache_interleave_size
    geometry = GroupGeometry(
        owner=owner,
        shard_count=shard_count,
        dcp_world_size=dcp_world_size,
        dcp_rank=dcp_rank,
        interleave_size=interleave_size,
        default_shard_count=default_shard_count(kv_cache_spec, dcp_world_size),
    )
    if not geometry.matches_default:
        try:
            check_interleave(kv_cache_spec.block_size, shard_count, interleave_size)
        except DcpGeometryError as exc:
            raise DcpGeometryError(f"{geometry.describe()}: {exc}") from exc
    check_prefill_context_parallel(
        geometry.describe(),
        shard_count,
        dcp_world_size,
        parallel_config.prefill_context_parallel_size,
    )
    return geometry


def check_rebind(obj: Any, geometry: GroupGeometry, what: str) -> bool:
    """True if ``obj`` is already bound to ``geometry``; error if to another."""
    bound = getattr(obj, BOUND_GEOMETRY_ATTR, None)
    if bound is None:
        return False
    if bound.shard_world != geometry.shard_world or bound.dcp_rank != (
        geometry.dcp_rank
    ):
        raise DcpGeometryError(
            f"{what} is bound to {bound.describe()} and cannot also serve "
            f"{geometry.describe()}"
        )
    return True


def make_impl_local(impl: Any) -> None:
    """Rule A2: run a replicated group's impl as plain local attention (no
    DCP pass).

    ``need_to_return_lse_for_decode`` is left as is: the runner's start-up
    check reads it for every target layer, and it only matters on DCP paths.
    With prefill context parallelism the impl's context path spans the PCP
    ranks too; the admission rule refuses K < D there, and so does this.
    """
    if impl.dcp_world_size == 1:
        return
    if impl.pcp_world_size > 1:
        raise DcpGeometryError(
            f"an attention impl of a replicated group (K=1) runs with prefill "
            f"context parallelism (PCP={impl.pcp_world_size}), which cannot be "
            "made local; use K=D ('sharded') or turn PCP off"
        )
    impl.dcp_world_size = 1
    impl.dcp_rank = 0
    impl.total_cp_world_size = 1
    impl.total_cp_rank = 0


# Exact combine for partial groups -------------------------------------------


def mask_duplicate_replica_lse(lse: torch.Tensor, replica: int) -> torch.Tensor:
    """Rule A3: the LSE to hand to a D-rank combine from replica ``q`` of a
    partial group.

    Each shard is held by D/K identical replicas; counting all of them scales
    the combined softmax denominator by D/K (LSE + ln(D/K)). Only replica 0
    takes part: the others send -inf, which the combine turns into weight 0
    and an output of exactly 0, so neither NaN nor a duplicate survives.
    """
    import torch

    if replica == 0:
        return lse
    return torch.full_like(lse, float("-inf"))


class ReplicaMaskedCombine:
    """Wraps a DCP combine whose first two arguments are the partial output
    and its LSE (``cp_lse_ag_out_rs`` / ``dcp_a2a_lse_reduce`` as impls hold
    them, ``MLADCPManager.combine``) so duplicate replicas weigh 0."""

    def __init__(self, combine: Callable[..., Any], replica: int) -> None:
        if isinstance(combine, ReplicaMaskedCombine):
            raise DcpGeometryError("a DCP combine is already replica-masked")
        self.combine = combine
        self.replica = replica

    def __call__(
        self, cp_attn_out: Any, cp_attn_lse: Any, *args: Any, **kw: Any
    ) -> Any:
        lse = mask_duplicate_replica_lse(cp_attn_lse, self.replica)
        return self.combine(cp_attn_out, lse, *args, **kw)

    def __repr__(self) -> str:
        return f"ReplicaMaskedCombine({self.combine!r}, replica={self.replica})"


def mask_combine(combine: Callable[..., Any], replica: int) -> Callable[..., Any]:
    """``combine`` replica-masked for ``replica`` (idempotent)."""
    if isinstance(combine, ReplicaMaskedCombine):
        if combine.replica != replica:
            raise DcpGeometryError(
                f"a DCP combine masked for replica {combine.replica} cannot be "
                f"reused by replica {replica}"
            )
        return combine
    return ReplicaMaskedCombine(combine, replica)


# Admission -------------------------------------------------------------------


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
    """The K unpatched vLLM 0.33.0's attention reads a group's cache with
    (None: no attention reads it): MLA always D, other backends D or 1 from
    ``dcp_sharded`` (``attention_admission.vllm_shard_count``)."""
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
    is one of ``attention_admission.LOCAL_ONLY_BUILDERS``)."""
    path = f"{builder_cls.__module__}.{builder_cls.__qualname__}"
    taught = TAUGHT_BACKENDS.get(backend_name)
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
    whose DCP path drops some (``DCP_DROPPED_FEATURES``)."""
    context = vllm_config.compilation_config.static_forward_context
    model_features: frozenset[str] = frozenset()
    if backend in DCP_DROPPED_FEATURES:
        model_features = model_attention_features(vllm_config)
    seen: dict[tuple[str, frozenset[str]], LayerFacts] = {}
    for name in layer_names:
        layer = context.get(name)
        if layer is None:
            facts = LayerFacts(name, "not in the forward context", None, frozenset())
        else:
            impl = getattr(layer, "impl", None)
            features = set(model_features)
            # FlashAttentionImpl always sets ``sinks``; a layer without an
            # impl (Inkling) has none to drop.
            reads_sinks = backend in DCP_DROPPED_FEATURES and impl is not None
            if reads_sinks and impl.sinks is not None:  # type: ignore[union-attr]
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
    from vllm_dcp_geometry import plugin

    if plugin.patch_applied(patch):
        return admission
    return AttentionAdmission(
        AttentionMode.REFUSED,
        f"{geometry.describe()}: attention backend {backend} runs K="
        f"{geometry.shard_count} only through the patch "
        f"{plugin.patch_module_name(patch)}, which is not applied in this process",
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


def bind_impl_to_group(impl: Any, geometry: GroupGeometry, layer_name: str) -> None:
    """Give an attention impl (built with the model, before any spec was
    known) its group's geometry; idempotent.

    K = D: untouched. K = 1: plain local attention. 1 < K < D: the impl keeps
    the D-rank query all-gather and combine, and its ``dcp_combine`` is
    replica-masked so the D-rank combine counts every shard once.
    """
    what = f"the attention impl of layer {layer_name}"
    if check_rebind(impl, geometry, what):
        return
    if geometry.is_replicated:
        make_impl_local(impl)
    elif geometry.is_partial:
        if impl.dcp_world_size != geometry.dcp_world_size:
            raise DcpGeometryError(
                f"{geometry.describe()}: {what} runs with a DCP world size of "
                f"{impl.dcp_world_size}, not the group's D"
            )
        impl.dcp_combine = mask_combine(impl.dcp_combine, geometry.replica)
    setattr(impl, BOUND_GEOMETRY_ATTR, geometry)


def group_local_seq_lens(
    seq_lens: torch.Tensor, geometry: GroupGeometry
) -> torch.Tensor:
    """Per-request local sequence lengths of this rank for the group: the
    positions ``< seq_len`` whose owner shard is ``s`` (contract
    ``local_seq_len``), computed by vLLM's own helper given (K, s)."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    shard_count, shard = geometry.shard_world
    return get_dcp_local_seq_lens(
        seq_lens, shard_count, shard, geometry.interleave_size
    )


def attach_local_seq_lens_buffer(builder: Any, vllm_config: Any, device: Any) -> None:
    """Give a partial group's builder a persistent buffer for its local
    lengths, so FULL CUDA graphs replay the current values."""
    import torch

    setattr(
        builder,
        LOCAL_SEQ_LENS_BUFFER_ATTR,
        torch.zeros(
            vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device
        ),
    )


def with_group_local_seq_lens(
    builder: Any, common_attn_metadata: Any, geometry: GroupGeometry, **changes: Any
) -> Any:
    """A copy of the common metadata whose DCP local lengths are the group's,
    held in the builder's persistent buffer (rows past the batch read 0), with
    ``changes`` applied in the same copy.

    The runners compute one ``dcp_local_seq_lens`` per step with vLLM's
    global (D, r) for every group; a partial group's builder reads this copy.
    """
    buffer = getattr(builder, LOCAL_SEQ_LENS_BUFFER_ATTR)
    seq_lens = common_attn_metadata.seq_lens
    num_rows = seq_lens.shape[0]
    buffer[:num_rows].copy_(group_local_seq_lens(seq_lens, geometry))
    buffer[num_rows:].zero_()
    # Only PCP fills this bound, and PCP never runs a partial group; derive it
    # anyway where given (the local length is monotonic in the length).
    upper_bound = None
    seq_upper_bound = common_attn_metadata.seq_lens_cpu_upper_bound
    if (
        common_attn_metadata.dcp_local_seq_lens_cpu_upper_bound is not None
        and seq_upper_bound is not None
    ):
        upper_bound = group_local_seq_lens(seq_upper_bound, geometry)
    return dataclasses.replace(
        common_attn_metadata,
        dcp_local_seq_lens=buffer[:num_rows],
        dcp_local_seq_lens_cpu_upper_bound=upper_bound,
        **changes,
    )


def bound_partial_geometry(builder: Any) -> GroupGeometry | None:
    """The partial group (1 < K < D) a metadata builder was bound to at
    construction, or None (upstream's ``build`` then runs untouched)."""
    geometry = getattr(builder, BOUND_GEOMETRY_ATTR, None)
    if geometry is None or not geometry.is_partial:
        return None
    return geometry


def make_partial_group_build(
    original: Callable[..., Any],
    adjust: Callable[[Any, GroupGeometry], dict[str, Any]] | None = None,
    finish: Callable[[Any, Any], None] | None = None,
) -> Callable[..., Any]:
    """Wrap a metadata builder's ``build`` (FlashInfer, MLA) for partial
    groups; upstream's own where the builder's group is not partial.

    A partial group's build runs upstream's on a copy of the common metadata
    with the group's local lengths (``with_group_local_seq_lens``) and the
    fields ``adjust(common_attn_metadata, geometry)`` returns, with the group
    active (``use_group_geometry``) for the module helpers upstream calls
    inside; ``finish(metadata, common_attn_metadata)`` may then correct what
    upstream derived from the adjusted copy.
    """

    def build(
        self: Any,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> Any:
        geometry = bound_partial_geometry(self)
        if geometry is None:
            return original(self, common_prefix_len, common_attn_metadata, fast_build)
        changes = {} if adjust is None else adjust(common_attn_metadata, geometry)
        group_metadata = with_group_local_seq_lens(
            self, common_attn_metadata, geometry, **changes
        )
        with use_group_geometry(geometry):
            metadata = original(self, common_prefix_len, group_metadata, fast_build)
        if finish is not None:
            finish(metadata, common_attn_metadata)
        return metadata

    return build
