# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm serve``'s ``--speculative-config`` and ``--additional-config`` in the
commands: the draft's backend by vLLM's inheritance rule, per-layer K by the
functions start-up applies, and ``--emit-topology``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib

from tests.support.attention import (
    attention_modes,
    cpu_platform,  # noqa: F401
    tiny_model_config,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.overrides import near_miss_sections
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.cli.plan.attention import draft_backend
from vllm_dcp_geometry.tooling.topology import (
    Topology,
    TopologyError,
    apply_additional_config,
    load_profile,
    load_topology_file,
    profile_names,
    topology_from_mapping,
    write_topology_file,
)
from vllm_dcp_geometry.tooling.topology.overrides import GROUP_LAYER_KINDS
from vllm_dcp_geometry.tooling.topology.writing import topology_toml

pytestmark = pytest.mark.patches("common.kv_cache_interface", "worker.utils")

KIMI, MLA_MIXED = "kimi-k3-tp16-dcp16", "mla-mixed-tp4-dcp4"


def _plan(capsys, *args: str, status: int = EXIT_OK) -> dict[str, Any]:
    assert main(["plan", "--json", *args]) == status
    return json.loads(capsys.readouterr().out)


def _one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def _draft(profile: str) -> Any:
    (group,) = [g for g in load_profile(profile).groups if g.draft]
    return group


# -- the draft's backend ----------------------------------------------------

BACKENDS = (None, "FLASHMLA", "TRITON_MLA", "FLASHINFER_MLA")


@pytest.mark.usefixtures("cpu_platform")
def test_the_draft_rule_is_vllms() -> None:
    """Both ways, against vLLM's own functions: an EAGLE/MTP draft inherits
    the target's backend unless the speculative config names its own
    (``SpeculativeConfig.apply_draft_overrides`` on a real ``VllmConfig``);
    a DSpark draft takes only its own, else vLLM's selector picks
    (``_resolve_dspark_attention_backend`` for Kimi-K3's DSpark model type)."""
    from vllm.config import AttentionConfig, replace
    from vllm.config.speculative import SpeculativeConfig
    from vllm.transformers_utils.configs.k3_dspark import K3DSparkConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import (
        _resolve_dspark_attention_backend,
    )

    def enum(name: str | None) -> Any:
        return None if name is None else AttentionBackendEnum[name]

    base = tiny_model_config(4, 1)
    dspark_model = SimpleNamespace(
        hf_config=SimpleNamespace(model_type=K3DSparkConfig.model_type)
    )
    eagle_draft, dspark_draft = _draft(MLA_MIXED), _draft(KIMI)
    target_group = load_profile(KIMI).groups[0]
    inherited = 0
    for target, named in itertools.product(BACKENDS, BACKENDS):
        config = replace(base, attention_config=AttentionConfig(backend=enum(target)))
        speculative = SimpleNamespace(
            attention_backend=enum(named), moe_backend=None, kv_cache_dtype=None
        )
        eagle = SpeculativeConfig.apply_draft_overrides(speculative, config)
        assert enum(draft_backend(eagle_draft, target, named)) == (
            eagle.attention_config.backend
        ), (target, named)
        assert enum(draft_backend(dspark_draft, target, named)) == (
            _resolve_dspark_attention_backend(dspark_model, enum(named), enum(target))
        ), (target, named)
        assert draft_backend(target_group, target, named) == target
        inherited += named is None and target is not None
    assert inherited == 3


def test_only_kimi_k3s_dspark_layer_is_non_causal() -> None:
    """The rule reads a DSpark draft from ``non_causal_multi_token_decode``:
    in vLLM 0.33.0 only Kimi-K3's DSpark MLA (``dspark_mla.py``) sets it."""
    import vllm

    root = Path(vllm.__file__).parent
    setters = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if "non_causal_multi_token_decode=True" in path.read_text(errors="ignore")
    )
    assert setters == ["models/kimi_k3/nvidia/dspark_mla.py"]


def test_target_on_flashmla_with_the_draft_on_flashinfer_mla(capsys) -> None:
    plan = _plan(
        capsys,
        "-p",
        KIMI,
        "--attention-backend",
        "FLASHMLA",
        "--speculative-config",
        '{"method": "dspark", "attention_backend": "FLASHINFER_MLA"}',
    )
    modes = attention_modes(plan)
    assert all(modes[f"mla.{i}"] == ("dcp", "FLASHMLA") for i in range(5))
    assert modes["draft"] == ("local", "FLASHINFER_MLA")
    assert plan["inputs"]["attention_backend"] == "FLASHMLA"
    assert plan["inputs"]["draft_attention_backend"] == "FLASHINFER_MLA"


