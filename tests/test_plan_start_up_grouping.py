# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan`` on a topology file runs vLLM's own KV-cache planner on the layers'
specs: a layout start-up refuses exits 2 with vLLM's message; a grouping that
is not the file's is named (split or merged groups, padded pages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.topology import (
    load_profile,
    profile_names,
    write_topology_file,
)

pytestmark = pytest.mark.patches("common.kv_cache_interface")


def _plan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, dict, str]:
    status = main(["plan", "--json", *args])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


@pytest.mark.parametrize("profile", profile_names())
def test_every_built_in_profile_is_grouped_as_start_up_groups_it(
    capsys, profile: str
) -> None:
    # The Kimi-K3 profile is what vLLM's planner made from the model's layers
    # (checked by 'profiles --check'); the hand profiles are laid out so that
    # the planner keeps their groups.
    status, document, _ = _plan(capsys, "-p", profile)
    grouping = document["start_up_grouping"]
    assert status == EXIT_OK
    assert grouping["checked"] and grouping["matches"], grouping["differences"]
    assert grouping["refusal"] is None
    # Each listed group lies in one of start-up's (DSA lists its indexer
    # cache apart from the latent cache start-up groups it with).
    start_up = [set(g["layers"]) for g in grouping["groups"]]
    for group in document["groups"]:
        assert sum(set(group["layers"]) <= held for held in start_up) == 1
    assert set().union(*start_up) == {
        name for group in document["groups"] for name in group["layers"]
    }


def test_a_layout_vllms_planner_refuses_exits_2(capsys, tmp_path: Path) -> None:
    # Latent and indexer caches at K=2 and K=4 cannot share vLLM's pages.
    status, document, err = _plan(capsys, "-t", _halves(tmp_path))
    assert status == EXIT_BAD_INPUT
    refusal = document["start_up_grouping"]["refusal"]
    assert "Padding is only supported for non-MLA attention layers" in refusal
    assert "indexer.k_cache" in refusal
    assert refusal in err


def _written(tmp_path: Path, mapping: dict) -> str:
    path = tmp_path / f"{mapping['name']}.json"
    path.write_text(json.dumps(mapping))
    return str(path)


def test_a_padded_page_and_other_groups_are_named(capsys, tmp_path: Path) -> None:
    # The Mamba profile without the padded page start-up gives its state, and
    # its Mamba layers listed in runs of four instead of the planner's chunks.
    mapping = load_profile("mamba-hybrid-tp4-dcp4").to_dict()
    mamba = [g for g in mapping["groups"] if g["kind"] == "mamba"]
    layers = sorted(
        (name for g in mamba for name in g["layers"]),
        key=lambda name: int(name.split(".")[2]),
    )
    for index, group in enumerate(mamba):
        del group["page_size_padded"]
        group["layers"] = layers[4 * index : 4 * index + 4]
    status, document, _ = _plan(capsys, "-t", _written(tmp_path, mapping))
    grouping = document["start_up_grouping"]
    assert status == EXIT_OK
    assert not grouping["matches"]
    padded = [d for d in grouping["differences"] if "page_size_padded=1064960" in d]
    assert padded and "model.layers.0.mixer" in padded[0]
    assert (
        "group 'mamba.0' (4 layers) is split over 4 of start-up's groups"
        in (grouping["differences"])
    )
    main(["plan", "-t", _written(tmp_path, mapping)])
    text = capsys.readouterr().out
    assert "WARNING: start-up groups these layers differently" in text


def test_a_one_layer_draft_splits_the_target_groups(capsys, tmp_path) -> None:
    # vLLM chunks every spec's layers by the smallest spec's layer count.
    mapping = load_profile("mla-mixed-tp4-dcp4").to_dict()
    (draft,) = [g for g in mapping["groups"] if g["draft"]]
    draft["layers"] = draft["layers"][:1]
    _, document, _ = _plan(capsys, "-t", _written(tmp_path, mapping))
    grouping = document["start_up_grouping"]
    assert len(grouping["groups"]) == 17
    assert (
        "group 'mla.k4' (8 layers) is split over 8 of start-up's groups"
        in (grouping["differences"])
    )


def test_a_group_split_in_two_is_named(capsys, tmp_path: Path) -> None:
    # One spec in two listed groups: vLLM's planner makes one of all layers.
    topology = load_profile("dense-gqa-tp8-dcp8")
    mapping = topology.to_dict()
    (group,) = mapping["groups"]
    half = len(group["layers"]) // 2
    mapping["groups"] = [
        {**group, "name": "front", "layers": group["layers"][:half]},
        {**group, "name": "back", "layers": group["layers"][half:]},
    ]
    path = tmp_path / "split.json"
    path.write_text(json.dumps(mapping))
    status, document, _ = _plan(capsys, "-t", str(path))
    grouping = document["start_up_grouping"]
    assert status == EXIT_OK
    assert len(grouping["groups"]) == 1
    assert grouping["differences"] == [
        "start-up's group 0 holds the layers of groups 'front', 'back'"
    ]


def test_the_emitted_topology_of_a_file_plans_the_same(capsys, tmp_path) -> None:
    path = tmp_path / "dense.toml"
    write_topology_file(load_profile("dense-gqa-tp8-dcp8"), path)
    _, document, _ = _plan(capsys, "-t", str(path))
    assert document["start_up_grouping"]["matches"]


def _halves(tmp_path: Path) -> str:
    """The DeepSeek-V3.2 profile's first 31 layers put at K = 2, the rest
    kept at K = 4 (both K within replicas, which FlashMLA's sparse builder
    admits at its 16 heads per rank)."""
    mapping = load_profile("deepseek-v32-tp8-dcp8").to_dict()
    halves = []
    for group in mapping["groups"]:
        front = {**group, "name": f"{group['name']}.k2", "layers": group["layers"][:31]}
        front["dcp_kv_shard_count"] = 2
        halves += [front, {**group, "layers": group["layers"][31:]}]
    mapping["groups"] = halves
    mapping["name"] = "halves"
    return _written(tmp_path, mapping)


@pytest.mark.parametrize("command", ["replay", "simulate"])
def test_replay_and_simulate_refuse_what_start_up_refuses(
    capsys, tmp_path: Path, command: str
) -> None:
    status = main([command, "-t", _halves(tmp_path), "--tokens", "4096"])
    err = capsys.readouterr().err
    assert status == EXIT_BAD_INPUT
    assert "vLLM's KV-cache planner refuses these layers" in err
    assert "Padding is only supported for non-MLA attention layers" in err


def test_replay_names_the_grouping_it_did_not_run(capsys, tmp_path: Path) -> None:
    mapping = load_profile("dense-gqa-tp8-dcp8").to_dict()
    (group,) = mapping["groups"]
    half = len(group["layers"]) // 2
    mapping["groups"] = [
        {**group, "name": "front", "layers": group["layers"][:half]},
        {**group, "name": "back", "layers": group["layers"][half:]},
    ]
    path = _written(tmp_path, mapping)
    args = ["replay", "-t", path, "--tokens", "4096", "--no-progress"]
    assert main(args) == EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith("WARNING: start-up groups these layers differently")
    assert "replay ran vLLM's manager on the topology's groups" in text
    assert main([*args, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["start_up_grouping"]["differences"] == [
        "start-up's group 0 holds the layers of groups 'front', 'back'"
    ]
