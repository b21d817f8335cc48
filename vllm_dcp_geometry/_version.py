# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Versions: this plugin's, and the vLLM releases it is written against.

``SUPPORTED_VLLM_RELEASES`` is the one list of releases the plugin knows:
every patch declares what it replaces and relies on for each of them, and
each has a lock file of fingerprints (``patches/pins/vllm-<release>.json``).
``pyproject.toml``'s ``vllm`` requirement admits exactly this range; a test
holds the two together.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

DISTRIBUTION = "vllm-dcp-geometry"

SUPPORTED_VLLM_RELEASES: tuple[str, ...] = ("0.33.0", "0.34.0")
"""The vLLM releases this plugin is written against, oldest first."""


@cache
def plugin_version() -> str:
    return metadata.version(DISTRIBUTION)


def vllm_requirement() -> str:
    """The installed distribution's ``vllm`` requirement, as declared."""
    for requirement in metadata.requires(DISTRIBUTION) or ():
        if requirement.replace(" ", "").startswith(("vllm>", "vllm=", "vllm<")):
            return requirement
    raise RuntimeError(
        f"{DISTRIBUTION} declares no vllm requirement; its metadata is broken "
        "(reinstall the package)"
    )


def installed_vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
