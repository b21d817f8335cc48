# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Sparse MLA and its DSA indexer: what admission runs and refuses, how an
indexer cache is bound, how overrides reach it with its latent cache, and
what ``plan`` shows for a DeepSeek-V3.2-shaped profile."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.processes import run_command
from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.attention_admission import (
    AttentionMode,
    admit_attention,
)
from vllm_dcp_geometry.contract.attention_backends import AttentionKind
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
    LAYER_CLASS_ATTR,
)

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "worker.deepseek_v32_attention", "worker.mla_indexer", "worker.utils"
    ),
]

OWNER = "KV-cache group 0 (model.layers.0.self_attn.attn)"
LATENT = "model.layers.0.self_attn.attn"
INDEXER = "model.layers.0.self_attn.indexer.k_cache"
GENERIC_MLA = "vllm.model_executor.layers.attention.mla_attention.MLAAttention"


def admit(layer_class: str, backend: str, k: int, d: int = 4, **kw: Any):
    return admit_attention(
        owner=OWNER,
        kind=AttentionKind.MLA,
        backend=backend,
        shard_count=k,
        dcp_world_size=d,
        default_shard_count=d,
        layer_class=layer_class,
        layer_name=LATENT,
        **kw,
    )


def refusal(admission: Any) -> str:
    assert admission.mode is AttentionMode.REFUSED
    assert "\n" not in admission.reason and admission.reason.startswith(OWNER)
    return admission.reason


@pytest.mark.parametrize("backend", ["FLASHMLA_SPARSE", "FLASHINFER_MLA_SPARSE"])
@pytest.mark.parametrize("dcp", [2, 4, 8])
def test_deepseek_v32_layers_run_every_k(backend: str, dcp: int) -> None:
    for k in (1, *[k for k in range(2, dcp) if dcp % k == 0], dcp):
        want = {1: AttentionMode.LOCAL, dcp: AttentionMode.DCP}.get(
            k, AttentionMode.DCP_PARTIAL
        )
        assert admit(DEEPSEEK_V32_ATTENTION, backend, k, dcp).mode is want
        assert admit(
            DEEPSEEK_V32_INDEXER_CACHE, "DEEPSEEK_V32_INDEXER", k, dcp
        ).mode is (want)


def test_sparse_backends_are_refused_for_other_layer_classes() -> None:
    """vLLM's generic MLA layer (its non-CUDA DeepSeek path) calls an
    indexer op the plugin has not taught: only vLLM's own K runs there."""
    for backend in ("FLASHMLA_SPARSE", "DEEPSEEK_V32_INDEXER"):
        message = refusal(admit(GENERIC_MLA, backend, 2))
        assert f"({GENERIC_MLA}), attention backend {backend}, K=2, D=4" in message
        assert (
            f"taught per-group DCP shard counts only for {DEEPSEEK_V32_ATTENTION}"
            in (message)
            or DEEPSEEK_V32_INDEXER_CACHE in message
        )
        assert admit(GENERIC_MLA, backend, 4).mode is AttentionMode.DCP


def test_deepseek_v32_layers_refuse_other_backends() -> None:
    message = refusal(admit(DEEPSEEK_V32_ATTENTION, "TRITON_MLA", 1))
    assert "only with FLASHINFER_MLA_SPARSE, FLASHMLA_SPARSE" in message
    message = refusal(admit(DEEPSEEK_V32_INDEXER_CACHE, "FLASHMLA_SPARSE", 2))
    assert "only with DEEPSEEK_V32_INDEXER" in message


@pytest.mark.parametrize(
    ("backend", "words"),
    [
        ("FLASH_ATTN_MLA_SPARSE", "FLASH_ATTN_MLA_SPARSE is not taught"),
        ("ROCM_AITER_MLA_SPARSE", "ROCM_AITER_MLA_SPARSE is not taught"),
        ("FLASHMLA_SPARSE_DSV4", "FLASHMLA_SPARSE_DSV4 is not taught"),
    ],
)
def test_other_sparse_backends_stay_refused(backend: str, words: str) -> None:
    for k in (1, 2):
        message = refusal(admit(DEEPSEEK_V32_ATTENTION, backend, k))
        assert words in message
        assert "FLASHMLA_SPARSE" in message.rpartition(";")[2]


