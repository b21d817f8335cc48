# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The audit of vLLM's model-owned attention classes, per supported release:
every class whose source reads the DCP world itself, with what the plugin
does about it.

Documentation and tests read it (``tests/test_layer_classes.py`` walks the
installed vLLM's model sources and fails on a class in neither this
release's audit (``audited_classes``) nor
``contract.layer_classes.TAUGHT_LAYERS``, and on an entry of this release
that vLLM does not define); the runtime never does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    FLINT_ATTENTION,
    GLM5NEXT_INDEXER_CACHE,
    KIMI_K3_DSA_ATTENTION,
    KIMI_K3_DSA_INDEXER,
    KIMI_K3_INDEXER_CACHE,
    KIMI_K3_MLA,
    MISTRAL_INDEXER_CACHE,
    MISTRAL_MLA,
)


class Disposition(str, enum.Enum):
    TAUGHT = "taught"
    """In ``TAUGHT_LAYERS``: bound per the group's K."""

    GENERIC = "generic underneath"
    """Wraps a generic ``Attention``/``MLAAttention`` (the class the plugin
    binds); its own DCP read is the one in ``note``."""

    REFUSED = "refused"
    """Not taught: only vLLM's own K runs; the plugin refuses every other K
    (by name where it is in ``layer_classes.REFUSED_LAYERS``)."""

    VLLM_REFUSES = "refused by vLLM"
    """vLLM itself refuses DCP for it at start-up."""

    NOT_A_LAYER = "not a layer"
    """A helper (builder, impl, indexer op, config) of a layer listed here."""


ALL_RELEASES = frozenset(SUPPORTED_VLLM_RELEASES)
ONLY_033 = frozenset({"0.33.0"})
ONLY_034 = frozenset({"0.34.0"})


@dataclass(frozen=True)
class AuditedClass:
    path: str
    disposition: Disposition
    note: str
    releases: frozenset[str] = ALL_RELEASES
    """The supported vLLM releases whose class (of this name) reads the DCP
    world or is refused by name; the audit of each release is checked
    against that release's sources."""


