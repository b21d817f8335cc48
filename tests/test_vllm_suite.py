# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``tools/vllm_suite.py``: vLLM's own tests pass patched wherever they pass
unpatched.

The comparison is checked on made-up outcomes first (a test that passes
unpatched and fails patched must fail the run; a test that passes patched
needs no unpatched run), and the node ids it reruns unpatched on a small
made-up test file; then the KV-cache core list of the installed vLLM
release's own tests (``FILE_LISTS``: 0.33.0 or 0.34.0) runs through the
script: every file patched, then unpatched only the tests that did not pass
patched, each run in a fresh process (8 to 11 minutes on 2 busy cores). That one
skips only when vLLM's sdist cannot be fetched.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytestmark = pytest.mark.long_running

REPO = Path(__file__).resolve().parent.parent


def _vllm_suite() -> ModuleType:
    name = "vllm_suite"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, REPO / "tools" / "vllm_suite.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _run(
    s: ModuleType,
    mode: str,
    outcomes: dict[str, str],
    note: str = "",
    tests: tuple[str, ...] = (),
) -> Any:
    run = s.FileRun("tests/x.py", mode, 0 if outcomes else 1, 1.0, outcomes, note=note)
    run.tests = list(tests)
    return run


def test_a_test_that_only_fails_patched_fails_the_run() -> None:
    s = _vllm_suite()
    patched = {
        "t::ok": "passed",
        "t::broken": "failed",
        "t::hub": "failed",
        "t::gpu": "skipped",
        "t::fixed": "passed",
    }
    # Unpatched ran only what did not pass patched.
    unpatched = {"t::broken": "passed", "t::hub": "failed", "t::gpu": "skipped"}
    result = s.compare(
        unpatched,
        patched,
        {"t::hub": "Invalid repository ID", "t::gpu": "needs CUDA"},
        {"t::broken": "AttributeError: parallel_config"},
        asked=unpatched,
    )
    assert not result.ok
    assert result.regressions == {
        "t::broken": ("failed", "AttributeError: parallel_config")
    }
    assert result.passed_patched == 2
    assert result.not_passing_both == {
        "t::gpu": ("skipped", "needs CUDA"),
        "t::hub": ("failed", "Invalid repository ID"),
    }
    assert not hasattr(result, "fixed")  # not measured: no unpatched run
    # A test passing unpatched that the patched run lacks is one too.
    assert s.compare({"t::gone": "passed"}, {}).regressions == {
        "t::gone": ("missing", "")
    }
    assert s.compare(unpatched, {**patched, "t::broken": "passed"}).ok


def test_a_test_passing_patched_needs_no_unpatched_outcome() -> None:
    s = _vllm_suite()
    result = s.compare({}, {"t::a": "passed", "t::b": "passed"})
    assert result.ok and result.passed_patched == 2
    assert result.regressions == result.not_passing_both == {}
    assert s.to_rerun(_run(s, s.PATCHED, {"x::a": "passed"})) is None
    # What does not pass patched must come back unpatched, or the run fails.
    result = s.compare({}, {"t::a": "passed", "t::b": "failed"}, asked=["t::b"])
    assert not result.ok
    assert result.not_compared == {"t::b": ("failed", "no unpatched outcome")}


def test_a_test_failing_in_both_is_no_regression() -> None:
    s = _vllm_suite()
    patched = {"t::a": "failed", "t::b": "error", "t::c": "skipped"}
    assert s.compare(patched, patched, asked=patched).ok
    assert s.compare({**patched, "t::b": "failed"}, patched, asked=patched).ok
    result = s.compare({**patched, "t::b": "passed"}, patched, asked=patched)
    assert not result.ok and set(result.regressions) == {"t::b"}


def test_what_runs_unpatched() -> None:
    s = _vllm_suite()
    run = _run(
        s,
        s.PATCHED,
        {"tests.x::a": "passed", "tests.x::b[1]": "failed", "tests.x::c": "skipped"},
    )
    assert s.to_rerun(run) == ["tests.x::b[1]", "tests.x::c"]
    run.returncode = 2  # interrupted: the whole file
    assert s.to_rerun(run) == []
    run.returncode, run.note = 1, "timed out after 1200 s"
    assert s.to_rerun(run) == []
    # A collection error's entry names no test: the whole file.
    run = _run(s, s.PATCHED, {"tests.x::a": "failed", "::tests.x": "error"})
    assert s.to_rerun(run) == []


