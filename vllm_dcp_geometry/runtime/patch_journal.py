# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What patches change in vLLM, recorded: the ledger and the undo journal.

Every change the helpers here make (``wrap``, ``add_attribute``,
``rebind_module_references``, ``set_item``) is entered in a ledger under
the patch applying it (``applying``, ``changes_made_by``), so a test can hold
a declaration to what was really done, and recorded while an
``undo_on_error`` block runs, undone if the block raises, so applying a set
of patches is all or nothing. ``patching`` declares and installs patches
with these. No vLLM import.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from vllm_dcp_geometry.runtime.upstream_symbols import (
    ORIGINAL_ATTR,
    UpstreamChangedError,
    callable_of,
)

FACTORY_ATTR = "__vllm_dcp_geometry_factory__"
"""Set on every wrapper we install; names the function that made it."""

WrapperFactory = Callable[..., Callable[..., Any]]
"""``make_wrapper(original, *factory_args) -> wrapper``."""


# The ledger of what each patch changed ------------------------------------------


ChangeKind = Literal["wrap", "add", "assign", "item"]


@dataclass(frozen=True)
class Change:
    """One change a patch made while it applied."""

    kind: ChangeKind
    owner: str
    """``module`` or ``module.QualName`` of the object changed (for an
    ``item``, the type of the mapping)."""
    name: str


_ledger: dict[str, list[Change]] = {}
_applying = threading.local()


@contextlib.contextmanager
def applying(patch_name: str) -> Iterator[None]:
    """Enter every change made in this block under ``patch_name``."""
    outer = getattr(_applying, "name", None)
    _applying.name = patch_name
    try:
        yield
    finally:
        _applying.name = outer


def _enter(kind: ChangeKind, owner: str, name: str) -> None:
    patch = getattr(_applying, "name", None)
    if patch is None:
        return
    entries = _ledger.setdefault(patch, [])
    entries.append(Change(kind, owner, name))

    def undo() -> None:
        entries.pop()

    _record(undo)


def changes_made_by(patch_name: str) -> tuple[Change, ...]:
    """What ``patch_name`` changed in this process (empty if it never ran)."""
    return tuple(_ledger.get(patch_name, ()))


PATCH_PACKAGE = "vllm_dcp_geometry.patches"
"""The package of the patch modules; declarations name them relative to it."""

_applied: dict[str, str] = {}


def record_applied(patch_name: str, upstream_module: str) -> None:
    """Enter in the ledger that ``patch_name`` applied to ``upstream_module``
    (undone with the block, like every change)."""
    _applied[patch_name] = upstream_module

    def undo() -> None:
        _applied.pop(patch_name, None)

    _record(undo)


def applied_patches() -> dict[str, str]:
    """Patch modules applied so far in this process, with their vLLM module."""
    return dict(_applied)


def patch_module_name(relative: str) -> str:
    """The full name of a patch module named relative to the patches
    package (``worker.flash_attn``), as declarations name them."""
    return f"{PATCH_PACKAGE}.{relative}"


def patch_applied(relative: str) -> bool:
    """Whether the patch module ``relative`` has applied in this process."""
    return patch_module_name(relative) in applied_patches()


def owner_path(owner: Any) -> str:
    if isinstance(owner, ModuleType):
        return owner.__name__
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    return type(owner).__name__


# Undo journal -------------------------------------------------------------------

_MISSING = object()
_journal = threading.local()


def _record(undo: Callable[[], None]) -> None:
    entries = getattr(_journal, "entries", None)
    if entries is not None:
        entries.append(undo)


def _assign(owner: Any, name: str, value: Any, kind: ChangeKind = "assign") -> None:
    """``setattr``, recorded so an ``undo_on_error`` block can restore it,
    and entered in the ledger of the patch applying."""
    namespace = owner.__dict__ if isinstance(owner, type) else vars(owner)
    previous = namespace.get(name, _MISSING)

    def undo() -> None:
        if previous is _MISSING:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, previous)

    _record(undo)
    setattr(owner, name, value)
    _enter(kind, owner_path(owner), name)


