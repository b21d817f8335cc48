# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks`` on a machine it does not fit, and a worker that dies.

Checked: D workers that need more memory than the machine has available at
the groups' own shapes are refused before any process starts (exit 2, one
line naming the need, the largest group's shapes and the free memory, and
the ``--scale`` that fits where one does, checked to fit); a worker killed by a signal, or one that exits without its
result, ends the run within seconds naming its rank and how it died, and its
partner (waiting on the dead rank's collectives) is stopped. The workers here
are tiny stand-in commands (``run.worker_command``), not vLLM: each run costs
about as much as ``ranks``' start-up (seconds on 2 cores).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, main
from vllm_dcp_geometry.tooling.cli.common.status import CliError
from vllm_dcp_geometry.tooling.cli.ranks import resources, run

PROFILE = "mla-mixed-tp4-dcp4"
PARTNER_SLEEP_S = 60


def _one_line(capsys: Any) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert captured.out == "" and len(lines) == 1, captured
    return lines[0]


def test_a_run_the_memory_cannot_hold_is_refused_before_any_worker_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    spawned: list[Any] = []
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: 2_000_000_000)
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    assert main(["ranks", "-p", PROFILE, "--no-progress"]) == EXIT_BAD_INPUT
    assert _one_line(capsys) == (
        "vllm-dcp-geometry: error: ranks: D=4 needs about 5.1 GB (4 workers x "
        "1.28 GB: 1.23 GB for vLLM and torch + 0.05 GB for group 'mla.k4' at "
        "32 heads x 512+64 bfloat16), this machine has 2.0 GB available; use a "
        "smaller --dcp"
    )
    assert spawned == []


def _wide_topology(path: Path) -> Path:
    """3,072 query heads per rank over contexts of ~2,000 tokens (block 256,
    K = D = 4): several GB per worker for its tensors alone."""
    path.write_text(
        'name = "wide"\n[parallel]\ntensor_parallel_size = 4\n'
        "decode_context_parallel_size = 4\n[[groups]]\n"
        'name = "mla.wide"\nkind = "mla"\nlayers = ["model.layers.0.attn"]\n'
        "block_size = 256\nnum_kv_heads = 1\nhead_size = 576\n"
        'kv_lora_rank = 512\nquery_heads = 12288\ndtype = "bfloat16"\n'
    )
    return path


def test_shapes_the_memory_cannot_hold_are_refused_naming_the_scale_that_fits(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    """vLLM and torch fit (4 x 1.23 GB in 12 GB), the group's own shapes do
    not: refused, naming the smallest power-of-two ``--scale`` that fits;
    that scale passes the same check, half of it does not."""
    from vllm_dcp_geometry.tooling.cli.ranks import cases
    from vllm_dcp_geometry.tooling.topology import load_topology_file

    available = 12_000_000_000
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: available)
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: 1 / 0)
    path = _wide_topology(tmp_path / "wide.toml")
    assert main(["ranks", "-t", str(path), "--no-progress"]) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert "ranks: D=4 needs about " in line
    assert "for group 'mla.wide' at 3072 heads x 512+64 bfloat16" in line
    assert line.endswith(
        "this machine has 12.0 GB available; run smaller shapes with --scale "
        "4, or use a smaller --dcp"
    )
    topology = load_topology_file(path)

    def check(scale: int) -> None:
        groups = cases.plan_groups(
            topology, gpu=False, scale=scale, partial_collectives="replica"
        )
        resources.check_memory(topology, groups, scale)

    check(4)
    with pytest.raises(CliError, match="with --scale 4, or"):
        check(2)


def test_available_memory_is_meminfos_else_psutils(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable:  7900000 kB\n")
    assert resources.available_memory_bytes(meminfo) == 7_900_000 * 1024
    import psutil

    missing = resources.available_memory_bytes(tmp_path / "absent")
    assert missing is not None and missing > 0
    assert abs(missing - psutil.virtual_memory().available) < 1_000_000_000


def _dying_rank_1(death: str, pid_file: Path) -> Any:
    """``worker_command``'s stand-in: rank 0 records its pid and waits (as a
    rank blocked on a collective), rank 1 dies once rank 0 is up."""

    def command(plan_path: Path, result_path: Path) -> list[str]:
        if plan_path.name == "plan.0.json":
            code = (
                f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid()))"
                f"; time.sleep({PARTNER_SLEEP_S})"
            )
        else:
            code = (
                f"import os, signal, sys, time\nwhile not os.path.exists("
                f"{str(pid_file)!r}): time.sleep(0.05)\n{death}"
            )
        return [sys.executable, "-c", code]

    return command


@pytest.mark.parametrize(
    ("death", "how"),
    [
        ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by SIGKILL"),
        ("sys.exit(0)", "exited with status 0"),
        ("print('boom'); sys.exit(3)", "exited with status 3"),
    ],
)
def test_a_dead_worker_ends_the_run_naming_its_rank(
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    tmp_path: Path,
    death: str,
    how: str,
) -> None:
    pid_file = tmp_path / "rank0.pid"
    monkeypatch.setattr(resources, "available_memory_bytes", lambda: 10**12)
    monkeypatch.setattr(run, "worker_command", _dying_rank_1(death, pid_file))
    started = time.perf_counter()
    code = main(["ranks", "-p", PROFILE, "--dcp", "2", "--no-progress"])
    elapsed = time.perf_counter() - started
    line = _one_line(capsys)
    assert code == EXIT_BAD_INPUT
    assert f"patched rank 1 of 2 {how}" in line, line
    assert "before writing its result; stopped the other ranks" in line, line
    assert elapsed < PARTNER_SLEEP_S / 2, elapsed
    with pytest.raises(ProcessLookupError):  # stopped and reaped
        os.kill(int(pid_file.read_text()), 0)


@pytest.mark.parametrize(
    ("returncode", "words"),
    [
        (-signal.SIGKILL, "was killed by SIGKILL (the out-of-memory killer sends it)"),
        (-signal.SIGSEGV, "was killed by SIGSEGV"),
        (1, "exited with status 1"),
    ],
)
def test_how_a_worker_died_in_words(returncode: int, words: str) -> None:
    assert resources.how_it_died(returncode) == words
