# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The plugin: entry point, version pin, idempotent registration, patch table."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT, run_python
from vllm_dcp_geometry import plugin
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime import patching
from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, UpstreamSymbol
from vllm_dcp_geometry.runtime.releases import active_release
from vllm_dcp_geometry.tooling.docs.patch_table import RUNS_IN, patch_table_markdown

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches("common.kv_cache_interface"),
]


def test_import_in_a_bare_interpreter_does_not_import_vllm() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, json, vllm_dcp_geometry, vllm_dcp_geometry.contract;"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('vllm', 'torch'))))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    )
    assert json.loads(out.stdout) == []


def test_entry_point_is_declared_for_vllm() -> None:
    points = metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in points if ep.value == "vllm_dcp_geometry.plugin:register"]
    assert [ep.name for ep in ours] == ["dcp_geometry"]


def test_loaded_through_vllm_own_plugin_loader() -> None:
    """Entry point discovered for real by vllm.plugins.load_general_plugins()."""
    result = run_python(
        """
import json, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1 import kv_cache_interface as k
from vllm_dcp_geometry.contract import cdiv
from tests.support.vllm_configs import make_vllm_config
out = {}
mamba = k.MambaSpec(block_size=768, shapes=((4, 64),), dtypes=(torch.float32,),
                    mamba_cache_mode="align", num_speculative_blocks=7)
out["mamba"] = k.get_kv_cache_dcp_shard_count(mamba, 16)
full = k.FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=64,
                           dtype=torch.bfloat16, dcp_kv_shard_count=4)
out["full"] = k.get_kv_cache_dcp_shard_count(full, 16)
out["width"] = full.max_num_blocks_per_req(make_vllm_config(16), 1_000_000)
out["expected_width"] = cdiv(1_000_000, 64 * 4)
errors = []
import dataclasses
for bad in (3, 0, 32):
    try:
        k.get_kv_cache_dcp_shard_count(dataclasses.replace(full, dcp_kv_shard_count=bad), 16)
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
try:
    k.get_kv_cache_dcp_shard_count(
        dataclasses.replace(full, dcp_sharded=False), 16)
    replicated = k.get_kv_cache_dcp_shard_count(
        dataclasses.replace(full, dcp_sharded=False, dcp_kv_shard_count=4), 16)
    errors.append(None)
except ValueError as exc:
    errors.append(str(exc))
out["errors"] = errors
print(json.dumps(out))
""",
        patched=False,  # the plugin must come in through vLLM's loader alone
        env={"VLLM_PLUGINS": "dcp_geometry"},
    )
    assert result["mamba"] == 1
    assert result["full"] == 4
    assert result["width"] == result["expected_width"] == 3907
    three, zero, thirty_two, partial_replicated = result["errors"]
    assert three and "K=3" in three and "D=16" in three
    assert zero and ">= 1" in zero
    assert thirty_two and "K=32" in thirty_two
    assert partial_replicated and "replicated" in partial_replicated


def test_vllm_plugins_filter_keeps_the_baseline_unpatched() -> None:
    result = run_python(
        """
import json
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.v1 import kv_cache_interface as k
print(json.dumps(hasattr(k, "get_kv_cache_dcp_shard_count")))
""",
        patched=False,
    )
    assert result is False


def import_every_patched_module() -> dict[str, str]:
    """Register, import every vLLM module a patch targets, and return the
    patches applied (all of them)."""
    plugin.register()
    for patch in declared_here().values():
        importlib.import_module(patch.upstream_module)
    return plugin.applied_patches()


def declared_here() -> dict[str, patching.Patch]:
    """The patches declared for the installed vLLM release."""
    release = active_release()
    return {n: p for n, p in declarations().items() if p.declared_for(release)}


def test_register_is_idempotent() -> None:
    from vllm.v1 import kv_cache_interface as k

    before = k.AttentionSpec.__dict__["max_num_blocks_per_req"]
    plugin.register()
    plugin.register()
    assert set(import_every_patched_module()) == set(declared_here())
    after = k.AttentionSpec.__dict__["max_num_blocks_per_req"]
    assert before is after
    original = patching.original_of(after)
    assert not hasattr(original, patching.ORIGINAL_ATTR)
    assert original.__module__ == "vllm.v1.kv_cache_interface"


def test_patch_applies_whether_vllm_is_imported_before_or_after() -> None:
    script = """
import json, sys
import vllm_dcp_geometry
if IMPORT_FIRST:
    import vllm.v1.kv_cache_interface
vllm_dcp_geometry.register()
# register() itself imports no vLLM module: the patch waits for the import.
imported = "vllm.v1.kv_cache_interface" in sys.modules
import vllm.v1.kv_cache_interface as k
print(json.dumps([imported, hasattr(k, "get_kv_cache_dcp_shard_count")]))
"""
    for import_first in (False, True):
        result = run_python(
            f"IMPORT_FIRST = {import_first}\n" + script,
            patched=False,
            cpu_prelude=False,
        )
        assert result == [import_first, True]


