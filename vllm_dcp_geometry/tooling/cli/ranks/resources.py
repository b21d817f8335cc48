# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks``' workers need of this machine, and how a worker died.

``check_memory`` refuses, before any worker starts, a run whose D workers
would not fit in the memory this machine has available: D x (vLLM and
torch's ``WORKER_PEAK_RSS_BYTES`` plus the largest group's tensors at its
shapes, its runner's ``worker_bytes``) against ``available_memory_bytes``.
A run that does not fit would otherwise be stopped by the kernel's
out-of-memory killer half-way through spawning; the refusal names the
``--scale`` that fits, if one does. ``how_it_died`` words a worker's exit
status.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.status import CliError
from vllm_dcp_geometry.tooling.cli.ranks.cases import layer_runner
from vllm_dcp_geometry.tooling.cli.ranks.shapes import BACKEND
from vllm_dcp_geometry.tooling.topology import Topology

WORKER_PEAK_RSS_BYTES = 1_197_676 * 1024
"""Peak resident memory of one CPU worker (it imports vLLM and torch and runs
the Triton interpreter), about 1.23 GB: measured on this project's 2-core
Linux machine as the largest ``ru_maxrss`` (1,197,676 KiB) of the workers of
``ranks -p mla-mixed-tp4-dcp4 --dcp 2``, read with
``resource.getrusage(RUSAGE_CHILDREN)`` in the launching process. Those
workers ran 2 query heads per rank at latent 256 + rope 64 in fp32 over
contexts of a few hundred tokens, tensors of a few MB: this is vLLM's and
torch's own. What a group's shapes add is its runner's ``worker_bytes``."""

MAX_SUGGESTED_SCALE = 64
"""The largest ``--scale`` a refusal looks for to fit (powers of two)."""

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


def _largest_group(
    topology: Topology, runnable: list[dict[str, Any]], scale: int
) -> tuple[int, str]:
    """The bytes of the largest group to run at ``scale``, and its words."""
    dcp = topology.decode_context_parallel_size
    sized = []
    for g in runnable:
        group = topology.groups[g["index"]]
        runner = layer_runner(group)
        assert runner is not None, g["name"]
        case = runner.plan(topology, group, scale, BACKEND, None)
        assert not isinstance(case, str), case
        size = runner.worker_bytes(case, dcp, g["block_size"], g["shard_count"])
        sized.append((size, g["name"], case.shape))
    size, name, shape = max(sized, key=lambda item: item[0])
    return size, f"group {name!r} at {shape.words}"


def _worker_bytes(
    topology: Topology, runnable: list[dict[str, Any]], scale: int
) -> int:
    return WORKER_PEAK_RSS_BYTES + _largest_group(topology, runnable, scale)[0]


def check_memory(
    topology: Topology, runnable: list[dict[str, Any]], scale: int = 1
) -> None:
    """Refuse (``CliError``, exit 2) D workers that need more memory than
    this machine has available at the shapes of the groups to run
    (``runnable``, planned at ``scale``), naming the ``--scale`` that fits
    if one does; where the memory is unknown, say so and go on."""
    dcp = topology.decode_context_parallel_size
    group, words = _largest_group(topology, runnable, scale)
    each = WORKER_PEAK_RSS_BYTES + group
    what = (
        f"D={dcp} needs about {_gb(dcp * each)} ({dcp} workers x "
        f"{each / 1e9:.2f} GB: {WORKER_PEAK_RSS_BYTES / 1e9:.2f} GB for vLLM "
        f"and torch + {group / 1e9:.2f} GB for {words}"
    )
    available = available_memory_bytes()
    if available is None:
        print(
            f"ranks: {what}); this machine's available memory is unknown "
            "(no /proc/meminfo, no psutil), so it is not checked",
            file=sys.stderr,
        )
        return
    if dcp * each <= available:
        return
    larger = (2**i for i in range(1, MAX_SUGGESTED_SCALE.bit_length()))
    fits = next(
        (
            n
            for n in larger
            if n > scale and dcp * _worker_bytes(topology, runnable, n) <= available
        ),
        None,
    )
    hint = "use a smaller --dcp"
    if fits is not None:
        hint = f"run smaller shapes with --scale {fits}, or {hint}"
    raise CliError(
        f"ranks: {what}), this machine has {_gb(available)} available; {hint}"
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
