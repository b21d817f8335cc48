# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Parsing, matching and validating operator overrides (pure Python)."""

from __future__ import annotations

import pytest

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.overrides import (
    LayerKind,
    LayerOverride,
    SpecGeometry,
    layer_geometry,
    match_layers,
    near_miss_sections,
    parse_overrides,
    target_geometry,
)

LAYERS = [
    "model.layers.0.self_attn.attn",
    "model.layers.1.mixer",
    "model.layers.3.self_attn.attn",
    "model.layers.13.self_attn.attn",
    "model.mtp.draft.0.attn",
]


def config(layers) -> dict:
    return {"dcp_geometry": {"layers": layers}}


def test_parse_values() -> None:
    parsed = parse_overrides(
        config({"model.layers.3.*": 4, "*.draft.*": "replicated", "x": "sharded"})
    )
    assert parsed == (
        LayerOverride("model.layers.3.*", 4),
        LayerOverride("*.draft.*", "replicated"),
        LayerOverride("x", "sharded"),
    )
    assert parse_overrides({}) == ()
    assert parse_overrides(None) == ()
    assert parse_overrides({"other_plugin": {"layers": 1}}) == ()
    assert parse_overrides(config({})) == ()


@pytest.mark.parametrize(
    ("additional_config", "message"),
    [
        ({"dcp_geometry": 4}, "must be a mapping"),
        # An explicit null is a mistake, not "no overrides".
        ({"dcp_geometry": None}, "must be a mapping.*got None"),
        ({"dcp_geometry": {"layers": None}}, "must map layer name patterns"),
        (
            {"dcp_geometry": {"layer": {}}},
            "unknown keys \\['layer'\\].*'layer' resembles 'layers'",
        ),
        ({"dcp_geometry": {"layers": ["a"]}}, "must map layer name patterns"),
        (config({"a": 0}), "K must be >= 1"),
        (config({"a": -2}), "K must be >= 1"),
        (config({"a": True}), "must be an integer K"),
        (config({"a": 2.0}), "must be an integer K"),
        (config({"a": "4"}), "write the integer 4 without quotes"),
        (config({"a": "Sharded"}), "must be an integer K"),
        (config({"": 4}), "non-empty strings"),
        (config({1: 4}), "non-empty strings"),
    ],
)
def test_parse_errors(additional_config, message) -> None:
    with pytest.raises(DcpGeometryError, match=message):
        parse_overrides(additional_config)


def test_match_globs_and_unmatched_pattern() -> None:
    overrides = parse_overrides(
        config({"model.layers.?.self_attn.attn": 4, "*draft*": "replicated"})
    )
    matches = match_layers(overrides, LAYERS)
    assert {name: [o.value for o in found] for name, found in matches.items()} == {
        "model.layers.0.self_attn.attn": [4],
        "model.layers.3.self_attn.attn": [4],
        "model.mtp.draft.0.attn": ["replicated"],
    }
    unmatched = parse_overrides(config({"model.layers.99.*": 4}))
    with pytest.raises(DcpGeometryError, match=r"'model.layers.99.\*': 4.*matches no"):
        match_layers(unmatched, LAYERS)
    assert match_layers(unmatched, LAYERS, require_every_pattern=False) == {}
    # Matching is case-sensitive on every platform.
    with pytest.raises(DcpGeometryError, match="matches no layer"):
        match_layers(parse_overrides(config({"MODEL.*": 4})), LAYERS)


FULL = LayerKind.FULL_ATTENTION
LAYER = "model.layers.3.self_attn.attn"


def _geometry_of_layer_3(layers: dict, kind: LayerKind, dcp: int):
    matches = match_layers(parse_overrides(config(layers)), LAYERS)
    return layer_geometry(LAYER, matches[LAYER], kind, dcp_world_size=dcp)


def test_conflicting_patterns_are_refused() -> None:
    for layers, kind, dcp in (
        ({"model.layers.3.*": 4, "model.layers.*.self_attn.attn": "sharded"}, FULL, 16),
        ({"model.layers.3.*": 1, "*.3.self_attn*": "sharded"}, FULL, 16),
        ({"model.layers.3.*": 16, "*.3.self_attn*": 8}, FULL, 16),
        ({"model.layers.3.*": "replicated", "*.3.self_attn*": "sharded"}, FULL, 4),
    ):
        with pytest.raises(DcpGeometryError, match=rf"layer '{LAYER}'.*conflict"):
            _geometry_of_layer_3(layers, kind, dcp)


@pytest.mark.parametrize(
    ("first", "second", "kind", "dcp", "expected"),
    [
        (4, 4, FULL, 16, SpecGeometry(True, 4)),
        (1, "replicated", FULL, 16, SpecGeometry(False, None)),
        ("replicated", 1, FULL, 16, SpecGeometry(False, None)),
        (16, "sharded", FULL, 16, SpecGeometry(True, None)),
        ("sharded", 8, FULL, 8, SpecGeometry(True, None)),
        (1, "replicated", LayerKind.RECURRENT, 16, None),
        # D = 1: every value means K = 1.
        (1, "sharded", FULL, 1, None),
    ],
)
def test_equal_values_written_differently_agree(
    first, second, kind, dcp, expected
) -> None:
    layers = {"model.layers.3.*": first, "*.3.self_attn*": second}
    assert _geometry_of_layer_3(layers, kind, dcp) == expected


