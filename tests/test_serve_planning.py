# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Planning the operator's own model: ``--model DIR`` and serve flags parsed
by vLLM's own parser, groups built from vLLM's model code on the meta device
(a fresh planning process), each group naming its source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.attention import cpu_platform  # noqa: F401
from vllm_dcp_geometry.tooling.topology import (
    TopologyError,
    model_configs_dir,
    topology_from_mapping,
)

pytestmark = pytest.mark.long_running

MODELS = model_configs_dir()


@pytest.fixture
def run_cli_json(run_cli):
    def run(*args: str) -> tuple[int, dict]:
        code, out, err = run_cli(*args)
        return code, (json.loads(out) if out.strip() else {"stderr": err})

    return run


@pytest.mark.slow
def test_llama_plan_from_the_serve_line_matches_vllms_parse(run_cli) -> None:
    """``plan -- vllm serve DIR ...``: the flags vLLM's parser takes (a
    frontend flag included), the groups vLLM's layers give; a near-miss
    ``additional_config`` section gets start-up's one warning."""
    code, out, err = run_cli(
        "plan", "--json", "--", "vllm", "serve", str(MODELS / "llama"),
        "--tensor-parallel-size", "16", "--decode-context-parallel-size", "2",
        "--port", "8123",
        "--additional-config", '{"dcp-geometry": {"layers": {"*": 1}}}',
    )  # fmt: skip
    assert code == 0, err
    warned = [line for line in err.splitlines() if "resembles" in line]
    assert len(warned) == 1
    assert "'dcp-geometry' resembles 'dcp_geometry'" in warned[0]
    plan = json.loads(out)
    (group,) = plan["groups"]
    assert group["source"] == "model"
    assert group["kind"] == "full_attention"
    assert group["num_layers"] == 4
    assert group["layer_class"].endswith("attention.attention.Attention")
    assert group["attention_backend"] == "FLASH_ATTN"
    # Llama-3.1-70B: 8 KV heads x 128 over TP16 -> one KV head per rank.
    assert group["shard_count"] == 2
    assert plan["inputs"]["tensor_parallel_size"] == 16


def test_vllm_validation_is_one_line_exit_2(run_cli) -> None:
    """vLLM's own refusal of the layout (GQA: TP must exceed the KV heads
    for DCP) comes back as one line, exit 2."""
    code, out, err = run_cli(
        "plan", "--model", str(MODELS / "llama"),
        "--tensor-parallel-size", "8", "--decode-context-parallel-size", "8",
    )  # fmt: skip
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "vLLM refuses the serve flags" in err


def test_unknown_flags_without_a_model_are_refused(run_cli) -> None:
    code, _, err = run_cli("plan", "--tensor-parallel-size", "8")
    assert code == 2
    assert "unrecognized arguments" in err


def test_a_spec_the_schema_cannot_rebuild_fails_closed() -> None:
    """The check that the topology rebuilds vLLM's own spec fails on a
    deliberately different spec (K silently changed)."""
    import vllm_dcp_geometry
    from vllm_dcp_geometry.tooling import vllm_objects
    from vllm_dcp_geometry.tooling.serve.deployment import _check_rebuilt
    from vllm_dcp_geometry.tooling.serve.model_build import CollectedLayer

    vllm_dcp_geometry.register()
    mapping = {
        "name": "t",
        "parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
        "groups": [
            {
                "name": "g0", "kind": "full_attention", "layers": ["a"],
                "block_size": 16, "num_kv_heads": 1, "head_size": 128,
                "dtype": "bfloat16", "source": "model",
            }
        ],
    }  # fmt: skip
    topology = topology_from_mapping(mapping)
    spec = vllm_objects.build_spec(topology.groups[0], topology, patched=True)
    same = CollectedLayer("a", spec, "x.Attention", "FLASH_ATTN", False)
    _check_rebuilt(topology, {"g0": [same]})
    from dataclasses import replace

    other = replace(same, spec=replace(spec, dcp_kv_shard_count=2))
    with pytest.raises(TopologyError, match=r"layer 'a'.*cannot describe"):
        _check_rebuilt(topology, {"g0": [other]})


