# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The declaration object of a patch (``runtime.patching.Patch``): declaring is
applying. ``install`` verifies every pinned symbol before changing anything,
installs exactly the declared wrappers (with the module or extra factory
arguments where declared, keeping classmethods, rebinding ``from x import f``
copies), then runs the patch's own ``apply``; a failure inside an
``undo_on_error`` block undoes all of it. Malformed declarations are refused
when the module is imported. Shown on fake upstream modules."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime import patching
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap

SAYS = {"why": "-", "remove_when": "-", "related": "-"}

FAKE_MODULES = ("fake_upstream", "vllm._fake_upstream", "other_module")


class _PinsWithFakes(dict):  # type: ignore[type-arg]
    """A release's lock file, plus an entry without a body fingerprint for
    every symbol of the fake upstream modules here (their source is made by
    ``exec``, so there is none to read)."""

    def __contains__(self, key: object) -> bool:
        return str(key).split(":")[0] in FAKE_MODULES or super().__contains__(key)

    def __getitem__(self, key: str) -> Any:
        if key.split(":")[0] in FAKE_MODULES:
            return {"parameters": None, "fingerprint": None}
        return super().__getitem__(key)


@pytest.fixture(autouse=True)
def fake_modules_are_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    real = patching.recorded_pins
    monkeypatch.setattr(
        patching, "recorded_pins", lambda release: _PinsWithFakes(real(release))
    )


def _upstream(name: str = "fake_upstream") -> types.ModuleType:
    module = types.ModuleType(name)
    exec(
        "def f(x):\n    return x\n"
        "def g():\n    return 0\n"
        "class C:\n"
        "    def m(self):\n        return 1\n"
        "    @classmethod\n    def cm(cls):\n        return 2\n",
        module.__dict__,
    )
    return module


def make_f(original: Callable[..., Any]) -> Callable[..., Any]:
    return lambda x: original(x) + 100


def make_m(original: Callable[..., Any], module: types.ModuleType) -> Any:
    return lambda self: (original(self), module.__name__)


def make_cm(original: Callable[..., Any], extra: int) -> Any:
    return lambda cls: original(cls) + extra


def _patch(name: str = "fake_upstream", **changes: Any) -> Patch:
    fields: dict[str, Any] = {
        "upstream_module": name,
        "replaces": (
            Wrap("f", "x", make_f),
            Wrap("C.m", "self", make_m, with_module=True),
            Wrap("C.cm", "cls", make_cm, factory_args=(40,)),
        ),
        "relies_on": (Pin("g", ""),),
        **SAYS,
    }
    return Patch(**{**fields, **changes})


def test_install_makes_exactly_the_declared_changes() -> None:
    module = _upstream()
    patch = _patch()
    with patching.applying("fake_install"):
        patch.install(module)
    assert module.f(1) == 101
    assert module.C().m() == (1, "fake_upstream")
    assert isinstance(module.C.__dict__["cm"], classmethod)
    assert module.C.cm() == 42
    made = patching.changes_made_by("fake_install")
    assert {(c.kind, c.name) for c in made} == {
        ("wrap", "f"),
        ("wrap", "m"),
        ("wrap", "cm"),
    }
    assert [str(s) for s in patch.patched_symbols] == [
        "fake_upstream.f",
        "fake_upstream.C.m",
        "fake_upstream.C.cm",
        "fake_upstream.g",
    ]
    # Installing again changes nothing (each wrapper knows its factory).
    patch.install(module)
    assert module.f(1) == 101
    assert len(patching.changes_made_by("fake_install")) == len(made)


def test_a_drifted_symbol_is_refused_before_anything_changes() -> None:
    module = _upstream()
    original = module.f
    for drifted in (Pin("g", "x"), Pin("gone")):
        patch = _patch(relies_on=(drifted,))
        with pytest.raises(patching.UpstreamChangedError, match=r"fake_upstream\.g"):
            patch.install(module)
        assert module.f is original
    with pytest.raises(ValueError, match="cannot install into other_module"):
        _patch().install(_upstream("other_module"))


def test_a_failing_apply_undoes_the_declared_wrappers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``apply`` runs after the wrappers; raising there leaves nothing behind,
    copies rebound in other vLLM modules included."""
    module = _upstream("vllm._fake_upstream")
    user = types.ModuleType("vllm._fake_user")
    user.f = module.f  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    original = module.f
    seen: list[Any] = []

    def failing_apply(upstream: types.ModuleType) -> None:
        seen.append((upstream.f(1), user.f(1)))
        raise RuntimeError("a check inside apply failed")

    patch = _patch(
        module.__name__,
        replaces=(Wrap("f", "x", make_f, rebind_copies=True),),
        apply=failing_apply,
    )
    failing = pytest.raises(RuntimeError, match="inside apply")
    with failing, patching.undo_on_error(), patching.applying("fake_failing"):
        patch.install(module)
    assert seen == [(101, 101)]
    assert module.f is original and user.f is original
    assert patching.changes_made_by("fake_failing") == ()


def test_malformed_declarations_are_refused() -> None:
    with pytest.raises(ValueError, match="declares g more than once"):
        _patch(replaces=(Wrap("g", "", make_f),))
    with pytest.raises(ValueError, match="f more than once"):
        _patch(relies_on=(), adds=("f",))
    with pytest.raises(ValueError, match="wrapper options without a factory"):
        Wrap("f", with_module=True)
    with pytest.raises(ValueError, match="only module functions are rebound"):
        Wrap("C.m", "self", make_f, rebind_copies=True)
    with pytest.raises(TypeError):
        Patch(upstream_module="fake_upstream")  # type: ignore[call-arg]


def test_the_registry_refuses_a_module_without_a_declaration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "fake_patch_module", types.ModuleType("x"))
    with pytest.raises(TypeError, match="fake_patch_module declares no PATCH"):
        declarations(["fake_patch_module"])
    first = next(iter(declarations()))
    assert isinstance(declarations([first])[first], Patch)
