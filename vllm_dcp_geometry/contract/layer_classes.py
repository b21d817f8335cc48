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
  A class in ``REFUSED_LAYERS`` (vLLM 0.34.0's Kimi-K3.1 DSA, Mistral
  Large 4, ...) is refused so too, with its model and why the plugin cannot
  bind it in the message.

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


# Refused by name (vLLM 0.34.0) ------------------------------------------------------

KIMI_K3_DSA_ATTENTION = "vllm.models.kimi_k3.nvidia.dsa.KimiK3DSAAttention"
KIMI_K3_DSA_INDEXER = "vllm.models.kimi_k3.nvidia.dsa.KimiK3DSAIndexer"
KIMI_K3_INDEXER_CACHE = "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerCache"
MISTRAL_MLA = "vllm.models.mistral.nvidia.attention._MistralMLA"
MISTRAL_INDEXER_CACHE = "vllm.models.mistral.nvidia.indexer.MistralIndexerCache"
GLM5NEXT_INDEXER_CACHE = "vllm.models.glm5next.common.attention.Glm5NextIndexerCache"

INDEXER_OWNERS: dict[str, str] = {KIMI_K3_DSA_INDEXER: KIMI_K3_DSA_ATTENTION}
"""Model-owned wrappers that build a generic sparse ``MLAAttention`` (the
layer in the forward context) around their own indexer, by the indexer's
``module.qualname``: the wrapper's code reads that cache too, so admission
and binding see the wrapper, not the generic class the plugin taught."""


@dataclass(frozen=True)
class RefusedLayer:
    """A model-owned class the plugin knows it cannot bind: only vLLM's own K
    runs, and the refusal names the model and the reason."""

    label: str
    """The model's and the layer's name, e.g. ``Kimi-K3.1's DSA attention``."""
    why: str
    """What in its code reads the DCP world that the plugin does not bind."""

    def describe(self, path: str) -> str:
        """``LABEL (ClassName)``, as the refusal names it."""
        return f"{self.label} ({path.rpartition('.')[2]})"


_K3_DSA_WHY = (
    "its indexer (KimiK3DSAIndexer) takes D from the parallel config and its "
    "rank from the DCP group at construction, hands them to the "
    "sparse_attn_indexer op and merges top-k candidates over all D ranks "
    "(init_dcp_topk_merge), and its latent is a generic sparse MLAAttention "
    "whose builder reads the DCP group's world; the plugin has no binder for "
    "the indexer's construction-time (D, r) or its merge"
)
_INDEXER_AT_CONSTRUCTION = (
    "its indexer op fixes D and the rank at construction, and no binder hands "
    "it the cache's shard world"
)
REFUSED_LAYERS: dict[str, RefusedLayer] = {
    KIMI_K3_DSA_ATTENTION: RefusedLayer("Kimi-K3.1's DSA attention", _K3_DSA_WHY),
    KIMI_K3_INDEXER_CACHE: RefusedLayer(
        "Kimi-K3.1's DSA indexer cache",
        "read by KimiK3DSAIndexer with its construction-time (D, r), and its "
        "builder (KimiK3IndexerMetadataBuilder) writes the indexer's slots from "
        "the block table with the builder's own DCP world",
    ),
    MISTRAL_MLA: RefusedLayer(
        "Mistral Large 4's MLA",
        "its layer gathers the query before forward (prepare_mqa_query) and "
        "defaults to the a2a up-projection, whose W_UV is gathered over all D "
        "ranks at load; the plugin binds neither",
    ),
    MISTRAL_INDEXER_CACHE: RefusedLayer(
        "Mistral Large 4's indexer cache",
        f"read by its SparseAttnIndexer: {_INDEXER_AT_CONSTRUCTION}, and with the "
        "model's a2a default it may rendezvous a D-rank direct top-k workspace",
    ),
    GLM5NEXT_INDEXER_CACHE: RefusedLayer(
        "GLM-5.3-Flash's kpool indexer cache",
        f"read by SparseAttnIndexerKpool: {_INDEXER_AT_CONSTRUCTION}",
    ),
    "vllm.models.minimax_m3.nvidia.model.MiniMaxM3SparseAttention": RefusedLayer(
        "MiniMax-M3's sparse attention",
        "it runs its own sparse backends, which the plugin does not teach",
    ),
    "vllm.models.minimax_m3.amd.model.MiniMaxM3SparseAttention": RefusedLayer(
        "MiniMax-M3's sparse attention (ROCm)",
        "it runs its own sparse backends, which the plugin does not teach",
    ),
    "vllm.models.minimax_m3.common.indexer.MiniMaxM3IndexerCache": RefusedLayer(
        "MiniMax-M3's indexer cache",
        "read by its own indexer backend, which the plugin does not teach",
    ),
}
"""Model-owned classes refused by name for every K but vLLM's own, by
``module.qualname``: the start-up error and ``plan`` say which model's layer
it is and why (fail closed; teaching one needs a binder for every DCP read
named here)."""


def refused_layer(path: str | None) -> RefusedLayer | None:
    """The named refusal of ``path``, if it is one of ``REFUSED_LAYERS``."""
    return None if path is None else REFUSED_LAYERS.get(path)


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


def _path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def layer_class_path(layer: Any) -> str:
    """The class whose code reads ``layer``'s cache: the model-owned wrapper
    a model patch named on it, else the wrapper its indexer's class gives
    away (``INDEXER_OWNERS``), else the layer's own class."""
    named = getattr(layer, LAYER_CLASS_ATTR, None)
    if isinstance(named, str):
        return named
    # The generic MLA layer keeps the indexer a wrapper hands it (None for a
    # dense layer); its class names the wrapper without a model patch.
    indexer = getattr(layer, "indexer", None)
    if indexer is not None:
        owner = INDEXER_OWNERS.get(_path(indexer))
        if owner is not None:
            return owner
    return _path(layer)


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
