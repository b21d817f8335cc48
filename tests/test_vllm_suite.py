# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``tools/vllm_suite.py``: vLLM's own tests pass patched wherever they pass
unpatched.

The comparison is checked on made-up outcomes first (a test that passes
unpatched and fails patched must fail the run); then the KV-cache core list
of the installed vLLM release's own tests (``FILE_LISTS``: 0.33.0 or 0.34.0)
runs through the script, unpatched and patched, each file in a fresh process
(about 10 minutes on 2 cores). That one skips only when vLLM's sdist cannot
be fetched.
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


def test_a_test_that_only_fails_patched_fails_the_run() -> None:
    s = _vllm_suite()
    unpatched = {
        "t::ok": "passed",
        "t::broken": "passed",
        "t::gone": "passed",
        "t::hub": "failed",
        "t::gpu": "skipped",
        "t::fixed": "failed",
    }
    patched = {
        "t::ok": "passed",
        "t::broken": "failed",
        "t::hub": "failed",
        "t::gpu": "skipped",
        "t::fixed": "passed",
    }
    result = s.compare(
        unpatched,
        patched,
        {"t::hub": "Invalid repository ID", "t::gpu": "needs CUDA"},
        {"t::broken": "AttributeError: parallel_config"},
    )
    assert not result.ok
    assert result.regressions == {
        "t::broken": ("failed", "AttributeError: parallel_config"),
        "t::gone": ("missing", ""),
    }
    assert result.passed_both == 1
    assert result.fixed == ["t::fixed"]
    assert result.not_passing_both == {
        "t::gpu": ("skipped", "needs CUDA"),
        "t::hub": ("failed", "Invalid repository ID"),
    }
    assert s.compare(unpatched, unpatched).ok


def _run(s: ModuleType, mode: str, outcomes: dict[str, str], note: str = "") -> Any:
    return s.FileRun("tests/x.py", mode, 0 if outcomes else 1, 1.0, outcomes, note=note)


def test_a_crashed_patched_file_fails_every_test_it_held(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    s = _vllm_suite()
    runs = [
        _run(s, s.UNPATCHED, {"x::a": "passed", "x::b": "skipped"}),
        _run(s, s.PATCHED, {}, note="no test outcomes (pytest exit 3)"),
    ]
    result = s.compare_runs(runs)
    assert set(result.regressions) == {"x::a"}
    assert "tests/x.py::<file>" in result.not_passing_both  # crashed vs missing
    # The script's exit status, with these runs.
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "x.py").write_text("")
    monkeypatch.setattr(s, "run_suite", lambda *a, **kw: runs)
    out = tmp_path / "out.json"
    assert s.main(["--src", str(tmp_path), "--json", str(out), "tests/x.py"]) == 1
    printed = capsys.readouterr().out
    assert "FAIL: 1 pass unpatched, not patched" in printed
    assert "tests/x.py::<file>" not in json.loads(out.read_text())["regressions"]
    runs[1] = _run(s, s.PATCHED, {"x::a": "passed", "x::b": "skipped"})
    assert s.main(["--src", str(tmp_path), "tests/x.py"]) == 0


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
    tree = s._extract_archive(archive, tmp_path / "unpacked")
    assert s._is_release_tree(tree, "9.9.9")
    assert not s._is_release_tree(tree, "9.9.8")
    cache = tmp_path / "cache"
    cache.mkdir()
    s._copy_kept(tree, cache / "vllm-9.9.9-src")
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
    assert s.pip_command() == ["/bin/pip3"]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(s.SourceUnavailable, match="no pip"):
        s.pip_command()


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
    assert result["passed_both"] > 500
