# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Post-import hooks: run a callback once a module is imported and fully
executed, and keep a module whose callback failed refused.

Three promises, because patches are applied through these hooks:

- A callback only ever sees a fully executed module. A module another thread
  is still importing is waited for (through the module's own import lock);
  one this thread is still importing is refused with an error, since there is
  no end of its execution left to hook.
- No import slips between "not imported yet" and "hook installed": after a
  hook is installed the module's import lock is taken once, so an import
  already past its finders finishes first and is then caught here.
- A callback that raises leaves its module refused: the import raises, the
  changes the callback made are undone (``patching.undo_on_error``) and every
  later import of that module raises again, so no caller can catch the error
  and retry its way to an unpatched module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, undo_on_error

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_hooks: dict[str, list[Callback]] = {}
_refused: dict[str, BaseException] = {}


class ModuleRefusedError(UpstreamChangedError):
    """A module whose patch failed when it was first imported stays refused."""


def _is_executing(module: ModuleType) -> bool:
    # importlib marks a module's spec while its code runs.
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _wait_for_import(name: str) -> None:
    """Return once no other thread is importing ``name``: take and release
    the module's import lock (re-entrant for this thread)."""
    from importlib import _bootstrap

    try:
        with _bootstrap._ModuleLockManager(name):  # type: ignore[attr-defined]
            pass
    except RuntimeError as exc:  # importlib's _DeadlockError
        raise RuntimeError(
            f"vllm-dcp-geometry cannot wait for the import of {name}: it would "
            f"deadlock with this thread's own imports ({exc})"
        ) from exc


def loaded_module(name: str) -> ModuleType | None:
    """``sys.modules[name]`` once fully executed; None if not imported.

    Waits for another thread's import of it to finish; raises if this very
    thread is still executing it.
    """
    if name not in sys.modules:
        return None
    _wait_for_import(name)
    module = sys.modules.get(name)
    if module is not None and _is_executing(module):
        raise RuntimeError(
            f"vllm-dcp-geometry was registered while {name} is still being "
            "imported by the same thread; register the plugin before importing "
            "vLLM, or after that import has finished"
        )
    return module


def _refusal(name: str) -> ModuleRefusedError:
    cause = _refused[name]
    error = ModuleRefusedError(
        f"{name} was refused when it was first imported and stays refused: {cause}"
    )
    error.__cause__ = cause
    return error


def _run_hooks(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _hooks.pop(name, [])
    try:
        with undo_on_error():
            for callback in callbacks:
                callback(module)
    except BaseException as exc:
        with _lock:
            _refused.setdefault(name, exc)
        raise


class _HookedLoader(importlib.abc.Loader):
    """Runs the registered callbacks right after the real loader executes."""

    def __init__(self, loader: importlib.abc.Loader, fullname: str) -> None:
        self._loader = loader
        self._fullname = fullname

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Tracebacks and inspect.getsource read __loader__.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_hooks(self._fullname, module)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        with _lock:
            if fullname in _refused:
                raise _refusal(fullname)
            hooked = fullname in _hooks
        resolving: set[str] = self._local.__dict__.setdefault("resolving", set())
        if not hooked or fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            resolving.discard(fullname)
        if spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported and fully executed
    (now, if it already is). A callback that raises leaves the module refused
    (see the module docstring)."""
    with _lock:
        if name in _refused:
            raise _refusal(name)
        _hooks.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    try:
        # An import that found its spec before the hook existed finishes first.
        _wait_for_import(name)
        module = loaded_module(name)
    except BaseException:
        forget(name, callback)
        raise
    if module is not None:
        _run_hooks(name, module)


def forget(name: str, callback: Callback) -> None:
    """Remove a callback that has not run yet (an aborted registration)."""
    with _lock:
        callbacks = _hooks.get(name, [])
        if callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _hooks.pop(name, None)
