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

The helpers that change vLLM (``wrap``, ``add_attribute``,
``rebind_module_references``, ``set_item``) and their ledger and undo journal
live in ``patch_journal``; they are re-exported here, where patches have
always found them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES
from vllm_dcp_geometry.runtime.patch_journal import (
    FACTORY_ATTR,
    PATCH_PACKAGE,
    Change,
    WrapperFactory,
    add_attribute,
    applied_patches,
    applying,
    changes_made_by,
    patch_applied,
    patch_module_name,
    rebind_module_references,
    record_applied,
    set_item,
    undo_on_error,
    wrap,
)
from vllm_dcp_geometry.runtime.releases import active_release, recorded_pins, symbol_key
from vllm_dcp_geometry.runtime.upstream_symbols import (
    ORIGINAL_ATTR,
    UpstreamChangedError,
    UpstreamSymbol,
    callable_of,
    lookup,
    original_of,
    verify_symbol,
)

# Declared here, and re-exported where patches and tests have always found them.
__all__ = [
    "FACTORY_ATTR",
    "ORIGINAL_ATTR",
    "PATCH_PACKAGE",
    "Change",
    "Parameters",
    "Patch",
    "Pin",
    "UpstreamChangedError",
    "UpstreamSymbol",
    "Wrap",
    "WrapperFactory",
    "add_attribute",
    "applied_patches",
    "applying",
    "callable_of",
    "changes_made_by",
    "original_of",
    "parameters_on",
    "patch_applied",
    "patch_module_name",
    "record_applied",
    "recorded_pins",
    "set_item",
    "undo_on_error",
    "verify_symbol",
    "wrap",
]

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
