# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patches fail closed: a drifted module stays refused, ``register()`` applies
all or nothing, and hooks only ever see fully executed modules.

The hook mechanics run on throw-away modules written to a temporary folder
(milliseconds); registration runs in fresh interpreters against real vLLM
(about 10 s each, most of it importing torch).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import run_python
from vllm_dcp_geometry.runtime import import_hooks, patching
from vllm_dcp_geometry.runtime.patching import UpstreamChangedError

pytestmark = pytest.mark.patches("common.kv_cache_interface")

WAIT_S = 10


@pytest.fixture
def new_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Write a module with a fresh name and return that name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names: list[str] = []

    def write(source: str) -> str:
        name = f"hooked_{uuid.uuid4().hex}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


@pytest.fixture
def control() -> Iterator[types.SimpleNamespace]:
    """Events a test module waits on during its import (found through
    ``sys.modules``, so the module needs no import of the test suite)."""
    state = types.SimpleNamespace(
        started=threading.Event(), go=threading.Event(), calls=[]
    )
    module = types.ModuleType("hook_test_control")
    module.state = state  # type: ignore[attr-defined]
    sys.modules["hook_test_control"] = module
    yield state
    state.go.set()
    del sys.modules["hook_test_control"]


SLOW_MODULE = """
import sys
state = sys.modules["hook_test_control"].state
EARLY = True
state.started.set()
assert state.go.wait(10), "the test never released the import"
LATE = True
def answer():
    return 1
"""


def _import_in_thread(name: str) -> tuple[threading.Thread, list[Any]]:
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(importlib.import_module(name))
        except BaseException as exc:  # reported to the test
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_failed_patch_stays_failed_and_its_changes_are_undone(new_module) -> None:
    name = new_module("def answer():\n    return 1\n")
    seen: list[Any] = []

    def drifted_patch(module: Any) -> None:
        seen.append(module)
        patching.wrap(module, "answer", lambda original: lambda: 2)
        raise UpstreamChangedError("answer() changed upstream")

    import_hooks.when_imported(name, drifted_patch)
    with pytest.raises(UpstreamChangedError, match="changed upstream"):
        importlib.import_module(name)
    (module,) = seen
    assert module.answer() == 1  # the wrap before the failure was undone
    assert name not in sys.modules
    # A caller that catches and retries never gets the module unpatched.
    for _ in range(2):
        with pytest.raises(UpstreamChangedError, match="stays refused"):
            importlib.import_module(name)
    with pytest.raises(UpstreamChangedError, match="stays refused"):
        import_hooks.when_imported(name, drifted_patch)
    assert len(seen) == 1


def test_a_hook_waits_for_another_threads_import_to_finish(new_module, control) -> None:
    name = new_module(SLOW_MODULE)
    thread, outcome = _import_in_thread(name)
    assert control.started.wait(WAIT_S)
    seen: list[bool] = []
    threading.Timer(0.2, control.go.set).start()
    # The module is in sys.modules but half executed: the hook must wait.
    import_hooks.when_imported(name, lambda m: seen.append(hasattr(m, "LATE")))
    thread.join(WAIT_S)
    assert seen == [True]
    assert outcome and not isinstance(outcome[0], BaseException)


class _SlowFinder(importlib.abc.MetaPathFinder):
    """Finds one module's spec slowly, as an import already past its finders
    when the hook is installed."""

    def __init__(self, name: str, entered: threading.Event, go: threading.Event):
        self.name, self.entered, self.go = name, entered, go

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.entered.set()
        assert self.go.wait(WAIT_S)
        return importlib.machinery.PathFinder.find_spec(fullname, path)


def test_an_import_already_past_its_finders_is_still_hooked(new_module) -> None:
    name = new_module("def answer():\n    return 1\n")
    entered, go = threading.Event(), threading.Event()
    finder = _SlowFinder(name, entered, go)
    sys.meta_path.insert(0, finder)
    try:
        thread, outcome = _import_in_thread(name)
        assert entered.wait(WAIT_S)
        seen: list[Any] = []
        threading.Timer(0.2, go.set).start()
        import_hooks.when_imported(name, seen.append)
        thread.join(WAIT_S)
    finally:
        go.set()
        sys.meta_path.remove(finder)
    assert len(seen) == 1 and seen[0] is outcome[0]


def test_a_hook_on_a_module_this_thread_is_importing_is_refused(
    new_module, control
) -> None:
    name = new_module(
        "import sys\n"
        "from vllm_dcp_geometry.runtime import import_hooks\n"
        "calls = sys.modules['hook_test_control'].state.calls\n"
        "if not calls:\n"
        "    calls.append('first import')\n"
        "    import_hooks.when_imported(__name__, calls.append)\n"
    )
    with pytest.raises(RuntimeError, match="still being imported by the same thread"):
        importlib.import_module(name)
    # The refused hook is not left behind to run on the next import.
    module = importlib.import_module(name)
    assert control.calls == ["first import"]
    assert module is sys.modules[name]


# register() against real vLLM, in fresh interpreters ------------------------------

