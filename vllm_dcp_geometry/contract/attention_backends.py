# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention backends: which ones the plugin taught a group's K, and what
each one's DCP path cannot do.

``TAUGHT_BACKENDS`` names, by vLLM backend name, every backend whose builder
the plugin taught a group's shard count K (and the patch that teaches it);
``LOCAL_ONLY_BUILDERS`` the builder classes taught K = 1 only. Any other
backend runs only the K vLLM 0.33.0 itself reads the cache with
(``vllm_shard_count``). ``DCP_DROPPED_FEATURES`` and
``INTERLEAVE_ONE_ONLY_BACKENDS`` record what a backend's DCP path drops or
refuses whatever the plugin does. The admission rule
(``attention_admission.admit_attention``) decides from these. Pure: no vLLM
import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
)


class AttentionKind(str, enum.Enum):
    """What a group's spec asks of attention."""

    ATTENTION = "attention"
    """Token-slot attention whose builder (FlashAttention, FlashInfer) takes
    the DCP world from the spec's ``dcp_sharded``."""

    MLA = "mla"
    """Multi-head latent attention (``MLAAttentionSpec`` and subclasses, the
    sparse indexer's cache too): vLLM 0.33.0's MLA builders and impls take D
    from the DCP group, never from the spec, so vLLM reads every MLA cache
    with K = D whatever ``dcp_sharded`` says."""

    NONE = "none"
    """No attention reads the cache (recurrent state)."""


@dataclass(frozen=True)
class TaughtBackend:
    """A backend whose builder (this exact class) the plugin taught a
    group's K: it runs K = 1 locally and 1 < K < D exactly."""

    kind: AttentionKind
    builder: str
    """``module.qualname`` of the builder class the patches act on."""
    patch: str
    """The patch module (under ``vllm_dcp_geometry.patches``) that teaches
    the builder; where it is not applied, start-up refuses the backend's
    K < D naming it."""

    layers: frozenset[str] | None = None
    """The layer classes it is taught for (None: every taught class of its
    kind). The sparse backends' top-k comes from their layer's indexer call,
    which only the taught DeepSeek-V3.2 layer hands the group's K."""


_BACKENDS = "vllm.v1.attention.backends."
_MLA_PATCH = "worker.mla_attention"
_SPARSE_PATCH = "worker.sparse_mla_attention"
_SPARSE_LAYERS = frozenset({DEEPSEEK_V32_ATTENTION})


def collectives_within_replica(backend: str | None) -> bool:
    """Rule A6 for a backend name: its partial groups collective within
    their replica where the operator keeps the default
    ``partial_collectives``. Every taught backend's patch binds the replica
    group (FlashAttention and FlashInfer bind the impls' forward to it, the
    MLA ones their layers' DCP managers); an untaught backend runs only
    vLLM's own K, never a partial group."""
    return (backend or "") in TAUGHT_BACKENDS


TAUGHT_BACKENDS: dict[str, TaughtBackend] = {
    "FLASH_ATTN": TaughtBackend(
        AttentionKind.ATTENTION,
        _BACKENDS + "flash_attn.FlashAttentionMetadataBuilder",
        "worker.flash_attn",
    ),
    "FLASHINFER": TaughtBackend(
        AttentionKind.ATTENTION,
        _BACKENDS + "flashinfer.FlashInferMetadataBuilder",
        "worker.flashinfer",
    ),
    "FLASHMLA": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.flashmla.FlashMLAMetadataBuilder",
        _MLA_PATCH,
    ),
    "FLASH_ATTN_MLA": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.flashattn_mla.FlashAttnMLAMetadataBuilder",
        _MLA_PATCH,
    ),
    "FLASHINFER_MLA": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.flashinfer_mla.FlashInferMLAMetadataBuilder",
        _MLA_PATCH,
    ),
    "CUTLASS_MLA": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.cutlass_mla.CutlassMLAMetadataBuilder",
        _MLA_PATCH,
    ),
    "TRITON_MLA": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.triton_mla.TritonMLAMetadataBuilder",
        _MLA_PATCH,
    ),
    "FLASHMLA_SPARSE": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.flashmla_sparse.FlashMLASparseMetadataBuilder",
        "worker.flashmla_sparse",
        _SPARSE_LAYERS,
    ),
    "FLASHINFER_MLA_SPARSE": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS
        + "mla.flashinfer_mla_sparse.FlashInferMLASparseTRTLLMMetadataBuilder",
        _SPARSE_PATCH,
        _SPARSE_LAYERS,
    ),
    "FLASH_ATTN_MLA_SPARSE_FA4": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.flashattn_mla_sparse.FlashAttnMLASparseFA4MetadataBuilder",
        _SPARSE_PATCH,
        _SPARSE_LAYERS,
    ),
    "DEEPSEEK_V32_INDEXER": TaughtBackend(
        AttentionKind.MLA,
        _BACKENDS + "mla.indexer.DeepseekV32IndexerMetadataBuilder",
        "worker.mla_indexer",
        frozenset({DEEPSEEK_V32_INDEXER_CACHE}),
    ),
}
"""Every backend the plugin taught a group's K, by vLLM backend name. Any
other backend runs only the K vLLM itself reads the cache with."""


