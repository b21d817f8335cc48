# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Fresh CPU processes that start warm: forked from a server that has
already imported the libraries vLLM's import spends its time in (torch,
transformers, flashinfer, ...), never vLLM or this package.

A child of vLLM on CPU spends most of its start importing those libraries
(on 2 cores, most of a minute for a ``ranks`` worker), and the same
libraries again in every worker and every fresh test interpreter. Forked
from ``warm_server``, a child begins where ``python -c`` or ``python -m``
would after those imports, and imports vLLM, the plugin and the code it runs
itself, in its own order: a fresh process for everything this project tests
or measures. ``start`` hands back a ``WarmProcess``, which answers as
``subprocess.Popen`` does (``poll``, ``wait``, ``terminate``, ``kill``,
``returncode``).

Only for processes that see no GPU (``CUDA_VISIBLE_DEVICES`` empty): a fork
after a library touched CUDA is undefined, so anything else starts cold. A
library reads some of the environment as it is imported, so a server serves
only children whose environment equals its own apart from vLLM's variables
(``VLLM_*``, read when vLLM reads them) and pytest's per-test name, or by
what the server's preload itself set as it was imported (a parent that
imported vLLM since holds those too: CuTe DSL's cache directory, say); another
environment gets its own server, and past ``MAX_SERVERS`` a cold process
(``start`` answers None).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

SERVER = Path(__file__).with_name("warm_server.py")
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._inductor.compile_fx",
    "sympy",
    "networkx",
    "numpy",
    "ml_dtypes",
    "numba",
    "triton",
    "transformers",
    "transformers.configuration_utils",
    "transformers.modeling_utils",
    "transformers.tokenization_utils_base",
    "transformers.image_processing_utils",
    "transformers.processing_utils",
    "flashinfer",
    "cutlass",
    "compressed_tensors",
    "aiohttp",
    "torchaudio",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)
"""Imported by every server where installed: what vLLM's import and the
plugin's patched modules spend most of their import time in (measured with
``python -X importtime``), and none of it reads the variables a child may
set apart from its server."""
PER_CHILD_PREFIXES = ("VLLM_", "PYTEST_CURRENT_TEST")
"""Variables a child may set apart from its server: none of the preloaded
libraries reads them (pytest sets ``PYTEST_CURRENT_TEST`` to each test's
name, so a server keyed on it would serve one test)."""
MAX_SERVERS = 2
"""Servers one process keeps (each holds those libraries in memory)."""
START_TIMEOUT_S = 600


class WarmStartError(RuntimeError):
    """The server could not start, or stopped; its error output's tail."""


