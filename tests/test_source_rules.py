# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``tools/check_sources.py``: the repository passes it, and each rule fails on a
deliberately wrong file."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEADER = (
    "# SPDX-License-Identifier: Apache-2.0\n"
    "# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry "
    "project\n"
)


def _check_sources():
    spec = importlib.util.spec_from_file_location(
        "check_sources", REPO / "tools" / "check_sources.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tracked_python_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in out.stdout.splitlines() if (REPO / line).exists()]


@pytest.mark.parametrize("check", ["spdx", "imports", "sizes"])
def test_the_repository_passes(check: str) -> None:
    result = subprocess.run(
        [sys.executable, "tools/check_sources.py", check, *tracked_python_files()],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "source",
    [
        "from vllm_dcp_geometry.patches.worker.block_table import apply\n",
        "from vllm_dcp_geometry.patches.worker import block_table\n",
        "import vllm_dcp_geometry.patches.common.kv_cache_interface as k\n",
        "def f():\n    from ...patches.engine_core import kv_cache_utils\n",
        "import importlib\n"
        "importlib.import_module('vllm_dcp_geometry.patches.worker.utils')\n",
    ],
)
def test_a_patch_module_import_outside_the_registry_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    check = _check_sources()
    monkeypatch.chdir(tmp_path)
    where = Path("vllm_dcp_geometry/tooling/cli/offender.py")
    where.parent.mkdir(parents=True)
    where.write_text(HEADER + source)
    problems = check.import_problems(where)
    assert (
        problems and "imports patch module vllm_dcp_geometry.patches." in (problems[0])
    )
    # The registry itself may name them.
    registry = Path("vllm_dcp_geometry/plugin.py")
    registry.write_text(HEADER + source)
    assert not check.import_problems(registry)


def test_the_package_and_cpu_switch_rules_fail(tmp_path: Path, monkeypatch) -> None:
    check = _check_sources()
    monkeypatch.chdir(tmp_path)
    where = Path("vllm_dcp_geometry/offender.py")
    where.parent.mkdir(parents=True)
    where.write_text(
        HEADER + "import torch\nimport os\nos.environ['TRITON_INTERPRET'] = '1'\n"
    )
    problems = check.import_problems(where)
    assert any("module-level import of torch" in p for p in problems)
    assert any("TRITON_INTERPRET is a test-only switch" in p for p in problems)
    # Only the tooling's CPU stand-ins (the CPU workers' switches) may name them.
    exempt = check.CPU_WORKER_SWITCHES
    exempt.parent.mkdir(parents=True)
    exempt.write_text(HEADER + "INTERPRETER = 'TRITON_INTERPRET'\n")
    assert not check.import_problems(exempt)
    beside = Path("vllm_dcp_geometry/tooling/cli/ranks/cpu.py")
    beside.parent.mkdir(parents=True)
    beside.write_text(HEADER + "INTERPRETER = 'TRITON_INTERPRET'\n")
    assert any("test-only switch" in p for p in check.import_problems(beside))
    unlicensed = Path("vllm_dcp_geometry/unlicensed.py")
    unlicensed.write_text("x = 1\n")
    assert check.spdx_problems(unlicensed)


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        # What a server loads never imports the tooling.
        (
            "vllm_dcp_geometry/runtime/offender.py",
            "def f():\n    from vllm_dcp_geometry.tooling.cli import main\n",
            "runtime imports vllm_dcp_geometry.tooling.cli (tooling)",
        ),
        (
            "vllm_dcp_geometry/patches/worker/offender.py",
            "from vllm_dcp_geometry.tooling import vllm_objects\n",
            "patches imports vllm_dcp_geometry.tooling (tooling)",
        ),
        (
            "vllm_dcp_geometry/plugin.py",
            "def f():\n    import vllm_dcp_geometry.tooling.topology\n",
            "plugin imports vllm_dcp_geometry.tooling.topology (tooling)",
        ),
        # Patch modules import only the contract and the runtime.
        (
            "vllm_dcp_geometry/patches/worker/offender.py",
            "from vllm_dcp_geometry import plugin\n",
            "patches imports vllm_dcp_geometry.plugin (plugin)",
        ),
        # No import runs back up a floor.
        (
            "vllm_dcp_geometry/runtime/offender.py",
            "def f():\n    from vllm_dcp_geometry import plugin\n",
            "runtime imports vllm_dcp_geometry.plugin (plugin)",
        ),
        (
            "vllm_dcp_geometry/contract/offender.py",
            "from vllm_dcp_geometry.runtime.geometry import shard_count\n",
            "contract imports vllm_dcp_geometry.runtime.geometry (runtime)",
        ),
        (
            "vllm_dcp_geometry/contract/offender.py",
            "from .. import runtime\n",
            "contract imports vllm_dcp_geometry.runtime (runtime)",
        ),
        # The contract is pure: no vLLM even inside a function.
        (
            "vllm_dcp_geometry/contract/offender.py",
            "def f():\n    from vllm.v1.kv_cache_interface import MambaSpec\n",
            "the contract imports vllm.v1.kv_cache_interface",
        ),
    ],
)
def test_an_import_that_climbs_a_floor_fails(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
    source: str,
    expected: str,
) -> None:
    check = _check_sources()
    monkeypatch.chdir(tmp_path)
    for part in ("contract", "runtime", "patches/worker", "tooling/cli"):
        (tmp_path / "vllm_dcp_geometry" / part).mkdir(parents=True, exist_ok=True)
    (tmp_path / "vllm_dcp_geometry" / "plugin.py").write_text(HEADER)
    path = Path(where)
    path.write_text(HEADER + source)
    problems = check.import_problems(path)
    assert any(expected in p for p in problems), problems
    # The tooling, beside vLLM, may import every part.
    beside = Path("vllm_dcp_geometry/tooling/cli/fine.py")
    beside.write_text(
        HEADER + source.replace("from .. import", "import vllm_dcp_geometry.")
    )
    assert not [
        p
        for p in check.import_problems(beside)
        if "imports" in p and "module-level" not in p
    ]


