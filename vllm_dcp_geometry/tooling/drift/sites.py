# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Where vLLM reads DCP, by function, and how that moved between releases.

A site is a function (or module or class body) of vLLM with at least one
line that reads DCP (``DCP_READ``). Each site is recorded as a digest of its
reading lines, so a release's sites compare with another's by file and
qualified name: new, changed or gone. Sites in the modules the plugin patches
are its own business (their symbols are pinned); every other one is a place
a new release may restate ``block_size * D`` behind the plugin's back.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path

from vllm_dcp_geometry.patches import declarations

DCP_READ = re.compile(
    r"get_dcp_group|decode_context_parallel_size|dcp_world_size|dcp_sharded"
    r"|block_size\b[^#\n]*\*[^#\n]*dcp"
)
"""A line that reads DCP: the group, the configured size, an impl's or a
builder's world, a spec's flag, or a block size multiplied by a DCP term."""

SITES_DIR = Path(__file__).resolve().parent

Sites = dict[str, dict[str, str]]
"""file (relative to the vllm package) -> qualified name -> digest."""


def sites_file(release: str) -> Path:
    return SITES_DIR / f"sites-vllm-{release}.json"


def _enclosing_names(tree: ast.AST) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every def and class."""
    spans: list[tuple[int, int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                end = child.end_lineno or child.lineno
                spans.append((child.lineno, end, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def _site_of(line: int, spans: list[tuple[int, int, str]]) -> str:
    inside = [s for s in spans if s[0] <= line <= s[1]]
    return max(inside, key=lambda s: s[0])[2] if inside else "<module>"


def file_sites(path: Path) -> dict[str, str]:
    """Qualified name -> digest of the DCP-reading lines in one file."""
    text = path.read_text(errors="replace")
    if not DCP_READ.search(text):
        return {}
    try:
        spans = _enclosing_names(ast.parse(text))
    except SyntaxError:
        spans = []
    lines: dict[str, list[str]] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if DCP_READ.search(line):
            lines.setdefault(_site_of(number, spans), []).append(line.strip())
    return {
        name: hashlib.sha256("\n".join(found).encode()).hexdigest()[:12]
        for name, found in sorted(lines.items())
    }


def installed_sites(vllm_root: Path) -> Sites:
    found: Sites = {}
    for path in sorted(vllm_root.rglob("*.py")):
        sites = file_sites(path)
        if sites:
            found[path.relative_to(vllm_root).as_posix()] = sites
    return found


def patched_files() -> set[str]:
    """Files (relative to the vllm package) of the modules the plugin patches."""
    files = set()
    for patch in declarations().values():
        parts = patch.upstream_module.split(".")[1:]
        files |= {"/".join(parts) + ".py", "/".join([*parts, "__init__.py"])}
    return files


def recorded_sites(release: str) -> Sites:
    path = sites_file(release)
    if not path.is_file():
        return {}
    sites: Sites = json.loads(path.read_text())["sites"]
    return sites


def write_sites_file(release: str, vllm_root: Path) -> Path:
    path = sites_file(release)
    contents = {"vllm": release, "sites": installed_sites(vllm_root)}
    path.write_text(json.dumps(contents, indent=1, sort_keys=True) + "\n")
    return path


def site_changes(
    installed: Sites, known: dict[str, Sites]
) -> list[tuple[str, str, str]]:
    """(status, file, qualified name) of every site outside the patched
    modules that no known release has as it is: "new" (no known release has
    the function reading DCP) or "changed" (its reading lines differ)."""
    skip = patched_files()
    changes = []
    for file, sites in installed.items():
        if file in skip:
            continue
        for name, digest in sites.items():
            recorded = [k.get(file, {}).get(name) for k in known.values()]
            if digest in recorded:
                continue
            status = "changed" if any(recorded) else "new"
            changes.append((status, file, name))
    return changes