@pytest.mark.slow
def test_emitted_topology_from_a_model_round_trips(
    tmp_path: Path, run_cli_json
) -> None:
    """DeepSeek-V3.2 with its MTP draft, built from vLLM's CUDA model code:
    latent and indexer caches of one uniform-type group become two groups of
    the real layer classes; the emitted file plans the same. At K = D = 8 the
    FLASHMLA_SPARSE builder refuses 16 local heads against 128 gathered ones
    (as vLLM alone does); the operators' layout, 2 replicas of K = 4, plans."""
    serve = [
        "--model", str(MODELS / "deepseek-v32"),
        "--tensor-parallel-size", "8", "--decode-context-parallel-size", "8",
        "--kv-cache-dtype", "fp8_ds_mla",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
    ]  # fmt: skip
    code, refused = run_cli_json("plan", "--json", *serve)
    assert code == 2, refused
    assert "FLASHMLA_SPARSE needs the local and gathered query heads" in str(refused)
    out = tmp_path / "dsv32.json"
    k4 = '{"dcp_geometry": {"layers": {"model.layers.*": 4}}}'
    code, plan = run_cli_json(
        "plan", "--json", *serve, "--additional-config", k4,
        "--emit-topology", str(out),
    )  # fmt: skip
    assert code == 0, plan
    assert {g["shard_count"] for g in plan["groups"] if not g["draft"]} == {4}
    classes = {g["layer_class"].rsplit(".", 1)[-1] for g in plan["groups"]}
    assert classes == {"DeepseekV32Attention", "DeepseekV32IndexerCache"}
    assert {g["source"] for g in plan["groups"]} == {"model"}
    assert {g["block_size"] for g in plan["groups"]} == {64}
    drafts = [layer for g in plan["groups"] if g["draft"] for layer in g["layers"]]
    assert drafts and all(".layers.4." in layer for layer in drafts)
    emitted = json.loads(out.read_text())
    code, again = run_cli_json("plan", "--json", "--topology", str(out))
    assert code == 0
    assert [g["shard_count"] for g in again["groups"]] == [
        g["shard_count"] for g in plan["groups"]
    ]
    assert emitted["groups"][0]["source"] == "model"


@pytest.mark.slow
@pytest.mark.vllm_releases("0.34.0")
def test_a_draft_built_at_dcp_1_plans_replicated_and_refuses_sharding_it(
    run_cli_json,
) -> None:
    """vLLM 0.34.0's ``draft_decode_context_parallel_size = 1``: DeepSeek-V3.2's
    MTP draft is built at DCP 1 (its impl's world 1) and its cache marked
    replicated, as the worker's speculator does; ``plan`` admits it at K = 1
    beside the target's K = 4, and refuses an override that shards it at
    K = 4 (the impl reads world 1), as start-up does."""
    spec = json.dumps(
        {
            "method": "mtp",
            "num_speculative_tokens": 1,
            "draft_decode_context_parallel_size": 1,
        }
    )
    serve = [
        "--model", str(MODELS / "deepseek-v32"),
        "--tensor-parallel-size", "8", "--decode-context-parallel-size", "8",
        "--kv-cache-dtype", "fp8_ds_mla", "--speculative-config", spec,
    ]  # fmt: skip
    target_k4 = '{"dcp_geometry": {"layers": {"model.layers.[0-3].*": 4}}}'
    code, plan = run_cli_json(
        "plan", "--json", *serve, "--additional-config", target_k4
    )
    assert code == 0, plan
    draft_k = {g["shard_count"] for g in plan["groups"] if g["draft"]}
    assert draft_k == {1}
    assert {g["shard_count"] for g in plan["groups"] if not g["draft"]} == {4}
    every_k4 = '{"dcp_geometry": {"layers": {"model.layers.*": 4}}}'
    code, refused = run_cli_json(
        "plan", "--json", *serve, "--additional-config", every_k4
    )
    assert code == 2, refused
    assert "model.layers.4." in str(refused), refused
    assert "built for a DCP world of 1" in str(refused), refused