def test_the_floors_hold_for_the_package_as_it_is() -> None:
    check = _check_sources()
    found = []
    for name in tracked_python_files():
        path = Path(name)
        if path.parts[0] == "vllm_dcp_geometry":
            tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
            found += check.floor_problems(path, tree)
    assert found == []
    # Every part of the package has a floor, or is the tooling beside vLLM.
    package = REPO / "vllm_dcp_geometry"
    parts = {p.stem for p in package.glob("*.py")}
    parts |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    assert parts - set(check.MAY_IMPORT) == {"tooling", "__main__"}


def test_a_long_module_or_function_fails(tmp_path: Path, monkeypatch) -> None:
    check = _check_sources()
    monkeypatch.chdir(tmp_path)
    limit = check.MAX_FUNCTION_LINES
    body = "".join(f"    x{i} = {i}\n" for i in range(limit - 1))
    long_function = HEADER + "@staticmethod\ndef long_one():\n" + body
    for root in check.SIZED:
        where = Path(root) / "offender.py"
        where.parent.mkdir(parents=True, exist_ok=True)
        # The decorator counts: limit + 1 lines from it to the last statement.
        where.write_text(long_function)
        assert check.main(["sizes", str(where)]) == 1
        assert any(
            "function long_one is 81 lines" in p for p in check.size_problems(where)
        )
        where.write_text(long_function.replace("@staticmethod\n", ""))
        assert check.main(["sizes", str(where)]) == 0
        where.write_text(HEADER + "x = 1\n" * (check.MAX_MODULE_LINES - 1))
        assert check.main(["sizes", str(where)]) == 1
        where.write_text(HEADER + "x = 1\n" * (check.MAX_MODULE_LINES - 2))
        assert check.main(["sizes", str(where)]) == 0
    # A module not split yet passes while it is over the limits, and fails
    # once it fits, until it is dropped from the list.
    listed = Path(check.NOT_YET_SPLIT[0])
    listed.parent.mkdir(parents=True, exist_ok=True)
    listed.write_text(long_function + "x = 1\n" * check.MAX_MODULE_LINES)
    assert check.main(["sizes", str(listed)]) == 0
    listed.write_text(HEADER + "x = 1\n")
    assert check.size_problems(listed) == [
        f"{listed}: within the limits now; drop it from NOT_YET_SPLIT"
    ]


def test_the_modules_not_split_yet_are_over_the_limits() -> None:
    """Every module of the list exists and is still over a limit (else the
    check above names it), and no other module under ``SIZED`` is."""
    check = _check_sources()
    for name in check.NOT_YET_SPLIT:
        assert check._over_the_limits(REPO / name), name
    over = [
        path.relative_to(REPO).as_posix()
        for root in check.SIZED
        for path in sorted((REPO / root).rglob("*.py"))
        if check._over_the_limits(path)
    ]
    assert over == sorted(check.NOT_YET_SPLIT)


def test_pre_commit_runs_the_size_check_on_the_sized_folders() -> None:
    config = (REPO / ".pre-commit-config.yaml").read_text(encoding="utf-8")
    hook = config.split("- id: sizes", 1)[1].split("- id:", 1)[0]
    assert "entry: python tools/check_sources.py sizes" in hook
    check = _check_sources()
    assert "files: ^(" + "|".join(check.SIZED) + ")/" in hook
