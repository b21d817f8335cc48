# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention layer classes: which ones the plugin taught a group's K, and how
it binds them.

A KV-cache group's attention is run by a layer class as much as by a backend:
vLLM 0.33.0's models own 23 attention layer classes or sites with DCP logic of
their own (under ``vllm/models/**`` and ``vllm/model_executor/models/**``),
some of which gate DCP on their own attribute or run their own collectives,
so binding the backend's impl alone is not enough for them. The admission rule
(``attention_admission.admit_attention``) therefore takes the layer class:

- a class in ``TAUGHT_LAYERS`` runs K = 1 (and 1 < K < D where ``partial``)
  through its ``binding``;
- any other class runs only the K its own code reads the cache with (vLLM's
  K); every other K is refused at start-up naming layer, class, backend, K
  and D. No model-owned class is admitted on the strength of its backend.

The audit of every vLLM class that reads the DCP world itself lives beside
the tooling (``vllm_dcp_geometry.tooling.docs.layer_class_audit``); a test
walks vLLM's model sources and fails on a class that is in neither table.
Pure: no vLLM import.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LAYER_CLASS_ATTR = "_vllm_dcp_geometry_layer_class"
"""Set by a model patch on the generic layer a model-owned wrapper registers
in the forward context, naming the wrapper (``module.qualname``): the class
whose code really reads that layer's cache."""


class LayerBinding(str, enum.Enum):
    """What the plugin changes on a layer of a group with K < D."""

    IMPL = "impl"
    """``layer.impl``: plain local attention for K = 1; for 1 < K < D the impl
    keeps D and its ``dcp_combine`` is replica-masked (``Attention`` reads
    only its impl's DCP world)."""

    MLA = "mla"
    """``layer.impl`` and ``layer.dcp_manager``: local for K = 1; for
    1 < K < D the decode kernel runs in the shard world ``(K, r % K)``, and
    within its replica (rule A6) the layer gets a replica DCP manager and
    its impl the world K, else the layer's D-wide combine is replica-masked
    (``MLAAttention.forward_impl`` reads its impl's DCP world)."""

    KIMI_K3_MLA = "kimi-k3-mla"
    """As ``MLA``, plus the layer's own DCP gate (``layer.dcp_world_size``,
    which decides the query all-gather, the LSE combine and the prefill
    context path): its impl's bound world (1 for K = 1, K within the
    replica, D on the D-wide group). Needs the patch
    ``patches.worker.kimi_k3_mla``, which registers the binder."""

    SPARSE_INDEXER_CACHE = "sparse-indexer-cache"
    """A DSA indexer cache read by its DeepSeek-V3.2 attention layer's
    ``sparse_attn_indexer`` call: that call takes the cache's shard world
    ``(K, r % K)`` (no merge for K = 1; duplicate replicas send no top-k
    candidates for 1 < K < D). Needs the patch
    ``patches.worker.deepseek_v32_attention``, which registers the binder
    (and checks that the cache's owner layer is that class)."""

    NONE = "none"
    """Nothing: the layer has no impl and reads only the builder's metadata,
    which the group's builder already builds in the group's world. Only
    K = 1 (a world-1 builder) is taught for such a layer."""


@dataclass(frozen=True)
class TaughtLayer:
    """A layer class the plugin taught a group's K."""

    path: str
    """``module.qualname`` of the class found in the forward context (or
    named by ``LAYER_CLASS_ATTR``)."""

    mla: bool
    """Whether its cache is an MLA cache (vLLM reads MLA caches with K = D)."""

    binding: LayerBinding
    partial: bool
    """Whether 1 < K < D is taught (K = 1 always is)."""

    why_not_partial: str = ""
    """Why 1 < K < D is refused for this class (``partial`` False)."""

    backends: frozenset[str] | None = None
    """The backends it is taught with (None: any taught backend of its
    kind); vLLM picks these layers' backends from the model, not the spec."""

    read_by: tuple[Callable[[str], str | None], str] | None = None
    """``(reader_name, class)``: the layer has no impl; the layer named
    ``reader_name(name)``, of that class, reads its cache (an indexer cache
    and its attention layer). Binding refuses any other reader."""


_GENERIC_ATTENTION = "vllm.model_executor.layers.attention.attention.Attention"
_GENERIC_MLA = "vllm.model_executor.layers.attention.mla_attention.MLAAttention"
KIMI_K3_MLA = "vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention"
FLINT_ATTENTION = "vllm.models.flint.model.FlintAttention"
DEEPSEEK_V32_ATTENTION = "vllm.models.deepseek_v32.attention.DeepseekV32Attention"
DEEPSEEK_V32_INDEXER_CACHE = (
    "vllm.model_executor.models.deepseek_v2.DeepseekV32IndexerCache"
)
SPARSE_MLA_BACKENDS = frozenset(
    {"FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE_FA4"}
)
"""The sparse MLA backends that run DCP in vLLM 0.33.0 (the taught ones)."""
DSA_INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
"""The backend of a DeepSeek-V3.2 indexer cache (the layer picks it)."""
INDEXER_CACHE_SUFFIX = ".indexer.k_cache"
LATENT_CACHE_SUFFIX = ".attn"
"""DeepSeek-V3.2 names a layer's caches from its module prefix ``P``: the
attention layer (latent cache) is ``P.attn``, its indexer cache
``P.indexer.k_cache``."""


def indexer_latent_name(name: str) -> str | None:
    """The latent cache's layer name for an indexer cache's (None: ``name``
    is not an indexer cache's)."""
    if not name.endswith(INDEXER_CACHE_SUFFIX):
        return None
    return name.removesuffix(INDEXER_CACHE_SUFFIX) + LATENT_CACHE_SUFFIX


_NO_IMPL_PARTIAL = (
    "the layer has no attention impl: it reads the builder's lengths and block "
    "table with its own kernel, which knows no shard world or combine"
)

TAUGHT_LAYERS: dict[str, TaughtLayer] = {
    layer.path: layer
    for layer in (
        TaughtLayer(_GENERIC_ATTENTION, False, LayerBinding.IMPL, True),
        TaughtLayer(_GENERIC_MLA, True, LayerBinding.MLA, True),
        # Target, KimiK3MTP and the DSpark draft (K3DSparkDecoderLayer).
        TaughtLayer(KIMI_K3_MLA, True, LayerBinding.KIMI_K3_MLA, True),
        # DeepSeek-V3.2, GLM-5 (GlmMoeDsa) and their MTP layers on CUDA: the
        # sparse latent cache (gather and combine gated on the impl) and its
        # indexer cache, read by the layer's indexer call.
        TaughtLayer(
            DEEPSEEK_V32_ATTENTION,
            True,
            LayerBinding.MLA,
            True,
            backends=SPARSE_MLA_BACKENDS,
        ),
        TaughtLayer(
            DEEPSEEK_V32_INDEXER_CACHE,
            True,
            LayerBinding.SPARSE_INDEXER_CACHE,
            True,
            backends=frozenset({DSA_INDEXER_BACKEND}),
            read_by=(indexer_latent_name, DEEPSEEK_V32_ATTENTION),
        ),
        TaughtLayer(
            FLINT_ATTENTION,
            False,
            LayerBinding.IMPL,
            False,
            "Flint's low-latency decode bypasses the impl and asserts that the "
            "FlashInfer decode has no DCP query layout, which a sharded builder "
            "gives it",
        ),
        TaughtLayer(
            "vllm.models.inkling.nvidia.attention.InklingAttention",
            False,
            LayerBinding.NONE,
            False,
            _NO_IMPL_PARTIAL,
        ),
        TaughtLayer(
            "vllm.models.inkling.amd.attention.InklingAttention",
            False,
            LayerBinding.NONE,
            False,
            _NO_IMPL_PARTIAL,
        ),
    )
}
"""Every layer class the plugin taught, by ``module.qualname``."""

GENERIC_LAYERS = {False: _GENERIC_ATTENTION, True: _GENERIC_MLA}
"""The class a group without a named layer class stands for (``plan`` on a
topology that names none), by ``mla``."""

SPECIALIZED_DECODE_LAYERS = frozenset({KIMI_K3_MLA})
"""Classes whose model may hand decode to Kimi-K3's specialized decode
(``additional_config={"decode_backend": "latency_specialized"}``), which runs
its own DCP mailboxes on the global D and bypasses the impl."""


def taught_layer(path: str | None, mla: bool) -> TaughtLayer | None:
    """The taught entry for ``path`` (the generic class where None), or None
    where the class is not taught for a cache of this kind."""
    taught = TAUGHT_LAYERS.get(GENERIC_LAYERS[mla] if path is None else path)
    if taught is None or taught.mla != mla:
        return None
    return taught


def reader_refusal(
    layer_class: str, name: str, find_class: Callable[[str], str | None]
) -> str | None:
    """Why a layer of ``layer_class`` named ``name``, whose cache another
    layer reads (``TaughtLayer.read_by``), cannot be bound; None where it
    can (or the class has no such reader). ``find_class(reader_name)`` is
    the reader's class, None where there is no such layer."""
    taught = TAUGHT_LAYERS.get(layer_class)
    if taught is None or taught.read_by is None:
        return None
    reader_of, reader_class = taught.read_by
    reader_name = reader_of(name) or "(no reader name)"
    found = find_class(reader_name) or "not in the model"
    if found == reader_class:
        return None
    return (
        f"layer {name} ({taught.path}) is read by {reader_name} ({found}), not "
        f"a {reader_class}, the only reader taught this cache's K; use K=D for it"
    )


def layer_class_path(layer: Any) -> str:
    """The class whose code reads ``layer``'s cache: the model-owned wrapper
    a model patch named on it, else the layer's own class."""
    named = getattr(layer, LAYER_CLASS_ATTR, None)
    if isinstance(named, str):
        return named
    cls = type(layer)
    return f"{cls.__module__}.{cls.__qualname__}"


# Binders registered by model patches ------------------------------------------------

LayerBinder = Callable[[Any, Any, str], None]
"""``binder(layer, geometry, layer_name)``: bind one layer of a group."""

LAYER_BINDERS: dict[LayerBinding, tuple[str, LayerBinder]] = {}
"""Binders that live in a model patch, by binding: (patch module, binder).
A model patch adds its entry in ``apply()`` (undone with it)."""

BINDING_PATCHES = {
    LayerBinding.KIMI_K3_MLA: "patches.worker.kimi_k3_mla",
    LayerBinding.SPARSE_INDEXER_CACHE: "patches.worker.deepseek_v32_attention",
}
"""The patch that must have registered each such binding's binder."""
