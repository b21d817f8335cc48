# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Versions: this plugin's, and the one vLLM release it is written against.

The vLLM pin is declared once, in ``pyproject.toml``'s dependencies; code and
tests read it back from the installed distribution's metadata.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import metadata

DISTRIBUTION = "vllm-dcp-geometry"


@cache
def plugin_version() -> str:
    return metadata.version(DISTRIBUTION)


@cache
def pinned_vllm_version() -> str:
    """The exact ``vllm==X`` requirement of the installed distribution."""
    for requirement in metadata.requires(DISTRIBUTION) or ():
        match = re.fullmatch(r"vllm\s*==\s*([^\s;]+)(\s*;.*)?", requirement.strip())
        if match:
            return match.group(1)
    raise RuntimeError(
        f"{DISTRIBUTION} declares no exact vllm==X requirement; its metadata is "
        "broken (reinstall the package)"
    )


def installed_vllm_version() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