def set_item(mapping: MutableMapping[Any, Any], key: Any, value: Any) -> None:
    """``mapping[key] = value``, recorded so an ``undo_on_error`` block can
    restore it (for upstream registries such as a dataclass's fields)."""
    previous = mapping.get(key, _MISSING)

    def undo() -> None:
        if previous is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = previous

    _record(undo)
    mapping[key] = value
    _enter("item", type(mapping).__name__, str(key))


@contextlib.contextmanager
def undo_on_error() -> Iterator[None]:
    """Undo every change the helpers of this module make in this thread while
    the block runs if it raises; nested blocks fold into the outer one."""
    outer = getattr(_journal, "entries", None)
    entries: list[Callable[[], None]] = []
    _journal.entries = entries
    try:
        yield
    except BaseException:
        for undo in reversed(entries):
            undo()
        raise
    finally:
        _journal.entries = outer
    if outer is not None:
        outer.extend(entries)


def mark_wrapper(wrapper: Any, original: Any) -> Any:
    """Record ``original`` on ``wrapper`` so patching twice is a no-op."""
    target = callable_of(wrapper)
    setattr(target, ORIGINAL_ATTR, original)
    if not hasattr(target, "__wrapped__"):
        target.__wrapped__ = callable_of(original)
    return wrapper


def wrap(
    owner: Any,
    name: str,
    make_wrapper: Callable[..., Callable[..., Any]],
    *factory_args: Any,
) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original, *factory_args)``.

    ``factory_args`` is how a wrapper reaches anything beyond the original
    (the upstream module, for instance). Keeps classmethod/staticmethod
    kinds; does nothing if already wrapped by the same factory.
    """
    namespace = owner.__dict__ if isinstance(owner, type) else vars(owner)
    raw = namespace[name]
    factory = f"{make_wrapper.__module__}.{make_wrapper.__qualname__}"
    existing = callable_of(raw)
    if hasattr(existing, ORIGINAL_ATTR):
        made_by = getattr(existing, FACTORY_ATTR, None)
        if made_by == factory:
            return
        # Two patches on one symbol would leave one of them silently unapplied.
        raise UpstreamChangedError(
            f"{getattr(owner, '__qualname__', owner)}.{name} is already wrapped by "
            f"{made_by}; {factory} cannot wrap it too"
        )
    func = callable_of(raw)
    new: Any = make_wrapper(func, *factory_args)
    setattr(new, FACTORY_ATTR, factory)
    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        if hasattr(func, attr):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(new, attr, getattr(func, attr))
    mark_wrapper(new, raw)
    if isinstance(raw, classmethod):
        new = classmethod(new)
    elif isinstance(raw, staticmethod):
        new = staticmethod(new)
    _assign(owner, name, new, "wrap")


def add_attribute(owner: type | ModuleType, name: str, value: Any) -> None:
    """Add a new attribute (to a class or module) this plugin defines; refuse
    to shadow upstream's."""
    existing = vars(owner).get(name)
    if existing is not None and not hasattr(callable_of(existing), ORIGINAL_ATTR):
        defined_in = getattr(callable_of(existing), "__module__", None) or ""
        if defined_in.startswith("vllm_dcp_geometry"):
            return
        where = (
            owner.__name__
            if isinstance(owner, ModuleType)
            else f"{owner.__module__}.{owner.__qualname__}"
        )
        raise UpstreamChangedError(
            f"{where} now defines {name!r} itself; vllm-dcp-geometry would shadow "
            "it. Review the plugin against this vLLM before running."
        )
    _assign(owner, name, value, "add")


def rebind_module_references(
    replacements: Mapping[Any, Any], prefix: str = "vllm"
) -> list[str]:
    """Point every loaded ``prefix.*`` module's global bound to an original in
    ``replacements`` (``from x import f`` copies) at its replacement, in one
    pass over ``sys.modules``. Returns what changed."""
    by_id = {id(original): new for original, new in replacements.items()}
    changed = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == prefix or mod_name.startswith(prefix + ".")):
            continue
        namespace = getattr(mod, "__dict__", None)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            new = by_id.get(id(value))
            if new is not None and new is not value:
                _assign(mod, attr, new)
                changed.append(f"{mod_name}.{attr}")
    return changed