@pytest.mark.slow
def test_kimi_k3_with_its_dspark_draft_on_their_own_backends(run_cli_json) -> None:
    """Kimi-K3 and its DSpark draft from vLLM's CUDA model code: the target
    on ``--attention-backend FLASHMLA``, the draft on the backend vLLM's
    DSpark loader picks itself (FLASHINFER_MLA, the SM90 backend with
    non-causal multi-token DCP), KDA state in recurrent groups."""
    draft = json.dumps(
        {
            "method": "dspark",
            "model": str(MODELS / "kimi-k3-dspark"),
            "num_speculative_tokens": 7,
        }
    )
    code, plan = run_cli_json(
        "plan", "--json", "--model", str(MODELS / "kimi-k3"),
        "--tensor-parallel-size", "16", "--decode-context-parallel-size", "16",
        "--attention-backend", "FLASHMLA", "--speculative-config", draft,
    )  # fmt: skip
    assert code == 0, plan
    groups = plan["groups"]
    mla = [g for g in groups if g["kind"] == "mla"]
    assert {g["attention_backend"] for g in mla if not g["draft"]} == {"FLASHMLA"}
    assert {g["attention_backend"] for g in mla if g["draft"]} == {"FLASHINFER_MLA"}
    assert {g["layer_class"].rsplit(".", 1)[-1] for g in mla} == {
        "MultiHeadLatentAttention"
    }
    # 96 query heads over TP16, latent 512 of a 576-wide row (the real K3).
    assert {g["query_heads"] for g in mla if not g["draft"]} == {96}
    assert {g["kv_lora_rank"] for g in mla} == {512}
    recurrent = [g for g in groups if g["kind"] == "mamba"]
    assert recurrent and all(g["shard_count"] == 1 for g in recurrent)
    assert {g["source"] for g in groups} == {"model"}


@pytest.mark.slow
@pytest.mark.patches("worker.gpt_oss_attention", "worker.flash_attn")
def test_gpt_oss_runs_under_dcp_with_its_sliding_layers_replicated(
    tmp_path: Path, run_cli, run_cli_json
) -> None:
    """gpt-oss at TP32/DCP4 (TP above its 8 KV heads, as vLLM's DCP check
    needs): vLLM 0.33.0's layer divides its KV heads by TP (0 per rank); the
    plugin's layer keeps the one its QKV projection replicates. Its sharded
    sliding-window layers are refused as start-up refuses them; replicated,
    they run locally and the full layers, sinks and all, run DCP."""
    model = ("--model", str(MODELS / "gpt-oss"))
    flags = (
        "--tensor-parallel-size", "32", "--decode-context-parallel-size", "4",
        "--max-model-len", "131072",
    )  # fmt: skip
    code, _, err = run_cli("plan", *model, *flags)
    assert code == 2
    assert "'g0' is a sliding-window cache sharded over DCP (D=4)" in err
    replicated = '{"dcp_geometry": {"layers": {"model.layers.*[02468].attn.attn": 1}}}'
    plan, emitted = _emitted_groups(
        tmp_path, run_cli_json, *model, *flags, "--additional-config", replicated
    )
    config = _config("gpt-oss")
    by_kind = {g["kind"]: g for g in plan["groups"]}
    sliding, full = by_kind["sliding_window"], by_kind["full_attention"]
    assert (sliding["shard_count"], sliding["attention_mode"]) == (1, "local")
    assert (full["shard_count"], full["attention_mode"]) == (4, "dcp")
    for group in (sliding, full):
        assert group["source"] == "model"
        assert group["num_layers"] == config["num_hidden_layers"] // 2
        fields = emitted[group["name"]]
        # One KV head per rank, the QKV projection's replica (not 8 // 32).
        assert fields["num_kv_heads"] == 1
        assert fields["head_size"] == config["head_dim"]
        assert fields["attention_features"] == ["sinks"]
    assert emitted[sliding["name"]]["sliding_window"] == config["sliding_window"]
    assert (
        plan["totals"]["without_dcp"]["kv_bytes_per_request_per_rank"]
        > (plan["totals"]["kv_bytes_per_request_per_rank"])
    )


