# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Overrides applied by the real runners' ``get_kv_cache_spec`` (V1 and V2),
checked by the engine core, and carried by ``EngineArgs`` from the CLI.

The runners are not constructed (that needs a GPU); their unbound
``get_kv_cache_spec`` runs on an instance created without ``__init__`` that
holds a real ``VllmConfig`` whose static forward context contains real
attention-layer objects (a minimal ``AttentionLayerBase`` subclass returning
real specs).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.support import scheduler as topo
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "worker.gpu_model_runner",
    "worker.gpu_model_runner_v2",
    "engine_core.kv_cache_planning",
)

LAYER_NAMES = {
    "model.layers.0.self_attn.attn": "full",
    "model.layers.1.self_attn.attn": "full",
    "model.layers.2.mixer": "mamba",
    "model.layers.3.self_attn.attn": "full",
    "model.layers.4.self_attn.attn": "mla",
    "model.layers.5.self_attn.attn": "window",
    "model.mtp.draft.0.attn": "full",
}


def make_spec(kind: str) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

    common = {"block_size": 64, "dtype": torch.bfloat16}
    if kind == "full":
        return topo.attention_spec()
    if kind == "mamba":
        return topo.mamba_spec()
    if kind == "mla":
        return MLAAttentionSpec(num_kv_heads=1, head_size=576, **common)
    return SlidingWindowSpec(
        num_kv_heads=1, head_size=128, sliding_window=512, dcp_sharded=False, **common
    )


def _layer_class() -> type:
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.v1.attention.backend import AttentionBackend

    class SpecLayer(AttentionLayerBase):
        def __init__(self, spec: Any) -> None:
            self.spec = spec

        def get_attn_backend(self) -> type:
            return AttentionBackend

        def get_kv_cache_spec(self, vllm_config: Any) -> Any:
            return self.spec

    return SpecLayer


@pytest.fixture
def make_config(monkeypatch: pytest.MonkeyPatch):
    from vllm.platforms import current_platform

    # VllmConfig needs a device type; the unspecified platform has none.
    monkeypatch.setattr(current_platform, "device_type", "cpu")

    def make(layers: dict[str, Any], dcp: int = 16, pp: int = 1, pcp: int = 1):
        from vllm.config import ParallelConfig, VllmConfig

        config = VllmConfig(
            parallel_config=ParallelConfig(
                tensor_parallel_size=dcp // pcp,
                decode_context_parallel_size=dcp,
                prefill_context_parallel_size=pcp,
                pipeline_parallel_size=pp,
            ),
            additional_config={"dcp_geometry": {"layers": layers}} if layers else {},
        )
        layer_cls = _layer_class()
        context = config.compilation_config.static_forward_context
        for name, kind in LAYER_NAMES.items():
            context[name] = layer_cls(make_spec(kind))
        return config

    return make


def run_v1(config: Any) -> dict[str, Any]:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.vllm_config = config
    runner.shared_kv_cache_layers = {}
    return GPUModelRunner.get_kv_cache_spec(runner)


def run_v2(config: Any) -> dict[str, Any]:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.vllm_config = config
    runner.speculator = None
    runner.dcp_size = config.parallel_config.decode_context_parallel_size
    return GPUModelRunner.get_kv_cache_spec(runner)


RUNNERS = pytest.mark.parametrize(
    "run",
    [
        # Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it).
        pytest.param(run_v1, id="v1", marks=pytest.mark.vllm_releases("0.33.0")),
        pytest.param(run_v2, id="v2"),
    ],
)


def run_default(config: Any) -> dict[str, Any]:
    """The release's first runner: V1 where it exists (0.33.0), else V2."""
    return run_v1(config) if has_model_runner_v1() else run_v2(config)


def release_runners() -> tuple[Any, ...]:
    """Every runner the installed release has."""
    return (run_v1, run_v2) if has_model_runner_v1() else (run_v2,)


OPERATOR_LAYERS = {
    "model.layers.3.self_attn.attn": 4,
    "model.mtp.draft.*": "replicated",
    "model.layers.0.*": "sharded",
    "model.layers.2.mixer": "replicated",
}


