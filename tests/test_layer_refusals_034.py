# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM 0.34.0's new DCP readers stay refused below vLLM's own K, by name.

Kimi-K3.1's DSA layer (``KimiK3DSAAttention``: a generic sparse
``MLAAttention`` around its own indexer) and its indexer cache, Mistral
Large 4's MLA and indexer cache, and the new backends and builders
(``KIMI_K3_KV_BALANCED_MLA``, Kimi-K3.1's indexer builder, ``FLASHINFER_TS``,
DASHAttention's) are found on vLLM's real classes, and start-up's admission
(``worker_admission.admit_group``) refuses K = 1 and a partial K naming the
class or backend and the reason; ``plan`` prints the same refusal.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.contract.attention_backends import (
    REFUSED_BACKENDS,
    AttentionKind,
)
from vllm_dcp_geometry.contract.layer_classes import (
    KIMI_K3_DSA_ATTENTION,
    KIMI_K3_DSA_INDEXER,
    KIMI_K3_INDEXER_CACHE,
    MISTRAL_INDEXER_CACHE,
    MISTRAL_MLA,
    layer_class_path,
)
from vllm_dcp_geometry.runtime.worker_admission import admit_group, backend_label

pytestmark = pytest.mark.vllm_releases("0.34.0")

GENERIC_MLA = "vllm.model_executor.layers.attention.mla_attention.MLAAttention"
OWNER = "KV-cache group 0 (model.layers.0.self_attn.attn)"
LAYER = "model.layers.0.self_attn.attn"


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _shell(path: str) -> Any:
    """An instance made without ``__init__``: admission reads only classes."""
    from torch import nn

    cls = _class(path)
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


def _label(backend: str | type) -> str:
    """The backend's label as start-up names it (``backend_label``)."""
    cls = _class(backend) if isinstance(backend, str) else backend
    return backend_label(cls.get_name(), cls.get_builder_cls())


def _start_up(
    owner: str, layer_name: str, layer: Any, backend: str, k: int, d: int
) -> Any:
    """Start-up's admission of a one-layer MLA group."""
    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context={layer_name: layer}),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=1),
        additional_config=None,
    )
    return admit_group(
        GroupGeometry(owner, k, d, d - 1),
        kind=AttentionKind.MLA,
        backend=backend,
        vllm_config=config,
        layer_names=[layer_name],
    )


def _admit(layer: Any, backend: str, k: int, d: int = 4) -> str:
    """Start-up's refusal of a one-layer MLA group (it must refuse)."""
    admission = _start_up(OWNER, LAYER, layer, backend, k, d)
    assert admission.refused, (k, admission)
    return admission.reason


def _kimi_k3_dsa_latent() -> Any:
    """The layer KimiK3DSAAttention registers: a generic MLAAttention holding
    the wrapper's KimiK3DSAIndexer."""
    layer = _shell(GENERIC_MLA)
    layer.indexer = _shell(KIMI_K3_DSA_INDEXER)
    return layer


def test_kimi_k3_dsa_latent_is_named_by_its_indexer() -> None:
    assert layer_class_path(_kimi_k3_dsa_latent()) == KIMI_K3_DSA_ATTENTION
    # A dense generic MLA layer (no indexer) stays the generic class.
    assert layer_class_path(_shell(GENERIC_MLA)) == GENERIC_MLA


@pytest.mark.parametrize("k", [1, 2])
def test_kimi_k31_dsa_is_refused_below_d(k: int) -> None:
    """Kimi-K3.1 with dsa_config: its latent on either sparse backend and its
    indexer cache on its own builder, refused for K = 1 and 1 < K < D."""
    sparse = "vllm.v1.attention.backends.mla.flashmla_sparse.FlashMLASparseBackend"
    for backend in (_label(sparse), "FLASHINFER_MLA_SPARSE"):
        reason = _admit(_kimi_k3_dsa_latent(), backend, k)
        assert f"layer {LAYER} ({KIMI_K3_DSA_ATTENTION})" in reason
        assert f"K={k}, D=4: Kimi-K3.1's DSA attention (KimiK3DSAAttention) is " in (
            reason
        )
        assert "not taught per-group DCP shard counts" in reason
        assert "init_dcp_topk_merge" in reason and reason.endswith(
            "use K=4 for this layer"
        )
    cache = _shell(KIMI_K3_INDEXER_CACHE)
    label = _label(cache.get_attn_backend())
    assert label == (
        "DEEPSEEK_V32_INDEXER "
        "(vllm.models.kimi_k3.common.dsa_cache.KimiK3IndexerMetadataBuilder)"
    )
    reason = _admit(cache, label, k)
    assert "Kimi-K3.1's DSA indexer cache (KimiK3IndexerCache) is not taught" in reason


