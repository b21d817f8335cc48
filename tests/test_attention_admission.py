# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The one admission rule (``attention_admission.admit_attention``), pure.

Every refusal is checked with its message: it names the group, the backend,
K and D, and says why and what to do.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.attention_admission import (
    AttentionMode,
    admit_attention,
)
from vllm_dcp_geometry.contract.attention_backends import (
    TAUGHT_BACKENDS,
    AttentionKind,
    is_mla_backend_name,
)

OWNER = "KV-cache group 2 (model.layers.3.self_attn.attn)"
MLA = AttentionKind.MLA
ATTN = AttentionKind.ATTENTION
DENSE_MLA = (
    "FLASHMLA",
    "FLASH_ATTN_MLA",
    "FLASHINFER_MLA",
    "CUTLASS_MLA",
    "TRITON_MLA",
)


def admit(kind: AttentionKind, backend: str | None, k: int, d: int, **kw: Any):
    default = kw.pop("default", d if k > 1 or kind is MLA else 1)
    return admit_attention(
        owner=OWNER,
        kind=kind,
        backend=backend,
        shard_count=k,
        dcp_world_size=d,
        default_shard_count=default,
        **kw,
    )


@pytest.mark.parametrize("backend", DENSE_MLA)
def test_dense_mla_runs_every_k(backend: str) -> None:
    assert admit(MLA, backend, 1, 8).mode is AttentionMode.LOCAL
    assert admit(MLA, backend, 1, 8, default=1).mode is AttentionMode.LOCAL
    for k in (2, 4):
        assert admit(MLA, backend, k, 8).mode is AttentionMode.DCP_PARTIAL
    assert admit(MLA, backend, 8, 8).mode is AttentionMode.DCP
    assert admit(MLA, backend, 1, 1).mode is AttentionMode.LOCAL


def test_recurrent_groups_have_no_attention() -> None:
    for d in (1, 4):
        admission = admit(AttentionKind.NONE, None, 1, d, default=1)
        assert admission.mode is AttentionMode.NONE
        assert admission.check() is admission


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
def test_taught_attention_backends(backend: str) -> None:
    assert admit(ATTN, backend, 1, 4, default=1).mode is AttentionMode.LOCAL
    assert admit(ATTN, backend, 2, 4).mode is AttentionMode.DCP_PARTIAL
    assert admit(ATTN, backend, 4, 4).mode is AttentionMode.DCP


def _refusal(admission) -> str:
    assert admission.mode is AttentionMode.REFUSED
    with pytest.raises(DcpGeometryError) as excinfo:
        admission.check()
    message = str(excinfo.value)
    assert message == admission.reason and "\n" not in message
    assert message.startswith(OWNER)
    return message


@pytest.mark.parametrize(
    ("backend", "k", "words"),
    [
        # Taught only for DeepSeek-V3.2's own layer classes.
        ("FLASHMLA_SPARSE", 1, "taught per-group DCP shard counts only for"),
        ("FLASHINFER_MLA_SPARSE", 2, "taught per-group DCP shard counts only for"),
        ("DEEPSEEK_V32_INDEXER", 1, "taught per-group DCP shard counts only for"),
        ("FLASH_ATTN_MLA_SPARSE", 1, "FLASH_ATTN_MLA_SPARSE is not taught"),
        ("ROCM_AITER_MLA", 1, "ROCM_AITER_MLA is not taught"),
        ("CPU_MLA", 2, "CPU_MLA is not taught"),
    ],
)
def test_untaught_mla_backends_refuse_every_k_but_d(
    backend: str, k: int, words: str
) -> None:
    """vLLM's MLA reads every cache with K = D, whatever dcp_sharded says."""
    message = _refusal(admit(MLA, backend, k, 8, default=1 if k == 1 else 8))
    assert f"attention backend {backend}, K={k}, D=8" in message
    assert words in message and "vLLM's own K=8" in message
    assert admit(MLA, backend, 8, 8).mode is AttentionMode.DCP


def test_untaught_attention_backend_runs_only_vllms_own_k() -> None:
    message = _refusal(admit(ATTN, "TRITON_ATTN", 2, 8))
    assert "attention backend TRITON_ATTN, K=2, D=8" in message
    assert "FLASH_ATTN" in message and "FLASHINFER" in message
    # vLLM's own replicated reading of a dcp_sharded=False spec stays.
    assert admit(ATTN, "TRITON_ATTN", 1, 8, default=1).mode is AttentionMode.LOCAL
    _refusal(admit(ATTN, "TRITON_ATTN", 1, 8, default=8))
    # A taught name for another kind is not taught.
    _refusal(admit(ATTN, "TRITON_MLA", 2, 8))
    _refusal(admit(MLA, "FLASH_ATTN", 1, 8))
    _refusal(admit(ATTN, None, 2, 8))