def test_query_replication_and_pcp_are_refused_below_d() -> None:
    message = refusal(
        admit(DEEPSEEK_V32_ATTENTION, "FLASHMLA_SPARSE", 2, dcp_q_replicate=True)
    )
    assert "dcp_q_replicate" in message
    message = refusal(
        admit(DEEPSEEK_V32_ATTENTION, "FLASHMLA_SPARSE", 1, pcp_world_size=2)
    )
    assert "PCP=2" in message


def _context(latent_class: str | None) -> dict[str, Any]:
    context: dict[str, Any] = {INDEXER: SimpleNamespace()}
    if latent_class is not None:
        context[LATENT] = SimpleNamespace(**{LAYER_CLASS_ATTR: latent_class})
    # An indexer cache has no impl; its class is DeepseekV32IndexerCache.
    setattr(context[INDEXER], LAYER_CLASS_ATTR, DEEPSEEK_V32_INDEXER_CACHE)
    return context


def _bind(context: dict[str, Any], k: int) -> None:
    from vllm_dcp_geometry.runtime.layer_binding import bind_group_layers

    config = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=context)
    )
    geometry = GroupGeometry(OWNER, k, 4, 3, default_shard_count=4)
    bind_group_layers(config, [INDEXER], geometry, mla=True)


@pytest.mark.parametrize("k", [1, 2])
def test_an_indexer_cache_is_bound_only_under_its_deepseek_layer(k: int) -> None:
    import vllm.models.deepseek_v32.attention  # noqa: F401  (registers the binder)

    from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR

    context = _context(DEEPSEEK_V32_ATTENTION)
    _bind(context, k)
    assert getattr(context[INDEXER], BOUND_GEOMETRY_ATTR).shard_world == (k, 3 % k)
    for reader, found in ((GENERIC_MLA, GENERIC_MLA), (None, "not in the model")):
        with pytest.raises(DcpGeometryError) as excinfo:
            _bind(_context(reader), k)
        message = str(excinfo.value)
        assert (
            f"layer {INDEXER} ({DEEPSEEK_V32_INDEXER_CACHE}) is read by {LATENT}"
            in (message)
        )
        assert found in message and f"K={k}, D=4" in message


def test_an_indexer_cache_without_its_binder_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_dcp_geometry.contract.layer_classes import LAYER_BINDERS, LayerBinding

    monkeypatch.delitem(LAYER_BINDERS, LayerBinding.SPARSE_INDEXER_CACHE, raising=False)
    with pytest.raises(DcpGeometryError, match="deepseek_v32_attention, which is not"):
        _bind(_context(DEEPSEEK_V32_ATTENTION), 2)


# Overrides -------------------------------------------------------------------


def _specs() -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    latent = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=656,
    )
    indexer = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=132,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )
    return {LATENT: latent, INDEXER: indexer}


def _apply(layers: dict[str, Any]) -> dict[str, Any]:
    return _apply_to(_specs(), layers)


@pytest.mark.parametrize("value", [1, 2, "replicated"])
def test_an_override_of_the_latent_cache_reaches_its_indexer(value: Any) -> None:
    specs = _apply({"model.layers.*.self_attn.attn": value})
    k = 1 if value == "replicated" else value
    assert specs[LATENT].dcp_shard_count(4) == k
    assert specs[INDEXER].dcp_shard_count(4) == k


