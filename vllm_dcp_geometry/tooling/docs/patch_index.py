# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""docs/patches.md's index by upstream symbol: for every vLLM symbol a patch
replaces, relies on or adds, the patch, the patches it is removed with, the
test modules that exercise it and its section of the page.

The test modules are read from a ``tests/`` folder the caller names (their
``pytest.mark.patches(...)`` markers, parsed, never imported): the shipped
package does not depend on the test suite. ``render_patches_page`` rewrites
both generated blocks of the page (``tools/update_docs.py``).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_dcp_geometry.patches import PATCH_MODULES
from vllm_dcp_geometry.patches import declarations as patches_declared
from vllm_dcp_geometry.runtime.patching import PATCH_PACKAGE, patch_module_name
from vllm_dcp_geometry.tooling.docs.patch_table import patch_table_markdown

PATCH_TABLE = "patch-table"
PATCH_INDEX = "patch-index"
PYTEST_PATCH = ".venv/bin/python -m pytest -q --patch"


@dataclass(frozen=True)
class PatchDeclaration:
    """What the page shows of one patch's declaration; qualnames are
    relative to ``upstream_module``."""

    name: str
    """Relative to ``vllm_dcp_geometry.patches`` (``worker.flash_attn``)."""
    upstream_module: str
    replaces: tuple[str, ...]
    relies_on: tuple[str, ...]
    adds: tuple[str, ...]
    remove_with: tuple[str, ...]


def read_declaration(name: str) -> PatchDeclaration:
    """The one place the page reads a patch module's declaration (its
    ``PATCH``, through the registry's ``declarations``)."""
    full = patch_module_name(name)
    patch = patches_declared([full])[full]
    return PatchDeclaration(
        name=name,
        upstream_module=patch.upstream_module,
        replaces=tuple(entry.qualname for entry in patch.replaces),
        relies_on=tuple(entry.qualname for entry in patch.relies_on),
        adds=tuple(patch.adds),
        remove_with=tuple(patch.remove_with),
    )


def declarations() -> list[PatchDeclaration]:
    """Every patch of the registry, by name."""
    names = (full.removeprefix(PATCH_PACKAGE + ".") for full in PATCH_MODULES)
    return [read_declaration(name) for name in sorted(names)]


# The tests that name each patch --------------------------------------------------


def _marked_patches(tree: ast.Module) -> set[str]:
    """The string arguments of every ``<...>.mark.patches(...)`` call."""
    named = set()
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "patches"
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "mark"
        ):
            continue
        named |= {
            arg.value
            for arg in node.args
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        }
    return named


def marked_test_modules(tests_dir: Path) -> dict[str, tuple[str, ...]]:
    """Each patch name a ``pytest.mark.patches(...)`` in ``tests_dir``'s test
    modules gives, with those modules' paths relative to ``tests_dir``'s
    parent (the repository root), sorted."""
    named: dict[str, list[str]] = {}
    for path in sorted(tests_dir.rglob("test_*.py")):
        if "__pycache__" in path.parts:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        where = path.relative_to(tests_dir.parent).as_posix()
        for name in _marked_patches(tree):
            named.setdefault(name, []).append(where)
    return {name: tuple(sorted(paths)) for name, paths in named.items()}


# Markdown ------------------------------------------------------------------------


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation other than
    ``-`` and ``_`` dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _heading(declaration: PatchDeclaration) -> str:
    return f"`{declaration.name}`"


def _patch_link(name: str) -> str:
    return f"[`{name}`](#{github_anchor(f'`{name}`')})"


def _links(names: Iterable[str]) -> str:
    return ", ".join(_patch_link(name) for name in names) or "-"


def _source(name: str) -> str:
    path = patch_module_name(name).replace(".", "/") + ".py"
    return f"[`{path}`](../{path})"


def _index_rows(
    found: list[PatchDeclaration], tests: dict[str, tuple[str, ...]]
) -> list[str]:
    """One row per symbol, by qualname (then module)."""
    rows = []
    for d in found:
        roles = (("replaces", d.replaces), ("relies on", d.relies_on), ("adds", d.adds))
        count = len(tests.get(d.name, ()))
        for role, qualnames in roles:
            for qualname in qualnames:
                rows.append(
                    (
                        (qualname.lower(), d.upstream_module),
                        f"| `{qualname}` | `{d.upstream_module}` | {role} "
                        f"| {_patch_link(d.name)} | {_links(d.remove_with)} "
                        f"| [{count}]({'#' + github_anchor(_heading(d))}) |",
                    )
                )
    return [row for _, row in sorted(rows)]


def _channels(name: str) -> str:
    from vllm_dcp_geometry.runtime.group_context import CHANNELS

    writes = [f"`{c.setter}`" for c in CHANNELS if name in c.writers]
    reads = [f"`{c.getter}`" for c in CHANNELS if name in c.readers]
    parts = []
    if writes:
        parts.append(f"writes {', '.join(writes)}")
    if reads:
        parts.append(f"reads {', '.join(reads)}")
    return "; ".join(parts) or "none"


def _section(d: PatchDeclaration, tests: tuple[str, ...]) -> list[str]:
    test_links = ", ".join(f"[`{path}`](../{path})" for path in tests) or "none"
    return [
        f"### {_heading(d)}",
        "",
        f"{_source(d.name)} patches `{d.upstream_module}`.",
        "",
        f"- remove with: {_links(d.remove_with)}",
        f"- side channels: {_channels(d.name)}",
        f"- tests ({len(tests)}): {test_links}",
        f"- run them: `{PYTEST_PATCH} {d.name}`",
        "",
    ]


def patch_index_markdown(tests_dir: Path) -> str:
    """The index by upstream symbol and one section per patch, with the test
    modules ``tests_dir`` holds for each."""
    found = declarations()
    tests = marked_test_modules(tests_dir)
    lines = [
        "| vLLM symbol | in module | role | patch | remove with | tests |",
        "| --- | --- | --- | --- | --- | --- |",
        *_index_rows(found, tests),
        "",
        "## The patches",
        "",
    ]
    for declaration in found:
        lines += _section(declaration, tests.get(declaration.name, ()))
    return "\n".join(lines).rstrip("\n")


# The page ------------------------------------------------------------------------


def _markers(block: str) -> tuple[str, str]:
    return f"<!-- {block}:start -->\n", f"\n<!-- {block}:end -->"


def _split(text: str, block: str) -> tuple[str, str, str]:
    """``text`` before, between and after its markers of ``block``."""
    start, end = _markers(block)
    head, found, rest = text.partition(start)
    body, closed, tail = ("\n" + rest).partition(end)
    if not (found and closed):
        raise ValueError(f"the page has no {start.strip()} ... {end.strip()} block")
    return head, body.removeprefix("\n"), tail


def generated_block(text: str, block: str) -> str:
    """What stands between ``text``'s markers of ``block``."""
    return _split(text, block)[1]


def with_generated_block(text: str, block: str, body: str) -> str:
    """``text`` with ``body`` between its markers of ``block``."""
    head, _, tail = _split(text, block)
    start, end = _markers(block)
    return head + start + body + end + tail


def render_patches_page(text: str, tests_dir: Path) -> str:
    """docs/patches.md (``text``) with both generated blocks current."""
    text = with_generated_block(text, PATCH_TABLE, patch_table_markdown())
    return with_generated_block(text, PATCH_INDEX, patch_index_markdown(tests_dir))
