# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Run Python in a fresh interpreter, patched or unpatched, and read back JSON.

The plugin's patches are process-wide, so "unpatched vLLM" is only ever a
fresh process that never calls ``register()``: an unpatched child gets
``VLLM_PLUGINS=""`` (vLLM's own plugin filter), so nothing in it loads the
plugin through its entry point either. The child prints one JSON document as
its last line of standard output (``run_fresh_python``), or prints where this
process prints and hands back its exit status (``run_fresh_python_in_view``).

One runner for everything that needs a second process: the unpatched
baselines of ``replay`` and ``simulate``, ``simulate``'s CPU process (vLLM's
Triton kernels under the interpreter), the benchmarks' measurement processes
and the test suite (which prepends its own set-up code).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

WARM_START_ENV = "VLLM_DCP_GEOMETRY_WARM_START"
"""``1``: every child ``run_fresh_python`` starts forks warm where it can."""


class FreshProcessError(RuntimeError):
    """The child failed, or printed no JSON; ``stderr`` holds its tail."""

    def __init__(self, message: str, returncode: int, stderr: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.stderr = stderr


def fresh_env(
    *, patched: bool, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment for a child; an unpatched child may not
    load the plugin."""
    env = dict(os.environ)
    if not patched:
        env["VLLM_PLUGINS"] = ""
    env.update(extra or {})
    return env


def run_fresh_python(
    args: Sequence[str],
    *,
    patched: bool,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    ok_returncodes: Sequence[int] = (0,),
    stderr_tail: int = 4000,
    warm: bool | None = None,
) -> Any:
    """``python args...`` in a fresh interpreter; the JSON of its last line.

    ``warm`` forks a child that sees no GPU from a warm-start server
    (``warm_start``), past the heavy libraries' imports; by default where
    ``WARM_START_ENV`` is ``1`` (a process that starts many, as the test
    suite does).

    ``env`` adds to (and overrides) this process's environment. Raises
    ``FreshProcessError`` when the exit status is not in ``ok_returncodes``
    or nothing was printed.
    """
    result = run_process(
        args,
        env=fresh_env(patched=patched, extra=env),
        cwd=cwd,
        timeout=timeout,
        warm=warm,
    )
    tail = result.stderr[-stderr_tail:]
    if result.returncode not in ok_returncodes:
        raise FreshProcessError(
            f"{' '.join(args[:3])} ... exited with {result.returncode}:\n{tail}",
            result.returncode,
            tail,
        )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if not lines:
        raise FreshProcessError(
            f"{' '.join(args[:3])} ... printed nothing:\n{tail}",
            result.returncode,
            tail,
        )
    return json.loads(lines[-1])


def run_process(
    args: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | None = None,
    timeout: float | None = None,
    warm: bool | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python args...`` with ``env`` as its whole environment, as
    ``subprocess.run(..., capture_output=True, text=True)`` reports it;
    ``warm`` as ``run_fresh_python`` takes it."""
    if warm is None:
        warm = os.environ.get(WARM_START_ENV) == "1"
    if warm:
        result = _run_warm(args, dict(env), cwd or os.getcwd(), timeout)
        if result is not None:
            return result
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=dict(env),
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def _run_warm(
    args: Sequence[str], env: dict[str, str], cwd: str, timeout: float | None
) -> subprocess.CompletedProcess[str] | None:
    """``args`` forked warm, as ``subprocess.run`` would report it; None
    where no server takes it (run it cold)."""
    from vllm_dcp_geometry.tooling import warm_start

    with tempfile.TemporaryDirectory(prefix="vllm-dcp-geometry-warm-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = warm_start.start(args, env=env, cwd=cwd, out=out, err=err)
        if child is None:
            return None
        try:
            returncode = child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise
        return subprocess.CompletedProcess(
            [sys.executable, *args],
            returncode,
            Path(out).read_text(errors="replace") if os.path.exists(out) else "",
            Path(err).read_text(errors="replace") if os.path.exists(err) else "",
        )


def run_fresh_python_in_view(
    args: Sequence[str],
    *,
    patched: bool,
    env: Mapping[str, str] | None = None,
) -> int:
    """``python args...`` in a fresh interpreter that prints to this process's
    standard output and error (its progress bar and report are the caller's);
    its exit status."""
    return subprocess.run(
        [sys.executable, *args],
        env=fresh_env(patched=patched, extra=env),
        check=False,
    ).returncode