@RUNNERS
def test_overrides_applied_by_the_runner(run, make_config) -> None:
    from vllm.v1.kv_cache_interface import get_kv_cache_dcp_shard_count

    plain = run(make_config({}))
    specs = run(make_config(OPERATOR_LAYERS))
    assert set(specs) == set(plain) == set(LAYER_NAMES)
    k = {name: get_kv_cache_dcp_shard_count(s, 16) for name, s in specs.items()}
    assert k["model.layers.3.self_attn.attn"] == 4
    assert specs["model.layers.3.self_attn.attn"].dcp_kv_shard_count == 4
    assert k["model.mtp.draft.0.attn"] == 1
    assert specs["model.mtp.draft.0.attn"].dcp_sharded is False
    assert k["model.layers.0.self_attn.attn"] == 16
    # Layers no pattern matches, and no-op overrides, are the runner's own.
    for name in (
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
        "model.layers.2.mixer",
        "model.layers.4.self_attn.attn",
        "model.layers.5.self_attn.attn",
    ):
        assert specs[name] == plain[name], name
    # Only the DCP fields change.
    changed = specs["model.layers.3.self_attn.attn"]
    assert (
        changed.page_size_bytes
        == plain["model.layers.3.self_attn.attn"].page_size_bytes
    )


@RUNNERS
def test_an_mla_layer_takes_a_partial_k(run, make_config) -> None:
    # Spec collection writes K; whether the MLA backend can run it is the
    # attention admission's decision when the builders are made.
    specs = run(make_config({"model.layers.4.self_attn.attn": 4}))
    assert specs["model.layers.4.self_attn.attn"].dcp_kv_shard_count == 4


@RUNNERS
def test_overrides_are_inert_at_dcp1(run, make_config) -> None:
    plain = run(make_config({}, dcp=1))
    specs = run(make_config({"model.layers.*.self_attn.attn": "replicated"}, dcp=1))
    assert specs == plain


@RUNNERS
@pytest.mark.parametrize(
    ("layers", "kwargs", "message"),
    [
        ({"model.layers.42.*": 4}, {}, "matches no layer"),
        ({"model.layers.3.*": 3}, {}, "K=3 must divide the DCP world size D=16"),
        ({"model.layers.2.*": 4}, {}, "layers.2.mixer.*never token-sharded"),
        ({"model.layers.5.*": 2}, {}, "layers.5.self_attn.attn.*only full attention"),
        ({"model.layers.3.*": 4}, {"pcp": 2}, "layers.3.self_attn.attn.*PCP=2"),
        (
            {"model.layers.3.*": 4, "*.self_attn.attn": "sharded"},
            {},
            "layers.3.self_attn.attn.*conflict",
        ),
        ({"model.layers.3.*": "4"}, {}, "without quotes"),
    ],
)
def test_override_errors_at_spec_collection(
    run, make_config, layers, kwargs, message
) -> None:
    with pytest.raises(DcpGeometryError, match=message):
        run(make_config(layers, **kwargs))


@RUNNERS
def test_a_null_section_is_refused_at_spec_collection(run, make_config) -> None:
    config = make_config({})
    config.additional_config = {"dcp_geometry": None}
    with pytest.raises(DcpGeometryError, match=r"\['dcp_geometry'\] must be a mapping"):
        run(config)


@RUNNERS
def test_equal_values_written_differently_are_no_conflict(run, make_config) -> None:
    from vllm.v1.kv_cache_interface import get_kv_cache_dcp_shard_count

    specs = run(
        make_config(
            {
                "model.layers.3.*": 1,
                "*.3.self_attn.attn": "replicated",
                "model.layers.0.*": 16,
                "*.0.self_attn.attn": "sharded",
            }
        )
    )
    k = {name: get_kv_cache_dcp_shard_count(s, 16) for name, s in specs.items()}
    assert k["model.layers.3.self_attn.attn"] == 1
    assert k["model.layers.0.self_attn.attn"] == 16