def taught_backend_name(builder_path: str) -> str | None:
    """The taught backend whose builder is exactly ``builder_path``."""
    for name, taught in TAUGHT_BACKENDS.items():
        if taught.builder == builder_path:
            return name
    return None


_DOTS3_SLIDING_BUILDER = (
    "vllm.models.dots3_note.nvidia.attention.Dots3NoteMLAMetadataBuilder"
)
LOCAL_ONLY_BUILDERS: dict[str, TaughtBackend] = {
    # Dots3 NOTE's sliding-window MLA builder (a TritonMLAMetadataBuilder)
    # raises for prefills whenever its own DCP world is > 1; built in the
    # world (1, 0) of a replicated group it is TRITON_MLA's DCP1 builder.
    _DOTS3_SLIDING_BUILDER: TaughtBackend(
        AttentionKind.MLA, _DOTS3_SLIDING_BUILDER, _MLA_PATCH
    ),
}
"""Builder classes (subclasses of a taught builder) taught K = 1 only, by
``module.qualname``; a backend label may name one in parentheses."""


@dataclass(frozen=True)
class RefusedBackend:
    """A backend or builder the plugin knows it cannot teach: only vLLM's own
    K runs on it, and the refusal says which it is and why."""

    label: str
    why: str


REFUSED_BACKENDS: dict[str, RefusedBackend] = {
    # vLLM 0.34.0.
    "KIMI_K3_KV_BALANCED_MLA": RefusedBackend(
        "Kimi-K3's KV-balanced MLA backend",
        "its decode sizes its heads as num_heads * D from the parallel config "
        "at construction and reads the impl's DCP world and dcp_tot_seq_lens "
        "every step; the plugin binds neither",
    ),
    "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerMetadataBuilder": (
        RefusedBackend(
            "Kimi-K3.1's DSA indexer builder",
            "a subclass of DEEPSEEK_V32_INDEXER's, it writes the indexer's slots "
            "from the block table with its own DCP world "
            "(get_compressed_slot_mapping), which the plugin does not bind",
        )
    ),
    "FLASHINFER_TS": RefusedBackend(
        "FlashInfer TS",
        "it declares no DCP support, so vLLM itself refuses it under DCP",
    ),
    "vllm.model_executor.layers.dash_attention.DASHAttentionMetadataBuilder": (
        RefusedBackend(
            "DASHAttention's TRITON_ATTN builder",
            "TRITON_ATTN has no DCP path, so vLLM itself refuses it under DCP",
        )
    ),
}
"""Backends (by name) and builders (by ``module.qualname``) refused by name
for every K but vLLM's own; a backend label names a builder in parentheses
(``worker_admission.backend_label``)."""


def refused_backend(backend: str) -> RefusedBackend | None:
    """The named refusal of ``backend`` (a label: a name, a builder path, or
    ``NAME (builder path)``), if any."""
    name = backend.partition(" (")[0]
    for key, refused in REFUSED_BACKENDS.items():
        if key in (backend, name) or backend.endswith(f"({key})"):
            return refused
    return None


