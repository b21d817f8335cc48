#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Rewrite the generated blocks of docs/patches.md: the patch table and the
index by upstream symbol (with the test modules under tests/ that name each
patch). ``--check`` changes nothing and exits 1 when the page is stale."""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_dcp_geometry.tooling.docs.patch_index import render_patches_page

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "patches.md"


def main(argv: list[str]) -> int:
    text = PAGE.read_text(encoding="utf-8")
    current = render_patches_page(text, ROOT / "tests")
    if argv == ["--check"]:
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run tools/update_docs.py")
            return 1
        return 0
    if argv:
        print("usage: update_docs.py [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(current, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
