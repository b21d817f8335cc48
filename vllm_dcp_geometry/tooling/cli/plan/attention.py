# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How each group's attention runs at start-up, for ``plan``.

The backend vLLM 0.33.0 picks for a group on SM90 (or the backend named for
it, for the groups of its kind: ``--attention-backend`` for the target, for a
draft the one ``draft_backend`` gives), the layer class that reads its cache,
vLLM's own selector refusal (which no K changes), and the plugin's admission
rule, the same one start-up applies (``attention_admission.admit_attention``).
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract.attention_admission import admit_attention
from vllm_dcp_geometry.contract.attention_backends import (
    AttentionKind,
    is_mla_backend_name,
)
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
    DSA_INDEXER_BACKEND,
    GENERIC_LAYERS,
    reader_refusal,
)
from vllm_dcp_geometry.runtime.geometry import (
    default_shard_count,
    kv_cache_group_name,
)
from vllm_dcp_geometry.tooling.cli.plan.kernel_shapes import (
    combine_refusal,
    latent_row_refusal,
)
from vllm_dcp_geometry.tooling.sm90_backends import (
    DEFAULT_ATTENTION_BACKENDS,
    NON_CAUSAL_DCP_MLA_BACKEND,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError
from vllm_dcp_geometry.tooling.vllm_release import on_installed_release, vllm_release

LAYER_CLASS_BACKENDS = {
    DEEPSEEK_V32_ATTENTION: "FLASHMLA_SPARSE",
    DEEPSEEK_V32_INDEXER_CACHE: DSA_INDEXER_BACKEND,
}
"""What vLLM 0.33.0 picks on SM90 for a layer class with a backend of its own
(DeepSeek-V3.2's sparse layers: FLASHMLA_SPARSE is the one sparse backend
with DCP there)."""

FIXED_BACKEND_CLASSES = frozenset({DEEPSEEK_V32_INDEXER_CACHE})
"""Layer classes whose backend the layer fixes (``--attention-backend`` does
not reach them)."""

NON_CAUSAL_DCP_MLA_BACKENDS = frozenset(
    {
        "FLASHINFER_MLA",
        "TOKENSPEED_MLA",
        "ROCM_AITER_MLA",
        "ROCM_AITER_TRITON_MLA",
        "KIMI_K3_KV_BALANCED_MLA",  # 0.34.0
    }
)
"""MLA backends whose builder has ``supports_non_causal_multi_token_dcp``
on a release that has them (a test checks the list against vLLM's
importable backends)."""

_ATTENTION_KINDS = {
    "mla": AttentionKind.MLA,
    "full_attention": AttentionKind.ATTENTION,
    "sliding_window": AttentionKind.ATTENTION,
    "mamba": AttentionKind.NONE,
}


def check_attention_backend(name: str | None) -> str | None:
    """``name`` if it is one of vLLM's attention backends (exit 2 otherwise)."""
    if name is None:
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = [member.name for member in AttentionBackendEnum]
    if name not in names:
        raise TopologyError(
            f"--attention-backend {name!r} is not a vLLM attention backend; "
            f"one of: {', '.join(names)}"
        )
    return name


def check_draft_attention_backend(speculative_config: Any) -> str | None:
    """The backend ``--speculative-config`` names for the draft, read by
    vLLM's own ``SpeculativeConfig`` validator (any case; ``"auto"`` and
    none: None); anything else exits 2 naming the flag."""
    if not speculative_config or "attention_backend" not in speculative_config:
        return None
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    value = speculative_config["attention_backend"]
    try:
        backend = SpeculativeConfig._parse_attention_backend(value)
    except (KeyError, ValueError) as exc:
        raise TopologyError(f"--speculative-config attention_backend: {exc}") from exc
    if backend is not None and not isinstance(backend, AttentionBackendEnum):
        raise TopologyError(
            "--speculative-config attention_backend must be a vLLM attention "
            f"backend name or 'auto', got {value!r}"
        )
    return None if backend is None else backend.name


def draft_inherits_target_backend(group: CacheGroup) -> bool:
    """Whether vLLM 0.33.0 gives a draft the target's backend when the
    speculative config names none (Model Runner V2, which DSpark needs and
    which is the default). EAGLE and MTP drafts inherit it
    (``load_eagle_model`` applies ``SpeculativeConfig.apply_draft_overrides``,
    whose ``_DRAFT_VLLM_CONFIG_OVERRIDES`` set the draft's backend only when
    named); a DSpark draft does not (``_resolve_dspark_attention_backend``:
    only DeepSeek-V4 drafts take the target's, others leave the choice to
    vLLM's selector). A group with ``non_causal_multi_token_decode`` is
    Kimi-K3's DSpark draft, the one vLLM 0.33.0 layer that sets it; any other
    draft group stands for an EAGLE/MTP draft (a test checks both rules
    against vLLM's functions)."""
    return not group.spec_fields.get("non_causal_multi_token_decode", False)


def draft_backend(
    group: CacheGroup, target_backend: str | None, named_backend: str | None
) -> str | None:
    """The backend named for the group: ``--attention-backend`` for a target
    group; for a draft, the speculative config's own, else the target's where
    the draft inherits it, else none (vLLM's selector picks)."""
    if not group.draft:
        return target_backend
    if named_backend is not None:
        return named_backend
    return target_backend if draft_inherits_target_backend(group) else None


def default_attention_backend(group: CacheGroup, dcp: int) -> str:
    """The backend vLLM 0.33.0 selects for the group on SM90."""
    if group.layer_class in LAYER_CLASS_BACKENDS:
        return LAYER_CLASS_BACKENDS[group.layer_class]
    if (
        group.kind == "mla"
        and dcp > 1
        and group.spec_fields.get("non_causal_multi_token_decode", False)
    ):
        return NON_CAUSAL_DCP_MLA_BACKEND
    return DEFAULT_ATTENTION_BACKENDS[group.kind]


def group_layer_class(group: CacheGroup) -> str | None:
    """The class that reads the group's cache (None for recurrent state)."""
    if not group.is_attention:
        return None
    return group.layer_class or GENERIC_LAYERS[group.kind == "mla"]


def vllm_selector_refusal(
    group: CacheGroup, index: int, backend: str | None, dcp: int
) -> str | None:
    """vLLM's own refusal at model construction, which no K changes: its
    selector refuses non-causal multi-token MLA decode (a DSpark draft)
    under DCP on a backend without DSpark DCP support."""
    non_causal = group.spec_fields.get("non_causal_multi_token_decode", False)
    if not non_causal or dcp == 1 or backend in NON_CAUSAL_DCP_MLA_BACKENDS:
        return None
    return (
        f"{kv_cache_group_name(group.layers, index)}: attention backend {backend}: "
        "vLLM 0.33.0's attention selector refuses non-causal multi-token MLA "
        "decode (a DSpark draft) under DCP on this backend, whatever the group's "
        "K (it selects when the model is built, before any KV-cache spec); use "
        f"{' or '.join(sorted(NON_CAUSAL_DCP_MLA_BACKENDS))}"
    )


FLASHMLA_SPARSE = "FLASHMLA_SPARSE"

FLASHMLA_SPARSE_RESTRICTS_EVERY_CACHE = {"0.33.0": True, "0.34.0": False}
"""Whether FLASHMLA_SPARSE's builder restricts DCP whatever the cache dtype
(0.33.0, whose impl refuses a bf16 cache under DCP anyway) or only for its
quantized caches, vLLM's ``QUANTIZED_DS_MLA_CACHE_FORMATS`` (0.34.0: its
bf16 kernel returns every token's LSE and pads the gathered heads itself)."""


def _collective_world(backend: str, topology: Topology, k: int) -> int:
    """W: the ranks the group's collectives run over (none for K = 1, K
    within a replica, else D), as the runtime binds them."""
    from vllm_dcp_geometry.contract.attention_backends import (
        collectives_within_replica,
    )
    from vllm_dcp_geometry.contract.collectives import (
        REPLICA,
        collective_world_size,
    )

    within = topology.partial_collectives == REPLICA and collectives_within_replica(
        backend
    )
    return collective_world_size(
        k, topology.decode_context_parallel_size, replica_collectives=within
    )


def kernel_shape_refusal(
    group: CacheGroup, index: int, backend: str | None, topology: Topology, k: int
) -> str | None:
    """A shape rule of vLLM's kernels the group breaks (``kernel_shapes``)."""
    if backend is None:
        return None
    name = kv_cache_group_name(group.layers, index)
    return latent_row_refusal(group, name, backend) or combine_refusal(
        group, name, _collective_world(backend, topology, k)
    )


def flashmla_sparse_refusal(
    group: CacheGroup, index: int, backend: str | None, topology: Topology, k: int
) -> str | None:
    """vLLM's FlashMLA sparse builder's refusal under DCP, for the
    world the group's query is gathered over (the plugin's
    ``patches.worker.flashmla_sparse`` shows it that world: none for K = 1,
    K within a replica, else D): its fp8 decode runs DCP only on the
    mixed-batch path (fewer than ``MIN_HEADS_FOR_BF16_PREFILL`` heads per
    rank), and only where the local and the gathered head counts pad to the
    same kernel envelope (vLLM's own ``_compute_fp8_decode_padded_heads``);
    on 0.34.0 for a quantized cache only. None where it builds, or where the
    topology gives no query heads."""
    if backend != FLASHMLA_SPARSE:
        return None
    from vllm.v1.attention.backends.mla import flashmla_sparse

    restricts_every_cache = on_installed_release(FLASHMLA_SPARSE_RESTRICTS_EVERY_CACHE)
    cache_dtype = group.spec_fields.get("cache_dtype_str")
    if not restricts_every_cache and (
        cache_dtype not in flashmla_sparse.QUANTIZED_DS_MLA_CACHE_FORMATS
    ):
        return None
    world = _collective_world(backend, topology, k)
    heads = topology.heads_per_rank(group)
    if world == 1 or heads is None:
        return None
    name = kv_cache_group_name(group.layers, index)
    limit = flashmla_sparse.MIN_HEADS_FOR_BF16_PREFILL
    if heads >= limit:
        return (
            f"{name}: FLASHMLA_SPARSE runs DCP only on its mixed-batch fp8 path, "
            f"fewer than {limit} query heads per rank; this group has {heads} "
            f"(vLLM {vllm_release()}'s builder refuses it at start-up)"
        )
    pad = flashmla_sparse.FlashMLASparseImpl._compute_fp8_decode_padded_heads
    if pad(heads) != pad(heads * world):
        return (
            f"{name}: FLASHMLA_SPARSE needs the local and gathered query heads "
            f"to pad to the same fp8 decode kernel envelope: {heads} heads per "
            f"rank pad to {pad(heads)}, the {heads * world} gathered over its "
            f"W = {world} ranks to {pad(heads * world)} (vLLM {vllm_release()}'s "
            "builder refuses it at start-up; a smaller K within its replica "
            "gathers fewer)"
        )
    return None


def _reader_refusal(group: CacheGroup, topology: Topology) -> str | None:
    """Start-up's refusal of a cache whose reader layer (an indexer cache's
    attention layer) is not the taught class, from the topology's classes."""
    if group.layer_class is None:
        return None
    classes = {
        layer: group_layer_class(g) for g in topology.groups for layer in g.layers
    }
    return reader_refusal(group.layer_class, group.layers[0], classes.get)


def group_attention(
    group: CacheGroup,
    index: int,
    spec: Any,
    topology: Topology,
    attention_backend: str | None,
) -> dict[str, Any]:
    """How the group's attention runs at start-up: the admission rule the
    runtime calls, with the group named as the runtime names KV-cache group
    ``index`` and its first layer standing for the layer class.
    ``attention_backend`` is the backend named for the group
    (``draft_backend``), applied if it is of the group's kind."""
    dcp = topology.decode_context_parallel_size
    kind = _ATTENTION_KINDS[group.kind]
    backend = None
    if group.built_backend is not None:
        # Built by vLLM's selector with the serve flags' backends already.
        backend = group.built_backend
    elif kind is not AttentionKind.NONE:
        backend = default_attention_backend(group, dcp)
        if (
            attention_backend is not None
            and is_mla_backend_name(attention_backend) == (kind is AttentionKind.MLA)
            and group.layer_class not in FIXED_BACKEND_CLASSES
        ):
            backend = attention_backend
    layer_class = group_layer_class(group)
    refusal = vllm_selector_refusal(group, index, backend, dcp)
    if refusal is not None:
        return {
            "layer_class": layer_class,
            "attention_backend": backend,
            "attention_mode": "refused",
            "attention_refusal": refusal,
        }
    k = spec.dcp_shard_count(dcp)
    sparse = flashmla_sparse_refusal(
        group, index, backend, topology, k
    ) or kernel_shape_refusal(group, index, backend, topology, k)
    if sparse is not None:
        return {
            "layer_class": layer_class,
            "attention_backend": backend,
            "attention_mode": "refused",
            "attention_refusal": sparse,
        }
    reader = _reader_refusal(group, topology)
    if reader is not None and spec.dcp_shard_count(dcp) < dcp:
        return {
            "layer_class": layer_class,
            "attention_backend": backend,
            "attention_mode": "refused",
            "attention_refusal": (
                f"{kv_cache_group_name(group.layers, index)}: {reader}"
            ),
        }
    admission = admit_attention(
        owner=kv_cache_group_name(group.layers, index),
        kind=kind,
        backend=backend,
        shard_count=spec.dcp_shard_count(dcp),
        dcp_world_size=dcp,
        default_shard_count=default_shard_count(spec, dcp),
        interleave_size=topology.interleave_size,
        layer_class=layer_class,
        layer_name=group.layers[0],
        layer_features=frozenset(group.attention_features),
    )
    return {
        "layer_class": layer_class,
        "attention_backend": backend,
        "attention_mode": admission.mode.value,
        "attention_refusal": admission.reason or None,
    }
