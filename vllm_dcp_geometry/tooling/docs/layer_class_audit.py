# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The audit of vLLM 0.33.0's model-owned attention classes: every class
whose source reads the DCP world itself, with what the plugin does about it.

Documentation and tests read it (``tests/test_layer_classes.py`` walks vLLM's
model sources and fails on a class in neither this table nor
``contract.layer_classes.TAUGHT_LAYERS``); the runtime never does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    FLINT_ATTENTION,
    KIMI_K3_MLA,
)


class Disposition(str, enum.Enum):
    TAUGHT = "taught"
    """In ``TAUGHT_LAYERS``: bound per the group's K."""

    GENERIC = "generic underneath"
    """Wraps a generic ``Attention``/``MLAAttention`` (the class the plugin
    binds); its own DCP read is the one in ``note``."""

    REFUSED = "refused"
    """Not taught: only vLLM's own K runs; the plugin refuses every other K."""

    VLLM_REFUSES = "refused by vLLM"
    """vLLM 0.33.0 itself refuses DCP for it at start-up."""

    NOT_A_LAYER = "not a layer"
    """A helper (builder, impl, indexer op, config) of a layer listed here."""


@dataclass(frozen=True)
class AuditedClass:
    path: str
    disposition: Disposition
    note: str


_A = AuditedClass
_D = Disposition
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
    )
}
"""Every class of vLLM 0.33.0's model sources that reads the DCP world itself
(``decode_context_parallel_size``, ``get_dcp_group``, ``dcp_world_size``, ...),
with what the plugin does about it."""
