# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How each group's attention runs at start-up, for ``plan``.

The backend vLLM 0.33.0 picks for a group on SM90 (or ``--attention-backend``
for the groups of its kind), the layer class that reads its cache, vLLM's own
selector refusal (which no K changes), and the plugin's admission rule, the
same one start-up applies (``attention_admission.admit_attention``).
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
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError

DEFAULT_ATTENTION_BACKENDS = {
    "mla": "FLASH_ATTN_MLA",
    "full_attention": "FLASH_ATTN",
    "sliding_window": "FLASH_ATTN",
}
"""What vLLM 0.33.0 picks first for a group's kind on a Hopper (SM90) GPU
(``vllm.platforms.cuda``'s backend priorities). ``--attention-backend NAME``
replaces it for the groups of NAME's kind (MLA backends for MLA groups)."""

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

NON_CAUSAL_DCP_MLA_BACKEND = "FLASHINFER_MLA"
"""What vLLM 0.33.0 picks on SM90 for an MLA layer with non-causal
multi-token decode (a DSpark draft) under DCP: its selector keeps only
builders with ``supports_non_causal_multi_token_dcp``, whatever the group's
K (the selector runs with the model, before any spec is known)."""

NON_CAUSAL_DCP_MLA_BACKENDS = frozenset(
    {"FLASHINFER_MLA", "TOKENSPEED_MLA", "ROCM_AITER_MLA", "ROCM_AITER_TRITON_MLA"}
)
"""MLA backends whose builder has ``supports_non_causal_multi_token_dcp``
(a test checks the list against vLLM's importable backends)."""

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
    ``index`` and its first layer standing for the layer class."""
    dcp = topology.decode_context_parallel_size
    kind = _ATTENTION_KINDS[group.kind]
    backend = None
    if kind is not AttentionKind.NONE:
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