@pytest.mark.patches("worker.gpt_oss_attention")
@pytest.mark.usefixtures("cpu_platform")
def test_gpt_oss_layer_keeps_the_projections_kv_heads() -> None:
    """The wrapper hands back to upstream's hook where the counts agree or
    DCP is off, and otherwise sets the layer's count and K/V split width
    from its QKV projection before the hook builds the ``Attention``."""
    import types

    from vllm.model_executor.models.gpt_oss import OAIAttention

    from vllm_dcp_geometry.patches.worker import gpt_oss_attention
    from vllm_dcp_geometry.runtime.patching import ORIGINAL_ATTR

    assert hasattr(OAIAttention._build_attention, ORIGINAL_ATTR)
    seen = []
    build = gpt_oss_attention._make_build_attention(
        lambda layer, *args: seen.append(
            (layer.num_local_key_value_heads, layer.kv_size)
        )
    )
    for dcp, held, expected in ((4, 1, (1, 64)), (1, 1, (0, 0)), (4, 0, (0, 0))):
        layer = types.SimpleNamespace(
            qkv_proj=types.SimpleNamespace(num_kv_heads=held),
            num_local_key_value_heads=0,
            kv_size=0,
            head_dim=64,
        )
        with _dcp_world_size(dcp):
            build(layer, None, None, None, "model.layers.1.attn")
        assert seen.pop() == expected, (dcp, held)


def _dcp_world_size(dcp: int):
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config

    return set_current_vllm_config(
        VllmConfig(
            parallel_config=ParallelConfig(
                tensor_parallel_size=dcp, decode_context_parallel_size=dcp
            )
        )
    )


def _config(model: str) -> dict:
    return json.loads((MODELS / model / "config.json").read_text())


def _emitted_groups(tmp_path: Path, run_cli_json, *flags: str) -> tuple[dict, dict]:
    """``plan --json`` on a test model and the topology it emits (its
    groups by name, spec fields included)."""
    out = tmp_path / "emitted.json"
    code, plan = run_cli_json("plan", "--json", *flags, "--emit-topology", str(out))
    assert code == 0, plan
    emitted = {g["name"]: g for g in json.loads(out.read_text())["groups"]}
    return plan, emitted