_A = AuditedClass
_D = Disposition
_K3 = "vllm.models.kimi_k3."
_K3_SPECIALIZED_DSA = (
    "Kimi-K3.1 specialized decode of DSA layers, which are refused below D"
)
_K3_TOPK_MERGE = "Kimi-K3.1 DSA's top-k merge over D; its layers are refused below D"
_NEW_IN_034 = (
    _A(
        "vllm.model_executor.models.config.UnlimitedOCRForCausalLMConfig",
        _D.VLLM_REFUSES,
        "its config verifier refuses context parallelism (DCP != 1)",
        ONLY_034,
    ),
    _A(
        "vllm.models.beam.amd.attention.BeamAttention",
        _D.GENERIC,
        "ROCm, as on NVIDIA: reads attn.impl.dcp_world_size once to enable a "
        "fused KV insert (performance only)",
        ONLY_034,
    ),
    _A(
        "vllm.models.beam.amd.dflash2.DFlash2BeamAttention",
        _D.GENERIC,
        "ROCm: reads attn.impl.dcp_world_size once to enable a fused KV insert "
        "(performance only)",
        ONLY_034,
    ),
    _A(
        _K3 + "amd.specialized_decode.runtime.decode.SpecializedDecode",
        _D.NOT_A_LAYER,
        "Kimi-K3 ROCm specialized decode (DCP8): needs the DCP group to be the "
        "TP group; ROCm MLA backends are not taught, so its groups run only D",
        ONLY_034,
    ),
    _A(
        _K3 + "amd.specialized_decode.runtime.runner.MonoRunner",
        _D.NOT_A_LAYER,
        "Kimi-K3 ROCm specialized decode: D from the DCP group; ROCm MLA "
        "backends are not taught, so its groups run only D",
        ONLY_034,
    ),
    _A(
        _K3 + "common.dsa_cache.KimiK3IndexerMetadataBuilder",
        _D.NOT_A_LAYER,
        "builder of KimiK3IndexerCache: writes indexer slots with its own DCP "
        "world; refused by name (attention_backends.REFUSED_BACKENDS)",
        ONLY_034,
    ),
    _A(
        KIMI_K3_DSA_INDEXER,
        _D.NOT_A_LAYER,
        "KimiK3DSAAttention's indexer: D from the config, r from the DCP group "
        "at construction, top-k merged over D (init_dcp_topk_merge)",
        ONLY_034,
    ),
    _A(
        _K3 + "nvidia.kv_balanced_mla.decode.KvBalancedDecode",
        _D.NOT_A_LAYER,
        "decode of KIMI_K3_KV_BALANCED_MLA (heads * D from the config, the "
        "impl's world): refused by name (attention_backends.REFUSED_BACKENDS)",
        ONLY_034,
    ),
    _A(
        _K3 + "nvidia.model.KimiLinearModel",
        _D.NOT_A_LAYER,
        "model-level DSA top-k buffer with D - 1 rows of slack; its DSA layers "
        "are refused below D",
        ONLY_034,
    ),
    *(
        _A(
            _K3 + "nvidia.ops.dcp_topk_merge.kernels." + n,
            _D.NOT_A_LAYER,
            _K3_TOPK_MERGE,
            ONLY_034,
        )
        for n in ("DCPTopkRescueKernel", "DCPTopkSelectKernel", "_RowsOutput")
    ),
    *(
        _A(
            _K3 + "nvidia.specialized_decode.cutedsl.dsa." + n,
            _D.NOT_A_LAYER,
            _K3_SPECIALIZED_DSA,
            ONLY_034,
        )
        for n in (
            "attn_fi.FlashInferCore",
            "indexer.FusedIndexer",
            "indexer_stage.IndexerStage",
            "prepared.PreparedDsa",
        )
    ),
    _A(
        _K3 + "nvidia.specialized_decode.cutedsl.mla.dcp.DcpValue",
        _D.NOT_A_LAYER,
        "Kimi-K3 specialized decode: K < D refused on its groups",
        ONLY_034,
    ),
    _A(
        _K3 + "nvidia.specialized_decode.drafter.attention.DraftDcp",
        _D.NOT_A_LAYER,
        "Kimi-K3 specialized decode's drafter: built at load from the draft "
        "layer's D on the DCP group; K < D refused on Kimi-K3 MLA groups under "
        "specialized decode",
        ONLY_034,
    ),
    _A(
        "vllm.models.mistral.mistral_large4.amd.specialized_decode.mono.op."
        "Ml4MonoKernel",
        _D.NOT_A_LAYER,
        "Mistral Large 4 ROCm specialized decode (DCP in {1, all ranks}); the "
        "model's layers are refused below D",
        ONLY_034,
    ),
    _A(
        "vllm.models.mistral.mistral_large4.amd.specialized_decode.runtime.spec."
        "DecodeConfig",
        _D.VLLM_REFUSES,
        "Mistral Large 4 ROCm specialized decode lists DCP != 1 as unsupported",
        ONLY_034,
    ),
)
_NAMED_REFUSALS = (
    _A(
        KIMI_K3_DSA_ATTENTION,
        _D.REFUSED,
        "Kimi-K3.1 DSA: indexer (D, r) fixed at construction, top-k merge over "
        "D; found on its generic sparse MLAAttention by its indexer "
        "(layer_classes.INDEXER_OWNERS); refused by name below D",
        ONLY_034,
    ),
    _A(
        KIMI_K3_INDEXER_CACHE,
        _D.REFUSED,
        "Kimi-K3.1's DSA indexer cache (KimiK3IndexerBackend): refused by name below D",
        ONLY_034,
    ),
    _A(
        MISTRAL_MLA,
        _D.REFUSED,
        "Mistral Large 4's MLA (prepare_mqa_query, a2a up-projection by "
        "default): refused by name below D",
        ONLY_034,
    ),
    _A(
        MISTRAL_INDEXER_CACHE,
        _D.REFUSED,
        "Mistral Large 4's indexer cache (its SparseAttnIndexer fixes D and r "
        "at construction): refused by name below D",
        ONLY_034,
    ),
    _A(
        "vllm.model_executor.layers.dash_attention.DASHAttention",
        _D.VLLM_REFUSES,
        "a TRITON_ATTN-based layer with no DCP path; its builder is refused by "
        "name (attention_backends.REFUSED_BACKENDS)",
        ONLY_034,
    ),
    _A(
        GLM5NEXT_INDEXER_CACHE,
        _D.REFUSED,
        "GLM-5.3-Flash's kpool indexer cache (SparseAttnIndexerKpool fixes D "
        "and r at construction): refused by name below D",
    ),
    _A(
        "vllm.models.minimax_m3.nvidia.model.MiniMaxM3SparseAttention",
        _D.REFUSED,
        "its own sparse backends: refused by name below vLLM's K",
    ),
    _A(
        "vllm.models.minimax_m3.amd.model.MiniMaxM3SparseAttention",
        _D.REFUSED,
        "its own sparse backends: refused by name below vLLM's K",
    ),
    _A(
        "vllm.models.minimax_m3.common.indexer.MiniMaxM3IndexerCache",
        _D.REFUSED,
        "its own indexer backend: refused by name below vLLM's K",
    ),
)
AUDITED_CLASSES: dict[str, AuditedClass] = {
    entry.path: entry
    for entry in (
        _A(
            "vllm.models.beam.nvidia.attention.BeamAttention",
            _D.GENERIC,
            "reads attn.impl.dcp_world_size once to enable a fused KV insert; "
            "it stays off for K = 1 groups (performance only)",
        ),
        _A(
            "vllm.models.beam.nvidia.dflash2.DFlash2BeamAttention",
            _D.GENERIC,
            "asserts impl.dcp_world_size == 1: Model Runner V2 builds the draft "
            "at DCP 1 (K = 1); 'sharded' on it is refused (impl world != D)",
        ),
        _A(
            "vllm.models.beam.nvidia.dflash2.DFlash2BeamModel",
            _D.NOT_A_LAYER,
            "the DFlash2BeamAttention model; same impl-world assertion",
        ),
        _A(
            DEEPSEEK_V32_ATTENTION,
            _D.TAUGHT,
            "sparse MLA with its indexer: its indexer call takes D and r from "
            "the parallel config and DCP manager; the deepseek_v32_attention "
            "patch hands it the indexer cache's (K, r % K)",
        ),
        _A(
            "vllm.models.deepseek_v41.nvidia.model.DeepseekV4Model",
            _D.VLLM_REFUSES,
            "requires DCP = 1 for PCP and specialized decode; its SWA caches "
            "assert under DCP",
        ),
        _A(
            "vllm.models.dots3_note.nvidia.attention.Dots3NoteMLAMetadataBuilder",
            _D.NOT_A_LAYER,
            "builder of Dots3NoteSlidingAttention: taught for K = 1 only "
            "(attention_backends.LOCAL_ONLY_BUILDERS)",
        ),
        _A(
            "vllm.models.dots3_note.nvidia.model.Dots3NoteSlidingAttention",
            _D.GENERIC,
            "MLAAttention over Dots3NoteMLAMetadataBuilder, which raises for "
            "prefills in a DCP world: K = 1 runs it in world 1",
        ),
        _A(
            FLINT_ATTENTION,
            _D.TAUGHT,
            "K = 1 only: its fast decode asserts on DCP decode metadata",
        ),
        _A(
            "vllm.models.glm5next.amd.sparse_indexer.SparseAttnIndexerKpool",
            _D.VLLM_REFUSES,
            "raises under DCP on ROCm",
        ),
        _A(
            "vllm.models.glm5next.nvidia.sparse_indexer.SparseAttnIndexerKpool",
            _D.NOT_A_LAYER,
            "the GLM-5.3-Flash indexer op: D and r fixed at construction; its "
            "cache is an MLA indexer cache, refused for K < D",
        ),
        _A(
            "vllm.models.kimi_k3.amd.mla.KimiK3MultiHeadLatentAttentionWrapper",
            _D.GENERIC,
            "reads impl.dcp_world_size once for its fused Q-prep (stays off "
            "for K = 1: performance only)",
        ),
        _A(KIMI_K3_MLA, _D.TAUGHT, "K = 1 local, 1 < K < D exact"),
        _A(
            "vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.mla.dcp.DcpBox",
            _D.NOT_A_LAYER,
            "Kimi-K3 specialized decode: K < D refused on its groups",
        ),
        _A(
            "vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.mla.prepared."
            "PreparedMla",
            _D.NOT_A_LAYER,
            "Kimi-K3 specialized decode: K < D refused on its groups",
        ),
        _A(
            "vllm.models.kimi_k3.nvidia.specialized_decode.cutedsl.mla.query.MlaQuery",
            _D.NOT_A_LAYER,
            "Kimi-K3 specialized decode: K < D refused on its groups",
        ),
        _A(
            "vllm.models.kimi_k3.nvidia.specialized_decode.runtime.providers.Attention",
            _D.NOT_A_LAYER,
            "Kimi-K3 specialized decode: K < D refused on its groups",
        ),
        _A(
            "vllm.models.minimax_m3.amd.specialized_decode.runtime.spec.DecodeConfig",
            _D.VLLM_REFUSES,
            "MiniMax-M3 specialized decode refuses DCP",
        ),
        _A(
            "vllm.models.qwen4_exp.amd.qsa.Qwen4ExpQSAFlashAttentionImpl",
            _D.VLLM_REFUSES,
            "NotImplementedError under DCP at model construction",
            ONLY_033,
        ),
        _A(
            "vllm.models.qwen4_exp.amd.qsa.Qwen4ExpQSAImpl",
            _D.VLLM_REFUSES,
            "0.34.0's name of Qwen4ExpQSAFlashAttentionImpl: NotImplementedError "
            "under DCP",
            ONLY_034,
        ),
        _A(
            "vllm.models.qwen4_exp.amd.qsa.Qwen4ExpQSAAttention",
            _D.VLLM_REFUSES,
            "NotImplementedError under DCP at model construction",
        ),
        _A(
            "vllm.models.qwen4_exp.nvidia.qsa.Qwen4ExpQSAFlashAttentionImpl",
            _D.VLLM_REFUSES,
            "NotImplementedError under DCP at model construction",
            ONLY_033,
        ),
        _A(
            "vllm.models.qwen4_exp.nvidia.qsa.Qwen4ExpQSAImpl",
            _D.VLLM_REFUSES,
            "0.34.0's name of Qwen4ExpQSAFlashAttentionImpl: NotImplementedError "
            "under DCP",
            ONLY_034,
        ),
        _A(
            "vllm.models.qwen4_exp.nvidia.qsa.Qwen4ExpQSAAttention",
            _D.VLLM_REFUSES,
            "NotImplementedError under DCP at model construction",
        ),
        _A(
            "vllm.models.step5.nvidia.sparse_attention.Step5SplitKVFlashAttentionImpl",
            _D.VLLM_REFUSES,
            "its DSA impl raises for DCP > 1",
        ),
        _A(
            "vllm.models.step5.nvidia.sparse_attention.Step5DSAAttentionImpl",
            _D.VLLM_REFUSES,
            "raises for DCP > 1",
        ),
        _A(
            "vllm.model_executor.models.deepseek_v2.DeepseekV2MLAAttention",
            _D.GENERIC,
            "MLAAttention underneath; reads only DCP query replication, which "
            "is refused for K < D",
        ),
        *_NEW_IN_034,
        *_NAMED_REFUSALS,
    )
}
"""Every class of the supported releases' model sources that reads the DCP
world itself (``decode_context_parallel_size``, ``get_dcp_group``,
``dcp_world_size``, ...), and every class refused by name, with what the
plugin does about it and the releases that have it."""


def audited_classes(release: str) -> dict[str, AuditedClass]:
    """The audit of one vLLM release (``X.Y.Z``)."""
    return {p: e for p, e in AUDITED_CLASSES.items() if release in e.releases}
