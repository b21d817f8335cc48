#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Source checks run by pre-commit: ``check_sources.py spdx|imports|sizes FILE...``.

spdx: every Python file carries this project's SPDX header, never vLLM's.

imports: forbidden imports and settings in the package.
- No module of ``vllm_dcp_geometry`` imports vLLM or torch at module level:
  importing the package must stay cheap, and patches apply when vLLM's own
  modules load, not when ours do. Import them inside functions (or under
  ``if TYPE_CHECKING:``).
- Library code never imports the test suite, and never sets the CPU-testing
  switches (TRITON_INTERPRET, CUDA_VISIBLE_DEVICES, PIN_MEMORY): those belong
  in tests/conftest.py. One module is exempt, ``CPU_WORKER_SWITCHES``: the
  tooling's CPU stand-ins, with the environment ``ranks`` gives the CPU
  worker processes it spawns.
- Patch modules are removable one at a time: nothing in the package or the
  benchmarks imports a module under ``vllm_dcp_geometry.patches`` (at any
  level, by statement or by ``importlib``), except the registry
  (``vllm_dcp_geometry/patches/__init__.py`` and ``plugin.py``), which loads
  them by name from ``PATCH_MODULES``. Tests may import the module they test.
- The floors (``MAY_IMPORT``): the contract imports only itself and nothing
  of vLLM, even inside a function; the runtime imports the contract; patch
  modules import the contract and the runtime; the entry point those and the
  registry. None of them imports the tooling, which may import everything.

sizes: in the package, the benchmarks, the tools and the tests (``SIZED``),
no module over ``MAX_MODULE_LINES`` lines and no function over
``MAX_FUNCTION_LINES`` (its decorators through its last line), so that a
module reads in one sitting and a regression shows the day it lands. The test
modules written before the tests were sized and not split yet are named in
``NOT_YET_SPLIT``; one that fits fails until it is dropped from the list, so
the list only shrinks.
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
REGISTRY_NAMES = {"PATCH_MODULES", "PATCH_PACKAGE", "declarations"}
TEST_ONLY_SWITCHES = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PIN_MEMORY")
CPU_WORKER_SWITCHES = Path("vllm_dcp_geometry/tooling/cpu_stand_ins.py")
"""The one library module that may name the switches: the tooling's CPU
stand-ins, with what the tooling puts in the environment of the processes it
starts for vLLM's kernels on a machine with no GPU (``ranks``' workers,
``simulate``'s CPU process; never in its own process, never at import
time)."""


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


PACKAGE = "vllm_dcp_geometry"
MAY_IMPORT: dict[str, frozenset[str]] = {
    "_version": frozenset(),
    "contract": frozenset({"contract"}),
    "runtime": frozenset({"_version", "contract", "runtime"}),
    "patches": frozenset({"contract", "runtime"}),
    "plugin": frozenset({"_version", "contract", "runtime", "patches"}),
    "__init__": frozenset({"_version", "contract", "runtime", "plugin"}),
}
"""Each part of the package (its first path component below
``vllm_dcp_geometry``; ``__init__`` is the package module itself) and the
parts it may import, anywhere in the file: the floors of the house, lowest
first. What a server loads (contract, runtime, patches, the entry point)
never imports the tooling; the contract imports nothing of vLLM at all. The
parts not listed (``tooling``, ``__main__``) run beside vLLM and may import
every part."""
BESIDE_VLLM = frozenset({"tooling", "__main__"})
PURE = "contract"


def _package_part(name: str, root: Path) -> str | None:
    """The part of the package a dotted name lies in (None: not ours)."""
    parts = name.split(".")
    if parts[0] != PACKAGE:
        return None
    if len(parts) == 1:
        return "__init__"
    child = parts[1]
    if child in MAY_IMPORT or child in BESIDE_VLLM:
        return child
    if (root / PACKAGE / child).is_dir() or (root / PACKAGE / f"{child}.py").exists():
        return child
    return "__init__"


def _file_part(path: Path) -> str:
    below = path.parts[path.parts.index(PACKAGE) + 1 :]
    return Path(below[0]).stem


def _imports_anywhere(tree: ast.Module, path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(node, path)
            if module == PACKAGE:
                found.extend((node.lineno, f"{module}.{a.name}") for a in node.names)
            else:
                found.append((node.lineno, module))
    return found


def floor_problems(path: Path, tree: ast.Module) -> list[str]:
    """Imports that climb: a part importing what its floor may not."""
    part = _file_part(path)
    allowed = MAY_IMPORT.get(part)
    if allowed is None:
        return []
    root = Path(*path.parts[: path.parts.index(PACKAGE)])
    found = []
    for lineno, name in _imports_anywhere(tree, path):
        if part == PURE and name.split(".")[0] in HEAVY:
            found.append(
                f"{path}:{lineno}: the contract imports {name}; it stays pure "
                "Python (vLLM-facing code belongs in vllm_dcp_geometry/runtime)"
            )
        target = _package_part(name, root)
        if target is None or (target == part and part != "__init__"):
            continue
        if target not in allowed:
            found.append(
                f"{path}:{lineno}: {part} imports {name} ({target}); {part} may "
                f"import only {', '.join(sorted(allowed)) or 'nothing of ours'}"
            )
    return found


def patch_import_problems(path: Path, tree: ast.Module) -> list[str]:
    if path.parts[0] not in ("vllm_dcp_geometry", "benchmarks"):
        return []
    if any(path == registry for registry in REGISTRY):
        return []
    return [
        f"{path}:{lineno}: imports patch module {name}; patch modules must be "
        "removable one at a time: move what it shares into "
        "vllm_dcp_geometry/runtime or vllm_dcp_geometry/contract"
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
    found = patch_import_problems(path, tree) + floor_problems(path, tree)
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


SIZED = ("vllm_dcp_geometry", "benchmarks", "tools", "tests")
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
NOT_YET_SPLIT = ("tests/gpu/test_gpu_sparse_mla.py",)
"""Test modules over the limits from before the tests were sized, each to be
split; the GPU script's functions wait for a GPU to check the split on."""


def size_problems(path: Path) -> list[str]:
    if not path.parts or path.parts[0] not in SIZED:
        return []
    found = _over_the_limits(path)
    if path.as_posix() not in NOT_YET_SPLIT:
        return found
    if found:
        return []
    return [f"{path}: within the limits now; drop it from NOT_YET_SPLIT"]


def _over_the_limits(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    found = []
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(
            f"{path}: {lines} lines, over the {MAX_MODULE_LINES}-line module limit; "
            "split it by responsibility"
        )
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        length = (node.end_lineno or node.lineno) - first + 1
        if length > MAX_FUNCTION_LINES:
            found.append(
                f"{path}:{first}: function {node.name} is {length} lines, over the "
                f"{MAX_FUNCTION_LINES}-line limit; split it where its steps are"
            )
    return found


CHECKS: dict[str, Callable[[Path], list[str]]] = {
    "spdx": spdx_problems,
    "imports": import_problems,
    "sizes": size_problems,
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
