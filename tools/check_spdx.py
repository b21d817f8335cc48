#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every Python file carries this project's SPDX header, never vLLM's."""

from __future__ import annotations

import sys
from pathlib import Path

LICENSE = "# SPDX-License-Identifier: Apache-2.0"
COPYRIGHT = (
    "# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project"
)
# Split so this file does not itself carry the line it looks for.
FOREIGN = "contributors to the " + "vllm project"


def problems(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    found = []
    if lines[:2] != [LICENSE, COPYRIGHT]:
        found.append(f"{path}: must start with\n  {LICENSE}\n  {COPYRIGHT}")
    if FOREIGN in text.lower():
        found.append(f"{path}: carries vLLM's copyright line; only our own code here")
    return found


def main(argv: list[str]) -> int:
    found = [p for name in argv if name.endswith(".py") for p in problems(Path(name))]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
