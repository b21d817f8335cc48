# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' launcher: D worker processes on this machine, their results.

``run_ranks`` starts one ``vllm_dcp_geometry.tooling.cli.ranks.worker`` process per
DCP rank (gloo on CPU, NCCL where D GPUs are visible), each with its plan in a
JSON file (once ``resources.check_memory`` finds room for D of them), waits
for them with a progress line (a worker that dies stops the others and the
run, naming its rank and how it died), and merges their results into one
report: per group the worst error over every rank and the bytes each rank
moved through the DCP group in one decode step (the same on every rank, or
the group is flagged), next to what ``collectives.mla_decode_step_bytes``
says vLLM's D-wide collectives move.

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

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.contract.collectives import (
    REPLICA,
    attention_work_ratio,
    collective_world_size,
    mla_decode_step_bytes,
)
from vllm_dcp_geometry.tooling.cli.common.runs import progress_bar
from vllm_dcp_geometry.tooling.cli.common.status import CliError
from vllm_dcp_geometry.tooling.cli.ranks.cases import (
    Shape,
    longest_request,
    why_not_run,
)
from vllm_dcp_geometry.tooling.cli.ranks.resources import check_memory, how_it_died
from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
from vllm_dcp_geometry.tooling.topology import Topology

TOLERANCE = 1e-5
"""Max abs error (output and LSE, fp32) a rank may show against the float64
reference."""

WORKER_TIMEOUT_S = 900
"""How long the workers may run in all before they are stopped."""

STOP_GRACE_S = 5.0
"""How long a worker still running may take to exit on SIGTERM once the run
stops (a partner died, the run timed out or was interrupted)."""


def attention_mode(shard_count: int, dcp: int) -> str:
    """The contract's attention mode of a group with K shards (``plan``'s
    names): ``local`` (K = 1), ``dcp-partial`` (1 < K < D), ``dcp`` (K = D)."""
    if shard_count == 1:
        return "local"
    return "dcp" if shard_count == dcp else "dcp-partial"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_shape(topology: Topology) -> Shape:
    """The run's sizes: ``Shape``'s, long enough for every group's batches."""
    return Shape(max_model_len=cdiv(longest_request(topology), 64) * 64)


def plan_groups(topology: Topology, *, gpu: bool) -> list[dict[str, Any]]:
    """Every group of the topology: what the workers run, or why not."""
    dcp = topology.decode_context_parallel_size
    planned = []
    for index, group in enumerate(topology.groups):
        k = group.shard_count(dcp) if group.is_attention else None
        reason = why_not_run(group, gpu=gpu)
        planned.append(
            {
                "index": index,
                "name": group.name,
                "kind": group.kind + (" (draft)" if group.draft else ""),
                "layer_class": group.layer_class,
                "block_size": group.block_size,
                "shard_count": k,
                "dcp_kv_shard_count": group.dcp_kv_shard_count,
                "dcp_sharded": group.dcp_sharded,
                "draft": group.draft,
                "interleave": topology.interleave_size,
                "run": reason is None,
                "reason": reason,
            }
        )
    return planned


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
    partial_collectives: str,
) -> tuple[list[dict[str, Any]], float]:
    """Run the D workers; their results (by rank) and the wall time. Refuses
    (``CliError``) D workers this machine's memory cannot hold, before any
    starts, and a run in which a worker dies, naming it and how it died."""
    dcp = topology.decode_context_parallel_size
    check_memory(dcp)
    shape = run_shape(topology)
    runnable = [g for g in groups if g["run"]]
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
        "shape": shape.to_dict(),
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