@pytest.mark.parametrize("backend", DENSE_MLA)
def test_mla_with_pcp_or_query_replication_refuses_k_below_d(backend: str) -> None:
    for k in (1, 2):
        message = _refusal(admit(MLA, backend, k, 4, pcp_world_size=2))
        assert f"{backend}, K={k}, D=4" in message and "PCP=2" in message
        message = _refusal(admit(MLA, backend, k, 4, dcp_q_replicate=True))
        assert f"{backend}, K={k}, D=4" in message and "dcp_q_replicate" in message
    assert admit(MLA, backend, 4, 4, pcp_world_size=2).mode is AttentionMode.DCP
    assert admit(MLA, backend, 4, 4, dcp_q_replicate=True).mode is AttentionMode.DCP


def test_attention_with_pcp_refuses_every_k_below_d() -> None:
    """vLLM's PCP attention spans the PCP ranks; it is only known right for
    K = D, so even a spec vLLM itself reads with K = 1 is refused."""
    for backend, k, default in (
        ("FLASH_ATTN", 1, 1),
        ("FLASH_ATTN", 1, 4),
        ("FLASHINFER", 2, 4),
        ("TRITON_ATTN", 1, 1),
    ):
        message = _refusal(
            admit(ATTN, backend, k, 4, default=default, pcp_world_size=2)
        )
        assert f"{backend}, K={k}, D=4" in message and "PCP=2" in message
    assert admit(ATTN, "FLASH_ATTN", 4, 4, pcp_world_size=2).mode is AttentionMode.DCP
    assert admit(ATTN, "TRITON_ATTN", 1, 4, default=1).mode is AttentionMode.LOCAL


def test_flashinfer_mla_needs_interleave_one_below_d() -> None:
    for k in (1, 2):
        message = _refusal(admit(MLA, "FLASHINFER_MLA", k, 4, interleave_size=16))
        assert "cp_kv_cache_interleave_size=16" in message
        assert admit(MLA, "FLASHINFER_MLA", k, 4).mode is not AttentionMode.REFUSED
    assert admit(MLA, "TRITON_MLA", 2, 4, interleave_size=16).mode is (
        AttentionMode.DCP_PARTIAL
    )


def test_bad_shard_counts_are_errors_not_refusals() -> None:
    for k, d in ((3, 4), (0, 4), (8, 4)):
        with pytest.raises(DcpGeometryError, match=f"K={k}"):
            admit(MLA, "TRITON_MLA", k, d, default=d)


