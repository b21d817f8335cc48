# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every pinned symbol of every patch, observed in the installed vLLM.

A symbol is observed unpatched (behind any wrapper of ours), its parameters
rendered as the pins render them and its source fingerprinted as start-up
fingerprints it, so what the report says is what ``register()`` would do.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES, installed_vllm_version
from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime.fingerprints import fingerprint
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap, parameters_on
from vllm_dcp_geometry.runtime.releases import lock_file, recorded_pins, symbol_key
from vllm_dcp_geometry.runtime.upstream_symbols import describe_parameters, lookup


@dataclass(frozen=True)
class Observed:
    """One pinned symbol as the installed vLLM has it (``problem`` set where
    it has none: its module or attribute is missing)."""

    module: str
    qualname: str
    parameters: str | None = None
    fingerprint: str | None = None
    problem: str | None = None

    @property
    def key(self) -> str:
        return symbol_key(self.module, self.qualname)


def observe(module_name: str, qualname: str) -> Observed:
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return Observed(module_name, qualname, problem=f"module missing ({exc})")
    try:
        owner, _, raw = lookup(module, qualname)
    except AttributeError:
        return Observed(module_name, qualname, problem="missing")
    try:
        parameters: str | None = describe_parameters(raw)
    except (TypeError, ValueError):
        parameters = None
    return Observed(module_name, qualname, parameters, fingerprint(owner, raw))


def declared_entries(patch: Patch, release: str) -> list[tuple[str, str | None]]:
    """(qualname, declared parameters) of every entry ``patch`` has on
    ``release``."""
    entries: tuple[Pin | Wrap, ...] = (
        *patch.replaces_on(release),
        *patch.relies_on_on(release),
    )
    return [(e.qualname, parameters_on(e.parameters, release)[1]) for e in entries]


def every_pinned_symbol() -> list[tuple[str, str, str]]:
    """(patch module, vLLM module, qualname) of every entry declared for any
    known release, once each, in declaration order."""
    seen: dict[tuple[str, str], str] = {}
    for name, patch in declarations().items():
        for release in SUPPORTED_VLLM_RELEASES:
            for qualname, _ in declared_entries(patch, release):
                seen.setdefault((patch.upstream_module, qualname), name)
    return [(name, module, qualname) for (module, qualname), name in seen.items()]


def _defines(path: Path, name: str) -> bool:
    text = path.read_text(errors="replace")
    return re.search(rf"^\s*(def|class)\s+{re.escape(name)}\b", text, re.M) is not None


def moved_to(qualname: str, vllm_root: Path) -> list[str]:
    """The vLLM modules that define the symbol's outermost name at their top
    level (where a missing symbol may have moved)."""
    outer = qualname.split(".")[0]
    found = []
    for path in sorted(vllm_root.rglob("*.py")):
        if not _defines(path, outer):
            continue
        module_name = ".".join(path.relative_to(vllm_root.parent).with_suffix("").parts)
        module_name = module_name.removesuffix(".__init__")
        try:
            module = importlib.import_module(module_name)
            lookup(module, qualname)
        except Exception:  # a module that does not import here tells nothing
            continue
        found.append(module_name)
    return found


def compare(observed: Observed, release: str) -> str:
    """How ``observed`` compares with ``release``'s lock file."""
    recorded = recorded_pins(release).get(observed.key)
    if recorded is None:
        return "not pinned"
    if observed.problem is not None:
        return observed.problem
    if recorded["parameters"] != observed.parameters:
        return "parameters changed"
    if recorded["fingerprint"] != observed.fingerprint:
        return "body changed"
    return "identical"


def lock_file_contents(release: str) -> dict[str, Any]:
    """The lock file of the installed release, from the declarations and the
    installed code; refuses where a declaration no longer matches."""
    installed = installed_vllm_version()
    if installed != release:
        raise SystemExit(
            f"the lock file of vLLM {release} needs it installed, not {installed}"
        )
    symbols: dict[str, dict[str, str | None]] = {}
    problems = []
    for name, patch in declarations().items():
        for qualname, declared in declared_entries(patch, release):
            seen = observe(patch.upstream_module, qualname)
            if seen.problem is not None:
                problems.append(f"{name}: {seen.key} {seen.problem}")
            elif declared is not None and declared != seen.parameters:
                problems.append(
                    f"{name}: {seen.key} declares ({declared}) but vLLM {release} "
                    f"has ({seen.parameters})"
                )
            symbols[seen.key] = {
                "parameters": seen.parameters,
                "fingerprint": seen.fingerprint,
            }
    if problems:
        raise SystemExit(
            f"not writing the lock file of vLLM {release}; fix the declarations:\n  "
            + "\n  ".join(problems)
        )
    return {"vllm": release, "symbols": dict(sorted(symbols.items()))}


def write_lock_file(release: str) -> Path:
    contents = lock_file_contents(release)
    path = lock_file(release)
    path.write_text(json.dumps(contents, indent=1, sort_keys=True) + "\n")
    recorded_pins.cache_clear()
    return path