# The patch table ----------------------------------------------------------------


def test_patch_table_page_is_current() -> None:
    """docs/patches.md carries the generated table; regenerate it with
    ``python tools/update_docs.py``."""
    page = (Path(REPO_ROOT) / "docs" / "patches.md").read_text()
    start, end = "<!-- patch-table:start -->\n", "\n<!-- patch-table:end -->"
    assert start in page and end in page
    table = page.split(start, 1)[1].split(end, 1)[0]
    assert table == patch_table_markdown()


def test_every_patch_module_documents_itself() -> None:
    for name, patch in declarations().items():
        doc = importlib.import_module(name).__doc__ or ""
        upstream = patch.upstream_module
        assert upstream in doc or upstream.split(".")[-1] in doc, name
        assert "Why:" in doc and "Remove when:" in doc, name
        assert patch.why and patch.remove_when and patch.related, name
        assert "~" not in doc, f"{name}: name symbols, not line numbers"
        assert all(patch.symbols(r) for r in patch.releases), name
        # The folder says which process runs the patched code.
        assert name.split(".")[-2] in RUNS_IN, name


def test_one_patch_module_per_upstream_symbol() -> None:
    owners: dict[str, str] = {}
    for name, patch in declarations().items():
        for symbol in patch.patched_symbols:
            key = str(symbol)
            assert key not in owners, f"{key} patched by {owners.get(key)} too"
            owners[key] = name


def test_every_patched_symbol_matches_unpatched_vllm() -> None:
    """Fails loudly if an upstream symbol moved or changed its parameters."""
    result = run_python(
        """
import json
from vllm_dcp_geometry.runtime.patching import verify_symbol
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.tooling.docs.patch_table import patch_table_markdown
problems, checked = [], 0
for patch in declarations().values():
    for symbol in patch.patched_symbols:
        try:
            verify_symbol(symbol)
            checked += 1
        except Exception as exc:
            problems.append(f"{symbol}: {exc}")
print(json.dumps({"checked": checked, "problems": problems}))
""",
        patched=False,
    )
    assert result["problems"] == []
    assert result["checked"] == sum(
        len(p.patched_symbols) for p in declarations().values()
    )


def test_moved_or_changed_symbols_raise() -> None:
    module = "vllm.v1.kv_cache_interface"
    with pytest.raises(UpstreamChangedError, match="no longer exists"):
        patching.verify_symbol(UpstreamSymbol(module, "AttentionSpec.gone"))
    with pytest.raises(UpstreamChangedError, match="parameters changed"):
        patching.verify_symbol(
            UpstreamSymbol(module, "AttentionSpec.max_num_blocks_per_req", "self")
        )
    # Inherited attributes do not count: a patch must land where it is defined.
    with pytest.raises(UpstreamChangedError):
        patching.verify_symbol(UpstreamSymbol(module, "MLAAttentionSpec.max_len"))


def test_a_changed_symbol_stops_registration() -> None:
    result = run_python(
        """
import dataclasses, json
import vllm_dcp_geometry.plugin as plugin
from vllm_dcp_geometry.runtime.patching import Pin
from vllm_dcp_geometry.patches.common import kv_cache_interface as patch
patch.PATCH = dataclasses.replace(patch.PATCH, relies_on=patch.PATCH.relies_on + (
    Pin("AttentionSpec.renamed_upstream"),))
try:
    plugin.register()
    import vllm.v1.kv_cache_interface
    print(json.dumps("registered"))
except Exception as exc:
    print(json.dumps(type(exc).__name__ + ": " + str(exc)))
""",
        patched=False,
    )
    assert result.startswith("UpstreamChangedError")
    assert "AttentionSpec.renamed_upstream" in result


def test_a_second_patch_on_one_symbol_is_refused() -> None:
    class Owner:
        def method(self) -> int:
            return 1

    def make_first(original):  # type: ignore[no-untyped-def]
        return lambda self: original(self) + 1

    def make_second(original):  # type: ignore[no-untyped-def]
        return lambda self: original(self) * 10

    patching.wrap(Owner, "method", make_first)
    patching.wrap(Owner, "method", make_first)  # idempotent
    assert Owner().method() == 2
    with pytest.raises(UpstreamChangedError, match="already wrapped by"):
        patching.wrap(Owner, "method", make_second)
    assert Owner().method() == 2