REGISTER_SCRIPT = """
import dataclasses, importlib, json
import vllm_dcp_geometry.plugin as plugin
from vllm_dcp_geometry.runtime.patching import ORIGINAL_ATTR, Pin
utils_patch = importlib.import_module(
    "vllm_dcp_geometry.patches.engine_core.kv_cache_utils")

def patched(owner, name):
    return hasattr(owner.__dict__[name], ORIGINAL_ATTR)

def attempt(action):
    try:
        action()
        return "ok"
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)
"""


def test_a_drifted_module_imported_after_register_stays_refused() -> None:
    result = run_python(
        REGISTER_SCRIPT
        + """
utils_patch.PATCH = dataclasses.replace(utils_patch.PATCH,
    relies_on=utils_patch.PATCH.relies_on + (Pin("renamed_upstream"),))
plugin.register()
first = attempt(lambda: importlib.import_module("vllm.v1.core.kv_cache_utils"))
again = attempt(lambda: importlib.import_module("vllm.v1.core.kv_cache_utils"))
import vllm.v1.kv_cache_interface as k
print(json.dumps({"first": first, "again": again,
                  "other_patched": patched(k.AttentionSpec, "max_num_blocks_per_req")}))
""",
        patched=False,
        cpu_prelude=False,
    )
    assert result["first"].startswith("UpstreamChangedError")
    assert "renamed_upstream" in result["first"]
    assert result["again"].startswith("ModuleRefusedError")
    assert "stays refused" in result["again"] and "renamed_upstream" in result["again"]
    assert result["other_patched"]


def test_register_verifies_every_imported_module_before_applying_any() -> None:
    result = run_python(
        REGISTER_SCRIPT
        + """
import vllm.v1.kv_cache_interface as k
import vllm.v1.core.kv_cache_utils
utils_patch.PATCH = dataclasses.replace(utils_patch.PATCH,
    relies_on=utils_patch.PATCH.relies_on + (Pin("renamed_upstream"),))
outcomes = [attempt(plugin.register), attempt(plugin.register)]
print(json.dumps({"outcomes": outcomes,
                  "spec_patched": patched(k.AttentionSpec, "max_num_blocks_per_req"),
                  "module_function": hasattr(k, "get_kv_cache_dcp_shard_count")}))
""",
        patched=False,
        cpu_prelude=False,
    )
    assert all(o.startswith("UpstreamChangedError") for o in result["outcomes"])
    # kv_cache_interface comes first in PATCH_MODULES; it must not be patched.
    assert result["spec_patched"] is False
    assert result["module_function"] is False


def test_register_undoes_what_it_applied_when_a_patch_fails() -> None:
    result = run_python(
        REGISTER_SCRIPT
        + """
import vllm.v1.kv_cache_interface as k
import vllm.v1.core.kv_cache_utils as u
def failing_apply(module):  # runs after the patch's declared wrappers
    raise RuntimeError("a check inside apply failed")
utils_patch.PATCH = dataclasses.replace(utils_patch.PATCH, apply=failing_apply)
outcome = attempt(plugin.register)
import vllm.v1.core.kv_cache_coordinator as coordinator
print(json.dumps({
    "outcome": outcome,
    "spec_patched": patched(k.AttentionSpec, "max_num_blocks_per_req"),
    "utils_patched": hasattr(u.resolve_dcp_kv_block_size, ORIGINAL_ATTR),
    "later_module_patched": patched(coordinator.KVCacheCoordinator, "__init__"),
    "applied": plugin.applied_patches(),
}))
""",
        patched=False,
        cpu_prelude=False,
    )
    assert result["outcome"].startswith("RuntimeError: a check inside apply")
    assert result["spec_patched"] is False
    assert result["utils_patched"] is False
    # The hooks of modules not yet imported were removed too.
    assert result["later_module_patched"] is False
    assert result["applied"] == {}


def test_upstream_defining_the_shard_count_helper_stops_registration() -> None:
    """If vLLM ever ships ``get_kv_cache_dcp_shard_count`` itself, the plugin
    refuses to shadow it, and nothing it had applied before stays applied
    (the spec classes' grafted field included)."""
    result = run_python(
        REGISTER_SCRIPT
        + """
import vllm.v1.kv_cache_interface as k
def get_kv_cache_dcp_shard_count(spec, dcp_world_size):
    return 1
k.get_kv_cache_dcp_shard_count = get_kv_cache_dcp_shard_count
outcome = attempt(plugin.register)
print(json.dumps({
    "outcome": outcome,
    "helper_is_upstream": k.get_kv_cache_dcp_shard_count is get_kv_cache_dcp_shard_count,
    "field_grafted": "dcp_kv_shard_count" in k.FullAttentionSpec.__dataclass_fields__,
    "spec_patched": patched(k.AttentionSpec, "max_num_blocks_per_req"),
    "applied": plugin.applied_patches(),
}))
""",
        patched=False,
        cpu_prelude=False,
    )
    assert result["outcome"].startswith("UpstreamChangedError: ")
    assert "get_kv_cache_dcp_shard_count" in result["outcome"]
    assert result["helper_is_upstream"] is True
    assert result["field_grafted"] is False
    assert result["spec_patched"] is False
    assert result["applied"] == {}
