# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Plain-text tables for the commands' output (and the benchmarks')."""

from __future__ import annotations

RULE: list[str] = []
"""A row that ``render_table`` draws as a horizontal rule."""


def render_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    """``headers`` over ``rows`` in padded columns; the columns whose index is
    in ``right`` are right-aligned."""
    cells = [row for row in rows if row is not RULE]
    widths = [
        max([len(headers[i])] + [len(row[i]) for row in cells])
        for i in range(len(headers))
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(headers), rule]
    for row in rows:
        out.append(rule if row is RULE else line(row))
    return "\n".join(out)
