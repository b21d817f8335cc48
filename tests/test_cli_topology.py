# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Topologies: built-in profiles, user files, and the errors bad input gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.simulate import attention_group
from vllm_dcp_geometry.contract import TokenLayout
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    TopologyError,
    load_profile,
    load_topology_file,
    profile_names,
    topology_from_mapping,
)


def test_builtin_profiles_load_and_include_the_small_ones():
    names = profile_names()
    assert DEFAULT_PROFILE in names
    kinds = {name: {g.kind for g in load_profile(name).groups} for name in names}
    # A dense GQA model, a Mamba hybrid and a partial-shard example.
    assert any(k == {"full_attention"} for k in kinds.values())
    assert any({"mamba", "full_attention"} <= k for k in kinds.values())
    partial = [
        name
        for name in names
        if any(
            g.dcp_kv_shard_count
            not in (None, load_profile(name).decode_context_parallel_size)
            for g in load_profile(name).groups
        )
    ]
    assert partial
    topology = load_profile(partial[0])
    dcp = topology.decode_context_parallel_size
    assert 4 in {g.shard_count(dcp) for g in topology.groups}


def test_default_profile_is_kimi_k3_as_vllm_groups_it():
    """The 20 groups vLLM 0.33.0's planner makes of Kimi-K3 and its DSpark
    draft (``profiles --check`` holds the file to vLLM's model code)."""
    topology = load_profile(DEFAULT_PROFILE)
    assert topology.tensor_parallel_size == 16
    assert topology.decode_context_parallel_size == 16
    assert topology.max_model_len == 1_000_000
    assert topology.mamba_cache_mode == "align"
    assert len(topology.groups) == 20
    target = [g for g in topology.groups if not g.draft]
    draft = [g for g in topology.groups if g.draft]
    assert len(target) == 19 and len(draft) == 1
    assert sum(len(g.layers) for g in target) == 93
    assert all(len(g.layers) <= 5 for g in topology.groups)
    mla = [g for g in target if g.kind == "mla"]
    kda = [g for g in target if g.kind == "mamba"]
    assert len(mla) == 5 and len(kda) == 14
    assert sum(len(g.layers) for g in mla) == 24
    assert {g.block_size for g in topology.groups} == {384}
    for g in kda:
        assert g.spec_fields["num_speculative_blocks"] == 7
        assert g.layout is TokenLayout.RECURRENT
        assert g.shard_count(16) == 1
    assert all(g.shard_count(16) == 16 for g in mla)
    (d,) = draft
    assert len(d.layers) == 5
    assert d.is_attention and d.layout is TokenLayout.REPLICATED
    assert d.shard_count(16) == 1
    assert topology.replay_tokens == 1_000_000


def test_json_file_round_trips(tmp_path: Path):
    original = load_profile("partial-shard-tp8-dcp8")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(original.to_dict()))
    loaded = load_topology_file(path)
    assert loaded.to_dict() == original.to_dict()
    assert loaded.source == str(path)


def test_toml_file_with_layer_template(tmp_path: Path):
    path = tmp_path / "mine.toml"
    path.write_text(
        """
[parallel]
tensor_parallel_size = 4
decode_context_parallel_size = 4
[[groups]]
name = "a"
kind = "full_attention"
layer_template = "model.layers.{}.attn"
layer_ids = [0, 1, 2]
block_size = 16
num_kv_heads = 1
head_size = 64
dtype = "float16"
dcp_kv_shard_count = 2
"""
    )
    topology = load_topology_file(path)
    assert topology.name == "mine"
    (group,) = topology.groups
    assert group.layers == (
        "model.layers.0.attn",
        "model.layers.1.attn",
        "model.layers.2.attn",
    )
    assert group.shard_count(4) == 2