@pytest.mark.slow
def test_glm5_groups_follow_its_config(tmp_path: Path, run_cli_json) -> None:
    """GLM-5 (``GlmMoeDsaForCausalLM``, DeepSeek-V3.2's DSA code) with its MTP
    layer: every layer's latent and indexer cache, at the widths its
    ``config.json`` gives, the MTP layer's as the draft."""
    config = _config("glm-5")
    plan, emitted = _emitted_groups(
        tmp_path, run_cli_json,
        "--model", str(MODELS / "glm-5"),
        "--tensor-parallel-size", "8", "--decode-context-parallel-size", "8",
        "--kv-cache-dtype", "fp8_ds_mla",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
    )  # fmt: skip
    layers = config["num_hidden_layers"]
    mtp = config["num_nextn_predict_layers"]
    latent = [g for g in emitted.values() if g.get("cache_role") == "sparse"]
    indexer = [g for g in emitted.values() if g.get("cache_role") == "indexer"]
    for caches, suffix in ((latent, "attn"), (indexer, "indexer.k_cache")):
        names = sorted(name for g in caches for name in g["layers"])
        assert names == sorted(
            f"model.layers.{i}.self_attn.{suffix}" for i in range(layers + mtp)
        )
        drafts = {name for g in caches if g["draft"] for name in g["layers"]}
        assert drafts == {f"model.layers.{layers}.self_attn.{suffix}"}
    rope = config["qk_rope_head_dim"]
    assert {g["head_size"] for g in latent} == {config["kv_lora_rank"] + rope}
    assert {g["kv_lora_rank"] for g in latent} == {config["kv_lora_rank"]}
    assert {g["query_heads"] for g in latent} == {config["num_attention_heads"]}
    assert {g["topk_buffer_width"] for g in latent} == {config["index_topk"]}
    # The indexer key and its fp8 scale (4 bytes) per token.
    assert {g["head_size"] for g in indexer} == {config["index_head_dim"] + 4}
    assert {g["source"] for g in plan["groups"]} == {"model"}
    assert {g["shard_count"] for g in plan["groups"]} == {8}
    assert {g["attention_backend"] for g in plan["groups"]} == {
        "FLASHMLA_SPARSE",
        "DEEPSEEK_V32_INDEXER",
    }


@pytest.mark.slow
def test_qwen3_next_groups_follow_its_config(tmp_path: Path, run_cli_json) -> None:
    """Qwen3-Next (GDN hybrid) with its MTP layer: every
    ``full_attention_interval``-th layer is gated attention (DCP-sharded),
    the others GDN state (recurrent, K = 1), one block size for all."""
    config = _config("qwen3-next")
    plan, emitted = _emitted_groups(
        tmp_path, run_cli_json,
        "--model", str(MODELS / "qwen3-next"),
        "--tensor-parallel-size", "4", "--decode-context-parallel-size", "2",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}',
    )  # fmt: skip
    interval = config["full_attention_interval"]
    full = {i for i in range(config["num_hidden_layers"]) if (i + 1) % interval == 0}
    by_kind: dict[str, set[str]] = {}
    for group in emitted.values():
        by_kind.setdefault(group["kind"], set()).update(group["layers"])
    assert by_kind["full_attention"] == {
        *(f"model.layers.{i}.self_attn.attn" for i in full),
        "mtp.layers.0.self_attn.attn",
    }
    assert by_kind["mamba"] == {
        f"model.layers.{i}.linear_attn"
        for i in range(config["num_hidden_layers"])
        if i not in full
    }
    attention = [g for g in emitted.values() if g["kind"] == "full_attention"]
    # Two KV heads over TP4: each rank holds one (replicated).
    assert {g["num_kv_heads"] for g in attention} == {1}
    assert {g["head_size"] for g in attention} == {config["head_dim"]}
    assert {g["query_heads"] for g in attention} == {config["num_attention_heads"]}
    shard_counts = {g["kind"]: set() for g in plan["groups"]}
    for group in plan["groups"]:
        shard_counts[group["kind"]].add(group["shard_count"])
    assert shard_counts == {"full_attention": {2}, "mamba": {1}}
    assert len({g["block_size"] for g in plan["groups"]}) == 1
    assert {g["source"] for g in plan["groups"]} == {"model"}


@pytest.mark.slow
def test_without_the_hybrid_manager_a_gdn_hybrid_is_refused(run_cli) -> None:
    """``--disable-hybrid-kv-cache-manager`` reaches vLLM's planner, which
    cannot unify GDN state with attention: start-up's refusal, one line."""
    code, out, err = run_cli(
        "plan", "--model", str(MODELS / "qwen3-next"),
        "--tensor-parallel-size", "4", "--decode-context-parallel-size", "2",
        "--disable-hybrid-kv-cache-manager",
    )  # fmt: skip
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "Qwen3NextForCausalLM" in err
    assert "Failed to promote local KV cache specs to one unified type" in err
