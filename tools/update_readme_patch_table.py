#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Rewrite README.md's generated table of patched vLLM symbols."""

from __future__ import annotations

from pathlib import Path

from vllm_dcp_geometry.tooling.docs.patch_table import patch_table_markdown

START, END = "<!-- patch-table:start -->\n", "\n<!-- patch-table:end -->"


def main() -> None:
    readme = Path(__file__).resolve().parent.parent / "README.md"
    text = readme.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + START + patch_table_markdown() + END + tail)


if __name__ == "__main__":
    main()
