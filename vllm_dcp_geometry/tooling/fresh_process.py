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
from collections.abc import Mapping, Sequence
from typing import Any


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
) -> Any:
    """``python args...`` in a fresh interpreter; the JSON of its last line.

    ``env`` adds to (and overrides) this process's environment. Raises
    ``FreshProcessError`` when the exit status is not in ``ok_returncodes``
    or nothing was printed.
    """
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env=fresh_env(patched=patched, extra=env),
        cwd=cwd,
        timeout=timeout,
        check=False,
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
