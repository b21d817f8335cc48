# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The repository's Python sources as the layout tests read and write them:
``module_name`` (the dotted name of a file under a root), ``write_module`` (a
file of a deliberately broken tree, with this project's ``SPDX_HEADER``).
"""

from __future__ import annotations

from pathlib import Path

SPDX_HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry "
    "project\n"
)


def module_name(root: Path, path: Path) -> str:
    """``a/b/c.py`` under ``root``: ``a.b.c`` (a package: its folder's name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def write_module(root: Path, relative: str, source: str = "") -> None:
    """``source`` under the SPDX header at ``root / relative``, folders made."""
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SPDX_HEADER + source, encoding="utf-8")
