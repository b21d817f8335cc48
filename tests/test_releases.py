# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The releases the plugin serves: declarations per release, lock files of
fingerprints, pins that see bodies, and the version override."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT, run_python
from vllm_dcp_geometry import plugin
from vllm_dcp_geometry._version import (
    SUPPORTED_VLLM_RELEASES,
    installed_vllm_version,
    vllm_requirement,
)
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime.fingerprints import source_digest
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap, parameters_on
from vllm_dcp_geometry.runtime.releases import recorded_pins, symbol_key
from vllm_dcp_geometry.runtime.upstream_symbols import (
    UpstreamChangedError,
    UpstreamSymbol,
    verify_symbol,
)

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches("common.kv_cache_interface"),
]


def test_requirement_admits_exactly_the_supported_releases() -> None:
    pyproject = (Path(REPO_ROOT) / "pyproject.toml").read_text()
    assert len(re.findall(r'"vllm[=<>]', pyproject)) == 1
    first, last = SUPPORTED_VLLM_RELEASES[0], SUPPORTED_VLLM_RELEASES[-1]
    major, minor, _ = last.split(".")
    assert vllm_requirement().replace(" ", "") in (
        f"vllm<0.{int(minor) + 1},>={first}",
        f"vllm>={first},<0.{int(minor) + 1}",
    ), major
    assert metadata.version("vllm") in SUPPORTED_VLLM_RELEASES


def test_an_unknown_release_is_refused_naming_the_known_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(plugin, "installed_vllm_version", lambda: "0.35.0")
    monkeypatch.delenv(plugin.ALLOW_OTHER_VLLM_ENV, raising=False)
    with pytest.raises(plugin.VllmVersionError, match=r"0\.33\.0, 0\.34\.0.*0\.35"):
        plugin.check_vllm_version()
    monkeypatch.setenv(plugin.ALLOW_OTHER_VLLM_ENV, "0.36.0")
    with pytest.raises(plugin.VllmVersionError):
        plugin.check_vllm_version()
    monkeypatch.setenv(plugin.ALLOW_OTHER_VLLM_ENV, "0.35.0")
    assert plugin.check_vllm_version() is None  # matched symbol by symbol
    for release in SUPPORTED_VLLM_RELEASES:
        monkeypatch.setattr(plugin, "installed_vllm_version", lambda r=release: r)
        assert plugin.check_vllm_version() == release


@pytest.mark.parametrize("release", SUPPORTED_VLLM_RELEASES)
def test_every_lock_file_records_exactly_the_declared_symbols(release: str) -> None:
    """No vLLM needed: the lock file's keys are the entries declared for the
    release, and a declared parameter list is the one recorded."""
    recorded = recorded_pins(release)
    declared = {}
    for patch in declarations().values():
        for entry in (*patch.replaces_on(release), *patch.relies_on_on(release)):
            key = symbol_key(patch.upstream_module, entry.qualname)
            declared[key] = parameters_on(entry.parameters, release)[1]
    assert set(recorded) == set(declared)
    for key, parameters in declared.items():
        if parameters is not None:
            assert recorded[key]["parameters"] == parameters, key


def test_model_runner_v1_patches_are_not_applicable_on_0_34() -> None:
    patches = declarations()
    for name in ("worker.block_table", "worker.gpu_model_runner"):
        patch = patches[f"vllm_dcp_geometry.patches.{name}"]
        assert patch.releases == ("0.33.0",)
        assert patch.symbols("0.34.0") == ()


def test_per_release_entries() -> None:
    patch = Patch(
        upstream_module="m",
        replaces=(Wrap("f", {"0.34.0": "x, y="}),),
        relies_on=(Pin("g", "x"),),
        why="w",
        remove_when="r",
        related="-",
    )
    assert [e.qualname for e in patch.replaces_on("0.33.0")] == []
    assert [e.qualname for e in patch.replaces_on("0.34.0")] == ["f"]
    assert [e.qualname for e in patch.relies_on_on("0.33.0")] == ["g"]
    with pytest.raises(ValueError, match=r"0\.99\.0"):
        Patch(
            upstream_module="m",
            releases=("0.33.0",),
            relies_on=(Pin("g", {"0.99.0": "x"}),),
            why="w",
            remove_when="r",
            related="-",
        )


def test_fingerprints_see_code_not_docstrings_comments_or_layout() -> None:
    base = source_digest("def f(x):\n    '''Doc.'''\n    return x + 1\n")
    assert base == source_digest("def f(x):\n    # why\n    return (x +\n  1)\n")
    assert base == source_digest("    def f(x):\n        return x + 1\n")
    assert base != source_digest("def f(x):\n    return x + 2\n")
    assert base != source_digest("def f(x):\n    return 1 + x\n")


