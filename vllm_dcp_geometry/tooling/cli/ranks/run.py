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


DEVICES = ("auto", "cpu", "cuda")
"""Where the ranks run (``--device``): ``auto`` is CUDA where D GPUs are
visible, else the CPU."""

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""torch.distributed's environment, as ``torchrun`` sets it for each process:
with all of them set, this process is one rank of a run across nodes."""


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def torchrun_environment() -> dict[str, str] | None:
    """``TORCHRUN_VARIABLES`` where every one is set (None otherwise)."""
    found = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    if any(value is None for value in found.values()):
        return None
    return {name: str(value) for name, value in found.items()}


def runs_on_gpu(device: str, dcp: int, *, torchrun: bool) -> bool:
    """Whether the ranks run on CUDA; refuses (``CliError``) a ``--device``
    the machine cannot give: CUDA with fewer than D visible GPUs (one
    process per GPU, unless torchrun spreads the ranks over nodes), or a
    CPU run under torchrun whose environment lacks the CPU switches (they
    must be set before vLLM is imported: the launcher sets them in its
    fresh workers, torchrun passes on the environment it is given)."""
    if torchrun:
        if device == "cuda" or (device == "auto" and visible_gpus() > 0):
            if visible_gpus() == 0:
                raise CliError("ranks --device cuda under torchrun: no GPU visible")
            return True
        switches = child_environment()
        missing = {k: v for k, v in switches.items() if os.environ.get(k) != v}
        if missing:
            words = " ".join(f"{k}={v!r}" for k, v in sorted(switches.items()))
            raise CliError(
                "ranks on CPU under torchrun needs the CPU switches in its "
                f"environment before vLLM is imported: run it as {words} torchrun ..."
            )
        return False
    if device == "cpu":
        return False
    gpus = visible_gpus()
    if device == "cuda" and gpus < dcp:
        raise CliError(
            f"ranks --device cuda: D={dcp} needs {dcp} visible GPUs (one worker "
            f"per GPU), {gpus} visible; use a smaller --dcp, or torchrun across "
            "nodes"
        )
    return gpus >= dcp


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


def _start_worker(command: list[str], env: dict[str, str], log: Any) -> Any:
    """One worker, writing to ``log``: on CPU forked warm (``warm_start``:
    past the libraries every worker would import again), where it may see a
    GPU a cold process."""
    from vllm_dcp_geometry.tooling import warm_start

    child = warm_start.start(
        command[1:], env=env, cwd=os.getcwd(), out=log.name, err=log.name
    )
    if child is not None:
        return child
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


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
    cuda_graph: bool = False,
) -> tuple[list[dict[str, Any]], float]:
    """Run the D workers; their results (by rank) and the wall time. Refuses
    (``CliError``) D workers this machine's memory cannot hold at the
    groups' shapes, before any starts, and a run in which a worker dies,
    naming it and how it died."""
    dcp = topology.decode_context_parallel_size
    runnable = [g for g in groups if g["run"]]
    check_memory(topology, runnable, scale)
    env = _child_env(patched=patched, gpu=gpu, verbose=verbose)
    mode = "patched" if patched else "unpatched"
    started = time.perf_counter()
    common = worker_plan(
        dcp,
        runnable,
        gpu=gpu,
        seed=seed,
        partial_collectives=partial_collectives,
        cuda_graph=cuda_graph,
    )
    common["port"] = free_port()
    procs: list[Any] = []
    with tempfile.TemporaryDirectory(prefix="vllm-dcp-geometry-ranks-") as tmp:
        try:
            for rank in range(dcp):
                plan_path = Path(tmp, f"plan.{rank}.json")
                plan_path.write_text(json.dumps({"rank": rank, **common}))
                log = open(Path(tmp, f"log.{rank}.txt"), "w+", encoding="utf-8")  # noqa: SIM115
                proc = _start_worker(
                    worker_command(plan_path, Path(tmp, f"result.{rank}.json")),
                    env,
                    log,
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


def worker_plan(
    dcp: int,
    runnable: list[dict[str, Any]],
    *,
    gpu: bool,
    seed: int,
    partial_collectives: str,
    cuda_graph: bool,
) -> dict[str, Any]:
    """What every worker's plan holds (each adds its rank and how the ranks
    meet)."""
    return {
        "world": dcp,
        "backend": "nccl" if gpu else "gloo",
        "device": "cuda" if gpu else "cpu",
        "seed": seed,
        "partial_collectives": partial_collectives,
        "cuda_graph": cuda_graph,
        "groups": runnable,
    }


def run_in_torchrun(
    environment: dict[str, str],
    groups: list[dict[str, Any]],
    dcp: int,
    *,
    gpu: bool,
    seed: int,
    partial_collectives: str,
    cuda_graph: bool,
) -> tuple[list[dict[str, Any]] | None, float]:
    """This process as one rank of a torchrun run (no launcher): its worker
    run, meeting the others through torch.distributed's environment; rank 0
    gets every rank's result (None elsewhere), and the wall time."""
    from vllm_dcp_geometry.tooling.cli.ranks.worker import run_rank

    world = int(environment["WORLD_SIZE"])
    if world != dcp:
        raise CliError(
            f"ranks under torchrun: WORLD_SIZE={world} processes, the topology's "
            f"D={dcp} ranks (one process per DCP rank)"
        )
    plan = worker_plan(
        dcp,
        [g for g in groups if g["run"]],
        gpu=gpu,
        seed=seed,
        partial_collectives=partial_collectives,
        cuda_graph=cuda_graph,
    )
    plan.update(
        rank=int(environment["RANK"]),
        local_rank=int(environment["LOCAL_RANK"]),
        init_method="env://",
        gather=True,
    )
    started = time.perf_counter()
    results = run_rank(plan)
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


