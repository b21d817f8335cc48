# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The layout of ``tests/``: test modules and the two packages, every helper in
``tests/support/``, no test module importing another, each patch's tests
findable from the patch, no helper defined twice.

- ``tests/`` holds only ``__init__.py``, ``conftest.py``, ``test_*.py`` and the
  packages ``gpu/`` (``__init__.py`` and ``test_*.py`` only) and ``support/``
  (no ``test_*`` module; each module named after its subject, with no role
  word such as ``harness``, and a docstring saying what it offers); the test
  packages' ``__init__.py`` define nothing;
- no module under ``tests/`` imports a test module: import statements at any
  level, ``importlib.import_module`` names and the code in string constants
  (the snippets fresh interpreters run) all count;
- every name a ``pytest.mark.patches(...)`` marker gives is a patch module of
  ``PATCH_MODULES`` (relative to ``vllm_dcp_geometry.patches``), every patch
  module is named by at least one test module, and a test module that imports
  a patch module names it: deleting a patch fails here, naming the test
  modules that go with it; ``--patch NAME`` (``tests/conftest.py``) runs them;
- no function is defined twice with the same name and body (local names,
  docstrings and annotations aside) in ``tests/``, or in ``tests/`` and the
  library; ``cdiv``, ``divisors`` and ``emulate_dcp_group`` are defined once.

Each check takes the repository root and returns its violations; each runs on
this repository and is shown to fail on a deliberately broken tree.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.sources import write_module
from tests.support.suite_layout import (
    PATCHES,
    copy_problems,
    import_problems,
    layout_problems,
    marker_problems,
    patch_modules,
)

REPO = Path(__file__).resolve().parent.parent


# The repository ----------------------------------------------------------------------


def test_tests_holds_test_modules_and_the_two_packages() -> None:
    assert layout_problems(REPO) == []


def test_no_test_module_imports_another() -> None:
    assert import_problems(REPO) == []


def test_every_patch_has_tests_and_every_marker_a_patch() -> None:
    from vllm_dcp_geometry.patches import PATCH_MODULES

    assert patch_modules(REPO) == [n.removeprefix(PATCHES) for n in PATCH_MODULES]
    assert marker_problems(REPO) == []


def test_no_helper_is_defined_twice() -> None:
    assert copy_problems(REPO) == []


def test_the_patch_option_runs_the_modules_that_name_the_patch() -> None:
    def pytest(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=False,
        )

    chosen = pytest(
        "--collect-only",
        "--patch",
        "worker.flint_model",
        "tests/test_layer_classes.py",
        "tests/test_specs.py",
    )
    assert chosen.returncode == 0, chosen.stdout + chosen.stderr
    items = [line for line in chosen.stdout.splitlines() if "::" in line]
    assert items and all(i.startswith("tests/test_layer_classes.py") for i in items)
    assert "deselected" in chosen.stdout
    unknown = pytest("--collect-only", "--patch", "worker.no_such_patch")
    assert unknown.returncode == 4, unknown.stdout + unknown.stderr
    assert "--patch worker.no_such_patch: not a patch module" in unknown.stderr


# Deliberately broken trees -----------------------------------------------------------


def _good_tree(root: Path) -> None:
    write_module(root, "tests/__init__.py")
    write_module(root, "tests/conftest.py", "def pytest_configure(config):\n    pass\n")
    write_module(root, "tests/test_a.py", "import pytest\n")
    write_module(root, "tests/gpu/__init__.py", '"""GPU scripts."""\n')
    write_module(root, "tests/gpu/test_gpu_a.py")
    write_module(root, "tests/support/__init__.py", '"""Shared: ``worker``."""\n')
    write_module(root, "tests/support/worker.py", '"""Worker tables."""\n')
    write_module(
        root,
        "vllm_dcp_geometry/patches/__init__.py",
        "PATCH_MODULES: tuple[str, ...] = (\n"
        f'    "{PATCHES}worker.a",\n'
        f'    "{PATCHES}worker.b",\n'
        ")\n",
    )
    write_module(
        root,
        "vllm_dcp_geometry/contract/rules.py",
        "def cdiv(a: int, b: int) -> int:\n"
        '    """Ceiling division."""\n'
        "    return -(-a // b)\n",
    )


