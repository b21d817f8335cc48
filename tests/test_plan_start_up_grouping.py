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
from vllm_dcp_geometry.tooling.topology import load_profile, write_topology_file

pytestmark = pytest.mark.patches("common.kv_cache_interface")


def _plan(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, dict, str]:
    status = main(["plan", "--json", *args])
    captured = capsys.readouterr()
    return status, json.loads(captured.out), captured.err


@pytest.mark.parametrize("profile", ["dense-gqa-tp8-dcp8", "kimi-k3-tp16-dcp16"])
def test_a_topology_start_up_groups_alike_matches(capsys, profile: str) -> None:
    # The Kimi-K3 profile is what vLLM's planner made from the model's layers
    # (checked by 'profiles --check'): regrouping its specs gives it back.
    status, document, _ = _plan(capsys, "-p", profile)
    grouping = document["start_up_grouping"]
    assert status == EXIT_OK
    assert grouping["checked"] and grouping["matches"], grouping["differences"]
    assert grouping["refusal"] is None
    assert sorted(sorted(g["layers"]) for g in grouping["groups"]) == sorted(
        sorted(g["layers"]) for g in document["groups"]
    )


def test_a_layout_vllms_planner_refuses_exits_2(capsys, tmp_path: Path) -> None:
    # Latent and indexer caches at K=8 and K=4 cannot share vLLM's pages:
    # the DeepSeek-V3.2 profile's first 31 layers put back at K=8.
    mapping = load_profile("deepseek-v32-tp8-dcp8").to_dict()
    halves = []
    for group in mapping["groups"]:
        front = {**group, "name": f"{group['name']}.k8", "layers": group["layers"][:31]}
        del front["dcp_kv_shard_count"]
        halves += [front, {**group, "layers": group["layers"][31:]}]
    mapping["groups"] = halves
    path = tmp_path / "halves.json"
    path.write_text(json.dumps(mapping))
    status, document, err = _plan(capsys, "-t", str(path))
    assert status == EXIT_BAD_INPUT
    refusal = document["start_up_grouping"]["refusal"]
    assert "Padding is only supported for non-MLA attention layers" in refusal
    assert "indexer.k_cache" in refusal
    assert refusal in err


def test_a_padded_page_and_other_groups_are_named(capsys) -> None:
    # vLLM pads the attention page to the Mamba page and groups the Mamba
    # layers by position, not as the file lists them.
    status, document, _ = _plan(capsys, "-p", "mamba-hybrid-tp4-dcp4")
    grouping = document["start_up_grouping"]
    assert status == EXIT_OK
    assert not grouping["matches"]
    padded = [d for d in grouping["differences"] if "page_size_padded=" in d]
    assert padded and "model.layers.6.mixer" in padded[0]
    assert any("'mamba.0'" in d for d in grouping["differences"])
    main(["plan", "-p", "mamba-hybrid-tp4-dcp4"])
    text = capsys.readouterr().out
    assert "WARNING: start-up groups these layers differently" in text


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