def _check_plugin_loaded(results: list[dict[str, Any]], *, patched: bool) -> None:
    """Refuse (``CliError``) workers whose plugin loader did not do as the
    run asked (a patched run's must load the plugin, an unpatched one's not)."""
    if any(r["patched"] != patched for r in results):
        raise CliError(
            "a worker's vLLM plugin loader "
            + ("did not load" if patched else "loaded")
            + " the plugin (is the package installed, or VLLM_PLUGINS set?)"
        )


def _planned(
    topology: Topology,
    *,
    device: str,
    torchrun: bool,
    cuda_graph: bool,
    scale: int,
    partial_collectives: str,
    backend: str,
    dtype: str | None,
) -> tuple[bool, list[dict[str, Any]]]:
    """Whether the ranks run on CUDA, and every group's plan
    (``cases.plan_groups``); refuses (``CliError``) a device the machine
    cannot give, CUDA graphs without one, and a plan with no group to run."""
    gpu = runs_on_gpu(device, topology.decode_context_parallel_size, torchrun=torchrun)
    if cuda_graph and not gpu:
        raise CliError("ranks --cuda-graph captures CUDA graphs: it needs a GPU run")
    groups = plan_groups(
        topology,
        gpu=gpu,
        scale=scale,
        partial_collectives=partial_collectives,
        backend=backend,
        dtype=dtype,
    )
    if not any(g["run"] for g in groups):
        raise CliError(nothing_to_run(topology, groups))
    return gpu, groups


def run_ranks(
    topology: Topology,
    *,
    patched: bool,
    seed: int = 0,
    progress: bool = True,
    verbose: bool = False,
    scale: int = 1,
    partial_collectives: str | None = None,
    device: str = "auto",
    backend: str = "auto",
    cuda_graph: bool = False,
    dtype: str | None = None,
) -> dict[str, Any] | None:
    """The whole run on ``patched`` (or unpatched) vLLM; a JSON-ready report.
    ``scale``: the divisor of every group's heads, latent and rope dims (1:
    its own); ``partial_collectives``: where the patched ranks run partial
    groups' collectives (``collectives.REPLICA`` or ``DCP_GROUP``; None: the
    topology's, as ``plan`` reads it); ``device``, ``backend`` and
    ``cuda_graph``: ``--device``, ``--attention-backend``, ``--cuda-graph``;
    ``dtype``: every group's dtype instead of its own (``--float32``).
    Under torchrun this process is one rank (``run_in_torchrun``): rank 0
    returns the report, the others None; the plugin is loaded or not as
    ``VLLM_PLUGINS`` says. Refuses (``CliError``) a topology with no group
    to run, naming why per group, and a device the machine cannot give."""
    where = partial_collectives or topology.partial_collectives
    dcp = topology.decode_context_parallel_size
    torchrun = torchrun_environment()
    gpu, groups = _planned(
        topology,
        device=device,
        torchrun=torchrun is not None,
        cuda_graph=cuda_graph,
        scale=scale,
        partial_collectives=where,
        backend=backend,
        dtype=dtype,
    )
    if torchrun is not None:
        gathered, elapsed = run_in_torchrun(
            torchrun,
            groups,
            dcp,
            gpu=gpu,
            seed=seed,
            partial_collectives=where,
            cuda_graph=cuda_graph,
        )
        if gathered is None:
            return None
        results = gathered
        patched = bool(results[0]["patched"])
    else:
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
            cuda_graph=cuda_graph,
        )
    _check_plugin_loaded(results, patched=patched)
    return merge(
        topology,
        groups,
        results,
        patched=patched,
        elapsed=elapsed,
        gpu=gpu,
        scale=scale,
        partial_collectives=where,
        launched_by="torchrun" if torchrun is not None else "vllm-dcp-geometry",
    )
