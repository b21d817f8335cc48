# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Third-party import noise stays out of the command's output unless
``--verbose``; errors and this plugin's own warnings always pass.

The filter runs in-process on written lines (milliseconds); the command runs
twice in fresh interpreters, where importing vLLM really prints torch's notes
(about 8 s each).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings

import pytest

from tests.support.processes import REPO_ROOT
from vllm_dcp_geometry.tooling.cli.common.noise import (
    THIRD_PARTY_NOTE,
    third_party_noise_hidden,
)

NOTE = "W1130 08:18:30.743000 7093 torch/_opaque_base.py:6] torch._opaque_base is deprecated"
INFO = "I1130 08:18:30.743000 7093 torch/_dynamo/x.cpp:12] some detail"
ERROR = "E1130 08:18:30.743000 7093 torch/csrc/x.cpp:12] a real error"
VLLM_NOTE = "(APIServer pid=7) WARNING 11-30 08:18:30 [interface.py:12] a vLLM note"
VLLM_ERROR = "(APIServer pid=7) ERROR 11-30 08:18:30 [interface.py:12] a vLLM error"
OURS = os.path.join(REPO_ROOT, "vllm_dcp_geometry", "plugin.py")


def _emit_everything() -> None:
    os.write(2, f"{NOTE}\n  continued on an indented line\n".encode())
    os.write(2, f"{INFO}\n{ERROR}\n{VLLM_NOTE}\n{VLLM_ERROR}\n".encode())
    print("a plain line", file=sys.stderr)
    # As in the command, where no handler is configured for it (pytest's
    # own log capture would otherwise take the record).
    logger = logging.getLogger("vllm_dcp_geometry")
    propagate, logger.propagate = logger.propagate, False
    try:
        logger.warning("the plugin's own warning")
    finally:
        logger.propagate = propagate
    warnings.warn_explicit("a third-party warning", UserWarning, "/x/site.py", 1)
    warnings.warn_explicit("our own warning", UserWarning, OURS, 1)


@pytest.fixture
def warnings_to_stderr():
    """Python warnings printed to stderr, as in the command; pytest's own
    warning capture would otherwise record them (plain ``pytest`` runs)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield


def test_the_filter_drops_only_third_party_notes(capfd, warnings_to_stderr) -> None:
    with third_party_noise_hidden():
        _emit_everything()
    err = capfd.readouterr().err
    for kept in (
        ERROR,
        VLLM_ERROR,
        "a plain line",
        "the plugin's own warning",
        "our own warning",
    ):
        assert kept in err
    for dropped in (
        NOTE,
        "continued on an indented line",
        INFO,
        VLLM_NOTE,
        "a third-party",
    ):
        assert dropped not in err


def test_the_filter_off_lets_everything_through(capfd, warnings_to_stderr) -> None:
    with third_party_noise_hidden(enabled=False):
        _emit_everything()
    err = capfd.readouterr().err
    for line in (NOTE, INFO, ERROR, VLLM_NOTE, "a plain line", "a third-party warning"):
        assert line in err


def test_output_is_kept_when_the_block_raises(capfd) -> None:
    with pytest.raises(RuntimeError), third_party_noise_hidden():
        os.write(2, f"{NOTE}\nwhy it failed\n".encode())
        raise RuntimeError("import failed")
    err = capfd.readouterr().err
    assert "why it failed" in err and NOTE not in err


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "vllm_dcp_geometry", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        timeout=300,
        check=False,
    )


def test_the_command_hides_import_noise_but_not_its_error() -> None:
    # The error comes after vLLM is imported: the noise was printed by then.
    result = _cli("plan", "-p", "dense-gqa-tp8-dcp8", "--max-model-len", "2147483647")
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("vllm-dcp-geometry: error: one max-length request")


def test_verbose_shows_the_noise() -> None:
    result = _cli("plan", "-p", "dense-gqa-tp8-dcp8", "--json", "--verbose")
    assert result.returncode == 0, result.stderr[-3000:]
    notes = [
        line for line in result.stderr.splitlines() if THIRD_PARTY_NOTE.match(line)
    ]
    # What this torch prints on import; the non-verbose run above hid it.
    assert any("deprecated" in line for line in notes), result.stderr


def test_vllms_planner_notes_stay_out_of_the_output() -> None:
    # vLLM's KV-cache planner logs the padding layers it adds for the default
    # profile's KDA groups: start-up's log, not the plan (whose rows say it).
    result = _cli("plan")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == ""
