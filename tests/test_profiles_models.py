# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The built-in profiles that stand for a model equal what vLLM's model code
builds for that model folder and serve line (``profiles --check``), and the
check names every difference planted in a copy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from vllm_dcp_geometry.tooling.cli import main
from vllm_dcp_geometry.tooling.cli.common.status import EXIT_OK, EXIT_VIOLATION
from vllm_dcp_geometry.tooling.cli.profiles.drift import profile_drift
from vllm_dcp_geometry.tooling.serve import deployment
from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    Topology,
    load_profile,
    profile_models,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built() -> dict[str, Topology]:
    """Each model profile's topology as vLLM's model code builds it (one
    planning process per model)."""
    return {
        name: deployment.model_topology(model.serve_argv())
        for name, model in profile_models().items()
    }


def test_the_model_profiles_and_their_models() -> None:
    models = {name: model.model for name, model in profile_models().items()}
    assert models == {
        DEFAULT_PROFILE: "kimi-k3",
        "deepseek-v32-tp8-dcp8": "deepseek-v32",
        "gpt-oss-tp32-dcp4": "gpt-oss",
        "gpt-oss-tp64-dcp8": "gpt-oss",
    }


def test_model_profiles_equal_vllms_build(built: dict[str, Topology]) -> None:
    for name, model in built.items():
        assert {g.source for g in model.groups} == {"model"}
        assert profile_drift(load_profile(name), model) == [], name


def _replace_group(topology: Topology, name: str, **changes) -> Topology:
    groups = tuple(
        dataclasses.replace(g, **changes) if g.name == name else g
        for g in topology.groups
    )
    return dataclasses.replace(topology, groups=groups)


def test_the_check_names_each_planted_difference(built: dict[str, Topology]) -> None:
    model = built[DEFAULT_PROFILE]
    profile = load_profile(DEFAULT_PROFILE)
    by_name = {g.name: g for g in profile.groups}
    kda0, kda1 = by_name["kda.0"], by_name["kda.1"]
    moved = _replace_group(
        _replace_group(profile, "kda.0", layers=kda0.layers[1:]),
        "kda.1",
        layers=(*kda1.layers, kda0.layers[0]),
    )
    planted = {
        "max_num_seqs: 2 in the profile, 1 in the model": dataclasses.replace(
            profile, max_num_seqs=2
        ),
        "'mla.0' (model group g14): query_heads 64 in the profile, 96": (
            _replace_group(profile, "mla.0", query_heads=64)
        ),
        "'draft' (model group g19): spec: dcp_sharded True in the profile": (
            _replace_group(
                profile,
                "draft",
                spec_fields={**by_name["draft"].spec_fields, "dcp_sharded": True},
            )
        ),
        "'kda.1' (model group g0): the model groups": moved,
        "layers of the model the profile lacks: model.layers.97.self_attn": (
            _replace_group(profile, "draft", layers=by_name["draft"].layers[:-1])
        ),
    }
    for expected, wrong in planted.items():
        drift = profile_drift(wrong, model)
        assert any(expected in line for line in drift), (expected, drift)
    # A planted spec change also shows in what plan derives from it.
    drift = profile_drift(
        planted[next(k for k in planted if "dcp_sharded" in k)], model
    )
    assert any(
        "plan's shard_count 16 in the profile, 1 in the model" in line for line in drift
    )


def test_profiles_check_exits_1_on_drift(
    built: dict[str, Topology], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The command's wiring, on the fixture's builds: exit 0 when every
    model profile agrees, 1 naming the difference when one does not."""
    by_argv = {
        json.dumps(model.serve_argv()): built[name]
        for name, model in profile_models().items()
    }
    monkeypatch.setattr(
        deployment, "model_topology", lambda argv: by_argv[json.dumps(list(argv))]
    )
    assert main(["profiles", "--check", "--json"]) == EXIT_OK
    checks = json.loads(capsys.readouterr().out)["checks"]
    assert [(c["name"], c["drift"]) for c in checks] == [
        ("deepseek-v32-tp8-dcp8", []),
        ("gpt-oss-tp32-dcp4", []),
        ("gpt-oss-tp64-dcp8", []),
        (DEFAULT_PROFILE, []),
    ]
    wrong = dataclasses.replace(built[DEFAULT_PROFILE], max_model_len=2_000_000)
    monkeypatch.setattr(deployment, "model_topology", lambda argv: wrong)
    assert main(["profiles", "--check", DEFAULT_PROFILE]) == EXIT_VIOLATION
    out = capsys.readouterr().out
    assert (
        f"{DEFAULT_PROFILE} differs from vLLM's build of model_configs/kimi-k3" in out
    )
    assert "max_model_len: 1000000 in the profile, 2000000 in the model" in out
    assert main(["profiles", "--check", "dense-gqa-tp8-dcp8"]) == 2
    assert "stand(s) for no model" in capsys.readouterr().err
