# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' launcher: D worker processes on this machine, their results.

``run_ranks`` plans every group (``cases.plan_groups``: its shapes, or why it
cannot run; a topology with none to run is refused), then starts one
``vllm_dcp_geometry.tooling.cli.ranks.worker`` process per DCP rank (gloo on
CPU, NCCL where D GPUs are visible), each with its plan in a JSON file (once
``resources.check_memory`` finds room for D of them at the groups' shapes),
waits for them with a progress line (a worker that dies stops the others and
the run, naming its rank and how it died), and merges their results into one
report (``results.merge``).

Children get this process's environment, plus ``VLLM_PLUGINS=""`` when
unpatched (``fresh_process.fresh_env``) and, with no GPU visible, the CPU
switches of ``cpu_stand_ins.child_environment``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.runs import progress_bar
from vllm_dcp_geometry.tooling.cli.common.status import CliError
from vllm_dcp_geometry.tooling.cli.ranks.cases import nothing_to_run, plan_groups
from vllm_dcp_geometry.tooling.cli.ranks.resources import check_memory, how_it_died
from vllm_dcp_geometry.tooling.cli.ranks.results import merge
from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
from vllm_dcp_geometry.tooling.topology import Topology

WORKER_TIMEOUT_S = 900
"""How long the workers may run in all before they are stopped."""

STOP_GRACE_S = 5.0
"""How long a worker still running may take to exit on SIGTERM once the run
stops (a partner died, the run timed out or was interrupted)."""


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child_env(*, patched: bool, gpu: bool, verbose: bool) -> dict[str, str]:
    from vllm_dcp_geometry.tooling.fresh_process import fresh_env

    extra = {} if gpu else child_environment()
    if not verbose:
        extra["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")
    return fresh_env(patched=patched, extra=extra)


def worker_command(plan_path: Path, result_path: Path) -> list[str]:
    """One worker process's command line: its plan in, its result out."""
    return [
        sys.executable,
        "-m",
        "vllm_dcp_geometry.tooling.cli.ranks.worker",
        str(plan_path),
        str(result_path),
    ]


def launch(
    topology: Topology,
    groups: list[dict[str, Any]],
    *,
    patched: bool,
    seed: int,
    progress: bool,
    verbose: bool,
    gpu: bool,
    scale: int,
    partial_collectives: str,
) -> tuple[list[dict[str, Any]], float]:
    """Run the D workers; their results (by rank) and the wall time. Refuses
    (``CliError``) D workers this machine's memory cannot hold at the
    groups' shapes, before any starts, and a run in which a worker dies,
    naming it and how it died."""
    dcp = topology.decode_context_parallel_size
    runnable = [g for g in groups if g["run"]]
    check_memory(topology, runnable, scale)
    env = _child_env(patched=patched, gpu=gpu, verbose=verbose)
    port = free_port()
    mode = "patched" if patched else "unpatched"
    started = time.perf_counter()
    common = {
        "world": dcp,
        "port": port,
        "backend": "nccl" if gpu else "gloo",
        "device": "cuda" if gpu else "cpu",
        "seed": seed,
        "partial_collectives": partial_collectives,
        "groups": runnable,
    }
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="vllm-dcp-geometry-ranks-") as tmp:
        try:
            for rank in range(dcp):
                plan_path = Path(tmp, f"plan.{rank}.json")
                plan_path.write_text(json.dumps({"rank": rank, **common}))
                log = open(Path(tmp, f"log.{rank}.txt"), "w+", encoding="utf-8")  # noqa: SIM115
                proc = subprocess.Popen(
                    worker_command(plan_path, Path(tmp, f"result.{rank}.json")),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
                procs.append((proc, log))
            bar = progress_bar(dcp, f"ranks {mode}: {dcp} workers", progress)
            bar.unit = "rank"
            with bar:
                dead = _wait(procs, bar, started, Path(tmp))
            if dead is not None:
                proc, log = procs[dead]
                log.seek(0)
                raise CliError(
                    f"{mode} rank {dead} of {dcp} {how_it_died(proc.returncode)} "
                    "before writing its result; stopped the other ranks: "
                    + _last_line(log.read()[-3000:])
                )
            results = [
                json.loads(Path(tmp, f"result.{rank}.json").read_text())
                for rank in range(dcp)
            ]
        finally:
            _stop(procs)
            for _, log in procs:
                log.close()
    return results, time.perf_counter() - started


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _wait(procs: list[Any], bar: Any, started: float, tmp: Path) -> int | None:
    """Poll the workers until all have finished; the rank of the first that
    dies (a signal, a non-zero exit, an exit without its result), whose
    partners would otherwise wait on its collectives."""
    done: set[int] = set()
    while len(done) < len(procs):
        for rank, (proc, _) in enumerate(procs):
            if rank in done or proc.poll() is None:
                continue
            if proc.returncode != 0 or not Path(tmp, f"result.{rank}.json").exists():
                return rank
            done.add(rank)
            bar.update(1)
        if time.perf_counter() - started > WORKER_TIMEOUT_S:
            raise CliError(
                f"the ranks did not finish within {WORKER_TIMEOUT_S} s; stopped them"
            )
        time.sleep(0.2)
    return None


def _stop(procs: list[Any]) -> None:
    """Stop every worker still running: SIGTERM, then SIGKILL after
    ``STOP_GRACE_S``; each is reaped before this returns."""
    alive = [proc for proc, _ in procs if proc.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.perf_counter() + STOP_GRACE_S
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_ranks(
    topology: Topology,
    *,
    patched: bool,
    seed: int = 0,
    progress: bool = True,
    verbose: bool = False,
    scale: int = 1,
    partial_collectives: str | None = None,
) -> dict[str, Any]:
    """The whole run on ``patched`` (or unpatched) vLLM; a JSON-ready report.
    ``scale``: the divisor of every group's heads, latent and rope dims (1:
    its own); ``partial_collectives``: where the patched ranks run partial
    groups' collectives (``collectives.REPLICA`` or ``DCP_GROUP``; None: the
    topology's, as ``plan`` reads it). Refuses (``CliError``) a topology with
    no group to run, naming why per group."""
    where = partial_collectives or topology.partial_collectives
    gpu = visible_gpus() >= topology.decode_context_parallel_size
    groups = plan_groups(topology, gpu=gpu, scale=scale, partial_collectives=where)
    if not any(g["run"] for g in groups):
        raise CliError(nothing_to_run(topology, groups))
    results, elapsed = launch(
        topology,
        groups,
        patched=patched,
        seed=seed,
        progress=progress,
        verbose=verbose,
        gpu=gpu,
        scale=scale,
        partial_collectives=where,
    )
    if any(r["patched"] != patched for r in results):
        raise CliError(
            "a worker's vLLM plugin loader "
            + ("did not load" if patched else "loaded")
            + " the plugin (is the package installed, or VLLM_PLUGINS set?)"
        )
    return merge(
        topology,
        groups,
        results,
        patched=patched,
        elapsed=elapsed,
        gpu=gpu,
        scale=scale,
        partial_collectives=where,
    )
