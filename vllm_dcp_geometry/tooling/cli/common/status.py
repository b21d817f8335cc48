# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The exit statuses of every command, and bad input as one line.

Exit status: 0 clean, 1 a replay or simulation found a violation, 2 bad
input, 130 interrupted. Every bad input (a flag, a topology file, a layout
vLLM or the contract forbids, a size beyond what vLLM can represent) is one
line on standard error naming the flag, field or group and the allowed
range: a command raises ``CliError`` or any ``DcpGeometryError`` (the errors
of ``bad_input_errors``) and ``main`` reports it (``report_bad_input``).
"""

from __future__ import annotations

import sys

from vllm_dcp_geometry.contract import DcpGeometryError

PROG = "vllm-dcp-geometry"
EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """Bad input the command reports and exits 2 on."""


def bad_input_errors() -> tuple[type[BaseException], ...]:
    """What a command raises for input it cannot run: exit 2, one line."""
    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError

    errors: tuple[type[BaseException], ...] = (
        CliError,
        DcpGeometryError,
        UpstreamChangedError,
    )
    try:
        from vllm_dcp_geometry.plugin import VllmVersionError
    except Exception:  # pragma: no cover - the plugin import itself failed
        return errors
    return (*errors, VllmVersionError)


def report_bad_input(error: BaseException | str) -> int:
    """Print ``error`` as one line on standard error; the exit status for
    bad input."""
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return EXIT_BAD_INPUT
