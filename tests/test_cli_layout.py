# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The layout of ``vllm_dcp_geometry/tooling/cli/``: one package per command, shared
helpers in ``cli/common``, no import circle, library code outside.

- ``cli/__init__.py`` holds ``main`` and the parser only; every command is a
  package of ``cli`` whose ``__init__`` has ``HELP``, ``add_arguments`` and
  ``command``;
- no module of ``cli`` imports, at any level, a module that imports it back
  (module-level, function-level and ``TYPE_CHECKING`` imports all count), nor
  one of its ancestor packages (a child reaching into its parent);
- one ``Violations`` type;
- the command's ``SimulationOptions`` carry no test hook (the tests'
  subclass, ``tests/support/simulate.py``, adds them through
  ``SimulationHooks``);
- the package outside ``cli/`` (the library) imports no ``cli`` module, except
  ``__main__``.

The import and layout rules are checked on the repository and shown to fail
on a deliberately broken tree (the tree before this layout failed every one).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.sources import module_name, write_module

REPO = Path(__file__).resolve().parent.parent
CLI = "vllm_dcp_geometry.tooling.cli"
PARSER_NAMES = {"main", "build_parser", "_Parser", "_add_common_flags"}
"""What ``cli/__init__.py`` may define: ``main`` and the parser."""
COMMAND_NAMES = {"HELP", "add_arguments", "command"}


