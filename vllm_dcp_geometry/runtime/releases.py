# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The vLLM release the patches are checked against, and what was recorded
for each release the plugin knows.

Each supported release has a lock file, ``patches/pins/vllm-<release>.json``:
for every symbol a patch declares on that release, the parameter list and the
source fingerprint (``fingerprints``) of that release's code. It is written by
``tools/drift_report.py --write`` on an installed release and reviewed like
any lock file; a test holds it to the declarations.

``active_release`` is the release whose declarations apply in this process:
the installed vLLM where the plugin knows it. On a release it does not know
(the version override), ``plugin.register`` matches every patch to a known
release first (``set_patch_release``) or refuses. No vLLM import.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import TypedDict

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES, installed_vllm_version

PINS_DIR = Path(__file__).resolve().parent.parent / "patches" / "pins"


class RecordedPin(TypedDict):
    parameters: str | None
    fingerprint: str


def lock_file(release: str) -> Path:
    return PINS_DIR / f"vllm-{release}.json"


def symbol_key(module: str, qualname: str) -> str:
    return f"{module}:{qualname}"


@cache
def recorded_pins(release: str) -> dict[str, RecordedPin]:
    """The lock file of ``release``: ``module:qualname`` -> what was recorded."""
    path = lock_file(release)
    if not path.is_file():
        raise FileNotFoundError(
            f"vllm-dcp-geometry has no lock file for vLLM {release} ({path}); "
            "write it with tools/drift_report.py --write"
        )
    data = json.loads(path.read_text())
    if data.get("vllm") != release:
        raise ValueError(f"{path} records vLLM {data.get('vllm')}, not {release}")
    symbols: dict[str, RecordedPin] = data["symbols"]
    return symbols


_patch_release: dict[str, str] = {}


def set_patch_release(patch_module: str, release: str) -> None:
    """On a vLLM release the plugin does not know: check ``patch_module``
    against the known ``release`` whose code it matched."""
    _patch_release[patch_module] = release


def installed_release() -> str | None:
    """The installed vLLM where the plugin knows it, else None."""
    installed = installed_vllm_version()
    return installed if installed in SUPPORTED_VLLM_RELEASES else None


def active_release(patch_module: str | None = None) -> str:
    """The known release whose declarations ``patch_module`` applies with."""
    if patch_module is not None and patch_module in _patch_release:
        return _patch_release[patch_module]
    release = installed_release()
    if release is None:
        raise RuntimeError(
            f"vLLM {installed_vllm_version()} is not a release vllm-dcp-geometry "
            f"knows ({', '.join(SUPPORTED_VLLM_RELEASES)}), and no patch was "
            "matched to one (plugin.register does that under the version override)"
        )
    return release
