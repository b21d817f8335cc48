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
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from types import ModuleType

from vllm_dcp_geometry._version import installed_vllm_version, pinned_vllm_version
from vllm_dcp_geometry.patches import PATCH_MODULES, declarations
from vllm_dcp_geometry.runtime import import_hooks, patching

logger = logging.getLogger("vllm_dcp_geometry")

ALLOW_OTHER_VLLM_ENV = "VLLM_DCP_GEOMETRY_ALLOW_VLLM_VERSION"
"""Set to the installed vLLM version to run against it anyway (with a warning).

Every patched symbol is still checked, so a moved or changed symbol fails."""


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the release this plugin is written against."""


_lock = threading.Lock()
_installed = False


def check_vllm_version() -> str:
    """Return the installed vLLM version, refusing any but the pinned one."""
    pinned = pinned_vllm_version()
    installed = installed_vllm_version()
    if installed == pinned:
        return installed
    allowed = os.environ.get(ALLOW_OTHER_VLLM_ENV)
    if installed is not None and allowed == installed:
        logger.warning(
            "vllm-dcp-geometry is written for vllm==%s but runs on vllm==%s "
            "because %s=%s. Every patched symbol is still checked.",
            pinned,
            installed,
            ALLOW_OTHER_VLLM_ENV,
            allowed,
        )
        return installed
    raise VllmVersionError(
        f"vllm-dcp-geometry needs vllm=={pinned}, found "
        f"{installed or 'no vllm'}. Install vllm=={pinned}, or set "
        f"{ALLOW_OTHER_VLLM_ENV}={installed} to try this vLLM anyway."
    )


def _apply_patch(name: str, patch: patching.Patch, upstream: ModuleType) -> None:
    with patching.applying(name):
        patch.install(upstream)
        patching.record_applied(name, upstream.__name__)
    logger.debug("vllm-dcp-geometry patched %s", upstream.__name__)


def register() -> None:
    """Install the DCP geometry contract into vLLM; idempotent per process.

    Each patch applies when its vLLM module is imported (at once if it already
    is), all or nothing (see the module docstring). Raises if vLLM is not the
    pinned release or a patched symbol moved.
    """
    global _installed
    with _lock:
        if _installed:
            return
        check_vllm_version()
        patches = declarations(PATCH_MODULES)
        for patch in patches.values():
            upstream = import_hooks.loaded_module(patch.upstream_module)
            if upstream is not None:
                patch.verify(upstream)
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
