# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``register()`` after vLLM's patched modules are already imported (the eager
path: a script, notebook or test process that imported vLLM before
``load_general_plugins`` ran) reaches exactly the state of the lazy path
(``register()`` first, the modules imported after it), whatever the order and
whichever subset was imported first.

The state compared is every global of every loaded ``vllm.*`` module that is
one of the plugin's wrappers or the upstream object a wrapper replaced (a copy
taken with ``from m import f`` that still holds the original would call
upstream's code where the patch meant its own), plus the applied patches.
"""

from __future__ import annotations

import pytest

from tests.support.processes import run_python

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches("worker.mla_attention", "worker.sparse_mla_attention"),
]

STATE = """
import importlib, json, random, sys, types
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime.patching import ORIGINAL_ATTR, original_of
from vllm_dcp_geometry.runtime.releases import active_release
import vllm_dcp_geometry.plugin as plugin

# The modules patched on the installed release (0.34.0 has no Model Runner V1).
UPSTREAM = [
    patch.upstream_module
    for patch in declarations().values()
    if patch.declared_for(active_release())
]

def import_all(names):
    for name in names:
        importlib.import_module(name)

def is_wrapper(value):
    if isinstance(value, types.ModuleType):
        return False
    try:
        return callable(value) and ORIGINAL_ATTR in getattr(value, "__dict__", {})
    except Exception:  # lazy loaders import on attribute access
        return False

def state():
    wrappers = {}
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("vllm."):
            continue
        for attr, value in list(vars(mod).items()):
            if is_wrapper(value):
                wrappers[id(original_of(value))] = value
    found = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("vllm."):
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in wrappers and value is not wrappers[id(value)]:
                found.append(f"{mod_name}.{attr}: upstream")
            elif is_wrapper(value):
                found.append(f"{mod_name}.{attr}: wrapped")
    return {"globals": sorted(found), "applied": sorted(plugin.applied_patches())}
"""

LAZY = (
    STATE
    + """
plugin.register()
import_all(UPSTREAM)
print(json.dumps(state()))
"""
)


def eager(first: str) -> str:
    return (
        STATE
        + f"""
first = {first}
import_all(first)
plugin.register()
import_all(UPSTREAM)
print(json.dumps(state()))
"""
    )


EAGER_ORDERS = {
    "registry order": "UPSTREAM",
    "reversed": "UPSTREAM[::-1]",
    "shuffled": "random.Random(7).sample(UPSTREAM, len(UPSTREAM))",
    "sparse MLA alone": (
        "['vllm.model_executor.layers.attention.sparse_mla_attention']"
    ),
    "a random half": "random.Random(3).sample(UPSTREAM, len(UPSTREAM) // 2)",
}


@pytest.fixture(scope="module")
def lazy_state() -> dict:
    return run_python(LAZY, patched=False)


@pytest.mark.parametrize("first", sorted(EAGER_ORDERS))
def test_the_eager_path_reaches_the_lazy_state(first: str, lazy_state: dict) -> None:
    result = run_python(eager(EAGER_ORDERS[first]), patched=False)
    assert result["applied"] == lazy_state["applied"]
    assert result["globals"] == lazy_state["globals"]
    # Every patch applied, and no loaded copy still calls upstream's code
    # where a patch replaced it.
    assert len(result["applied"]) >= 25
    stale = [line for line in result["globals"] if line.endswith(": upstream")]
    assert not [
        line for line in stale if "build_mla_chunked_context_metadata" in line
    ], stale
