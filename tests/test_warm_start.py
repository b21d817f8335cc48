# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A warm-started child is the process ``python -c``/``-m`` would be, less
the libraries' imports: its own environment, working directory, argv,
``sys.path[0]``, ``__main__``, stdin, output files and exit status (signals
included), with its threads joined and exit handlers run; and no server
preloads vLLM or this package. The servers here preload only the standard
library, so that what is compared is the process, not the libraries; the
suite's fresh interpreters and ``ranks`` workers run on the real preload.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT
from vllm_dcp_geometry.tooling import warm_start
from vllm_dcp_geometry.tooling.fresh_process import fresh_env, run_fresh_python


@pytest.fixture(scope="module")
def server():
    started = warm_start.WarmServer(dict(os.environ), preload=("json", "decimal"))
    yield started
    started.close()


def _run(server, tmp_path: Path, *args: str, env=None, cwd=None):
    out, err = tmp_path / "out", tmp_path / "err"
    child = server.start(
        args, {**os.environ, **(env or {})}, str(cwd or tmp_path), str(out), str(err)
    )
    code = child.wait(60)
    return code, out.read_text(), err.read_text()


SELF_REPORT = """
import json, os, sys
print(json.dumps({
    "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "name": __name__, "main": sys.modules["__main__"].__dict__ is globals(),
    "env": os.environ.get("VLLM_WARM_PROBE"), "stdin": sys.stdin.read(),
    "decimal": "decimal" in sys.modules,
    "ours": sorted(m for m in sys.modules if m.split(".")[0] in
                   ("vllm", "vllm_dcp_geometry")),
}))
"""


def test_a_child_is_the_process_python_c_would_be(server, tmp_path: Path) -> None:
    code, out, _ = _run(
        server, tmp_path, "-c", SELF_REPORT, "a", env={"VLLM_WARM_PROBE": "x"}
    )
    report = json.loads(out)
    assert code == 0
    assert report["argv"] == ["-c", "a"] and report["path0"] == ""
    assert report["cwd"] == str(tmp_path) and report["name"] == "__main__"
    assert report["main"] and report["env"] == "x" and report["stdin"] == ""
    # Warm: the preloaded library is there; nothing of vLLM or the plugin.
    assert report["decimal"] and report["ours"] == []
    assert server.preloaded() == ["json", "decimal"]


def test_a_module_runs_as_python_m_would(server, tmp_path: Path) -> None:
    (tmp_path / "probe_main.py").write_text(
        "import json, sys\nprint(json.dumps([__name__, sys.argv[1:], sys.path[0]]))\n"
    )
    code, out, _ = _run(server, tmp_path, "-m", "probe_main", "b")
    assert code == 0
    assert json.loads(out) == ["__main__", ["b"], str(tmp_path)]


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import sys; sys.exit(3)", 3),
        ("import sys; sys.exit('refused')", 1),
        ("raise ValueError('boom')", 1),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
    ],
)
def test_exit_status_as_subprocess_reports_it(
    server, tmp_path: Path, source: str, expected: int
) -> None:
    code, _, err = _run(server, tmp_path, "-c", source)
    assert code == expected
    if "boom" in source:
        assert "ValueError: boom" in err
    if "refused" in source:
        assert err.strip() == "refused"


def test_threads_are_joined_and_exit_handlers_run(server, tmp_path: Path) -> None:
    source = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('exit handler'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
    )
    code, out, _ = _run(server, tmp_path, "-c", source)
    assert code == 0 and out.split() == ["thread", "exit", "handler"]


def test_a_child_is_stopped_as_popen_stops_one(server, tmp_path: Path) -> None:
    child = server.start(
        ["-c", "import time; time.sleep(60)"],
        dict(os.environ),
        str(tmp_path),
        str(tmp_path / "o"),
        str(tmp_path / "e"),
    )
    assert child.poll() is None
    with pytest.raises(warm_start.subprocess.TimeoutExpired):
        child.wait(0.2)
    child.terminate()
    assert child.wait(30) == -signal.SIGTERM and child.poll() == -signal.SIGTERM


def test_a_server_that_would_preload_the_code_under_test_refuses() -> None:
    server = warm_start.WarmServer(dict(os.environ), preload=("vllm_dcp_geometry",))
    try:
        with pytest.raises(warm_start.WarmStartError, match="preloading imported"):
            server.start(
                ["-c", "pass"], dict(os.environ), REPO_ROOT, os.devnull, os.devnull
            )
    finally:
        server.close()