def test_a_body_changed_behind_the_same_parameters_is_refused(tmp_path: Path) -> None:
    """Swap a relied-on function for one with the same parameters and other
    code: start-up refuses, naming the symbol, the release and both
    fingerprints."""
    (tmp_path / "swapped_body.py").write_text(
        "def max_num_blocks_per_req(self, vllm_config, max_len):\n    return 1\n"
    )
    result = run_python(
        f"""
import json, sys
sys.path.insert(0, {str(tmp_path)!r})
import swapped_body
from vllm.v1 import kv_cache_interface as k
k.MambaSpec.max_num_blocks_per_req = swapped_body.max_num_blocks_per_req
import vllm_dcp_geometry.plugin as plugin
try:
    plugin.register()
    print(json.dumps("registered"))
except Exception as exc:
    print(json.dumps(type(exc).__name__ + ": " + str(exc)))
""",
        patched=False,
    )
    release = installed_vllm_version()
    assert result.startswith("UpstreamChangedError"), result
    assert "MambaSpec.max_num_blocks_per_req, whose code changed" in result
    recorded = recorded_pins(str(release))[
        "vllm.v1.kv_cache_interface:MambaSpec.max_num_blocks_per_req"
    ]["fingerprint"]
    assert f"vLLM {release}'s fingerprint is {recorded}" in result


UNKNOWN_RELEASE = """
import json, os, sys
sys.path.insert(0, {tmp!r})
os.environ["VLLM_DCP_GEOMETRY_ALLOW_VLLM_VERSION"] = "0.99.0"
import vllm_dcp_geometry.plugin as plugin
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime.releases import active_release
# The unknown release is the installed one's code under another number: the
# patches the installed release declares are the ones that must match (one
# declared for another release only refuses code it was not written for).
real = active_release()
plugin.PATCH_MODULES = tuple(
    n for n, p in declarations(plugin.PATCH_MODULES).items() if p.declared_for(real)
)
plugin.installed_vllm_version = lambda: "0.99.0"
from vllm_dcp_geometry.runtime import releases
releases.installed_vllm_version = lambda: "0.99.0"
if {swap}:
    import swapped_body
    from vllm.v1 import kv_cache_interface as k
    k.MambaSpec.max_num_blocks_per_req = swapped_body.max_num_blocks_per_req
    k.AttentionSpec.max_num_blocks_per_req = swapped_body.max_num_blocks_per_req
try:
    plugin.register()
    import vllm.v1.kv_cache_interface as k
    print(json.dumps(["registered", hasattr(k, "get_kv_cache_dcp_shard_count")]))
except Exception as exc:
    print(json.dumps(type(exc).__name__ + ": " + str(exc)))
"""


def test_override_on_an_unknown_release_matches_symbol_by_symbol(
    tmp_path: Path,
) -> None:
    """Under the override an unknown release runs only where every patch
    matches a known release; otherwise start-up lists every difference."""
    (tmp_path / "swapped_body.py").write_text(
        "def max_num_blocks_per_req(self, vllm_config, max_len):\n    return 1\n"
    )
    same = run_python(
        UNKNOWN_RELEASE.format(tmp=str(tmp_path), swap=False), patched=False
    )
    assert same == ["registered", True]
    swapped = run_python(
        UNKNOWN_RELEASE.format(tmp=str(tmp_path), swap=True), patched=False
    )
    assert swapped.startswith("UpstreamChangedError"), swapped
    assert "MambaSpec.max_num_blocks_per_req" in swapped
    assert "AttentionSpec.max_num_blocks_per_req" in swapped  # all at once


@pytest.mark.vllm_releases("0.34.0")
def test_the_0_33_pins_refuse_0_34_mla_forward_impl() -> None:
    """The a2a up-projection changed MLAAttention.forward_impl's body; the
    0.33.0 pin refuses it (and Kimi-K3's _attention, whose parameters did
    not change at all)."""
    recorded = recorded_pins("0.33.0")
    for module, qualname in (
        (
            "vllm.model_executor.layers.attention.mla_attention",
            "MLAAttention.forward_impl",
        ),
        ("vllm.models.kimi_k3.nvidia.mla", "MultiHeadLatentAttention._attention"),
    ):
        pin = recorded[symbol_key(module, qualname)]
        symbol = UpstreamSymbol(module, qualname, None, pin["fingerprint"], "0.33.0")
        with pytest.raises(UpstreamChangedError, match="whose code changed"):
            verify_symbol(symbol)


def test_drift_report_finds_nothing_on_a_known_release() -> None:
    """On the installed (known) release the report is clean against its own
    lock files."""
    result = run_python(
        f"""
import json
from vllm_dcp_geometry.tooling.drift.report import drift
report = drift(({installed_vllm_version()!r},))
print(json.dumps(report))
""",
        patched=False,
    )
    differ = [
        r
        for r in result["symbols"]
        if not r["status"].startswith(("identical", "not pinned"))
    ]
    assert differ == []
    assert result["sites"] == []
    assert json.dumps(result)  # plain JSON
