# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How patches are declared, checked and applied.

Every patch module under ``vllm_dcp_geometry.patches`` declares itself once,
``PATCH = Patch(...)``: the vLLM releases it applies to, the upstream module
it patches, the symbols it replaces (``Wrap``, each with the wrapper factory
that replaces it) apart from those it only relies on (``Pin``), both with the
parameter list they were written against on each release, the attributes it
adds, the patches it must be removed with, why, and when it can go. Every
pinned symbol is also held to the source fingerprint recorded for the release
(``releases.recorded_pins``), so a body that changed behind the same
parameters refuses as a changed parameter list does. Declaring is applying:
``Patch.install`` verifies every pinned symbol, installs the declared
wrappers and runs the patch's own ``apply`` for whatever more it does. Every
change made while it applies is entered in a ledger (``changes_made_by``), so
a test can hold the declaration to what was really done.
``plugin.register`` installs each one the moment its upstream module is
imported (at once if it already is, through ``import_hooks``), so a process
only pays for the vLLM modules it really loads. A symbol that is missing,
whose parameters or whose code changed raises ``UpstreamChangedError``
(``upstream_symbols``): a patch never switches itself off.

Every change the helpers here make (``wrap``, ``add_attribute``,
``rebind_module_references``, ``set_item``) is recorded while an
``undo_on_error`` block runs, and undone if the block raises, so applying a
set of patches is all or nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from dataclasses import KW_ONLY, dataclass
from types import ModuleType
from typing import Any, Literal

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES
from vllm_dcp_geometry.runtime.releases import active_release, recorded_pins, symbol_key
from vllm_dcp_geometry.runtime.upstream_symbols import (
    ORIGINAL_ATTR,
    UpstreamChangedError,
    UpstreamSymbol,
    callable_of,
    lookup,
    verify_symbol,
)
from vllm_dcp_geometry.runtime.upstream_symbols import (
    original_of as original_of,  # re-exported: where callers have always found it
)

FACTORY_ATTR = "__vllm_dcp_geometry_factory__"
"""Set on every wrapper we install; names the function that made it."""

WrapperFactory = Callable[..., Callable[..., Any]]
"""``make_wrapper(original, *factory_args) -> wrapper``."""

Parameters = str | None | Mapping[str, str | None]
"""One parameter list for every release the patch declares, or one per
release (``{"0.33.0": "self, x", "0.34.0": "self, x, y="}``): a release the
mapping leaves out does not have the entry (not pinned, not wrapped)."""


def parameters_on(parameters: Parameters, release: str) -> tuple[bool, str | None]:
    """(whether the entry exists on ``release``, its parameter list there)."""
    if isinstance(parameters, Mapping):
        return release in parameters, parameters.get(release)
    return True, parameters


# Declarations -------------------------------------------------------------------


@dataclass(frozen=True)
class Pin:
    """An upstream symbol a patch relies on without changing it.

    ``qualname`` is the symbol in the patch's upstream module; ``parameters``
    the parameter list the patch was written against (None: it must exist).
    """

    qualname: str
    parameters: Parameters = None