def test_another_environment_gets_another_server_up_to_the_cap(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[dict[str, str]] = []

    class Recorded(warm_start.WarmServer):
        def __init__(self, env, preload=("json",)) -> None:
            made.append(dict(env))
            super().__init__(env, preload)

    monkeypatch.setattr(warm_start, "WarmServer", Recorded)
    monkeypatch.setattr(warm_start, "_servers", {})

    def start(env: dict[str, str]):
        return warm_start.start(
            ["-c", "pass"], env=env, cwd=str(tmp_path), out=os.devnull, err=os.devnull
        )

    base = {"PATH": os.environ["PATH"], "VLLM_PLUGINS": "", "CUDA_VISIBLE_DEVICES": ""}
    try:
        # A child that may see a GPU is never forked (and makes no server).
        assert start({**base, "CUDA_VISIBLE_DEVICES": "0"}) is None
        assert start({k: v for k, v in base.items() if "CUDA" not in k}) is None
        assert made == []
        for env in (
            base,
            {**base, "VLLM_PLUGINS": "x"},
            {**base, "PYTEST_CURRENT_TEST": "tests/test_a.py::test_b (call)"},
            {**base, "HF_HUB_OFFLINE": "1"},
        ):
            child = start(env)
            assert child is not None and child.wait(60) == 0
        # vLLM's variables and pytest's per-test name ride on the same
        # server (else each test of a suite would want its own); any other
        # variable needs its own.
        assert len(made) == 2 and made[1]["HF_HUB_OFFLINE"] == "1"
        assert start({**base, "OTHER": "1"}) is None
    finally:
        warm_start._close_servers()


def test_a_killed_server_is_replaced(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    made: list[warm_start.WarmServer] = []

    class Light(warm_start.WarmServer):
        def __init__(self, env, preload=("json",)) -> None:
            super().__init__(env, preload)
            made.append(self)

    monkeypatch.setattr(warm_start, "WarmServer", Light)
    monkeypatch.setattr(warm_start, "_servers", {})
    env = {"PATH": os.environ["PATH"], "CUDA_VISIBLE_DEVICES": ""}

    def run() -> int:
        child = warm_start.start(
            ["-c", "pass"], env=env, cwd=str(tmp_path), out=os.devnull, err=os.devnull
        )
        assert child is not None
        return child.wait(60)

    try:
        assert run() == 0
        made[0]._proc.kill()
        made[0]._proc.wait()
        assert made[0].preloaded() == ["json"]
        deadline = 100
        while not made[0].stopped and deadline:
            deadline -= 1
            threading.Event().wait(0.05)
        assert made[0].stopped
        assert run() == 0 and len(made) == 2 and not made[1].stopped
    finally:
        warm_start._close_servers()


def test_a_child_gets_what_the_preload_set_and_shares_its_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A library that sets a variable as it is imported (as flashinfer sets
    CuTe DSL's cache directory) sets it in the server: a child gets it where
    its own environment does not say (its own import would have set it); an
    environment that holds the same value (its parent imported the library
    since) rides on the same server, and another value needs its own."""
    (tmp_path / "sets_a_variable.py").write_text(
        "import os\nos.environ.setdefault('WARM_PROBE_SET', 'by-import')\n"
    )
    made: list[warm_start.WarmServer] = []

    class Setting(warm_start.WarmServer):
        def __init__(self, env, preload=("sets_a_variable",)) -> None:
            super().__init__(env, preload)
            made.append(self)

    monkeypatch.setattr(warm_start, "WarmServer", Setting)
    monkeypatch.setattr(warm_start, "_servers", {})
    base = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(tmp_path),
        "CUDA_VISIBLE_DEVICES": "",
    }

    def seen(env: dict[str, str]) -> str:
        out = tmp_path / "out"
        out.unlink(missing_ok=True)
        code = "import os; print(os.environ['WARM_PROBE_SET'])"
        child = warm_start.start(
            ["-c", code], env=env, cwd=str(tmp_path), out=str(out), err=os.devnull
        )
        assert child is not None and child.wait(60) == 0
        return out.read_text().strip()

    try:
        assert seen(base) == "by-import"
        assert made[0].set_by_preload() == {"WARM_PROBE_SET": "by-import"}
        assert seen({**base, "WARM_PROBE_SET": "by-import"}) == "by-import"
        assert len(made) == 1
        assert seen({**base, "WARM_PROBE_SET": "own"}) == "own"
        assert len(made) == 2
    finally:
        warm_start._close_servers()


def test_run_fresh_python_warm_reads_back_json_and_failures(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Servers of its own: the worker's may be at the cap with other tests'.
    monkeypatch.setattr(warm_start, "_servers", {})
    try:
        _run_fresh_python_warm(tmp_path)
    finally:
        warm_start._close_servers()


def _run_fresh_python_warm(tmp_path: Path) -> None:
    assert run_fresh_python(
        ["-c", "import json, sys; print(json.dumps(sys.argv))"],
        patched=False,
        warm=True,
        cwd=str(tmp_path),
    ) == ["-c"]
    with pytest.raises(Exception) as failed:
        run_fresh_python(["-c", "import sys; sys.exit(4)"], patched=False, warm=True)
    assert getattr(failed.value, "returncode", None) == 4
    # The suite's own server: every library of the preload is installed here.
    server = warm_start.server_for(fresh_env(patched=False))
    assert server is not None
    assert server.preloaded() == list(warm_start.PRELOAD)