def test_an_eagle_draft_inherits_unless_named(capsys) -> None:
    """vLLM's validator reads the name (any case; ``auto`` names none)."""
    plan = _plan(capsys, "-p", MLA_MIXED, "--attention-backend", "TRITON_MLA")
    assert attention_modes(plan)["draft"] == ("local", "TRITON_MLA")
    for spelled in ("flashinfer_mla", "FLASHINFER_MLA"):
        plan = _plan(
            capsys,
            "-p",
            MLA_MIXED,
            "--attention-backend",
            "TRITON_MLA",
            "--speculative-config",
            json.dumps({"attention_backend": spelled}),
        )
        assert attention_modes(plan)["draft"] == ("local", "FLASHINFER_MLA")
        assert attention_modes(plan)["mla.k4"] == ("dcp", "TRITON_MLA")
    plan = _plan(
        capsys,
        "-p",
        MLA_MIXED,
        "--attention-backend",
        "TRITON_MLA",
        "--speculative-config",
        '{"attention_backend": "auto"}',
    )
    assert attention_modes(plan)["draft"] == ("local", "TRITON_MLA")
    assert plan["inputs"]["draft_attention_backend"] is None


@pytest.mark.usefixtures("cpu_platform")
def test_flags_read_as_vllms_parser_reads_them() -> None:
    """The two JSON flags hold what ``EngineArgs.add_cli_args`` parses."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_dcp_geometry.tooling.cli import build_parser

    speculative = '{"method": "dspark", "attention_backend": "FLASHINFER_MLA"}'
    additional = '{"dcp_geometry": {"layers": {"model.layers.1*": 2}}, "x": [1]}'
    flags = ["--speculative-config", speculative, "--additional-config", additional]
    ours = build_parser().parse_args(["plan", *flags])
    vllms = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(flags)
    assert ours.speculative_config == vllms.speculative_config
    assert ours.additional_config == vllms.additional_config
    assert isinstance(ours.additional_config, dict)


# -- per-layer K through --additional-config -----------------------------------

START_UP_CASES = [
    (KIMI, {"model.layers.*.self_attn": "sharded"}),
    (KIMI, {"model.layers.*": 4, "language_model.model.layers.[37].*": 16}),
    (MLA_MIXED, {"model.layers.*": 2, "draft_model.*": 1}),
    ("deepseek-v32-tp8-dcp8", {"model.layers.*.self_attn.attn": "sharded"}),
    ("partial-shard-tp8-dcp8", {"*": "sharded"}),
    ("mamba-hybrid-tp4-dcp4", {"model.layers.*.mixer": "replicated"}),
    ("dense-gqa-tp8-dcp8", {"model.layers.*": 2}),
]


def _start_up(topology: Topology, additional_config: dict[str, Any]) -> Any:
    """What start-up makes of the specs vLLM builds for the topology's
    layers: ``apply_to_kv_cache_specs`` with a real ``VllmConfig``."""
    from vllm_dcp_geometry.runtime.spec_overrides import apply_to_kv_cache_specs

    specs = {
        layer: vllm_objects.build_spec(group, topology, patched=True)
        for group in topology.groups
        for layer in group.layers
    }
    config = make_vllm_config(
        topology.decode_context_parallel_size,
        tp=topology.tensor_parallel_size,
        real=True,
        additional_config=additional_config,
    )
    return apply_to_kv_cache_specs(specs, config)


@pytest.mark.parametrize(("profile", "layers"), START_UP_CASES)
def test_overrides_equal_start_ups_application(profile: str, layers: dict) -> None:
    topology = load_profile(profile)
    additional_config = {"dcp_geometry": {"layers": layers}}
    expected = _start_up(topology, additional_config)
    overridden = apply_additional_config(topology, additional_config)
    changed = 0
    for group in overridden.groups:
        spec = vllm_objects.build_spec(group, overridden, patched=True)
        for layer in group.layers:
            assert spec == expected[layer], (group.name, layer)
        before = topology.groups[[g.name for g in topology.groups].index(group.name)]
        changed += group != before
    assert changed > 0


@pytest.mark.parametrize(
    "layers",
    [
        {"nope.*": 2},
        {"model.layers.*": 3},
        {"model.layers.0.self_attn.attn": "sharded"},
        {"model.layers.*.self_attn.indexer.k_cache": 1},
    ],
)
def test_bad_overrides_fail_as_start_up_fails(layers: dict) -> None:
    """The same error, message for message (no match, K not dividing D,
    a sliding-window layer sharded, an indexer cache apart from its latent)."""
    topology = load_profile("deepseek-v32-tp8-dcp8")
    if "model.layers.0.self_attn.attn" in layers:
        topology = topology_from_mapping(_sliding_window_topology())
    additional_config = {"dcp_geometry": {"layers": layers}}
    with pytest.raises(DcpGeometryError) as start_up:
        _start_up(topology, additional_config)
    with pytest.raises(DcpGeometryError) as ours:
        apply_additional_config(topology, additional_config)
    assert str(start_up.value) in str(ours.value)


def _sliding_window_topology() -> dict[str, Any]:
    return {
        "name": "window",
        "parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
        "groups": [
            {
                "name": "window",
                "kind": "sliding_window",
                "layers": ["model.layers.0.self_attn.attn"],
                "block_size": 16,
                "num_kv_heads": 1,
                "head_size": 64,
                "dtype": "bfloat16",
                "sliding_window": 128,
                "dcp_sharded": False,
            }
        ],
    }


def test_layer_kinds_are_the_kinds_of_vllms_specs() -> None:
    from vllm_dcp_geometry.runtime.spec_overrides import layer_kind

    topologies = [load_profile(name) for name in profile_names()]
    topologies.append(topology_from_mapping(_sliding_window_topology()))
    kinds = set()
    for topology in topologies:
        for group in topology.groups:
            spec = vllm_objects.build_spec(group, topology, patched=True)
            assert layer_kind(spec) is GROUP_LAYER_KINDS[group.kind], group.name
            kinds.add(group.kind)
    assert kinds == set(GROUP_LAYER_KINDS)


def test_a_group_whose_layers_get_different_k_fails_closed() -> None:
    """One group, one K: an override on some of its layers names the group
    and its layers per K (start-up itself would plan two groups)."""
    topology = load_profile(MLA_MIXED)
    config = {"dcp_geometry": {"layers": {"model.layers.0.*": 2}}}
    with pytest.raises(TopologyError) as excinfo:
        apply_additional_config(topology, config)
    message = str(excinfo.value)
    assert message.startswith("group 'mla.k4': the dcp_geometry overrides give")
    assert "K=2: model.layers.0.self_attn.attn; K=4: model.layers.2." in message
    whole = {"dcp_geometry": {"layers": {"model.layers.*[02468].*": 2}}}
    (group, *_) = apply_additional_config(topology, whole).groups
    assert group.shard_count(4) == 2


def test_plan_reports_the_overridden_k_and_partial_collectives(capsys) -> None:
    default = _plan(capsys, "-p", MLA_MIXED)
    assert default["inputs"]["additional_config"] is None
    additional = {
        "dcp_geometry": {
            "layers": {"model.layers.*": 2, "draft_model.*": "replicated"},
            "partial_collectives": "dcp",
        }
    }
    plan = _plan(capsys, "-p", MLA_MIXED, "--additional-config", json.dumps(additional))
    groups = {g["name"]: g for g in plan["groups"]}
    assert groups["mla.k4"]["shard_count"] == groups["mla.k2"]["shard_count"] == 2
    assert plan["inputs"]["partial_collectives"] == "dcp"
    assert plan["inputs"]["additional_config"] == additional
    assert groups["mla.k2"]["collective_world_size"] == 4
    assert {g["name"]: g["collective_world_size"] for g in default["groups"]}[
        "mla.k2"
    ] == 2


def test_partial_collectives_stays_where_the_section_names_none() -> None:
    topology = dataclasses.replace(load_profile(MLA_MIXED), partial_collectives="dcp")
    config = {"dcp_geometry": {"layers": {"draft_model.*": 1}}}
    assert apply_additional_config(topology, config).partial_collectives == "dcp"
    assert apply_additional_config(topology, {"other_plugin": 1}) is topology


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["plan", "--additional-config", '{"dcp_geometry": '],
            "argument --additional-config: not valid JSON (Expecting value: line 1",
        ),
        (
            ["replay", "--additional-config", "[1]"],
            "argument --additional-config: takes a JSON object",
        ),
        (
            ["ranks", "--additional-config", "{'a': 1}"],
            "argument --additional-config: not valid JSON",
        ),
        (
            ["plan", "--speculative-config", "{"],
            "argument --speculative-config: not valid JSON",
        ),
        (
            ["plan", "--speculative-config", '{"attention_backend": "NOPE"}'],
            "--speculative-config attention_backend: Unknown attention backend: 'NOPE'",
        ),
        (
            ["plan", "--speculative-config", '{"attention_backend": 7}'],
            "--speculative-config attention_backend must be a vLLM attention",
        ),
        (
            [
                "simulate",
                "--additional-config",
                '{"dcp_geometry": {"layers": {"nope.*": 2}}}',
            ],
            "dcp_geometry override 'nope.*': 2 matches no layer with a KV cache",
        ),
        (
            ["plan", "--additional-config", '{"dcp_geometry": {"layerz": {}}}'],
            "additional_config['dcp_geometry'] has unknown keys ['layerz']",
        ),
        (["plan", "--emit-topology", "out.yaml"], "must end in .toml or .json"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, argv, message) -> None:
    assert message in _one_line_error(capsys, argv)


# -- --emit-topology ------------------------------------------------------------


@pytest.mark.parametrize("name", profile_names())
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_emitted_topologies_round_trip(tmp_path: Path, name: str, suffix: str) -> None:
    topology = load_profile(name)
    path = tmp_path / f"out{suffix}"
    write_topology_file(topology, path)
    loaded = load_topology_file(path)
    assert dataclasses.replace(loaded, source="") == dataclasses.replace(
        topology, source=""
    )


def test_plan_emits_the_overridden_topology(capsys, tmp_path: Path) -> None:
    path = tmp_path / "kimi.toml"
    additional = '{"dcp_geometry": {"layers": {"model.layers.*": "sharded"}}}'
    argv = ["plan", "-p", KIMI, "--additional-config", additional]
    assert main([*argv, "--emit-topology", str(path)]) == EXIT_OK
    capsys.readouterr()
    emitted = load_topology_file(path)
    (draft,) = [g for g in emitted.groups if g.draft]
    assert draft.shard_count(16) == 16
    assert emitted.groups[:-1] == load_profile(KIMI).groups[:-1]
    assert tomllib.loads(path.read_text())["groups"][-1]["dcp_sharded"] is True
    # The emitted file plans as the flags did.
    from_flags, from_file = _plan(capsys, *argv[1:]), _plan(capsys, "-t", str(path))
    assert from_file["groups"] == from_flags["groups"]
    assert from_file["totals"] == from_flags["totals"]


def test_toml_writer_refuses_what_it_cannot_write() -> None:
    assert tomllib.loads(topology_toml({"a": 'x\x7fy\n"', "t": {"b": [[1], [2]]}}))
    with pytest.raises(TopologyError, match=r"topology\.a: cannot write 1\.5 as TOML"):
        topology_toml({"a": 1.5})


def test_plan_warns_of_a_near_miss_section_as_start_up_does(run_cli) -> None:
    """A key that resembles the section gets start-up's warning, once, and
    changes nothing: the plan is the plan without it (nothing refused)."""
    section = {"layers": {"model.layers.*.self_attn.attn": 2}}
    near_miss = json.dumps({"dcp_geomtry": section, "another_plugin": {}})
    base = ("plan", "--json", "-p", "deepseek-v32-tp8-dcp8")
    code, out, err = run_cli(*base, "--additional-config", near_miss)
    assert code == 0, err
    warned = [line for line in err.splitlines() if "resembles" in line]
    assert warned == ["warning: " + near_miss_sections({"dcp_geomtry": section})[0]]
    assert "'dcp_geomtry' resembles 'dcp_geometry'" in warned[0]
    _, plain, _ = run_cli(*base)
    assert json.loads(out)["groups"] == json.loads(plain)["groups"]
    _, applied, _ = run_cli(
        *base, "--additional-config", json.dumps({"dcp_geometry": section})
    )
    assert json.loads(applied)["groups"] != json.loads(plain)["groups"]