@RUNNERS
def test_pipeline_stage_skips_unmatched_check(run, make_config) -> None:
    config = make_config({"model.layers.42.*": 4, "model.layers.3.*": 4}, pp=2)
    specs = run(config)
    assert specs["model.layers.3.self_attn.attn"].dcp_kv_shard_count == 4


def test_engine_core_checks_every_worker(make_config) -> None:
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    from vllm_dcp_geometry.runtime.spec_overrides import check_applied

    config = make_config(OPERATOR_LAYERS)
    applied = run_default(config)
    plain = run_default(make_config({}))
    # A worker without the plugin reports the runner's own geometry.
    with pytest.raises(DcpGeometryError, match="plugin loaded in every worker"):
        get_global_kv_cache_groups(config, [applied, plain])
    # Pipeline stages: each pattern must match a layer of some stage.
    stage_a = {n: s for n, s in applied.items() if n.startswith("model.layers")}
    stage_b = {n: s for n, s in applied.items() if not n.startswith("model.layers")}
    # (Grouping itself needs a model config; the check runs first.)
    check_applied([stage_a, stage_b], config)
    check_applied([applied, applied], config)
    lost = make_config({**OPERATOR_LAYERS, "model.layers.42.*": 2})
    with pytest.raises(DcpGeometryError, match=r"layers\.42"):
        get_global_kv_cache_groups(lost, [stage_a, stage_b])


def test_start_up_warns_once_of_a_near_miss_section(make_config, caplog) -> None:
    """The engine core's planning (once per start-up) names a key that only
    resembles the plugin's section; start-up goes on, the overrides unapplied."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    config = make_config({})
    config.additional_config["dcp_geomtry"] = {"layers": OPERATOR_LAYERS}
    specs = run_default(config)
    assert specs == run_default(make_config({}))
    # Grouping itself needs a model config; the check runs first.
    with (
        caplog.at_level("WARNING", logger="vllm_dcp_geometry"),
        pytest.raises(AttributeError, match="supports_kv_cache_grouping"),
    ):
        get_global_kv_cache_groups(config, [specs])
    warned = [r.getMessage() for r in caplog.records if "resembles" in r.getMessage()]
    assert len(warned) == 1
    assert "'dcp_geomtry' resembles 'dcp_geometry'" in warned[0]


def test_engine_args_carry_overrides_from_the_cli(tmp_path, monkeypatch) -> None:
    """``--additional-config`` as the CLI parses it reaches VllmConfig; the
    runner-side application then reads it from there."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setattr(current_platform, "device_type", "cpu")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "num_hidden_layers": 2,
                "vocab_size": 256,
                "max_position_embeddings": 4096,
                "torch_dtype": "float32",
            }
        )
    )
    overrides = {"dcp_geometry": {"layers": {"model.layers.1.self_attn.attn": 2}}}
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            str(tmp_path),
            "--skip-tokenizer-init",
            "--tensor-parallel-size",
            "4",
            "--decode-context-parallel-size",
            "4",
            "--additional-config",
            json.dumps(overrides),
        ]
    )
    engine_config = EngineArgs.from_cli_args(args).create_engine_config()
    assert engine_config.additional_config == overrides
    assert engine_config.parallel_config.decode_context_parallel_size == 4

    layer_cls = _layer_class()
    context = engine_config.compilation_config.static_forward_context
    for i in (0, 1):
        context[f"model.layers.{i}.self_attn.attn"] = layer_cls(topo.attention_spec())
    for run in release_runners():
        specs = run(engine_config)
        assert specs["model.layers.1.self_attn.attn"].dcp_kv_shard_count == 2
        assert specs["model.layers.0.self_attn.attn"] == topo.attention_spec()
    engine_config.additional_config = {
        "dcp_geometry": {"layers": {"model.layers.1.self_attn.attn": 3}}
    }
    with pytest.raises(DcpGeometryError, match=r"K=3 must divide .*D=4"):
        run_default(engine_config)