def _modules(root: Path, package: str = "vllm_dcp_geometry") -> dict[str, Path]:
    base = root.joinpath(*package.split("."))
    return {module_name(root, p): p for p in sorted(base.rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at any level."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in known
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Every ``cli`` module and what it imports of ``cli``."""
    modules = {n: p for n, p in _modules(root).items() if n.startswith(CLI)}
    return {n: _imports(p, set(modules)) - {n} for n, p in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles: list[list[str]] = []
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            if target in path:
                circles.append([*path[path.index(target) :], target])
            elif target not in done:
                visit(target, [*path, target])
        done.add(name)

    for name in sorted(graph):
        if name not in done:
            visit(name, [name])
    return circles


def parent_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, ancestor package it imports)."""
    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if name.startswith(target + ".")
    )


def layout_problems(root: Path) -> list[str]:
    """What breaks the layout rules other than imports."""
    cli = root / "vllm_dcp_geometry" / "tooling" / "cli"
    problems = []
    tree = ast.parse((cli / "__init__.py").read_text(encoding="utf-8"))
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
    }
    if defined - PARSER_NAMES:
        problems.append(f"cli/__init__.py defines {sorted(defined - PARSER_NAMES)}")
    for path in sorted(cli.glob("*.py")):
        if path.name != "__init__.py":
            problems.append(f"{path.name}: a module in cli/ itself, not a package")
    for package in sorted(p for p in cli.iterdir() if (p / "__init__.py").exists()):
        if package.name == "common":
            continue
        tree = ast.parse((package / "__init__.py").read_text(encoding="utf-8"))
        names = {
            target.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        names |= {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if COMMAND_NAMES - names:
            problems.append(
                f"cli/{package.name}/__init__.py lacks {sorted(COMMAND_NAMES - names)}"
            )
    classes = [
        f"{path.relative_to(root)}"
        for path in sorted(cli.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and node.name == "Violations"
    ]
    if len(classes) != 1:
        problems.append(f"{len(classes)} Violations classes: {classes}")
    library = {
        n: p
        for n, p in _modules(root).items()
        if not n.startswith(CLI) and n != "vllm_dcp_geometry.__main__"
    }
    cli_modules = set(import_graph(root)) | {CLI}
    for name, path in library.items():
        if _imports(path, cli_modules):
            problems.append(f"library module {name} imports the CLI")
    return problems


def test_the_cli_has_no_import_circle_and_no_child_imports_its_parent() -> None:
    graph = import_graph(REPO)
    assert {"vllm_dcp_geometry.tooling.cli.simulate.run", CLI} <= set(graph)
    assert import_circles(graph) == []
    assert parent_imports(graph) == []


def test_the_cli_is_one_package_per_command() -> None:
    assert layout_problems(REPO) == []


def test_the_commands_simulation_options_carry_no_test_hook() -> None:
    import dataclasses

    from vllm_dcp_geometry.tooling.cli.simulate.options import (
        SimulationHooks,
        SimulationOptions,
    )

    fields = {f.name for f in dataclasses.fields(SimulationOptions)}
    assert not fields & {"shift_shard", "on_step"}
    assert type(SimulationOptions().hooks()) is SimulationHooks


def _good_tree(root: Path) -> None:
    write_module(root, "vllm_dcp_geometry/__init__.py", "")
    write_module(
        root,
        "vllm_dcp_geometry/__main__.py",
        "from vllm_dcp_geometry.tooling.cli import main\n",
    )
    write_module(root, "vllm_dcp_geometry/tooling/vllm_objects.py", "")
    write_module(
        root,
        "vllm_dcp_geometry/tooling/cli/__init__.py",
        "from vllm_dcp_geometry.tooling.cli import plan\n"
        "def build_parser():\n    pass\n"
        "def main():\n    pass\n",
    )
    write_module(root, "vllm_dcp_geometry/tooling/cli/common/__init__.py", "")
    write_module(
        root,
        "vllm_dcp_geometry/tooling/cli/common/violations.py",
        "class Violations:\n    pass\n",
    )
    write_module(
        root,
        "vllm_dcp_geometry/tooling/cli/plan/__init__.py",
        "from vllm_dcp_geometry.tooling.cli.plan.output import fmt\n"
        "HELP = 'plan'\n"
        "def add_arguments(parser):\n    pass\n"
        "def command(args):\n    return fmt()\n",
    )
    write_module(
        root,
        "vllm_dcp_geometry/tooling/cli/plan/output.py",
        "from vllm_dcp_geometry.tooling.cli.common import violations\ndef fmt():\n    pass\n",
    )


def test_the_rules_fail_on_a_broken_tree(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    graph = import_graph(tmp_path)
    assert not import_circles(graph)
    assert not parent_imports(graph)
    assert not layout_problems(tmp_path)

    # A circle through a function-level import, and a child reaching into
    # its parent package.
    write_module(
        tmp_path,
        "vllm_dcp_geometry/tooling/cli/plan/output.py",
        "def fmt():\n"
        "    from vllm_dcp_geometry.tooling.cli.plan import command\n"
        "    from vllm_dcp_geometry.tooling import cli\n",
    )
    graph = import_graph(tmp_path)
    assert [
        "vllm_dcp_geometry.tooling.cli.plan",
        "vllm_dcp_geometry.tooling.cli.plan.output",
        "vllm_dcp_geometry.tooling.cli.plan",
    ] in import_circles(graph)
    assert ("vllm_dcp_geometry.tooling.cli.plan.output", CLI) in parent_imports(graph)

    # A command in cli/__init__.py, a flat command module, a package without
    # its command, a second Violations, and library code importing the CLI.
    _good_tree(tmp_path)
    write_module(
        tmp_path,
        "vllm_dcp_geometry/tooling/cli/__init__.py",
        "def main():\n    pass\ndef cmd_replay(args):\n    pass\n",
    )
    write_module(tmp_path, "vllm_dcp_geometry/tooling/cli/replay.py", "")
    write_module(
        tmp_path, "vllm_dcp_geometry/tooling/cli/simulate/__init__.py", "HELP = 's'\n"
    )
    write_module(
        tmp_path,
        "vllm_dcp_geometry/tooling/cli/simulate/views.py",
        "class Violations:\n    pass\n",
    )
    write_module(
        tmp_path,
        "vllm_dcp_geometry/tooling/vllm_objects.py",
        "from vllm_dcp_geometry.tooling.cli.common import violations\n",
    )
    problems = layout_problems(tmp_path)
    assert any("defines ['cmd_replay']" in p for p in problems)
    assert any(p.startswith("replay.py: a module in cli/") for p in problems)
    assert any(
        "simulate/__init__.py lacks ['add_arguments', 'command']" in p for p in problems
    )
    assert any("2 Violations classes" in p for p in problems)
    assert any(
        "vllm_dcp_geometry.tooling.vllm_objects imports the CLI" in p for p in problems
    )
