# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks``' workers need of this machine, and how a worker died.

``check_memory`` refuses, before any worker starts, a run whose D workers
would not fit in the memory this machine has available (D x
``WORKER_PEAK_RSS_BYTES`` against ``available_memory_bytes``): a run that
does not fit would otherwise be stopped by the kernel's out-of-memory killer
half-way through spawning. ``how_it_died`` words a worker's exit status.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from vllm_dcp_geometry.tooling.cli.common.status import CliError

WORKER_PEAK_RSS_BYTES = 1_197_676 * 1024
"""Peak resident memory of one CPU worker (it imports vLLM and torch and runs
the Triton interpreter), about 1.23 GB: measured on this project's 2-core
Linux machine as the largest ``ru_maxrss`` (1,197,676 KiB) of the workers of
``ranks -p mla-mixed-tp4-dcp4 --dcp 2``, read with
``resource.getrusage(RUSAGE_CHILDREN)`` in the launching process. A worker's
sizes are scaled down and do not grow with D."""

MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int | None:
    """Memory this machine can give new processes without swapping: Linux's
    ``MemAvailable``, else psutil's ``available`` (macOS, Windows), else
    ``None`` (unknown)."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(":")
            if name == "MemAvailable":
                return int(value.split()[0]) * 1024  # the kernel counts kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


def check_memory(dcp: int) -> None:
    """Refuse (``CliError``, exit 2) D workers that need more memory than this
    machine has available; where that is unknown, say so and go on."""
    need = dcp * WORKER_PEAK_RSS_BYTES
    each = f"{WORKER_PEAK_RSS_BYTES / 1e9:.2f} GB"
    what = f"D={dcp} needs about {_gb(need)} ({dcp} workers x {each}"
    available = available_memory_bytes()
    if available is None:
        print(
            f"ranks: {what}); this machine's available memory is unknown "
            "(no /proc/meminfo, no psutil), so it is not checked",
            file=sys.stderr,
        )
        return
    if need > available:
        raise CliError(
            f"ranks: {what}), this machine has {_gb(available)} available; "
            "use a smaller --dcp"
        )


def how_it_died(returncode: int) -> str:
    """A worker's exit status in words: the signal that killed it (a kill by
    SIGKILL is what the kernel's out-of-memory killer sends) or its code."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    oom = " (the out-of-memory killer sends it)" if name == "SIGKILL" else ""
    return f"was killed by {name}{oom}"