def test_backend_names_and_builders() -> None:
    """The taught table names vLLM's real backends and builder classes, and
    the CLI's name rule for MLA backends matches every importable backend."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for member in AttentionBackendEnum:
        try:
            backend = member.get_class()
        except Exception:
            continue
        assert is_mla_backend_name(member.name) == backend.is_mla(), member.name
        taught = TAUGHT_BACKENDS.get(member.name)
        if taught is not None:
            builder = backend.get_builder_cls()
            assert taught.builder == f"{builder.__module__}.{builder.__qualname__}"
            assert (taught.kind is MLA) == backend.is_mla()
    # The DSA indexer's backend is the layer's own, not a selector member.
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    indexer = DeepseekV32IndexerBackend
    builder = indexer.get_builder_cls()
    assert TAUGHT_BACKENDS[indexer.get_name()].builder == (
        f"{builder.__module__}.{builder.__qualname__}"
    )
    assert set(TAUGHT_BACKENDS) - {m.name for m in AttentionBackendEnum} == {
        indexer.get_name()
    }


def test_a_group_layer_without_an_impl_is_refused_for_every_k_below_d() -> None:
    """An impl the plugin cannot find keeps vLLM's D-rank path: for K = 1 as
    for a partial K, binding the group refuses instead of skipping it (a
    layer of a generic or untaught class; a missing layer likewise)."""
    from types import SimpleNamespace

    from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
    from vllm_dcp_geometry.runtime.layer_binding import bind_group_layers

    impl = SimpleNamespace(dcp_world_size=4, dcp_rank=3, pcp_world_size=1)
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(
            static_forward_context={"a": SimpleNamespace(impl=impl), "b": object()}
        )
    )
    for k in (1, 2):
        geometry = GroupGeometry("g", k, 4, 3)
        with pytest.raises(
            DcpGeometryError, match=r"layer b \(builtins.object\) has no"
        ):
            bind_group_layers(config, ["a", "b"], geometry, mla=False)
        with pytest.raises(DcpGeometryError, match=r"layer c is not in the forward"):
            bind_group_layers(config, ["c"], geometry, mla=False)


def test_a_replicated_impl_under_pcp_is_not_left_on_the_dcp_path() -> None:
    from types import SimpleNamespace

    from vllm_dcp_geometry.contract import DcpGeometryError
    from vllm_dcp_geometry.runtime.impl_binding import make_impl_local

    impl = SimpleNamespace(dcp_world_size=4, dcp_rank=3, pcp_world_size=1)
    make_impl_local(impl)
    assert (impl.dcp_world_size, impl.dcp_rank, impl.total_cp_world_size) == (1, 0, 1)
    with pytest.raises(DcpGeometryError, match="PCP=2"):
        make_impl_local(SimpleNamespace(dcp_world_size=4, dcp_rank=3, pcp_world_size=2))


# Classes and backends refused by name (vLLM 0.34.0's new DCP readers) -----------

KIMI_K3_DSA = "vllm.models.kimi_k3.nvidia.dsa.KimiK3DSAAttention"
KIMI_K3_INDEXER_CACHE = "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerCache"
KIMI_K3_INDEXER_BUILDER = (
    "vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerMetadataBuilder"
)


@pytest.mark.parametrize(
    ("layer_class", "backend", "words"),
    [
        (
            KIMI_K3_DSA,
            "FLASHMLA_SPARSE",
            "Kimi-K3.1's DSA attention (KimiK3DSAAttention)",
        ),
        (
            KIMI_K3_DSA,
            "FLASHINFER_MLA_SPARSE",
            "Kimi-K3.1's DSA attention (KimiK3DSAAttention)",
        ),
        (
            KIMI_K3_INDEXER_CACHE,
            f"DEEPSEEK_V32_INDEXER ({KIMI_K3_INDEXER_BUILDER})",
            "Kimi-K3.1's DSA indexer cache (KimiK3IndexerCache)",
        ),
        (
            "vllm.models.mistral.nvidia.attention._MistralMLA",
            "FLASHMLA_SPARSE",
            "Mistral Large 4's MLA (_MistralMLA)",
        ),
        (
            "vllm.models.mistral.nvidia.indexer.MistralIndexerCache",
            "DEEPSEEK_V32_INDEXER",
            "Mistral Large 4's indexer cache (MistralIndexerCache)",
        ),
        (
            "vllm.models.glm5next.common.attention.Glm5NextIndexerCache",
            "DEEPSEEK_V32_INDEXER",
            "GLM-5.3-Flash's kpool indexer cache (Glm5NextIndexerCache)",
        ),
    ],
)
def test_classes_refused_by_name_run_only_vllms_k(
    layer_class: str, backend: str, words: str
) -> None:
    """Fail closed: K = 1 and a partial K are refused on a taught backend,
    the message naming the model's class and why; vLLM's own K runs."""
    for k in (1, 2, 4):
        message = _refusal(
            admit(MLA, backend, k, 8, layer_class=layer_class, layer_name="l.0")
        )
        assert f"layer l.0 ({layer_class}), attention backend {backend}" in message
        assert f"{words} is not taught per-group DCP shard counts: " in message
        assert "vLLM's K=8; use K=8 for this layer" in message
    admitted = admit(MLA, backend, 8, 8, layer_class=layer_class, layer_name="l.0")
    assert admitted.mode is AttentionMode.DCP


def test_kimi_k3_dsa_refusal_says_why() -> None:
    message = _refusal(
        admit(MLA, "FLASHMLA_SPARSE", 1, 16, layer_class=KIMI_K3_DSA, layer_name="x")
    )
    assert "init_dcp_topk_merge" in message and "at construction" in message


@pytest.mark.parametrize(
    ("kind", "backend", "words"),
    [
        (MLA, "KIMI_K3_KV_BALANCED_MLA", "Kimi-K3's KV-balanced MLA backend"),
        (
            MLA,
            f"DEEPSEEK_V32_INDEXER ({KIMI_K3_INDEXER_BUILDER})",
            "Kimi-K3.1's DSA indexer builder",
        ),
        (MLA, KIMI_K3_INDEXER_BUILDER, "Kimi-K3.1's DSA indexer builder"),
        (ATTN, "FLASHINFER_TS", "FlashInfer TS"),
        (
            ATTN,
            "TRITON_ATTN (vllm.model_executor.layers.dash_attention."
            "DASHAttentionMetadataBuilder)",
            "DASHAttention's TRITON_ATTN builder",
        ),
    ],
)
def test_backends_refused_by_name_run_only_vllms_k(
    kind: AttentionKind, backend: str, words: str
) -> None:
    """On vLLM's generic layer too: the backend is named with its reason."""
    message = _refusal(admit(kind, backend, 2, 8))
    assert f"attention backend {backend}, K=2, D=8" in message
    assert f"{words} is not taught per-group DCP shard counts: " in message
    assert admit(kind, backend, 8, 8).mode is AttentionMode.DCP


def test_specialized_decode_refusal_names_the_drafter() -> None:
    message = _refusal(
        admit(
            MLA,
            "FLASHINFER_MLA",
            2,
            8,
            layer_class="vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention",
            specialized_decode=True,
        )
    )
    assert "latency_specialized" in message and "DraftDcp" in message
