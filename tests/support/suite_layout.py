# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The rules of the test suite's layout, each a check that takes a
repository root and returns its violations (``test_test_layout`` runs them
on this repository and on deliberately broken trees): ``layout_problems``,
``import_problems``, ``patch_modules`` with ``marker_problems``, and
``copy_problems``.
"""

from __future__ import annotations

import ast
import copy
import re
import textwrap
from collections import defaultdict
from pathlib import Path

from tests.support.sources import module_name

PATCHES = "vllm_dcp_geometry.patches."
TEST_PACKAGES = ("gpu", "support")
ROLE_WORDS = {
    "cases",
    "catalogue",
    "common",
    "fixtures",
    "harness",
    "helpers",
    "hooks",
    "runner",
    "support",
    "util",
    "utils",
}
"""Words that name a helper's role, not its subject."""
ONE_DEFINITION = ("cdiv", "divisors", "emulate_dcp_group")
"""Helpers that were copied: each is defined once, in ``tests/`` and the
library together."""


def _entries(folder: Path) -> list[Path]:
    return sorted(
        p
        for p in folder.iterdir()
        if p.name != "__pycache__" and not p.name.startswith(".")
    )


def _python_files(root: Path, folder: str) -> list[Path]:
    return sorted(
        p for p in (root / folder).rglob("*.py") if "__pycache__" not in p.parts
    )


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_test_file(path: Path) -> bool:
    return path.name.startswith("test_") and path.suffix == ".py"


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError:
        return None


# (a) Where files go ----------------------------------------------------------------


def layout_problems(root: Path) -> list[str]:
    tests = root / "tests"
    problems = []
    for path in _entries(tests):
        if path.is_dir():
            if path.name not in TEST_PACKAGES:
                problems.append(
                    f"tests/{path.name}/: only the packages gpu/ and support/ "
                    "sit in tests/"
                )
        elif path.name not in ("__init__.py", "conftest.py") and not _is_test_file(
            path
        ):
            problems.append(
                f"tests/{path.name}: not a test module; helpers live in tests/support/"
            )
    for package in TEST_PACKAGES:
        if not (tests / package / "__init__.py").is_file():
            problems.append(f"tests/{package}/: not a package (no __init__.py)")
    gpu = tests / "gpu"
    if gpu.is_dir():
        for path in _entries(gpu):
            if path.name != "__init__.py" and not _is_test_file(path):
                problems.append(
                    f"tests/gpu/{path.name}: tests/gpu/ holds only __init__.py "
                    "and test_*.py; helpers live in tests/support/"
                )
    for init in (tests / "__init__.py", gpu / "__init__.py"):
        tree = _parse(init) if init.is_file() else None
        defined = [
            node.name
            for node in (tree.body if tree else [])
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        ]
        if defined:
            problems.append(
                f"{_relative(root, init)}: defines {', '.join(defined)}; helpers "
                "live in tests/support/"
            )
    support = tests / "support"
    init = _parse(support / "__init__.py") if support.is_dir() else None
    shared = (ast.get_docstring(init) or "") if init else ""
    for path in _entries(support) if support.is_dir() else []:
        where = f"tests/support/{path.name}"
        if path.is_dir():
            problems.append(f"{where}/: tests/support/ is one flat package")
        elif path.suffix != ".py":
            problems.append(f"{where}: not a Python module")
        elif path.name.startswith("test_"):
            problems.append(
                f"{where}: a test module in support/; test modules live in "
                "tests/ or tests/gpu/"
            )
        else:
            roles = sorted(set(path.stem.split("_")) & ROLE_WORDS)
            if roles:
                problems.append(
                    f"{where}: named by its role ({', '.join(roles)}); name it "
                    "after the subject it supports"
                )
            tree = _parse(path)
            if tree is None or not ast.get_docstring(tree):
                problems.append(f"{where}: no docstring saying what it offers")
            if path.name != "__init__.py" and f"``{path.stem}``" not in shared:
                problems.append(
                    f"{where}: not named in tests/support/__init__.py's docstring "
                    "(the map of what the tests share)"
                )
    return problems


# (b) No test module imports another --------------------------------------------------