@pytest.mark.parametrize(
    ("layer_path", "backend_path", "words"),
    [
        (
            MISTRAL_MLA,
            "vllm.v1.attention.backends.mla.flashmla_sparse.FlashMLASparseBackend",
            "Mistral Large 4's MLA (_MistralMLA) is not taught",
        ),
        (
            MISTRAL_INDEXER_CACHE,
            "vllm.v1.attention.backends.mla.indexer.DeepseekV32IndexerBackend",
            "Mistral Large 4's indexer cache (MistralIndexerCache) is not taught",
        ),
        (
            GENERIC_MLA,
            "vllm.models.kimi_k3.nvidia.kv_balanced_mla.backend."
            "KimiK3KvBalancedMLABackend",
            "Kimi-K3's KV-balanced MLA backend is not taught",
        ),
    ],
)
def test_new_mla_classes_and_backends_are_refused_by_name(
    layer_path: str, backend_path: str, words: str
) -> None:
    for k in (1, 2):
        reason = _admit(_shell(layer_path), _label(backend_path), k)
        assert f"layer {LAYER} ({layer_path})" in reason and words in reason


def test_refused_backend_names_are_vllms() -> None:
    """The names and builder paths ``REFUSED_BACKENDS`` keys are vLLM
    0.34.0's, and a refused builder is named in its backend's label."""
    kimi = "vllm.models.kimi_k3.nvidia.kv_balanced_mla.backend."
    ts = "vllm.v1.attention.backends.flashinfer_ts.FlashInferTSBackend"
    assert _class(kimi + "KimiK3KvBalancedMLABackend").get_name() in REFUSED_BACKENDS
    assert _class(ts).get_name() in REFUSED_BACKENDS
    dash = _class("vllm.model_executor.layers.dash_attention.DASHAttentionBackend")
    builder = dash.get_builder_cls()
    path = f"{builder.__module__}.{builder.__qualname__}"
    assert path in REFUSED_BACKENDS
    assert backend_label(dash.get_name(), builder) == f"TRITON_ATTN ({path})"
    for key in REFUSED_BACKENDS:
        if "." in key:
            assert _class(key).__qualname__ == key.rpartition(".")[2]


def _kimi_k31_topology(tmp_path: Path, k: int) -> Path:
    """DeepSeek-V3.2's profile with Kimi-K3.1's DSA classes and names."""
    from vllm_dcp_geometry.tooling import topology

    source = Path(topology.__file__).parent.parent / "profiles"
    text = (source / "deepseek-v32-tp8-dcp8.toml").read_text()
    for old, new in (
        (
            "vllm.models.deepseek_v32.attention.DeepseekV32Attention",
            KIMI_K3_DSA_ATTENTION,
        ),
        (
            "vllm.model_executor.models.deepseek_v2.DeepseekV32IndexerCache",
            KIMI_K3_INDEXER_CACHE,
        ),
        ("self_attn.indexer.k_cache", "self_attn.dsa_indexer.k_cache"),
        ('name = "deepseek-v32-tp8-dcp8"', 'name = "kimi-k31-dsa"'),
        ("dcp_kv_shard_count = 4", f"dcp_kv_shard_count = {k}"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / f"kimi-k31-k{k}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("k", [1, 4])
def test_plan_prints_start_ups_refusal(tmp_path: Path, capsys, k: int) -> None:
    """``plan`` refuses Kimi-K3.1's DSA groups with start-up's message: the
    same admission function, on the class and backend it names."""
    from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, main

    topology = _kimi_k31_topology(tmp_path, k)
    assert main(["plan", "--json", "--topology", str(topology)]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    groups = {g["layer_class"]: g for g in json.loads(captured.out)["groups"]}
    for layer_class, layer, words in (
        (KIMI_K3_DSA_ATTENTION, _kimi_k3_dsa_latent(), "Kimi-K3.1's DSA attention"),
        (KIMI_K3_INDEXER_CACHE, _shell(KIMI_K3_INDEXER_CACHE), "DSA indexer cache"),
    ):
        group = groups[layer_class]
        assert group["attention_mode"] == "refused"
        refusal = group["attention_refusal"]
        assert words in refusal and f"K={k}, D=8" in refusal
        # Start-up's admission of the group's first layer (the real layer
        # class behind the name), on the backend plan names: the same text.
        owner = refusal.partition(": layer ")[0]
        backend = group["attention_backend"]
        start_up = _start_up(owner, group["layers"][0], layer, backend, k, 8)
        assert start_up.reason == refusal
    assert captured.err.strip().startswith("vllm-dcp-geometry: error: ")
