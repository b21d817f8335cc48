# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The vLLM symbols a patch pins, and the checks that fail loudly on drift.

A patch is written against the vLLM releases it declares: every symbol it
replaces or relies on is named here with the parameter list and the source
fingerprint recorded for the release being checked (``UpstreamSymbol``), and
``verify_symbol`` refuses one that moved, whose parameters changed or whose
code changed (``UpstreamChangedError``). ``require_global_call`` and
``require_class_path`` pin what a parameter list cannot say. A patch never
switches itself off: every check raises. No vLLM import here.
"""

from __future__ import annotations

import importlib
import inspect
import types
from dataclasses import dataclass
from types import ModuleType
from typing import Any

ORIGINAL_ATTR = "__vllm_dcp_geometry_original__"
"""Set on every wrapper we install; holds the upstream object it replaced."""


class UpstreamChangedError(RuntimeError):
    """A vLLM symbol this plugin patches moved or changed its parameters."""


@dataclass(frozen=True)
class UpstreamSymbol:
    """A symbol in ``module`` this plugin patches or relies on.

    ``parameters`` is the parameter list the patch was written against, as
    ``describe_parameters`` prints it; None checks only that it exists.
    ``fingerprint`` is its source fingerprint on ``release``
    (``fingerprints.fingerprint``); None checks no body.
    """

    module: str
    qualname: str
    parameters: str | None = None
    fingerprint: str | None = None
    release: str | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


def callable_of(obj: Any) -> Any:
    """The function inside a classmethod, staticmethod or property."""
    if isinstance(obj, (classmethod, staticmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    return obj


def original_of(obj: Any) -> Any:
    """The upstream object behind one of our wrappers (or ``obj`` itself)."""
    return getattr(callable_of(obj), ORIGINAL_ATTR, obj)


def describe_parameters(obj: Any) -> str:
    """Parameter names and kinds of a callable, e.g. ``self, x, *, y=, **kw``.

    A Triton kernel (compiled or interpreted) is described by its
    ``arg_names``, in launch order, so a kernel the plugin launches is pinned
    argument by argument.
    """
    func = callable_of(obj)
    func = getattr(func, ORIGINAL_ATTR, func)
    func = callable_of(func)
    arg_names = getattr(func, "arg_names", None)
    if isinstance(arg_names, (list, tuple)) and not inspect.isroutine(func):
        return ", ".join(arg_names)
    parts: list[str] = []
    saw_kw_only = False
    params = list(inspect.signature(func).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            saw_kw_only = True
            continue
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        if p.kind is p.KEYWORD_ONLY and not saw_kw_only:
            parts.append("*")
            saw_kw_only = True
        default = "=" if p.default is not p.empty else ""
        parts.append(f"{p.name}{default}")
        nxt = params[i + 1] if i + 1 < len(params) else None
        if p.kind is p.POSITIONAL_ONLY and (
            nxt is None or nxt.kind is not p.POSITIONAL_ONLY
        ):
            parts.append("/")
    return ", ".join(parts)


def lookup(module: ModuleType, qualname: str) -> tuple[Any, str, Any]:
    """(owner, attribute name, raw attribute) of ``qualname`` in ``module``.

    The attribute must be defined on its owner itself (not inherited), so a
    patch never lands on a base class by accident.
    """
    owner: Any = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    namespace = owner.__dict__ if isinstance(owner, type) else vars(owner)
    if attr not in namespace:
        raise AttributeError(f"{owner!r} defines no attribute {attr!r}")
    return owner, attr, namespace[attr]


def verify_symbol(symbol: UpstreamSymbol, module: ModuleType | None = None) -> Any:
    """Check that ``symbol`` exists with the expected parameters and code;
    return it."""
    if module is None:
        module = importlib.import_module(symbol.module)
    try:
        owner, _, raw = lookup(module, symbol.qualname)
    except AttributeError as exc:
        raise UpstreamChangedError(
            f"vllm-dcp-geometry patches {symbol}, which no longer exists in the "
            f"installed vLLM ({exc}). The plugin refuses to run without it."
        ) from exc
    if symbol.parameters is not None:
        actual = describe_parameters(raw)
        if actual != symbol.parameters:
            raise UpstreamChangedError(
                f"vllm-dcp-geometry patches {symbol}, whose parameters changed: "
                f"expected ({symbol.parameters}), found ({actual}). The plugin "
                "refuses to run against it."
            )
    if symbol.fingerprint is not None:
        from vllm_dcp_geometry.runtime.fingerprints import fingerprint

        try:
            found = fingerprint(owner, raw)
        except (OSError, TypeError) as exc:
            raise UpstreamChangedError(
                f"vllm-dcp-geometry patches {symbol}, whose source cannot be "
                f"read to check it against vLLM {symbol.release}'s ({exc}). The "
                "plugin refuses to run against code it cannot check."
            ) from exc
        if found != symbol.fingerprint:
            raise UpstreamChangedError(
                f"vllm-dcp-geometry patches {symbol}, whose code changed: vLLM "
                f"{symbol.release}'s fingerprint is {symbol.fingerprint}, the "
                f"installed one is {found}. The plugin refuses to run against it "
                "(tools/drift_report.py shows every difference)."
            )
    return raw


def _global_names(code: types.CodeType) -> set[str]:
    """Names a code object and the functions nested in it look up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def require_global_call(module: ModuleType, qualname: str, callee: str) -> None:
    """Fail loudly unless ``module.qualname`` looks ``callee`` up as a global
    (so a wrapper of the module's ``callee`` is the one it calls): a patch
    relying on that must not switch itself off when vLLM inlines or imports
    the callee another way."""
    _, _, function = lookup(module, qualname)
    code = getattr(inspect.unwrap(callable_of(function)), "__code__", None)
    if code is None or callee not in _global_names(code):
        raise UpstreamChangedError(
            f"{module.__name__}.{qualname} no longer calls {callee} through its "
            "module globals, which this plugin's wrapper relies on; review the "
            "plugin against this vLLM"
        )


def require_class_path(module: ModuleType, name: str, expected: str) -> type:
    """``module.name``, a class whose ``module.qualname`` must be ``expected``
    (the path a table of this plugin names it by)."""
    cls = getattr(module, name)
    path = f"{cls.__module__}.{cls.__qualname__}"
    if path != expected:
        raise UpstreamChangedError(
            f"{module.__name__}.{name} is {path}, not {expected}, the class this "
            "plugin was taught; review the plugin against this vLLM"
        )
    return cls
