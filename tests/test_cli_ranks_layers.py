# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks`` runs each taught layer class across real worker processes, by
the class a group names: Kimi-K3's own ``MultiHeadLatentAttention`` (the
default profile's target and its DSpark draft) beside vLLM's generic
``MLAAttention``.

Two real runs (about 3 min on 2 cores together):

- the default profile (Kimi-K3 and its replicated DSpark draft) at D = 4
  with ``--scale 8``: every MLA group runs through Kimi-K3's layer, built by
  its own constructor and run through its own ``_attention``; the target
  groups K = D, the draft replicated (K = 1) decoding a non-causal
  multi-token block; every rank within the dtype's tolerance, bytes equal to
  the formula;
- a Kimi-K3 topology at D = 4 with K = 4, a partial K = 2 (within its
  replica) and a replicated non-causal draft, in float32 (``--float32``)
  with ``--baseline``: patched every rank within 1e-5 of float64, unpatched
  vLLM wrong on K = 2 and the draft.

Then, with no new process: the default run's results merged against a plan
naming another class fail (the class check), and the planning rules
(refusals with their reasons, the head floor of ``--scale``).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.contract.layer_classes import KIMI_K3_MLA
from vllm_dcp_geometry.tooling.cli import EXIT_OK, EXIT_VIOLATION, main
from vllm_dcp_geometry.tooling.cli.ranks import cases, run, shapes
from vllm_dcp_geometry.tooling.cli.ranks.report import format_report
from vllm_dcp_geometry.tooling.topology import load_profile, topology_from_mapping

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "common.kv_cache_interface",
        "worker.gpu_worker",
        "worker.kimi_k3_mla",
        "worker.mla_attention",
        "worker.mla_dcp_manager",
        "worker.utils",
    ),
]

KIMI_OPS = (
    "torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert",
    "torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert",
    "torch.ops._C.fused_kimi_k3_mla_kv_concat",
)