def test_a_crashed_patched_file_fails_every_test_it_held(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    s = _vllm_suite()
    crashed = _run(s, s.PATCHED, {}, note="no test outcomes (pytest exit 3)")
    assert s.to_rerun(crashed) == []  # the whole file, unpatched
    runs = [crashed, _run(s, s.UNPATCHED, {"x::a": "passed", "x::b": "skipped"})]
    result = s.compare_runs(runs)
    assert set(result.regressions) == {"x::a"}
    assert result.crashed == {"tests/x.py": "no test outcomes (pytest exit 3)"}
    # The script's exit status and report, with these runs.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "x.py").write_text("")
    monkeypatch.setattr(s, "run_suite", lambda *a, **kw: runs)
    out = tmp_path / "out.json"
    assert s.main(["--src", str(tmp_path), "--json", str(out), "tests/x.py"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL: 1 pass unpatched, not patched" in printed
    assert "whole file rerun unpatched: tests/x.py" in printed
    assert set(json.loads(out.read_text())["regressions"]) == {"x::a"}
    runs[:] = [_run(s, s.PATCHED, {"x::a": "passed", "x::b": "skipped"})]
    runs.append(_run(s, s.UNPATCHED, {"x::b": "skipped"}, tests=("x::b",)))
    assert s.main(["--src", str(tmp_path), "--json", str(out), "tests/x.py"]) == 0
    printed = capsys.readouterr().out
    assert "passed patched: 1 (no unpatched run needed" in printed
    assert "not passing patched: 1; rerun unpatched: 1 tests by id in 1 files" in (
        printed
    )
    assert "OK: every test that passes unpatched passes patched" in printed
    written = json.loads(out.read_text())
    assert written["passed_patched"] == 1 and "fixed" not in written
    # The unpatched rerun gave no outcome for what it was asked: not compared.
    runs[1] = _run(s, s.UNPATCHED, {}, note="no test outcomes (pytest exit 4)")
    runs[1].tests = ["x::b"]
    assert s.main(["--src", str(tmp_path), "tests/x.py"]) == 1
    assert "FAIL: 1 not compared unpatched" in capsys.readouterr().out


_MADE_UP_TESTS = """
import pytest


@pytest.mark.parametrize("p", ["a b", "x/y.z", "m::n", "[q]"], ids=str)
def test_param(p):
    assert p == "a b"


class TestC:
    @pytest.mark.parametrize("n", [1, 2])
    def test_m(self, n):
        assert n == 1

    class TestInner:
        def test_deep(self):
            pytest.skip("inner")


def test_ok():
    pass


def test_\u00fcn\u00ef():
    assert False
"""


def test_the_rerun_runs_exactly_the_tests_that_did_not_pass(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The junit ids map back to node ids pytest runs: parameters with
    spaces, dots, slashes, ``::`` and brackets, classes, nested classes, a
    name that is not ASCII (on the command line, not in the ``@`` file)."""
    s = _vllm_suite()
    src, out = tmp_path / "src", tmp_path / "out"
    (src / "tests" / "v1").mkdir(parents=True)
    out.mkdir()
    (src / "pyproject.toml").write_text("[tool.pytest.ini_options]\n")
    (src / "tests" / "v1" / "test_x.py").write_text(_MADE_UP_TESTS, encoding="utf-8")
    real_env = s._source.run_env  # without the mode: no vLLM in these runs
    monkeypatch.setattr(
        s._source,
        "run_env",
        lambda mode, record: {
            k: v for k, v in real_env(mode, record).items() if k != s.MODE_ENV
        },
    )
    file = "tests/v1/test_x.py"
    patched = s.run_file(src, file, s.PATCHED, out, 300)
    assert patched.returncode == 1 and not patched.crashed, patched
    assert len(patched.outcomes) == 9
    tests = s.to_rerun(patched)
    assert sorted(tests) == sorted(
        t for t, outcome in patched.outcomes.items() if outcome != "passed"
    )
    assert len(tests) == 6 and "tests.v1.test_x.TestC.TestInner::test_deep" in tests
    rerun = s.run_file(src, file, s.UNPATCHED, out, 300, tests)
    assert rerun.outcomes == {t: patched.outcomes[t] for t in tests}
    assert s.compare_runs([patched, rerun]).ok
    ascii_only = [t for t in tests if t.isascii()]
    rerun = s.run_file(src, file, s.UNPATCHED, out, 300, ascii_only)
    assert set(rerun.outcomes) == set(ascii_only)
    assert (out / "unpatched-tests_v1_test_x.args").read_text().splitlines() == [
        s.node_id(file, t) for t in ascii_only
    ]
    # An id that names no test: pytest runs nothing, and the run fails.
    wrong = "tests.v1.test_x::test_param[nope]"
    rerun = s.run_file(src, file, s.UNPATCHED, out, 300, [wrong])
    assert not rerun.outcomes
    patched.outcomes[wrong] = "failed"
    assert s.compare_runs([patched, rerun]).not_compared.keys() == {wrong}


def test_junit_outcomes(tmp_path: Path) -> None:
    s = _vllm_suite()
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok" />'
        '<testcase classname="tests.a" name="test_fail[1]">'
        '<failure message="AssertionError: boom&#10;more">tb</failure></testcase>'
        '<testcase classname="tests.a" name="test_skip">'
        '<skipped message="needs a GPU" /></testcase>'
        '<testcase classname="tests.a" name="test_teardown">'
        '<failure message="f" /></testcase>'
        '<testcase classname="tests.a" name="test_teardown">'
        '<error message="teardown" /></testcase>'
        '<testcase classname="" name="tests.b"><error message="collection" />'
        "</testcase></testsuite></testsuites>"
    )
    outcomes, reasons = s.parse_junit(xml)
    assert outcomes == {
        "tests.a::test_ok": "passed",
        "tests.a::test_fail[1]": "failed",
        "tests.a::test_skip": "skipped",
        "tests.a::test_teardown": "failed",
        "::tests.b": "error",
    }
    assert reasons["tests.a::test_fail[1]"] == "AssertionError: boom"
    assert reasons["tests.a::test_skip"] == "needs a GPU"
    assert (
        s.node_id("tests/a.py", "tests.a::test_fail[1]") == "tests/a.py::test_fail[1]"
    )
    assert (
        s.node_id("tests/a.py", "tests.a.TestC.TestD::test_x[1.5 a::b]")
        == "tests/a.py::TestC::TestD::test_x[1.5 a::b]"
    )
    assert s.node_id("tests/a.py", "::tests.b") is None  # a collection error
    assert s.node_id("tests/a.py", "tests.ab::test_x") is None  # another file


def test_only_the_tests_are_kept(tmp_path: Path) -> None:
    """vLLM's source package must never shadow the installed ``vllm``."""
    import tarfile

    s = _vllm_suite()
    root = tmp_path / "vllm-9.9.9"
    for name, text in {
        "PKG-INFO": "Metadata-Version: 2.4\nName: vllm\nVersion: 9.9.9\n",
        "pyproject.toml": "[tool.pytest.ini_options]\n",
        "tests/v1/test_x.py": "",
        "vllm/__init__.py": "",
        "setup.py": "",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    archive = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname=root.name)
    tree = s._source._extract_archive(archive, tmp_path / "unpacked")
    assert s._source._is_release_tree(tree, "9.9.9")
    assert not s._source._is_release_tree(tree, "9.9.8")
    cache = tmp_path / "cache"
    cache.mkdir()
    s._source._copy_kept(tree, cache / "vllm-9.9.9-src")
    kept = sorted(p.name for p in (cache / "vllm-9.9.9-src").iterdir())
    assert kept == ["PKG-INFO", "pyproject.toml", "tests"]
    assert s.fetch_source("9.9.9", cache) == cache / "vllm-9.9.9-src"  # cached


def test_the_lists() -> None:
    from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES

    s = _vllm_suite()
    assert tuple(s.FILE_LISTS) == SUPPORTED_VLLM_RELEASES
    for release, lists in s.FILE_LISTS.items():
        assert set(lists.core) <= set(lists.all), release
        assert len(set(lists.all)) == len(lists.all), release
        assert all(f.startswith("tests/v1/") and f.endswith(".py") for f in lists.all)
        # An absent file is one another release runs, named with its reason.
        others = {f for r, o in s.FILE_LISTS.items() if r != release for f in o.all}
        assert lists.absent.keys() <= others - set(lists.all), release
        assert all(lists.absent.values()), release
    # 0.33.0's lists are the ones it always ran; 0.34.0 lost Model Runner V1.
    old = s.FILE_LISTS["0.33.0"]
    assert (len(old.core), len(old.all)) == (10, 37)
    new = s.FILE_LISTS["0.34.0"]
    assert set(new.absent) == {"tests/v1/worker/test_gpu_input_batch.py"}
    assert set(old.core) - set(new.core) == set(new.absent)


def test_an_unknown_release_or_a_stale_list_is_bad_input(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    s = _vllm_suite()
    monkeypatch.setattr(s, "installed_vllm_version", lambda: "9.9.9")
    assert s.main(["--list"]) == 2
    assert "no file list for vLLM 9.9.9" in capsys.readouterr().err
    monkeypatch.setattr(s, "FILE_LISTS", {"9.9.9": s.FileList(("tests/v1/a.py",), ())})
    (tmp_path / "tests" / "v1").mkdir(parents=True)
    assert s.main(["--src", str(tmp_path)]) == 2  # the list names a lacking file
    assert "tests/v1/a.py" in capsys.readouterr().err
    (tmp_path / "tests" / "v1" / "a.py").write_text("")
    (tmp_path / "tests" / "v1" / "b.py").write_text("")
    lists = s.FileList(("tests/v1/a.py",), (), {"tests/v1/b.py": "gone in 9.9.9"})
    monkeypatch.setattr(s, "FILE_LISTS", {"9.9.9": lists})
    assert s.main(["--src", str(tmp_path)]) == 2  # says b.py is absent; it is not
    assert "tests/v1/b.py is in" in capsys.readouterr().err
    (tmp_path / "tests" / "v1" / "b.py").unlink()
    monkeypatch.setattr(s, "run_suite", lambda *a, **kw: [])
    assert s.main(["--src", str(tmp_path)]) == 0
    assert "tests/v1/b.py" in capsys.readouterr().out  # named, not run
    assert s.main(["--list"]) == 0
    captured = capsys.readouterr()
    assert captured.out.split() == ["tests/v1/a.py"]
    assert "tests/v1/b.py (gone in 9.9.9)" in captured.err


def test_pip_is_found_where_the_environment_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A virtual environment made with uv has no pip; any pip on PATH will do."""
    s = _vllm_suite()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(shutil, "which", lambda name: f"/bin/{name}")
    assert s._source.pip_command() == ["/bin/pip3"]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(s.SourceUnavailable, match="no pip"):
        s._source.pip_command()


@pytest.mark.slow
def test_vllm_core_suite_passes_patched_where_it_passes_unpatched(
    tmp_path: Path,
) -> None:
    s = _vllm_suite()
    release = s.installed_vllm_version()
    lists = s.FILE_LISTS[release]
    try:
        src = s.fetch_source(release)
    except s.SourceUnavailable as exc:
        pytest.skip(f"vLLM's sdist cannot be fetched: {exc}")
    # Every file of the release's list is in its sdist, every absent one not.
    assert s.check_files(src, lists.all, lists.absent) == []
    out = tmp_path / "suite.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "vllm_suite.py"),
            "--src",
            str(src),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    assert {r["file"] for r in runs} == set(lists.core)
    assert result["absent"] == dict(lists.absent)
    # The patched runs really ran patched, the unpatched ones did not.
    assert all(r["patches"] for r in runs if r["mode"] == s.PATCHED)
    assert not any(r["patches"] for r in runs if r["mode"] == s.UNPATCHED)
    assert result["passed_patched"] > 500 and "fixed" not in result
    # Unpatched ran exactly what did not pass patched, by id where it could.
    patched = {r["file"]: r for r in runs if r["mode"] == s.PATCHED}
    for rerun in (r for r in runs if r["mode"] == s.UNPATCHED):
        failing = [
            t for t, o in patched[rerun["file"]]["outcomes"].items() if o != "passed"
        ]
        assert rerun["tests"] in (failing, [])
        assert set(failing) <= set(rerun["outcomes"])
    assert all(
        r["file"] in {u["file"] for u in runs if u["mode"] == s.UNPATCHED}
        for r in patched.values()
        if set(r["outcomes"].values()) != {"passed"}
    )