def is_test_module(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "tests" and len(parts) > 1 and parts[-1].startswith("test_")


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Every dotted name ``node`` may import (``from a import b``: ``a`` and
    ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


_FROM = re.compile(r"\bfrom\s+(tests(?:\.\w+)*)\s+import\s+(\([^)]*\)|[\w \t,]+)")
_IMPORT = re.compile(r"\bimport\s+(tests(?:\.\w+)+)")


def _imported_in_text(text: str) -> list[str]:
    """Test-suite modules a string names: a dotted name itself (for
    ``importlib``), the imports of the code it holds, or, where it is no
    complete code, what its import lines name."""
    if re.fullmatch(r"tests(\.\w+)+", text):
        return [text]
    try:
        tree = ast.parse(textwrap.dedent(text))
    except SyntaxError:
        names = [m.group(1) for m in _IMPORT.finditer(text)]
        for m in _FROM.finditer(text):
            names.append(m.group(1))
            for imported in m.group(2).strip("()").split(","):
                words = imported.split()
                if words:
                    names.append(f"{m.group(1)}.{words[0]}")
        return names
    return [
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in _imported(node, "")
    ]


def import_problems(root: Path) -> list[str]:
    problems: list[tuple[str, int, str]] = []
    for path in _python_files(root, "tests"):
        tree = _parse(path)
        if tree is None:
            problems.append((_relative(root, path), 0, "does not parse"))
            continue
        module = module_name(root, path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names, how = _imported(node, package), "imports"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names, how = _imported_in_text(node.value), "runs code importing"
            else:
                continue
            for name in sorted(set(filter(is_test_module, names))):
                problems.append(
                    (
                        _relative(root, path),
                        node.lineno,
                        f"{how} test module {name}; move what they share to "
                        "tests/support/",
                    )
                )
    return [f"{where}:{line}: {what}" for where, line, what in sorted(problems)]


# (c) Each patch's tests --------------------------------------------------------------


def patch_modules(root: Path) -> list[str]:
    """``PATCH_MODULES`` relative to the package, read from its source."""
    registry = root / "vllm_dcp_geometry" / "patches" / "__init__.py"
    tree = _parse(registry)
    assert tree is not None, registry
    for node in tree.body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(getattr(t, "id", None) == "PATCH_MODULES" for t in targets):
            assert node.value is not None
            return [n.removeprefix(PATCHES) for n in ast.literal_eval(node.value)]
    raise AssertionError(f"{registry}: no PATCH_MODULES")


def _is_patches_mark(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "patches"
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "mark"
    )


def _test_files(root: Path) -> list[Path]:
    return [p for p in _python_files(root, "tests") if _is_test_file(p)]


def marker_problems(root: Path) -> list[str]:
    known = patch_modules(root)
    problems = []
    named: dict[str, list[str]] = defaultdict(list)
    for path in _test_files(root):
        where = _relative(root, path)
        tree = _parse(path)
        if tree is None:
            problems.append(f"{where}: does not parse")
            continue
        declared = set()
        for node in ast.walk(tree):
            if not _is_patches_mark(node):
                continue
            assert isinstance(node, ast.Call)
            for arg in node.args:
                if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
                    problems.append(
                        f"{where}:{node.lineno}: pytest.mark.patches takes patch "
                        "names as string literals"
                    )
                    continue
                declared.add(arg.value)
                named[arg.value].append(where)
                if arg.value not in known:
                    problems.append(
                        f"{where}:{node.lineno}: pytest.mark.patches names "
                        f"{arg.value}, which is not in PATCH_MODULES: a removed "
                        "patch takes its tests (or its marker) with it"
                    )
        imported = {
            name.removeprefix(PATCHES)
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for name in _imported(node, "tests")
        }
        for name in sorted((imported & set(known)) - declared):
            problems.append(
                f"{where}: imports patch module {name} but its "
                "pytest.mark.patches(...) does not name it"
            )
    problems += [
        f"patch module {name} is named by no test module's pytest.mark.patches(...)"
        for name in known
        if name not in named
    ]
    return problems


# (d) One definition per helper -------------------------------------------------------


def _constants(tree: ast.Module) -> dict[str, str]:
    """What each name its module assigns once at the top level holds."""
    assigned: dict[str, list[str]] = defaultdict(list)
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Name):
                    assigned[target.id].append(ast.dump(node.value))
    return {name: dumps[0] for name, dumps in assigned.items() if len(dumps) == 1}


def _normalized(
    function: ast.FunctionDef | ast.AsyncFunctionDef, constants: dict[str, str]
) -> str:
    """The function's parameters and body without docstring, annotations and
    decorators, its own local names numbered in order of appearance, and the
    module constants it reads by their values (two ``full(...)`` over
    different ``ATTN`` differ)."""
    fn = copy.deepcopy(function)
    if ast.get_docstring(fn) is not None:
        fn.body = fn.body[1:]
    fn.decorator_list, fn.returns, fn.name = [], None, "_"
    local: dict[str, str] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.arg):
            node.annotation = None
            node.arg = local.setdefault(node.arg, f"_{len(local)}")
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            local.setdefault(node.id, f"_{len(local)}")
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id in local:
            node.id = local[node.id]
        elif isinstance(node, ast.Name) and node.id in constants:
            node.id = f"{node.id}={constants[node.id]}"
        elif isinstance(node, ast.AnnAssign):
            node.annotation = ast.Constant(None)
    return ast.dump(fn)


def _functions(root: Path) -> list[tuple[str, str, str]]:
    """``(name, normalized, file)`` of every module-level function in
    ``tests/`` and the library."""
    found = []
    for path in _python_files(root, "tests") + _python_files(root, "vllm_dcp_geometry"):
        tree = _parse(path)
        if tree is None:
            continue
        constants = _constants(tree)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = _normalized(node, constants)
                found.append((node.name, body, _relative(root, path)))
    return found


def copy_problems(root: Path) -> list[str]:
    functions = _functions(root)
    copies: dict[tuple[str, str], list[str]] = defaultdict(list)
    for name, body, where in functions:
        copies[(name, body)].append(where)
    problems = []
    for (name, _), places in sorted(copies.items()):
        in_tests = [p for p in places if p.startswith("tests/")]
        library = [p for p in places if not p.startswith("tests/")]
        if not in_tests or len(places) < 2:
            continue
        if library:
            problems.append(
                f"{name} in {', '.join(in_tests)} copies {library[0]}: import it "
                "from there"
            )
        else:
            problems.append(
                f"{name} is defined in {', '.join(in_tests)}: define it once in "
                "tests/support/ and import it"
            )
    for name in ONE_DEFINITION:
        places = [where for n, _, where in functions if n == name]
        if len(places) != 1:
            problems.append(
                f"{name} is defined {len(places)} times ({', '.join(places)}), not once"
            )
    return problems