BASE_GROUP = attention_group()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "conv"}, "'kind' must be one of"),
        ({"colour": "red"}, "unknown key"),
        ({"block_size": 0}, r"block_size must be an integer in \[1, 2147483647\]"),
        ({"block_size": 10**18}, r"block_size must be an integer in \[1, 2147483647\]"),
        ({"num_kv_heads": 10**18}, "num_kv_heads must be an integer in"),
        ({"head_size": 10**30}, "head_size must be an integer in"),
        ({"head_size": 64.0}, "head_size must be an integer"),
        ({"name": "a\nb"}, "'name' must be a non-empty string of printable"),
        ({"layers": ["ok", ""]}, "each of 'layers' must be a non-empty string"),
        ({"dtype": 16}, "dtype must be a non-empty string"),
        ({"dcp_kv_shard_count": 3}, "must divide the DCP world size"),
        ({"dcp_kv_shard_count": 2, "dcp_sharded": False}, "replicated"),
        ({"layers": []}, "at least one layer"),
    ],
)
def test_bad_groups_are_rejected_with_the_rule(change, message):
    group = {**BASE_GROUP, **change}
    data = {
        "parallel": {"tensor_parallel_size": 8, "decode_context_parallel_size": 8},
        "groups": [group],
    }
    with pytest.raises(TopologyError, match=message):
        topology_from_mapping(data, "test")


def test_impossible_layouts_are_rejected():
    with pytest.raises(TopologyError, match="must divide the tensor-parallel"):
        load_profile(DEFAULT_PROFILE).with_layout(dcp=32)
    with pytest.raises(TopologyError, match="in both group"):
        topology_from_mapping(
            {"groups": [BASE_GROUP, {**BASE_GROUP, "name": "h"}]}, "test"
        )
    with pytest.raises(TopologyError, match="interleave"):
        load_profile("dense-gqa-tp8-dcp8").with_layout(interleave=3)


