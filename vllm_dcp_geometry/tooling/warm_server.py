# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The warm-start server that ``warm_start`` runs as a script (so it imports
nothing of this package): ``python warm_server.py LIBRARY...``.

It imports the libraries it is given, refuses to serve if that brought in
vLLM or this package, answers ``{"ready": ..., "set_by_preload": ...}`` (the
libraries and the environment variables their import set), then forks one child per
request line (JSON: argv, env, cwd, stdout, stderr) and answers the child's
pid, and later its exit status as ``subprocess`` writes it (negative for a
signal). A child starts as ``python -c CODE`` or ``python -m MODULE`` would
once those libraries are imported: its own environment, working directory,
``sys.argv``, ``sys.path[0]`` and ``__main__``, its output in its own files,
and at its end the non-daemon threads joined and the exit handlers run. Only
stdlib here; replies go out on a descriptor of their own, so nothing a
library prints can be taken for one.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import sys
import threading
import traceback
import types
from typing import Any

NOT_PRELOADED = ("vllm", "vllm_dcp_geometry")
"""What a child must import itself: it is the code under test or use."""


def preload(names: list[str]) -> list[str]:
    """Import ``names`` (those installed); the ones imported."""
    done = []
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # Not installed here (the library or the part named); anything
            # else a library could not import is an error.
            if exc.name and (name + ".").startswith(exc.name + "."):
                continue
            raise
        done.append(name)
    early = sorted(m for m in sys.modules if m.split(".")[0] in NOT_PRELOADED)
    if early:
        raise SystemExit(f"warm-start server: preloading imported {early[:3]}")
    return done


def _redirect(path: str, fd: int) -> None:
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(target, fd)
    os.close(target)


def _redirect_in(path: str) -> None:
    source = os.open(path, os.O_RDONLY)
    if source != 0:
        os.dup2(source, 0)
        os.close(source)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _run(argv: list[str]) -> None:
    """``python ARGV`` from here on: ``-c CODE`` or ``-m MODULE``."""
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        raise SystemExit(f"warm-start server: runs -c or -m, not {argv[0]!r}")


def child(
    request: dict[str, Any], closing: list[int], set_by_preload: dict[str, str]
) -> None:
    """The forked child: becomes the requested process, then exits. Its
    environment is the request's, with what the preloaded libraries set as
    they were imported where the request does not say (the child's own
    import of them would have set it)."""
    code = 0
    try:
        for fd in closing:
            os.close(fd)
        _redirect_in(os.devnull)
        os.environ.clear()
        os.environ.update({**set_by_preload, **request["env"]})
        os.chdir(request["cwd"])
        _redirect(request["stdout"], 1)
        _redirect(request["stderr"], 2)
        _run(request["argv"])
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(requests: int, replies: int, set_by_preload: dict[str, str]) -> None:
    """Fork a child per request line until the client closes its end."""
    children: set[int] = set()
    pending = b""

    def reply(message: dict[str, Any]) -> None:
        os.write(replies, (json.dumps(message) + "\n").encode())

    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    child(request, [requests, replies], set_by_preload)
                children.add(pid)
                reply({"id": request["id"], "pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                reply({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def main() -> None:
    replies = os.dup(1)
    os.dup2(2, 1)
    requests = sys.stdin.fileno()
    before = dict(os.environ)
    loaded = preload(sys.argv[1:])
    set_by_preload = {
        name: value for name, value in os.environ.items() if before.get(name) != value
    }
    ready = {"ready": loaded, "set_by_preload": set_by_preload}
    os.write(replies, (json.dumps(ready) + "\n").encode())
    serve(requests, replies, set_by_preload)


if __name__ == "__main__":
    main()