class WarmProcess:
    """A forked child, answering as ``subprocess.Popen`` does."""

    def __init__(self, server: WarmServer, pid: int) -> None:
        self._server = server
        self.pid = pid

    @property
    def returncode(self) -> int | None:
        return self._server.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            self._server.signal(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WarmServer:
    """One ``warm_server`` process and the children it forked for us."""

    def __init__(
        self, env: Mapping[str, str], preload: Sequence[str] = PRELOAD
    ) -> None:
        self._errors: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, str(SERVER), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env=dict(env),
            text=True,
        )
        self._lock = threading.Condition()
        self._ready: list[str] | None = None
        self._set_by_preload: dict[str, str] = {}
        self._pids: dict[int, int] = {}
        self._returncodes: dict[int, int] = {}
        self._closed = False
        self._next_id = 0
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _read_replies(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._lock:
                if "ready" in message:
                    self._ready = message["ready"]
                    self._set_by_preload = message["set_by_preload"]
                elif "returncode" in message:
                    self._returncodes[message["pid"]] = message["returncode"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._lock.notify_all()
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    @property
    def stopped(self) -> bool:
        """The server has exited."""
        with self._lock:
            return self._closed

    def preloaded(self, timeout: float = START_TIMEOUT_S) -> list[str]:
        """What the server imported, once it has."""
        with self._lock:
            self._lock.wait_for(
                lambda: self._ready is not None or self._closed, timeout
            )
            if self._ready is None:
                raise self._failure("did not get ready")
            return list(self._ready)

    def set_by_preload(self) -> dict[str, str]:
        """The environment variables the preloaded libraries set as they
        were imported (a child gets them where its own environment does not
        say, as its own import would have set them)."""
        self.preloaded()
        return dict(self._set_by_preload)

    def _failure(self, what: str) -> WarmStartError:
        self._errors.seek(0)
        tail = self._errors.read()[-3000:]
        return WarmStartError(f"warm-start server {what}:\n{tail}")

    def start(
        self, args: Sequence[str], env: Mapping[str, str], cwd: str, out: str, err: str
    ) -> WarmProcess:
        """Fork ``python args...``, its output appended to ``out``/``err``."""
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            request = {"id": request_id, "argv": list(args), "env": dict(env)}
            request.update(cwd=cwd, stdout=out, stderr=err)
            if self._closed or self._proc.stdin is None:
                raise self._failure("has stopped")
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            if (
                not self._lock.wait_for(
                    lambda: request_id in self._pids or self._closed, START_TIMEOUT_S
                )
                or request_id not in self._pids
            ):
                raise self._failure("did not start the child")
            return WarmProcess(self, self._pids.pop(request_id))

    def returncode(self, pid: int) -> int | None:
        with self._lock:
            return self._returncodes.get(pid)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(
                lambda: pid in self._returncodes or self._closed, timeout
            )
            if pid not in self._returncodes and self._closed:
                raise self._failure(f"stopped before child {pid} ended")
            return self._returncodes.get(pid)

    def signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def close(self) -> None:
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._errors.close()


_servers: dict[tuple[tuple[str, str], ...], WarmServer] = {}
_servers_lock = threading.Lock()


def _server_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    shared = (
        item for item in env.items() if not item[0].startswith(PER_CHILD_PREFIXES)
    )
    return tuple(sorted(shared))


def _find(
    env: Mapping[str, str],
) -> tuple[tuple[tuple[str, str], ...], WarmServer | None]:
    """The key ``env`` is served under and its server, if this process keeps
    one. An environment also matches a server where it differs only by what
    that server's preload set as it was imported (this process imported the
    same libraries since, and they set the same)."""
    key = _server_key(env)
    if key in _servers:
        return key, _servers[key]
    for served, server in _servers.items():
        if server.stopped:
            continue
        own = server.set_by_preload()
        if _server_key({k: v for k, v in env.items() if own.get(k) != v}) == served:
            return served, server
    return key, None


def server_for(env: Mapping[str, str]) -> WarmServer | None:
    """The server this process keeps for ``env``'s children, if any."""
    return _find(env)[1]


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


def start(
    args: Sequence[str], *, env: Mapping[str, str], cwd: str, out: str, err: str
) -> WarmProcess | None:
    """``python args...`` (``-c CODE`` or ``-m MODULE``) forked warm, with
    ``env`` as its whole environment; None where this process already keeps
    ``MAX_SERVERS`` servers for other environments, or where ``env`` lets
    the child see a GPU (start it cold)."""
    from vllm_dcp_geometry.tooling.cpu_stand_ins import VISIBLE_DEVICES

    if env.get(VISIBLE_DEVICES) != "":
        # It may see a GPU: nothing in it may meet a CUDA context its server
        # made, so it starts cold.
        return None
    with _servers_lock:
        key, server = _find(env)
        if server is not None and server.stopped:
            # Killed (by the OOM killer, say): its children are lost with
            # it, later ones get a new server.
            _servers.pop(key).close()
            server = None
        if server is None:
            if len(_servers) >= MAX_SERVERS:
                return None
            server = _servers[key] = WarmServer(env)
    return server.start(args, env, cwd, out, err)
