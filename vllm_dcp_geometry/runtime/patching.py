# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How patches are declared, checked and applied.

Every patch module under ``vllm_dcp_geometry.patches`` declares the upstream
module it patches, the symbols it replaces (``REPLACES``) apart from those it
only relies on (``RELIES_ON``), both with the parameter list they were written
against, the attributes it adds (``ADDS``), the patches it must be removed
with (``REMOVE_WITH``), why, and when it can go. Every change a patch makes
while it applies is entered in a ledger (``changes_made_by``), so a test can
hold the declaration to what was really done. ``plugin.register`` applies each
one the moment its upstream module is imported (at once if it already is,
through ``import_hooks``), so a process only pays for the vLLM modules it
really loads. A symbol that is missing or whose parameters changed raises
``UpstreamChangedError``: a patch never switches itself off.

Every change the helpers here make (``wrap``, ``add_attribute``,
``rebind_module_references``, ``set_item``) is recorded while an
``undo_on_error`` block runs, and undone if the block raises, so applying a
set of patches is all or nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

RunsIn = Literal["all", "engine_core", "worker", "benchmark"]
"""Where the patched upstream code runs. Documentation only: every process
installs every hook, and a hook costs nothing until its module is imported."""

ORIGINAL_ATTR = "__vllm_dcp_geometry_original__"
"""Set on every wrapper we install; holds the upstream object it replaced."""


FACTORY_ATTR = "__vllm_dcp_geometry_factory__"
"""Set on every wrapper we install; names the function that made it."""


class UpstreamChangedError(RuntimeError):
    """A vLLM symbol this plugin patches moved or changed its parameters."""


@dataclass(frozen=True)
class UpstreamSymbol:
    """A symbol in ``module`` this plugin patches or relies on.

    ``parameters`` is the parameter list the patch was written against, as
    ``describe_parameters`` prints it; None checks only that it exists.
    """

    module: str
    qualname: str
    parameters: str | None = None

    def __str__(self) -> str:
        return f"{self.module}.{self.qualname}"


class PatchModule(Protocol):
    """What every module under ``vllm_dcp_geometry.patches`` declares."""

    UPSTREAM_MODULE: str
    RUNS_IN: RunsIn
    REPLACES: tuple[UpstreamSymbol, ...]
    """Upstream symbols the patch wraps (exactly those)."""
    RELIES_ON: tuple[UpstreamSymbol, ...]
    """Upstream symbols it does not change but whose behaviour it assumes."""
    ADDS: tuple[str, ...]
    """Attributes (qualnames in the upstream module) the patch defines anew."""
    REMOVE_WITH: tuple[str, ...]
    """Patch modules (``worker.block_table``) that stop working without this
    one, and it without them: remove them together (symmetric)."""
    PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...]
    """``REPLACES + RELIES_ON``: everything ``register()`` pins."""
    WHY: str
    REMOVE_WHEN: str
    RELATED: str

    def apply(self, module: ModuleType) -> None: ...


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
    _record(lambda: _applied.pop(patch_name, None))


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


def _callable_of(obj: Any) -> Any:
    if isinstance(obj, (classmethod, staticmethod)):
        return obj.__func__
    if isinstance(obj, property):
        return obj.fget
    return obj


def describe_parameters(obj: Any) -> str:
    """Parameter names and kinds of a callable, e.g. ``self, x, *, y=, **kw``.

    A Triton kernel (compiled or interpreted) is described by its
    ``arg_names``, in launch order, so a kernel the plugin launches is pinned
    argument by argument.
    """
    func = _callable_of(obj)
    func = getattr(func, ORIGINAL_ATTR, func)
    func = _callable_of(func)
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


def original_of(obj: Any) -> Any:
    """The upstream object behind one of our wrappers (or ``obj`` itself)."""
    return getattr(_callable_of(obj), ORIGINAL_ATTR, obj)


def verify_symbol(symbol: UpstreamSymbol, module: ModuleType | None = None) -> Any:
    """Check that ``symbol`` exists with the expected parameters; return it."""
    if module is None:
        module = importlib.import_module(symbol.module)
    try:
        _, _, raw = lookup(module, symbol.qualname)
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
    return raw


def mark_wrapper(wrapper: Any, original: Any) -> Any:
    """Record ``original`` on ``wrapper`` so patching twice is a no-op."""
    target = _callable_of(wrapper)
    setattr(target, ORIGINAL_ATTR, original)
    if not hasattr(target, "__wrapped__"):
        target.__wrapped__ = _callable_of(original)
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
    existing = _callable_of(raw)
    if hasattr(existing, ORIGINAL_ATTR):
        made_by = getattr(existing, FACTORY_ATTR, None)
        if made_by == factory:
            return
        # Two patches on one symbol would leave one of them silently unapplied.
        raise UpstreamChangedError(
            f"{getattr(owner, '__qualname__', owner)}.{name} is already wrapped by "
            f"{made_by}; {factory} cannot wrap it too"
        )
    func = _callable_of(raw)
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
    code = getattr(inspect.unwrap(_callable_of(function)), "__code__", None)
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


def add_attribute(owner: type | ModuleType, name: str, value: Any) -> None:
    """Add a new attribute (to a class or module) this plugin defines; refuse
    to shadow upstream's."""
    existing = vars(owner).get(name)
    if existing is not None and not hasattr(_callable_of(existing), ORIGINAL_ATTR):
        defined_in = getattr(_callable_of(existing), "__module__", None) or ""
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


def wrap_module_functions(
    module: ModuleType,
    wrappers: Mapping[str, Callable[[Callable[..., Any]], Callable[..., Any]]],
) -> list[str]:
    """``wrap`` module-level functions, then rebind the copies other loaded
    vLLM modules took with ``from module import f`` (one pass for all)."""
    replacements: dict[Any, Any] = {}
    for name, make_wrapper in wrappers.items():
        _, _, original = lookup(module, name)
        wrap(module, name, make_wrapper)
        replacements[original] = getattr(module, name)
    return rebind_module_references(replacements)