def _worst(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def _group_row(g: dict[str, Any], dcp: int) -> dict[str, Any]:
    """A group's row before any rank's result: what the plan says of it."""
    return {
        "name": g["name"],
        "kind": g["kind"],
        "layer_class": g["layer_class"] or "MLAAttention",
        "shard_count": g["shard_count"],
        "block_size": g["block_size"],
        "attention_mode": "none"
        if g["shard_count"] is None
        else attention_mode(g["shard_count"], dcp),
        "status": "run" if g["run"] else "not run",
        "reason": g["reason"],
        "max_abs_error": None,
        "max_lse_error": None,
        "collective_bytes_per_rank_per_step": None,
    }


def _errors(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst errors over the ranks of a group, by phase, then overall."""
    errors = {
        "decode_max_abs_error": _worst([r["decode_max_abs_error"] for r in ranks]),
        "prefill_max_abs_error": _worst([r["prefill_max_abs_error"] for r in ranks]),
        "decode_max_lse_error": _worst([r["decode_max_lse_error"] for r in ranks]),
        "context_max_lse_error": _worst([r["prefill_max_lse_error"] for r in ranks]),
    }
    return {
        **errors,
        "max_abs_error": _worst(
            [errors["decode_max_abs_error"], errors["prefill_max_abs_error"]]
        ),
        "max_lse_error": _worst(
            [errors["decode_max_lse_error"], errors["context_max_lse_error"]]
        ),
    }


def _measured(
    g: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    dcp: int,
    shape: Shape,
    patched: bool,
    partial_collectives: str,
) -> dict[str, Any]:
    """What the ranks of a run group measured, against the plan and the
    traffic formula; the fields it adds to (or sets in) the group's row."""
    attended = max(r["impl_dcp_world_size"] for r in ranks)
    # What the plan says the group's collectives span; unpatched vLLM runs
    # every MLA group on the D-wide group.
    planned = (
        collective_world_size(
            g["shard_count"], dcp, replica_collectives=partial_collectives == REPLICA
        )
        if patched
        else dcp
    )
    decode = [r["decode_bytes"] for r in ranks]
    tokens = ranks[0]["decode_tokens"]
    expected = mla_decode_step_bytes(
        planned,
        tokens=tokens,
        heads_per_rank=shape.heads_per_rank,
        kv_lora_rank=shape.kv_lora_rank,
        rope_dim=shape.rope_dim,
        dtype_bytes=shape.dtype_bytes,
    )
    errors = _errors(ranks)
    return {
        "attention_mode": attention_mode(g["shard_count"], dcp)
        if patched
        else ("local" if attended == 1 else "dcp"),
        **errors,
        "collective_bytes_per_rank_per_step": max(decode),
        "collective_bytes_by_rank": decode,
        "collective_bytes_by_op": ranks[0]["decode_bytes_by_op"],
        "decode_tokens_per_step": tokens,
        "formula_bytes_per_rank_per_step": expected,
        "traffic_matches_formula": all(b == expected for b in decode)
        and attended == planned,
        "prefill_collective_bytes_per_rank": max(r["prefill_bytes"] for r in ranks),
        "attention_world_size": attended,
        "collective_world_size": planned,
        "collective_worlds_seen": sorted(
            {w for r in ranks for w in r["decode_collective_worlds"]}
        ),
        "attention_work_vs_sharded": attention_work_ratio(
            attended, g["shard_count"], dcp
        ),
        "ok": errors["max_abs_error"] is not None
        and errors["max_abs_error"] <= TOLERANCE
        and (errors["max_lse_error"] is None or errors["max_lse_error"] <= TOLERANCE),
    }


def merge(
    topology: Topology,
    groups: list[dict[str, Any]],
    results: list[dict[str, Any]],
    *,
    patched: bool,
    elapsed: float,
    gpu: bool,
    partial_collectives: str = REPLICA,
) -> dict[str, Any]:
    """One report from the ranks' results."""
    dcp = topology.decode_context_parallel_size
    shape = run_shape(topology)
    rows = []
    for g in groups:
        row = _group_row(g, dcp)
        if g["run"]:
            ranks = [
                next(r for r in result["groups"] if r["name"] == g["name"])
                for result in results
            ]
            row.update(
                _measured(
                    g,
                    ranks,
                    dcp=dcp,
                    shape=shape,
                    patched=patched,
                    partial_collectives=partial_collectives,
                )
            )
        rows.append(row)
    ran = [r for r in rows if r["status"] == "run"]
    first = results[0] if results else {}
    return {
        "command": "ranks",
        "mode": "patched" if patched else "unpatched",
        "topology": topology.name,
        "source": topology.source,
        "ranks": dcp,
        "ok": all(r["ok"] for r in ran),
        "groups_run": len(ran),
        "tolerance": TOLERANCE,
        "processes": {
            "count": len(results),
            "backend": "nccl" if gpu else "gloo",
            "device": "cuda" if gpu else "cpu",
            "tensor_parallel_size": dcp,
            "dcp_group": first.get("dcp_group"),
            "plugin_loaded_by_vllm": [r["patched"] for r in results],
        },
        "stand_ins": first.get("stand_ins", []),
        "partial_collectives": partial_collectives if patched else None,
        "replica_groups": first.get("replica_groups", []),
        "shape": {
            **shape.to_dict(),
            "note": "heads, head sizes and lengths scaled down; every group's K, "
            "block size and the interleave are the topology's",
        },
        "elapsed_s": round(elapsed, 3),
        "groups": rows,
    }


def run_ranks(
    topology: Topology,
    *,
    patched: bool,
    seed: int = 0,
    progress: bool = True,
    verbose: bool = False,
    partial_collectives: str = REPLICA,
) -> dict[str, Any]:
    """The whole run on ``patched`` (or unpatched) vLLM; a JSON-ready report.
    ``partial_collectives``: where the patched ranks run partial groups'
    collectives (``collectives.REPLICA`` or ``DCP_GROUP``)."""
    gpu = visible_gpus() >= topology.decode_context_parallel_size
    groups = plan_groups(topology, gpu=gpu)
    results: list[dict[str, Any]] = []
    elapsed = 0.0
    if any(g["run"] for g in groups):
        results, elapsed = launch(
            topology,
            groups,
            patched=patched,
            seed=seed,
            progress=progress,
            verbose=verbose,
            gpu=gpu,
            partial_collectives=partial_collectives,
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
        partial_collectives=partial_collectives,
    )