def test_every_matching_pattern_is_checked() -> None:
    # "sharded" on recurrent state is an error even where "replicated" also
    # matches and both mean K = 1 (D = 1): the order of the patterns decides
    # nothing.
    for layers in (
        {"model.layers.3.*": "replicated", "*.3.self_attn*": "sharded"},
        {"model.layers.3.*": "sharded", "*.3.self_attn*": "replicated"},
    ):
        with pytest.raises(DcpGeometryError, match="never token-sharded"):
            _geometry_of_layer_3(layers, LayerKind.RECURRENT, 1)


@pytest.mark.parametrize(
    ("value", "kind", "dcp", "expected"),
    [
        (4, FULL, 16, SpecGeometry(True, 4)),
        (4, FULL, 8, SpecGeometry(True, 4)),
        (16, FULL, 16, SpecGeometry(True, None)),
        ("sharded", FULL, 16, SpecGeometry(True, None)),
        (1, FULL, 16, SpecGeometry(False, None)),
        ("replicated", FULL, 16, SpecGeometry(False, None)),
        ("replicated", FULL, 16, SpecGeometry(False, None)),
        ("sharded", FULL, 16, SpecGeometry(True, None)),
        ("replicated", LayerKind.OTHER_ATTENTION, 16, SpecGeometry(False, None)),
        ("replicated", LayerKind.RECURRENT, 16, None),
        (1, LayerKind.RECURRENT, 16, None),
        # D = 1: validated, nothing changes.
        ("sharded", FULL, 1, None),
        ("replicated", FULL, 1, None),
        (1, FULL, 1, None),
    ],
)
def test_target_geometry(value, kind, dcp, expected) -> None:
    override = LayerOverride("p", value)
    assert target_geometry("l", override, kind, dcp_world_size=dcp) == expected


@pytest.mark.parametrize(
    ("value", "kind", "dcp", "pcp", "message"),
    [
        (3, FULL, 16, 1, "K=3 must divide the DCP world size D=16"),
        (32, FULL, 16, 1, "K=32 must divide"),
        (4, FULL, 1, 1, "K=4 must divide the DCP world size D=1"),
        (4, LayerKind.RECURRENT, 16, 1, "never token-sharded"),
        ("sharded", LayerKind.RECURRENT, 16, 1, "never token-sharded"),
        ("sharded", LayerKind.RECURRENT, 1, 1, "never token-sharded"),
        (4, LayerKind.OTHER_ATTENTION, 16, 1, "only full attention"),
        ("sharded", LayerKind.OTHER_ATTENTION, 16, 1, "only full attention"),
        (4, FULL, 16, 2, "prefill context parallelism \\(PCP=2\\)"),
        ("replicated", LayerKind.UNSUPPORTED, 16, 1, "only attention and Mamba"),
    ],
)
def test_target_geometry_errors(value, kind, dcp, pcp, message) -> None:
    override = LayerOverride("model.layers.*", value)
    with pytest.raises(DcpGeometryError, match=message) as info:
        target_geometry(
            "model.layers.7.attn",
            override,
            kind,
            dcp_world_size=dcp,
            pcp_world_size=pcp,
        )
    assert "model.layers.7.attn" in str(info.value)


def test_sharded_and_replicated_with_pcp_keep_upstream_behaviour() -> None:
    for value, expected in (
        ("sharded", SpecGeometry(True, None)),
        (1, SpecGeometry(False, None)),
    ):
        override = LayerOverride("p", value)
        got = target_geometry("l", override, FULL, dcp_world_size=16, pcp_world_size=2)
        assert got == expected


@pytest.mark.parametrize(
    "key",
    ["dcp_geomtry", "dcp-geometry", "DCP_Geometry", "dcp_geometri", "dcpgeometry"],
)
def test_a_near_miss_section_is_warned_never_refused(key: str) -> None:
    additional_config = {key: {"layers": {"model.layers.*": 2}}, "other": 1}
    (warning,) = near_miss_sections(additional_config)
    assert f"{key!r} resembles 'dcp_geometry'" in warning
    assert "ignored" in warning
    # Nothing of it applies, and nothing is refused.
    assert parse_overrides(additional_config) == ()
    # Beside the real section it is still named: what it says is lost.
    assert near_miss_sections({**additional_config, "dcp_geometry": {}})


@pytest.mark.parametrize(
    "additional_config",
    [
        {"dcp_geometry": {"layers": {}}},
        {"kv_transfer": 1, "dcp": 2, "geometry": 3, "dcp_geometry_extra": 4},
        None,
        "not a mapping",
    ],
)
def test_other_plugins_keys_are_not_warned(additional_config) -> None:
    assert near_miss_sections(additional_config) == ()