def teaching_patch(backend: str) -> str | None:
    """The patch that teaches ``backend`` (a label) a group's K, if any."""
    taught = TAUGHT_BACKENDS.get(backend)
    if taught is not None:
        return taught.patch
    local_only = local_only_builder(backend)
    return None if local_only is None else LOCAL_ONLY_BUILDERS[local_only].patch


def local_only_builder(backend: str) -> str | None:
    """The local-only builder ``backend`` (a label) names, if any."""
    for path in LOCAL_ONLY_BUILDERS:
        if backend == path or backend.endswith(f"({path})"):
            return path
    return None


ATTENTION_FEATURES = {
    "sinks": "attention sinks (s_aux)",
    "rswa_mask": "the R-SWA mask_mod",
    "mm_prefix_mask": "the multimodal-prefix mask_mod",
}
"""Attention features a layer may use that a backend's DCP path can drop,
by the name topologies use (``attention_features``)."""

DCP_DROPPED_FEATURES: dict[str, frozenset[str]] = {
    # FlashAttentionImpl._forward_with_dcp passes no mask_mod to its kernels
    # (it keeps ALiBi, the sliding window and the soft-cap; the plugin folds
    # sinks into it, rule A7); K = 1 runs the single-device path, which
    # passes them.
    "FLASH_ATTN": frozenset({"rswa_mask", "mm_prefix_mask"}),
    # FlashInfer's DCP prefill wrapper raises on sinks at the first step, and
    # its TRTLLM decode hands the sinks to every rank's partial attention, so
    # the combine counts them once per rank.
    "FLASHINFER": frozenset({"sinks"}),
}
"""Features each backend's DCP attention path (every K > 1, K = D included)
does not keep, with the plugin installed; vLLM's dense MLA has none of them."""


INTERLEAVE_ONE_ONLY_BACKENDS = frozenset({"FLASHINFER_MLA"})
"""Backends whose builder refuses ``cp_kv_cache_interleave_size != 1``
whenever DCP is on (it reads the parallel config, not the group)."""


def vllm_shard_count(
    kind: AttentionKind, dcp_world_size: int, default_shard_count: int
) -> int:
    """The K vLLM's own attention code reads a group's cache with. MLA reads
    D on 0.33.0 and 0.34.0 alike: 0.34.0's metadata builder takes world 1 for
    a ``dcp_sharded=False`` spec, but the impl and layer, built before specs
    exist, keep D (a draft built at DCP 1 has impl world 1, which admission
    checks apart)."""
    if kind is AttentionKind.MLA:
        return dcp_world_size
    return default_shard_count


def is_mla_backend_name(backend: str) -> bool:
    """vLLM 0.33.0 names every MLA member of ``AttentionBackendEnum`` (dense
    and sparse) with ``MLA`` in it; the CLI uses this where a backend cannot
    be imported without a GPU (a test checks it against every importable
    backend)."""
    return "MLA" in backend


def backend_is_taught(kind: AttentionKind, backend: str, shard_count: int) -> bool:
    """Whether the plugin taught ``backend`` (a label) ``shard_count`` for a
    cache of ``kind``: a taught backend of that kind, or a local-only builder
    of that kind for K = 1."""
    taught = TAUGHT_BACKENDS.get(backend)
    if taught is not None:
        return taught.kind is kind
    local_only = local_only_builder(backend)
    return (
        local_only is not None
        and LOCAL_ONLY_BUILDERS[local_only].kind is kind
        and shard_count == 1
    )


def backend_layer_classes(backend: str) -> frozenset[str] | None:
    """The layer classes ``backend`` is taught for (None: every taught class
    of its kind, or not a taught backend)."""
    taught = TAUGHT_BACKENDS.get(backend)
    return None if taught is None else taught.layers


def is_sparse_backend_name(backend: str) -> bool:
    """Sparse MLA backends and indexer caches (vLLM 0.33.0's names)."""
    return "SPARSE" in backend or "INDEXER" in backend
