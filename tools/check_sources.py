#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Source checks run by pre-commit: ``check_sources.py spdx|imports FILE...``.

spdx: every Python file carries this project's SPDX header, never vLLM's.

imports: forbidden imports and settings in the package.
- No module of ``vllm_dcp_geometry`` imports vLLM or torch at module level:
  importing the package must stay cheap, and patches apply when vLLM's own
  modules load, not when ours do. Import them inside functions (or under
  ``if TYPE_CHECKING:``).
- Library code never imports the test suite, and never sets the CPU-testing
  switches (TRITON_INTERPRET, CUDA_VISIBLE_DEVICES, PIN_MEMORY): those belong
  in tests/conftest.py. One module is exempt, ``CPU_WORKER_SWITCHES``: the
  environment ``ranks`` gives the CPU worker processes it spawns.
- Patch modules are removable one at a time: nothing in the package or the
  benchmarks imports a module under ``vllm_dcp_geometry.patches`` (at any
  level, by statement or by ``importlib``), except the registry
  (``vllm_dcp_geometry/patches/__init__.py`` and ``plugin.py``), which loads
  them by name from ``PATCH_MODULES``. What patch modules share lives in
  non-patch modules. Tests may import the module they test.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Callable
from pathlib import Path

LICENSE = "# SPDX-License-Identifier: Apache-2.0"
COPYRIGHT = (
    "# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project"
)
# Split so this file does not itself carry the line it looks for.
FOREIGN = "contributors to the " + "vllm project"


def spdx_problems(path: Path) -> list[str]:
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


HEAVY = {"vllm", "torch", "triton"}
PATCHES = "vllm_dcp_geometry.patches"
REGISTRY = (
    Path("vllm_dcp_geometry/patches/__init__.py"),
    Path("vllm_dcp_geometry/plugin.py"),
)
REGISTRY_NAMES = {"PATCH_MODULES", "PATCH_PACKAGE", "patch_table_markdown"}
TEST_ONLY_SWITCHES = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PIN_MEMORY")
CPU_WORKER_SWITCHES = Path("vllm_dcp_geometry/cli/ranks/cpu.py")
"""The one library module that may name the switches: what ``ranks`` puts in
the environment of the worker processes it spawns on a machine with no GPU
(never in its own process, never at import time)."""


def _top_level_imports(tree: ast.Module) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.extend((node.lineno, a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.append((node.lineno, node.module or ""))
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return found


def _module_name(path: Path) -> str:
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imported_patch_modules(tree: ast.Module, path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            names = [
                module
                if module != PATCHES or alias.name in REGISTRY_NAMES
                else f"{module}.{alias.name}"
                for alias in node.names
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith(PATCHES + ".") else []
        else:
            continue
        lineno = getattr(node, "lineno", 0)
        found.extend((lineno, name) for name in names if name.startswith(PATCHES + "."))
    return found


def shared_module_names() -> list[str]:
    """The shared modules as ``vllm_dcp_geometry.patches.SHARED_MODULES``
    lists them, read from its source (this tool imports nothing of ours)."""
    registry = Path(__file__).resolve().parent.parent / REGISTRY[0]
    tree = ast.parse(registry.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(getattr(t, "id", None) == "SHARED_MODULES" for t in targets):
                assert node.value is not None
                return [name for name, _ in ast.literal_eval(node.value)]
    raise SystemExit(f"{REGISTRY[0]}: SHARED_MODULES not found")


def patch_import_problems(path: Path, tree: ast.Module) -> list[str]:
    if path.parts[0] not in ("vllm_dcp_geometry", "benchmarks"):
        return []
    if any(path == registry for registry in REGISTRY):
        return []
    return [
        f"{path}:{lineno}: imports patch module {name}; patch modules must be "
        "removable one at a time: move what it shares into a non-patch module "
        f"({', '.join(shared_module_names())})"
        for lineno, name in _imported_patch_modules(tree, path)
    ]


def import_problems(path: Path) -> list[str]:
    if path.is_absolute():
        path = path.relative_to(Path.cwd())
    if path.parts[0] == "benchmarks":
        text = path.read_text(encoding="utf-8")
        return patch_import_problems(path, ast.parse(text, filename=str(path)))
    if "vllm_dcp_geometry" not in path.parts:
        return []
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text, filename=str(path))
    found = patch_import_problems(path, tree)
    for lineno, name in _top_level_imports(tree):
        root = name.split(".")[0]
        if root in HEAVY:
            found.append(
                f"{path}:{lineno}: module-level import of {name}; import it "
                "inside the function that needs it"
            )
        if root == "tests":
            found.append(f"{path}:{lineno}: library code imports the test suite")
    if path == CPU_WORKER_SWITCHES:
        return found
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in TEST_ONLY_SWITCHES
        ):
            found.append(
                f"{path}:{node.lineno}: {node.value} is a test-only switch; "
                "set it in tests/conftest.py"
            )
        if (
            isinstance(node, ast.Attribute)
            and node.attr in TEST_ONLY_SWITCHES
            and isinstance(getattr(node, "ctx", None), ast.Store)
        ):
            found.append(f"{path}:{node.lineno}: sets {node.attr} in library code")
    return found


CHECKS: dict[str, Callable[[Path], list[str]]] = {
    "spdx": spdx_problems,
    "imports": import_problems,
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in CHECKS:
        print(f"usage: check_sources.py {{{'|'.join(CHECKS)}}} FILE...")
        return 2
    check = CHECKS[argv[0]]
    found = [p for name in argv[1:] if name.endswith(".py") for p in check(Path(name))]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