def _run(*args: str) -> tuple[int, dict[str, Any], Any]:
    """One ``ranks --json`` run: its exit code, report and the workers'
    results (as the launcher returned them)."""
    launched: list[Any] = []
    real_launch = run.launch

    def recording(*a: Any, **k: Any) -> Any:
        launched.append(real_launch(*a, **k))
        return launched[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(run, "launch", recording)
        code = main(["ranks", *args, "--json", "--no-progress"])
    return code, json.loads(out.getvalue()), launched[0] if launched else None


def _nccl_bytes(world: int, tokens: int, shape: dict[str, Any]) -> int:
    """vLLM's MLA decode step on NCCL, restated: all-gathers of the [T, h,
    L + R] query and [T, W h] LSE (TRITON_MLA: in the query's dtype), a
    reduce-scatter of the [T, W h, L] partial output; ring traffic."""
    if world == 1:
        return 0
    h, e = shape["heads_per_rank"], 2
    gathered = tokens * h * (shape["kv_lora_rank"] + shape["rope_dim"] + world) * e
    scattered = tokens * world * h * shape["kv_lora_rank"] * e
    return 2 * (world - 1) * gathered + 2 * (world - 1) * scattered // world


@pytest.fixture(scope="module")
def default_profile() -> dict[str, Any]:
    code, report, launched = _run("--dcp", "4", "--scale", "8")
    return {"code": code, "report": report, "launched": launched}


def test_the_default_profile_runs_every_kimi_k3_group(
    default_profile: dict[str, Any],
) -> None:
    report = default_profile["report"]
    assert default_profile["code"] == EXIT_OK and report["ok"] is True
    groups = {g["name"]: g for g in report["groups"]}
    run_names = sorted(n for n, g in groups.items() if g["status"] == "run")
    assert run_names == sorted([*(f"mla.{i}" for i in range(5)), "draft"])
    for name, g in groups.items():
        if name.startswith("kda."):
            assert g["status"] == "not run" and "recurrent" in g["reason"]
            continue
        assert g["layer_class_run"] == [KIMI_K3_MLA] and g["layer_class_matches"]
        assert g["numerics_ok"] is True and g["traffic_matches_formula"] is True
        assert g["unmodeled_collectives"] == []
        tokens = g["decode_tokens_per_step"]
        world = g["collective_world_size"]
        assert g["nccl_formula_bytes_per_rank_per_step"] == _nccl_bytes(
            world, tokens, g["shape"]
        )
    for i in range(5):
        target = groups[f"mla.{i}"]
        assert target["shard_count"] == 4 and target["attention_world_size"] == 4
        assert target["decode_tokens_per_step"] == 3
    draft = groups["draft"]
    assert draft["shard_count"] == 1 and draft["attention_mode"] == "local"
    assert draft["attention_world_size"] == 1
    assert draft["collective_bytes_per_rank_per_step"] == 0
    # A non-causal block of NON_CAUSAL_DECODE_TOKENS per request, 3 requests.
    assert draft["decode_tokens_per_step"] == 3 * shapes.NON_CAUSAL_DECODE_TOKENS
    assert draft["shape"]["heads_per_rank"] == 2  # 64 / 4 / 8, at least 2
    for op in KIMI_OPS:
        assert op in report["stand_ins"]
    assert format_report(report).rstrip().endswith("OK")


def test_a_run_of_another_class_than_planned_fails(
    default_profile: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The default run's workers' results merged against a plan that names
    vLLM's generic MLAAttention for its groups: every one of them ran
    Kimi-K3's layer, so every one fails, naming the class it ran."""
    real_plan = cases.plan_groups

    def generic(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        planned = real_plan(*args, **kwargs)
        return [{**g, "layer_class": None} for g in planned]

    monkeypatch.setattr(run, "plan_groups", generic)
    monkeypatch.setattr(run, "launch", lambda *a, **k: default_profile["launched"])
    assert main(["ranks", "--dcp", "4", "--scale", "8", "--no-progress"]) == (
        EXIT_VIOLATION
    )
    text = capsys.readouterr().out
    assert text.count(f"ran {KIMI_K3_MLA}: FAILED") == 6
    assert text.rstrip().endswith("FAILED")


KIMI_TOPOLOGY = """\
name = "kimi-k3-layers"
[parallel]
tensor_parallel_size = 4
decode_context_parallel_size = 4
[limits]
max_model_len = 4096
max_num_seqs = 8
"""


def _kimi_group(name: str, layer: int, **fields: Any) -> str:
    lines = [
        f'name = "{name}"',
        'kind = "mla"',
        "block_size = 16",
        "num_kv_heads = 1",
        f'layers = ["model.layers.{layer}.self_attn"]',
        f'layer_class = "{KIMI_K3_MLA}"',
        "query_heads = 8",
        "kv_lora_rank = 512",
        "head_size = 576",
        'dtype = "bfloat16"',
        *(f"{k} = {json.dumps(v)}" for k, v in fields.items()),
    ]
    return "[[groups]]\n" + "\n".join(lines) + "\n"


def test_kimi_k3_partial_and_replicated_groups_and_the_unpatched_baseline(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kimi.toml"
    path.write_text(
        KIMI_TOPOLOGY
        + _kimi_group("kimi.k4", 0)
        + _kimi_group("kimi.k2", 1, dcp_kv_shard_count=2)
        + _kimi_group(
            "draft",
            2,
            draft=True,
            dcp_sharded=False,
            non_causal_multi_token_decode=True,
        )
    )
    code, report, _ = _run("-t", str(path), "--baseline", "--float32")
    assert report["patched_ok"] is True and report["replica_groups"] == [2]
    patched = {g["name"]: g for g in report["groups"]}
    assert [patched[n]["attention_world_size"] for n in ("kimi.k4", "kimi.k2")] == [
        4,
        2,
    ]
    for g in patched.values():
        assert g["ok"] is True and g["layer_class_run"] == [KIMI_K3_MLA], g
        # In float32 every rank is within 1e-5 of the float64 reference.
        assert g["shape"]["dtype"] == "float32"
        assert g["max_abs_error"] <= 1e-5 and g["max_lse_error"] <= 1e-5, g
    # Unpatched vLLM attends every cache as sharded over D: right for K = D,
    # wrong for the partial group and the replicated draft (which, on
    # 0.34.0, crashes instead: its builder takes world 1, its impl D).
    assert code == EXIT_VIOLATION and report["ok"] is False
    baseline = {g["name"]: g for g in report["baseline"]["groups"]}
    assert baseline["kimi.k4"]["ok"] is True
    for name in ("kimi.k2", "draft"):
        g = baseline[name]
        assert g["ok"] is False and g["attention_world_size"] == 4, g
        if g.get("crashed"):
            assert g["crashed_in"] and all(" (at vllm/" in c for c in g["crashed"])
        else:
            assert g["numerics_ok"] is False, g


# Planning (no process) ---------------------------------------------------------


def _topology(**draft_fields: Any) -> Any:
    group = {
        "name": "draft",
        "kind": "mla",
        "block_size": 16,
        "layers": ["model.layers.0.self_attn"],
        "num_kv_heads": 1,
        "head_size": 576,
        "kv_lora_rank": 512,
        "query_heads": 8,
        "dtype": "bfloat16",
        "layer_class": KIMI_K3_MLA,
        **draft_fields,
    }
    return topology_from_mapping(
        {
            "name": "t",
            "parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
            "limits": {"max_model_len": 4096, "max_num_seqs": 8},
            "groups": [group],
        },
        source="test",
    )


def _reason(topology: Any, *, gpu: bool = False, scale: int = 1) -> str | None:
    (planned,) = cases.plan_groups(
        topology, gpu=gpu, scale=scale, partial_collectives="replica"
    )
    return planned["reason"]


def test_a_non_causal_draft_under_dcp_runs_only_where_its_backend_does() -> None:
    """TRITON_MLA's builder has no DSpark DCP support: a non-causal draft at
    K > 1 is not run on a CPU (named), and is planned on a GPU (on
    FLASHINFER_MLA, vLLM's SM90 choice for it); replicated it runs here."""
    sharded = _topology(non_causal_multi_token_decode=True, dcp_kv_shard_count=2)
    assert _reason(sharded) == cases.NON_CAUSAL_DCP_REASON.format(backend="TRITON_MLA")
    assert _reason(sharded, gpu=True) is None
    replicated = _topology(non_causal_multi_token_decode=True, dcp_sharded=False)
    assert _reason(replicated) is None


def test_spec_values_and_classes_ranks_does_not_build_are_named() -> None:
    fp8 = _topology(cache_dtype_str="fp8", kv_quant_mode="FP8_PER_TENSOR")
    assert _reason(fp8) == (
        "not run: cache_dtype_str = 'fp8' needs a kernel or layer not built here"
    )
    unknown = _topology(layer_class="vllm.models.flint.model.FlintAttention")
    reason = _reason(unknown)
    assert reason is not None
    assert reason.startswith("not run: layer class FlintAttention (ranks builds ")
    assert "MultiHeadLatentAttention" in reason and "MLAAttention" in reason
    # Layout-only fields (memory strides, TP shards) run as they are.
    assert _reason(_topology(block_stride_multiple_of=64, max_tp_shards=1)) is None


def test_scaling_keeps_two_heads_and_one_local_bfloat16_head_is_refused() -> None:
    assert shapes.scaled_heads(16, 8) == 2
    assert shapes.scaled_heads(16, 16) == 2
    assert shapes.scaled_heads(1, 4) == 1
    assert shapes.scaled_heads(6, 2) == 3
    one_head = _topology(query_heads=4, dcp_sharded=False)
    reason = _reason(one_head)
    assert reason is not None and "non-grouped decode kernel" in reason
    assert _reason(one_head, gpu=True) is None
    # Sharded, the impl decodes the gathered heads: not one.
    assert _reason(_topology(query_heads=4)) is None
    # float16 is the interpreter's own numpy type: it runs.
    assert _reason(_topology(query_heads=4, dcp_sharded=False, dtype="float16")) is (
        None
    )


def test_the_default_profile_plans_every_mla_group_to_run() -> None:
    planned = cases.plan_groups(
        load_profile("kimi-k3-tp16-dcp16"),
        gpu=False,
        scale=1,
        partial_collectives="replica",
    )
    runs = {g["name"]: g["runner"] for g in planned if g["run"]}
    assert runs == {**{f"mla.{i}": "kimi_k3" for i in range(5)}, "draft": "kimi_k3"}