def test_cli_reports_bad_input_with_exit_2(tmp_path: Path, capsys):
    assert main(["plan", "--profile", "no-such-profile"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "unknown profile 'no-such-profile'" in err and DEFAULT_PROFILE in err

    broken = tmp_path / "broken.toml"
    broken.write_text("[[groups]\nname = ")
    assert main(["replay", "--topology", str(broken)]) == EXIT_BAD_INPUT
    assert "not valid TOML" in capsys.readouterr().err

    wrong_suffix = tmp_path / "t.yaml"
    wrong_suffix.write_text("groups: []")
    assert main(["plan", "--topology", str(wrong_suffix)]) == EXIT_BAD_INPUT
    assert ".toml or .json" in capsys.readouterr().err

    assert main(["plan", "--dcp", "32"]) == EXIT_BAD_INPUT
    assert "must divide the tensor-parallel size" in capsys.readouterr().err


def test_profiles_command_lists_every_profile(capsys):
    assert main(["profiles", "--json"]) == EXIT_OK
    listed = json.loads(capsys.readouterr().out)["profiles"]
    assert [p["name"] for p in listed] == profile_names()
    assert [p["name"] for p in listed if p["default"]] == [DEFAULT_PROFILE]


@pytest.mark.parametrize(
    "template",
    ["l.{}.{}", "l.{x}.{}", "l.{0}.{}", "l.{0}", "l.{", "l.}", "l.{:d}", "l.{!r}", "l"],
)
def test_layer_template_needs_exactly_one_plain_field(template):
    group = {**BASE_GROUP, "layer_template": template, "layer_ids": [0, 1]}
    del group["layers"]
    with pytest.raises(TopologyError, match="'layer_template' must be a string"):
        topology_from_mapping({"groups": [group]}, "test")


def test_layer_template_with_escaped_braces():
    group = {**BASE_GROUP, "layer_template": "l.{{x}}.{}", "layer_ids": [3]}
    del group["layers"]
    (loaded,) = topology_from_mapping({"groups": [group]}, "test").groups
    assert loaded.layers == ("l.{x}.3",)


def test_sharded_sliding_window_under_dcp_is_a_topology_error():
    window = {
        **BASE_GROUP,
        "kind": "sliding_window",
        "sliding_window": 128,
    }
    data = {
        "parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 4},
        "groups": [window],
    }
    with pytest.raises(TopologyError, match="group 'g' is a sliding-window cache"):
        topology_from_mapping(data, "test")
    # Replicated, or at DCP 1, it is a valid topology.
    topology_from_mapping(
        {**data, "groups": [{**window, "dcp_sharded": False}]}, "test"
    )
    topology_from_mapping({"groups": [window]}, "test")


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_topology_files_are_read_safely(tmp_path: Path):
    good = json.dumps({"groups": [BASE_GROUP]})
    with pytest.raises(TopologyError, match=r"not UTF-8 text: byte 0xff at offset 1"):
        load_topology_file(_write(tmp_path, "a.json", b"{\xff}"))
    duplicated = good.replace('"block_size": 16', '"block_size": 0, "block_size": 16')
    with pytest.raises(TopologyError, match="duplicate key 'block_size'"):
        load_topology_file(_write(tmp_path, "b.json", duplicated.encode()))
    top = '{"name": "x", "name": "y", "groups": []}'
    with pytest.raises(TopologyError, match="duplicate key 'name'"):
        load_topology_file(_write(tmp_path, "c.json", top.encode()))
    for text, message in (
        ('{"groups": NaN}', "NaN is not a valid JSON value"),
        ('{"a": ' + "9" * 5000 + "}", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ):
        with pytest.raises(TopologyError, match=message):
            load_topology_file(_write(tmp_path, "d.json", text.encode()))
    with pytest.raises(TopologyError, match="not valid TOML"):
        load_topology_file(_write(tmp_path, "e.toml", b"a = " + b"9" * 5000))
    (tmp_path / "f.json").mkdir()
    with pytest.raises(TopologyError, match="is not a regular file"):
        load_topology_file(tmp_path / "f.json")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path):
    import os

    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    with pytest.raises(TopologyError, match="is not a regular file"):
        load_topology_file(fifo)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ('[no-such-profile]\nmodel = "m"\nserve_flags = []', "no built-in profile"),
        (
            f'[{DEFAULT_PROFILE}]\nmodel = "m"\nserve_flags = []\nnote = 1',
            "needs exactly 'model' and 'serve_flags'",
        ),
        (
            f'[{DEFAULT_PROFILE}]\nmodel = "absent"\nserve_flags = []',
            "model 'absent' is not a folder here",
        ),
        (
            f'[{DEFAULT_PROFILE}]\nmodel = "m"\nserve_flags = "--tp 2"',
            "serve_flags must be a list of strings",
        ),
    ],
)
def test_profile_models_name_the_broken_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str, message: str
) -> None:
    from vllm_dcp_geometry.tooling.topology import files

    (tmp_path / "m").mkdir()
    (tmp_path / "profiles.toml").write_text(entry)
    monkeypatch.setattr(files, "model_configs_dir", lambda: tmp_path)
    with pytest.raises(TopologyError, match=message) as error:
        files.profile_models()
    assert "model_configs/profiles.toml: [" in str(error.value)


def test_more_than_one_kv_head_per_rank_under_dcp_is_refused() -> None:
    """vLLM 0.33.0's config check: DCP for a GQA/MQA model needs TP above its
    KV heads, so a rank holds one; an MLA model or a draft is not held to it."""
    mapping = {
        "name": "gqa",
        "parallel": {"tensor_parallel_size": 4, "decode_context_parallel_size": 2},
        "groups": [attention_group("attn", "l0", num_kv_heads=2)],
    }
    with pytest.raises(TopologyError, match=r"group 'attn' has num_kv_heads 2 per"):
        topology_from_mapping(mapping)
    mapping["parallel"]["decode_context_parallel_size"] = 1
    topology_from_mapping(mapping)
    mapping["parallel"]["decode_context_parallel_size"] = 2
    mla = {
        "name": "mla", "kind": "mla", "layers": ["l1"], "block_size": 16,
        "num_kv_heads": 1, "head_size": 576, "dtype": "bfloat16",
    }  # fmt: skip
    topology_from_mapping({**mapping, "groups": [*mapping["groups"], mla]})
    mapping["groups"][0]["draft"] = True
    topology_from_mapping(mapping)