def test_the_layout_check_fails_on_a_broken_tree(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    assert layout_problems(tmp_path) == []
    write_module(tmp_path, "tests/worker_harness.py", '"""Helpers."""\n')
    write_module(tmp_path, "tests/data/cases.json")
    write_module(tmp_path, "tests/gpu/__init__.py", "def gpu_marks():\n    return []\n")
    write_module(tmp_path, "tests/gpu/shapes.py")
    write_module(tmp_path, "tests/support/test_worker.py", '"""A test."""\n')
    write_module(tmp_path, "tests/support/mla_harness.py", '"""MLA."""\n')
    write_module(tmp_path, "tests/support/specs.py", "X = 1\n")
    assert layout_problems(tmp_path) == [
        "tests/data/: only the packages gpu/ and support/ sit in tests/",
        "tests/worker_harness.py: not a test module; helpers live in tests/support/",
        "tests/gpu/shapes.py: tests/gpu/ holds only __init__.py and test_*.py; "
        "helpers live in tests/support/",
        "tests/gpu/__init__.py: defines gpu_marks; helpers live in tests/support/",
        "tests/support/mla_harness.py: named by its role (harness); name it after "
        "the subject it supports",
        "tests/support/mla_harness.py: not named in tests/support/__init__.py's "
        "docstring (the map of what the tests share)",
        "tests/support/specs.py: no docstring saying what it offers",
        "tests/support/specs.py: not named in tests/support/__init__.py's "
        "docstring (the map of what the tests share)",
        "tests/support/test_worker.py: a test module in support/; test modules "
        "live in tests/ or tests/gpu/",
    ]


def test_the_import_check_fails_on_a_broken_tree(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    assert import_problems(tmp_path) == []
    # Names built in pieces, so that this file names no test module itself,
    # not even in a string.
    t = "tests."
    b, c, gpu = t + "test_b", t + "test_c", t + "gpu.test_gpu_a"
    write_module(
        tmp_path,
        "tests/test_a.py",
        "import importlib\n"
        "import tests.support.worker\n"
        f"from {b} import shared\n"
        f"from {t[:-1]} import support, {b[len(t) :]}\n"
        f"from . import {c[len(t) :]}\n"
        "def f():\n"
        f"    import {gpu}\n"
        f"    importlib.import_module({b!r})\n"
        f'SNIPPET = """\nimport json\nfrom {b} import shared\n"""\n'
        f'PROBE = "from {t}gpu import ({gpu[len(t) + 4 :]},\\n  x)\\ndef probe(:"\n',
    )
    write_module(tmp_path, "tests/support/worker.py", f'"""Worker."""\nimport {b}\n')
    assert import_problems(tmp_path) == [
        f"tests/support/worker.py:4: imports test module {b}; move what they "
        "share to tests/support/",
        *(
            f"tests/test_a.py:{line}: {how} test module {name}; move what they "
            "share to tests/support/"
            for line, how, name in [
                (5, "imports", b),
                (6, "imports", b),
                (7, "imports", c),
                (9, "imports", gpu),
                (10, "runs code importing", b),
                (11, "runs code importing", b),
                (15, "runs code importing", gpu),
            ]
        ),
    ]


def test_the_marker_check_fails_on_a_broken_tree(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    write_module(
        tmp_path,
        "tests/test_a.py",
        'import pytest\npytestmark = [pytest.mark.slow, pytest.mark.patches("worker.a")]\n',
    )
    write_module(
        tmp_path,
        "tests/gpu/test_gpu_a.py",
        "import pytest\n"
        'pytestmark = pytest.mark.patches("worker.a", "worker.b")\n'
        "from vllm_dcp_geometry.patches.worker import b\n",
    )
    assert marker_problems(tmp_path) == []
    # A maintainer deletes patch worker.a: its tests are named.
    write_module(
        tmp_path,
        "vllm_dcp_geometry/patches/__init__.py",
        f'PATCH_MODULES = ("{PATCHES}worker.b", "{PATCHES}worker.c")\n',
    )
    write_module(
        tmp_path,
        "tests/test_b.py",
        "import pytest\n"
        "import vllm_dcp_geometry.patches.worker.c as c\n"
        "NAME = 'worker.b'\n"
        "pytestmark = pytest.mark.patches(NAME)\n",
    )
    assert marker_problems(tmp_path) == [
        "tests/gpu/test_gpu_a.py:4: pytest.mark.patches names worker.a, which is "
        "not in PATCH_MODULES: a removed patch takes its tests (or its marker) "
        "with it",
        "tests/test_a.py:4: pytest.mark.patches names worker.a, which is not in "
        "PATCH_MODULES: a removed patch takes its tests (or its marker) with it",
        "tests/test_b.py:6: pytest.mark.patches takes patch names as string literals",
        "tests/test_b.py: imports patch module worker.c but its "
        "pytest.mark.patches(...) does not name it",
        "patch module worker.c is named by no test module's pytest.mark.patches(...)",
    ]


def test_the_copy_check_fails_on_a_broken_tree(tmp_path: Path) -> None:
    _good_tree(tmp_path)
    write_module(
        tmp_path,
        "tests/support/sweeps.py",
        '"""K grids."""\n'
        "def divisors(n: int) -> list[int]:\n"
        "    return [k for k in range(1, n + 1) if n % k == 0]\n",
    )
    write_module(tmp_path, "tests/support/worker.py", '"""Worker."""\n')
    write_module(
        tmp_path,
        "vllm_dcp_geometry/tooling/cli/workers.py",
        "def emulate_dcp_group(block_table, dcp_world_size, dcp_rank):\n"
        "    for table in block_table.block_tables:\n"
        "        table.dcp_world_size = dcp_world_size\n",
    )
    # Same body over different module constants: two helpers, no copy.
    for name, heads in (("test_b", 8), ("test_c", 2)):
        write_module(
            tmp_path,
            f"tests/{name}.py",
            f'ATTN = {{"heads": {heads}}}\ndef full(b):\n    return dict(ATTN, b=b)\n',
        )
    assert copy_problems(tmp_path) == []
    write_module(
        tmp_path,
        "tests/test_a.py",
        "def divisors(m):\n    return [d for d in range(1, m + 1) if m % d == 0]\n",
    )
    write_module(
        tmp_path,
        "tests/support/worker.py",
        '"""Worker."""\n'
        "def cdiv(x, y):\n    return -(-x // y)\n"
        "def emulate_dcp_group(tables, world, rank):\n"
        '    """Unpatched vLLM\'s geometry."""\n'
        "    for table in tables.block_tables:\n"
        "        table.dcp_world_size = world\n",
    )
    assert copy_problems(tmp_path) == [
        "cdiv in tests/support/worker.py copies vllm_dcp_geometry/contract/rules.py: "
        "import it from there",
        "divisors is defined in tests/support/sweeps.py, tests/test_a.py: define "
        "it once in tests/support/ and import it",
        "emulate_dcp_group in tests/support/worker.py copies "
        "vllm_dcp_geometry/tooling/cli/workers.py: import it from there",
        "cdiv is defined 2 times (tests/support/worker.py, "
        "vllm_dcp_geometry/contract/rules.py), not once",
        "divisors is defined 2 times (tests/support/sweeps.py, tests/test_a.py), "
        "not once",
        "emulate_dcp_group is defined 2 times (tests/support/worker.py, "
        "vllm_dcp_geometry/tooling/cli/workers.py), not once",
    ]
