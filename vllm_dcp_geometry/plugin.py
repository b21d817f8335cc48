# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process (API server, engine core,
workers) before KV-cache specs are collected or block tables built.

``register()`` applies all or nothing: every patched symbol of the vLLM
modules already imported is verified before any patch is applied, and if
applying fails, what was applied is undone and the hooks are removed. A patch
whose module is imported later fails that import, and every later one
(``import_hooks``).

Releases: on a vLLM release the plugin knows (``SUPPORTED_VLLM_RELEASES``)
each patch declared for it applies with that release's declarations and
fingerprints; one not declared for it (a module the release removed) is not
applicable. On any other release ``register()`` refuses, unless the version
override names it: then every patch module's vLLM module is imported at once
and each patch must match one known release in every pinned symbol, or
start-up is refused listing every symbol that differs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from types import ModuleType

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES, installed_vllm_version
from vllm_dcp_geometry.patches import PATCH_MODULES, declarations
from vllm_dcp_geometry.runtime import import_hooks, patching
from vllm_dcp_geometry.runtime.releases import active_release, set_patch_release
from vllm_dcp_geometry.runtime.upstream_symbols import UpstreamChangedError

logger = logging.getLogger("vllm_dcp_geometry")

ALLOW_OTHER_VLLM_ENV = "VLLM_DCP_GEOMETRY_ALLOW_VLLM_VERSION"
"""Set to the installed vLLM version to run against it anyway (with a warning).

Every pinned symbol must then match a release the plugin knows, parameters
and code, or start-up is refused listing every one that differs."""


class VllmVersionError(RuntimeError):
    """The installed vLLM is not a release this plugin is written against."""


_lock = threading.Lock()
_installed = False


def check_vllm_version() -> str | None:
    """The installed vLLM release where the plugin knows it; None where the
    version override names an unknown one; otherwise refused."""
    installed = installed_vllm_version()
    if installed in SUPPORTED_VLLM_RELEASES:
        return installed
    known = ", ".join(SUPPORTED_VLLM_RELEASES)
    allowed = os.environ.get(ALLOW_OTHER_VLLM_ENV)
    if installed is not None and allowed == installed:
        logger.warning(
            "vllm-dcp-geometry is written for vLLM %s but runs on vLLM %s because "
            "%s=%s: every patched symbol must match a known release.",
            known,
            installed,
            ALLOW_OTHER_VLLM_ENV,
            allowed,
        )
        return None
    raise VllmVersionError(
        f"vllm-dcp-geometry serves vLLM {known}, found "
        f"{installed or 'no vllm'}. Install one of those, or set "
        f"{ALLOW_OTHER_VLLM_ENV}={installed} to try this vLLM anyway (every "
        "patched symbol must then match a known release)."
    )


def _differences(patch: patching.Patch, module: ModuleType, release: str) -> list[str]:
    found = []
    for symbol in patch.symbols(release):
        try:
            patching.verify_symbol(symbol, module)
        except UpstreamChangedError as exc:
            found.append(f"{symbol} (against vLLM {release}): {exc}")
    return found


def match_known_releases(
    patches: dict[str, patching.Patch],
) -> dict[str, patching.Patch]:
    """On a release the plugin does not know: the patches to apply, each
    matched to the known release whose code it finds in every pinned symbol;
    refuses listing every symbol that differs, all at once."""
    matched: dict[str, patching.Patch] = {}
    problems: list[str] = []
    newest_first = tuple(reversed(SUPPORTED_VLLM_RELEASES))
    for name, patch in patches.items():
        try:
            module = importlib.import_module(patch.upstream_module)
        except ImportError as exc:
            if all(patch.declared_for(r) for r in SUPPORTED_VLLM_RELEASES):
                problems.append(f"{patch.upstream_module} is missing ({exc})")
            continue  # a release without the module does not declare the patch
        declared = [r for r in newest_first if patch.declared_for(r)]
        tried = {r: _differences(patch, module, r) for r in declared}
        release = next((r for r in declared if not tried[r]), None)
        if release is None:
            problems.extend(tried[declared[0]])
            continue
        set_patch_release(name, release)
        matched[name] = patch
    if problems:
        raise UpstreamChangedError(
            f"vLLM {installed_vllm_version()} differs from every release "
            "vllm-dcp-geometry knows in "
            + f"{len(problems)} pinned symbols:\n  - "
            + "\n  - ".join(problems)
        )
    return matched


def _apply_patch(name: str, patch: patching.Patch, upstream: ModuleType) -> None:
    with patching.applying(name):
        patch.install(upstream, active_release(name))
        patching.record_applied(name, upstream.__name__)
    logger.debug("vllm-dcp-geometry patched %s", upstream.__name__)


def register() -> None:
    """Install the DCP geometry contract into vLLM; idempotent per process.

    Each patch declared for the installed release applies when its vLLM
    module is imported (at once if it already is), all or nothing (see the
    module docstring). Raises if vLLM is not a known release (or, under the
    override, does not match one) or a pinned symbol moved or changed.
    """
    global _installed
    with _lock:
        if _installed:
            return
        release = check_vllm_version()
        patches = declarations(PATCH_MODULES)
        if release is None:
            patches = match_known_releases(patches)
        else:
            patches = {n: p for n, p in patches.items() if p.declared_for(release)}
        for name, patch in patches.items():
            upstream = import_hooks.loaded_module(patch.upstream_module)
            if upstream is not None:
                patch.verify(upstream, active_release(name))
        _install_hooks(patches)
        _installed = True


def _install_hooks(patches: dict[str, patching.Patch]) -> None:
    installed: list[tuple[str, import_hooks.Callback]] = []
    try:
        with patching.undo_on_error():
            for name, patch in patches.items():
                callback: import_hooks.Callback = functools.partial(
                    _apply_patch, name, patch
                )
                installed.append((patch.upstream_module, callback))
                import_hooks.when_imported(patch.upstream_module, callback)
    except BaseException:
        for module, callback in installed:
            import_hooks.forget(module, callback)
        raise


def applied_patches() -> dict[str, str]:
    """Patch modules applied so far in this process, with their vLLM module
    (the ledger's record, ``patching.applied_patches``)."""
    return patching.applied_patches()