def test_an_indexer_with_another_k_than_its_latent_cache_is_refused() -> None:
    for layers in (
        {"*.indexer.k_cache": 2},
        {"model.layers.*.self_attn.attn": 2, "*.indexer.k_cache": 1},
    ):
        with pytest.raises(DcpGeometryError) as excinfo:
            _apply(layers)
        message = str(excinfo.value)
        assert "\n" not in message
        assert f"layer {INDEXER!r} (indexer cache, K=" in message
        assert f"latent cache {LATENT!r} (K=" in message
        assert "must share one K" in message
    # The same K written twice is no conflict.
    specs = _apply({"model.layers.*.self_attn.attn": 2, "*.indexer.k_cache": 2})
    assert specs[INDEXER].dcp_shard_count(4) == 2


def _index_group_specs() -> dict[str, Any]:
    import dataclasses

    latent = _specs()[LATENT]
    leader = dataclasses.replace(
        latent, topk_buffer_width=64, is_index_group_leader=True
    )
    follower = dataclasses.replace(leader, is_index_group_leader=False)
    return {
        "model.layers.0.self_attn.attn": leader,
        "model.layers.1.self_attn.attn": follower,
        "model.layers.2.self_attn.attn": leader,
    }


def _apply_to(specs: dict[str, Any], layers: dict[str, Any]) -> dict[str, Any]:
    from vllm_dcp_geometry.runtime.spec_overrides import apply_to_kv_cache_specs

    config = SimpleNamespace(
        additional_config={"dcp_geometry": {"layers": layers}},
        parallel_config=SimpleNamespace(
            decode_context_parallel_size=4,
            prefill_context_parallel_size=1,
            pipeline_parallel_size=1,
        ),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    return apply_to_kv_cache_specs(specs, config)


def test_the_layers_of_one_index_group_share_one_k() -> None:
    """A skip-top-k layer reuses its group leader's top-k (converted to
    physical slots once at K = 1, with the leader's block table): its K must
    be the leader's; the next leader starts a new group."""
    with pytest.raises(DcpGeometryError) as excinfo:
        _apply_to(_index_group_specs(), {"model.layers.1.*": 1})
    message = str(excinfo.value)
    assert "'model.layers.0.self_attn.attn' (K=4)" in message
    assert "'model.layers.1.self_attn.attn' (K=1, D=4)" in message
    assert "\n" not in message
    specs = _apply_to(_index_group_specs(), {"model.layers.[01].*": 1})
    assert specs["model.layers.1.self_attn.attn"].dcp_shard_count(4) == 1
    specs = _apply_to(_index_group_specs(), {"model.layers.2.*": 2})
    assert specs["model.layers.2.self_attn.attn"].dcp_shard_count(4) == 2


def test_index_groups_follow_layer_order() -> None:
    from vllm_dcp_geometry.runtime.spec_overrides import index_groups

    leaders = {"m.layers.10.a": False, "m.layers.2.a": True, "m.layers.9.a": True}
    assert index_groups(leaders) == [
        ["m.layers.2.a"],
        ["m.layers.9.a", "m.layers.10.a"],
    ]
    assert index_groups({"x": True, "y": False}) == [["x", "y"]]


# plan ------------------------------------------------------------------------

PROFILE = "deepseek-v32-tp8-dcp8"


def _profile_source() -> str:
    root = Path(__file__).resolve().parent.parent
    return (
        root / "vllm_dcp_geometry" / "tooling" / "profiles" / f"{PROFILE}.toml"
    ).read_text()


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return run_command(["-m", "vllm_dcp_geometry", "plan", *args, "--json"])


def test_plan_shows_partial_and_local_sparse_groups(tmp_path: Path) -> None:
    # The profile at K=4 (two replicas of 4).
    done = _plan("-p", PROFILE)
    assert done.returncode == 0, done.stderr
    groups = {g["name"]: g for g in json.loads(done.stdout)["groups"]}
    latent, indexer = groups["latent.k4"], groups["indexer.k4"]
    assert latent["attention_mode"] == indexer["attention_mode"] == "dcp-partial"
    assert latent["attention_backend"] == "FLASHMLA_SPARSE"
    assert indexer["attention_backend"] == "DEEPSEEK_V32_INDEXER"
    assert latent["shard_count"] == indexer["shard_count"] == 4
    # Every layer at vLLM's K=8: vLLM 0.33.0's FlashMLA sparse builder
    # refuses the 128 gathered heads (16 per rank pad to 64, 128 to 128).
    sharded = tmp_path / "sharded.toml"
    sharded.write_text(_profile_source().replace("dcp_kv_shard_count = 4", ""))
    done = _plan("-t", str(sharded))
    assert done.returncode == 2
    assert "FLASHMLA_SPARSE needs the local and gathered query heads" in done.stderr
    # Every group replicated: local, no gather or combine.
    replicated = tmp_path / "replicated.toml"
    replicated.write_text(
        _profile_source()
        .replace("dcp_kv_shard_count = 4\n", "")
        .replace("dcp_sharded = true", "dcp_sharded = false")
    )
    done = _plan("-t", str(replicated))
    assert done.returncode == 0, done.stderr
    groups = {g["name"]: g for g in json.loads(done.stdout)["groups"]}
    assert groups["latent.k4"]["attention_mode"] == "local"
    assert groups["indexer.k4"]["attention_mode"] == "local"


def test_plan_refuses_an_indexer_with_another_k(tmp_path: Path) -> None:
    head, sep, indexer_k4 = _profile_source().rpartition('name = "indexer.k4"')
    broken = tmp_path / "broken.toml"
    broken.write_text(head + sep + indexer_k4.replace("dcp_kv_shard_count = 4", ""))
    done = _plan("-t", str(broken))
    assert done.returncode == 2
    assert "must share one K" in done.stderr
    assert "model.layers.0.self_attn.indexer.k_cache" in done.stderr


def test_plan_refuses_an_indexer_cache_without_its_deepseek_reader(
    tmp_path: Path,
) -> None:
    """As start-up does: the indexer cache of a layer that is not a
    DeepseekV32Attention (here: no ``P.attn`` layer at all) is refused."""
    moved = tmp_path / "moved.toml"
    moved.write_text(
        _profile_source().replace(
            'layer_template = "model.layers.{}.self_attn.attn"',
            'layer_template = "model.layers.{}.mla"',
        )
    )
    done = _plan("-t", str(moved))
    assert done.returncode == 2
    assert "KV-cache group 1 (model.layers.0.self_attn.indexer.k_cache" in (done.stderr)
    assert "is read by model.layers.0.self_attn.attn (not in the model)" in (
        done.stderr
    )


@pytest.mark.parametrize(
    ("layers", "collectives", "refused"),
    [
        (4, "replica", False),
        (8, "replica", True),
        (4, "dcp", True),
        (2, "replica", False),
    ],
)
def test_plan_refuses_the_flashmla_sparse_head_envelope_start_up_refuses(
    run_cli: Any, layers: int, collectives: str, refused: bool
) -> None:
    """DeepSeek-V3.2 at TP8/DCP8 (16 heads per rank, padding to FlashMLA's
    64-head fp8 envelope): gathered over a replica of 2 or 4 the heads still
    pad to 64 and the builder builds; over all 8 ranks (K = 8, or K = 4 on
    the D-wide group) they pad to 128 and vLLM's builder refuses, so ``plan``
    marks the latent group refused and exits 2 naming it and both envelopes."""
    config = json.dumps(
        {
            "dcp_geometry": {
                "layers": {"model.layers.*": layers},
                "partial_collectives": collectives,
            }
        }
    )
    code, out, err = run_cli(
        "plan", "-p", "deepseek-v32-tp8-dcp8", "--additional-config", config
    )
    if not refused:
        assert code == 0, err
        return
    assert code == 2
    assert "latent.k4" in out and "refused" in out
    (line,) = err.strip().splitlines()
    assert "FLASHMLA_SPARSE needs the local and gathered query heads" in line
    assert "16 heads per rank pad to 64, the 128 gathered over its W = 8" in line
