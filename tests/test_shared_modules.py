# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``SHARED_MODULES`` is exactly what the patch modules import of the
package, and the one list the README and the source checker read."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from vllm_dcp_geometry.patches import (
    SHARED_MODULES,
    patch_table_markdown,
    shared_modules_sentence,
)

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "vllm_dcp_geometry" / "patches"
PACKAGE = "vllm_dcp_geometry"


def imported_package_modules(path: Path) -> set[str]:
    """First-level ``vllm_dcp_geometry`` modules a file imports, anywhere."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE:
                names = [f"{PACKAGE}.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == PACKAGE and len(parts) > 1:
                found.add(parts[1])
    return found


def shared_module_problems(patch_dir: Path, shared: list[str]) -> list[str]:
    """What a patch imports that is not listed, and what is listed that no
    patch imports (the registry ``patches`` itself is neither)."""
    used: dict[str, list[str]] = {}
    for path in sorted(patch_dir.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        for module in imported_package_modules(path) - {"patches"}:
            used.setdefault(module, []).append(path.name)
    problems = [
        f"{module} is imported by {', '.join(files)} but not in SHARED_MODULES"
        for module, files in sorted(used.items())
        if module not in shared
    ]
    problems += [
        f"{module} is in SHARED_MODULES but no patch module imports it"
        for module in shared
        if module not in used
    ]
    return problems


def test_shared_modules_are_what_patches_import() -> None:
    names = [name for name, _ in SHARED_MODULES]
    assert len(set(names)) == len(names)
    assert shared_module_problems(PATCH_DIR, names) == []
    for name in names:
        assert importlib.util.find_spec(f"{PACKAGE}.{name}") is not None, name


def test_shared_module_check_fails_on_a_broken_tree(tmp_path: Path) -> None:
    names = [name for name, _ in SHARED_MODULES]
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "stray.py").write_text(
        "from vllm_dcp_geometry.cli.common import flags\n"
        "def f():\n    import vllm_dcp_geometry.contract\n"
    )
    problems = shared_module_problems(tmp_path, [*names, "unused_helper"])
    assert "cli is imported by stray.py but not in SHARED_MODULES" in problems
    assert "unused_helper is in SHARED_MODULES but no patch module imports it" in (
        problems
    )
    assert not any(p.startswith("contract ") for p in problems)


def test_readme_and_source_checker_read_the_one_list() -> None:
    spec = importlib.util.spec_from_file_location(
        "check_sources", ROOT / "tools" / "check_sources.py"
    )
    assert spec is not None and spec.loader is not None
    check_sources = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_sources)
    assert check_sources.shared_module_names() == [name for name, _ in SHARED_MODULES]
    assert patch_table_markdown().startswith(shared_modules_sentence())
    for name, _ in SHARED_MODULES:
        assert f"`{name}.py`" in shared_modules_sentence()
