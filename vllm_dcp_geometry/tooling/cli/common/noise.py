# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Keep third-party import noise out of the command's output.

Importing vLLM imports torch, whose loggers print deprecation and platform
notes a user cannot act on (``W1130 ... torch._opaque_base is deprecated``).
They are written straight to file descriptor 2, by Python loggers with their
own handlers and by C++ code, so they are caught at the descriptor: while
vLLM is imported, descriptor 2 points at a temporary file; afterwards every
line is written back except glog-style info and warning lines (torch's
Python and C++ loggers both use that format), vLLM's own debug, info and
warning log lines, and Python warnings raised outside this package. Errors
and this plugin's warnings pass through; ``--verbose`` turns the filter off.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

import vllm_dcp_geometry

THIRD_PARTY_NOTE = re.compile(
    r"[IW]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+:\d+\] "
    r"|.*\bpid=\d+\) (?:\x1b\[[\d;]*m)?(?:DEBUG|INFO|WARNING)\b.* \[\S+:\d+\] "
)
"""A glog-style info or warning line (``W1130 08:18:30.743000 7093 f.py:6] ...``)
or a vLLM log line below error level (``(EngineCore pid=7) WARNING 11-30
08:18:30 [f.py:6] ...``)."""

_PACKAGE_DIR = os.path.dirname(os.path.abspath(vllm_dcp_geometry.__file__))
"""``vllm_dcp_geometry/``: warnings raised from under it are this plugin's."""


def kept_lines(text: str) -> list[str]:
    """The lines of captured output that are not third-party notes; indented
    continuation lines go with the line they continue."""
    kept: list[str] = []
    dropping = False
    for line in text.splitlines(keepends=True):
        if THIRD_PARTY_NOTE.match(line):
            dropping = True
        elif not (dropping and line[:1].isspace()):
            dropping = False
            kept.append(line)
    return kept


def _is_ours(warning: warnings.WarningMessage) -> bool:
    return os.path.abspath(warning.filename).startswith(_PACKAGE_DIR + os.sep)


@contextlib.contextmanager
def third_party_noise_hidden(enabled: bool = True) -> Iterator[None]:
    """Hide third-party notes printed while the block runs (see the module
    docstring); everything else is written to standard error afterwards."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to redirect: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        # Python-level writers (loggers) reach the same file even where
        # sys.stderr is not descriptor 2 (an embedding program, a test).
        text = io.TextIOWrapper(
            io.FileIO(sink.fileno(), "w", closefd=False),
            encoding="utf-8",
            errors="replace",
            write_through=True,
        )
        caught: list[warnings.WarningMessage] = []
        try:
            with (
                contextlib.redirect_stderr(text),
                warnings.catch_warnings(record=True) as caught,
            ):
                yield
        finally:
            text.flush()
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured = sink.read().decode("utf-8", errors="replace")
            sys.stderr.writelines(kept_lines(captured))
            for warning in caught:
                if _is_ours(warning):
                    warnings.showwarning(
                        warning.message,
                        warning.category,
                        warning.filename,
                        warning.lineno,
                    )
            sys.stderr.flush()


@contextlib.contextmanager
def vllm_notes_held_back(enabled: bool = True) -> Iterator[None]:
    """vLLM's log records below ERROR held back while vLLM objects are read
    rather than run (the CPU platform's missing ``vllm._C``, config notes,
    the KV-cache planner's padding notes): nothing the user acts on;
    ``enabled=False`` (``--verbose``) lets them through."""
    logger = logging.getLogger("vllm")
    saved = logger.level
    if enabled:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)