@dataclass(frozen=True)
class Wrap:
    """An upstream symbol a patch replaces with a wrapper.

    ``make_wrapper(original, *factory_args)`` makes the wrapper
    ``Patch.install`` puts in its place (with ``with_module``, the upstream
    module is passed before ``factory_args``); None where the patch's own
    ``apply`` wraps it. ``rebind_copies`` (module functions only) also points
    the copies other loaded vLLM modules took with ``from module import f``
    at the wrapper.
    """

    qualname: str
    parameters: Parameters = None
    make_wrapper: WrapperFactory | None = None
    _: KW_ONLY
    factory_args: tuple[Any, ...] = ()
    with_module: bool = False
    rebind_copies: bool = False

    def __post_init__(self) -> None:
        options = self.factory_args or self.with_module or self.rebind_copies
        if self.make_wrapper is None and options:
            raise ValueError(f"{self.qualname}: wrapper options without a factory")
        if self.rebind_copies and "." in self.qualname:
            raise ValueError(f"{self.qualname}: only module functions are rebound")


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One patch module's declaration: what it changes in ``upstream_module``.

    ``releases``: the vLLM releases it applies to (a module a release removed
    has no entry there: not applicable, not refused); ``replaces``: the
    symbols it wraps (exactly those); ``relies_on``: those it does not change
    but whose behaviour it assumes, each with its parameters per release;
    ``adds``: qualnames it defines anew in the upstream module;
    ``remove_with``: patch modules (``worker.block_table``) that stop working
    without this one, and it without them (symmetric); ``apply(module)``:
    what the patch does beyond its declared wrappers, run after them.
    """

    upstream_module: str
    releases: tuple[str, ...] = SUPPORTED_VLLM_RELEASES
    replaces: tuple[Wrap, ...] = ()
    relies_on: tuple[Pin, ...] = ()
    adds: tuple[str, ...] = ()
    remove_with: tuple[str, ...] = ()
    why: str
    remove_when: str
    related: str
    apply: Callable[[ModuleType], None] | None = None

    def __post_init__(self) -> None:
        replaced = [entry.qualname for entry in self.replaces]
        relied = [entry.qualname for entry in self.relies_on]
        named = replaced + relied + list(self.adds)
        twice = sorted({q for q in named if named.count(q) > 1})
        if twice:
            raise ValueError(
                f"the patch of {self.upstream_module} declares {', '.join(twice)} "
                "more than once (replaced, relied on or added)"
            )
        unknown = set(self.releases) - set(SUPPORTED_VLLM_RELEASES)
        entries: tuple[Pin | Wrap, ...] = (*self.replaces, *self.relies_on)
        for entry in entries:
            if isinstance(entry.parameters, Mapping):
                unknown |= set(entry.parameters) - set(self.releases)
        if unknown:
            raise ValueError(
                f"the patch of {self.upstream_module} names releases it does not "
                f"declare or the plugin does not know: {', '.join(sorted(unknown))}"
            )

    def declared_for(self, release: str) -> bool:
        return release in self.releases

    def replaces_on(self, release: str) -> tuple[Wrap, ...]:
        """The wraps that exist on ``release``."""
        if not self.declared_for(release):
            return ()
        return tuple(
            e for e in self.replaces if parameters_on(e.parameters, release)[0]
        )

    def relies_on_on(self, release: str) -> tuple[Pin, ...]:
        """The pins that exist on ``release``."""
        if not self.declared_for(release):
            return ()
        return tuple(
            e for e in self.relies_on if parameters_on(e.parameters, release)[0]
        )

    def symbols(
        self, release: str, *, replaced: bool = True, relied_on: bool = True
    ) -> tuple[UpstreamSymbol, ...]:
        """The pinned symbols on ``release``, each with its parameters and the
        fingerprint recorded for that release (refused where none is)."""
        entries: list[Pin | Wrap] = []
        if replaced:
            entries += self.replaces_on(release)
        if relied_on:
            entries += self.relies_on_on(release)
        recorded = recorded_pins(release)
        found = []
        for entry in entries:
            key = symbol_key(self.upstream_module, entry.qualname)
            if key not in recorded:
                raise UpstreamChangedError(
                    f"vllm-dcp-geometry records no fingerprint of {key} for vLLM "
                    f"{release}; write the lock file with tools/drift_report.py "
                    "--write and review it"
                )
            found.append(
                UpstreamSymbol(
                    self.upstream_module,
                    entry.qualname,
                    parameters_on(entry.parameters, release)[1],
                    recorded[key]["fingerprint"],
                    release,
                )
            )
        return tuple(found)

    @property
    def replaced_symbols(self) -> tuple[UpstreamSymbol, ...]:
        """The replaced symbols on the installed release."""
        return self.symbols(active_release(), relied_on=False)

    @property
    def relied_on_symbols(self) -> tuple[UpstreamSymbol, ...]:
        """The relied-on symbols on the installed release."""
        return self.symbols(active_release(), replaced=False)

    @property
    def patched_symbols(self) -> tuple[UpstreamSymbol, ...]:
        """Everything ``verify`` pins on the installed release: the replaced
        symbols, then the relied on."""
        return self.symbols(active_release())

    def verify(self, module: ModuleType, release: str | None = None) -> None:
        """Raise ``UpstreamChangedError`` unless every pinned symbol is as
        declared and recorded for ``release`` (default: the installed one)."""
        for symbol in self.symbols(release or active_release()):
            verify_symbol(symbol, module)

    def install(self, module: ModuleType, release: str | None = None) -> None:
        """Verify ``module``, install the wrappers declared for ``release``
        (default: the installed one), then run ``apply`` (changes recorded:
        inside ``undo_on_error`` a failure undoes them)."""
        if module.__name__ != self.upstream_module:
            raise ValueError(
                f"the patch of {self.upstream_module} cannot install into "
                f"{module.__name__}"
            )
        release = release or active_release()
        if not self.declared_for(release):
            raise ValueError(
                f"the patch of {self.upstream_module} declares nothing for vLLM "
                f"{release}"
            )
        self.verify(module, release)
        copies: dict[Any, Any] = {}
        for entry in self.replaces_on(release):
            if entry.make_wrapper is None:
                continue
            owner, name, raw = lookup(module, entry.qualname)
            args = entry.factory_args
            if entry.with_module:
                args = (module, *args)
            wrap(owner, name, entry.make_wrapper, *args)
            if entry.rebind_copies:
                copies[raw] = getattr(owner, name)
        if copies:
            rebind_module_references(copies)
        if self.apply is not None:
            self.apply(module)


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
