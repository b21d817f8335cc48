# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' report, merged from its workers' results (``merge``).

Per group: what the plan says of it, and for a group run, its runner's
``measure`` of every rank's row (``verdict``: errors within the dtype's
tolerance, the bytes each rank moved in one decode step against the
formula's over the W the plan names, the class it ran), or what a rank's
layer raised. The run is ``ok`` only where every group run is.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract.collectives import GLOO, NCCL
from vllm_dcp_geometry.tooling.cli.ranks.runners import RUNNERS_BY_NAME
from vllm_dcp_geometry.tooling.cli.ranks.verdict import (
    DTYPE_ROUNDINGS,
    EPSILON,
    attention_mode,
)

STEP_TIME_CPU = (
    "the slowest rank's median of 3 decode steps of one layer "
    "(metadata build + forward_impl), CPU: vLLM's Triton kernels under the "
    "interpreter, D processes sharing this machine's cores, gloo over loopback; "
    "compare groups of one run only, never a GPU's time"
)
STEP_TIME_GPU = (
    "the slowest rank's median of 3 decode steps of one layer "
    "(metadata build + forward_impl, eager, synchronised), on the run's GPUs "
    "with NCCL"
)


def _shape_row(g: dict[str, Any]) -> dict[str, Any]:
    """What the group ran at (None where it did not run) and what the
    topology gives, with its block size and the interleave."""
    return {
        "shape": g["shape"],
        "topology_shape": g["topology_shape"],
        "interleave": g["interleave"],
    }


def _group_row(g: dict[str, Any], dcp: int) -> dict[str, Any]:
    """A group's row before any rank's result: what the plan says of it."""
    return {
        "name": g["name"],
        "kind": g["kind"],
        "layer_class": g["layer_class"] or "MLAAttention",
        "backend": g.get("backend"),
        "shard_count": g["shard_count"],
        "block_size": g["block_size"],
        **_shape_row(g),
        "attention_mode": "none"
        if g["shard_count"] is None
        else attention_mode(g["shard_count"], dcp),
        "collective_world_size": g["collective_world_size"],
        "status": "run" if g["run"] else "not run",
        "reason": g["reason"],
        "max_abs_error": None,
        "max_lse_error": None,
        "collective_bytes_per_rank_per_step": None,
    }


def _crashed(
    ranks: list[dict[str, Any]], crashed: list[str], *, dcp: int, patched: bool
) -> dict[str, Any]:
    """A group some rank's layer raised in: what it raised, in which phase,
    and (where every rank built its layer) the world its impl attends over
    (unpatched: its mode, as for a group that ran)."""
    row: dict[str, Any] = {"crashed": crashed, "ok": False}
    phases = sorted({r["crashed_in"] for r in ranks if "crashed_in" in r})
    if phases:
        row["crashed_in"] = phases
    if all("impl_dcp_world_size" in r for r in ranks):
        attended = max(r["impl_dcp_world_size"] for r in ranks)
        row["attention_world_size"] = attended
        if not patched:
            row["attention_mode"] = "local" if attended == 1 else "dcp"
    return row


def merge(
    topology: Any,
    groups: list[dict[str, Any]],
    results: list[dict[str, Any]],
    *,
    patched: bool,
    elapsed: float,
    gpu: bool,
    scale: int,
    partial_collectives: str,
    launched_by: str = "vllm-dcp-geometry",
) -> dict[str, Any]:
    """One report from the ranks' results (``launched_by``: this command's
    launcher, or ``torchrun``)."""
    dcp = topology.decode_context_parallel_size
    backend = NCCL if gpu else GLOO
    rows = []
    for g in groups:
        row = _group_row(g, dcp)
        if g["run"]:
            ranks = [
                next(r for r in result["groups"] if r["name"] == g["name"])
                for result in results
            ]
            crashed = sorted({r["crashed"] for r in ranks if "crashed" in r})
            if crashed:
                row.update(_crashed(ranks, crashed, dcp=dcp, patched=patched))
            else:
                measure = RUNNERS_BY_NAME[g["runner"]].measure
                row.update(measure(g, ranks, dcp=dcp, patched=patched, backend=backend))
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
        "tolerance": {
            "dtype_roundings": DTYPE_ROUNDINGS,
            "epsilon": EPSILON,
            "rule": "error <= (dtype_roundings * epsilon[dtype] / 2 + "
            "(sqrt(L + R, or the head size) + sqrt(longest context)) * "
            "epsilon[float32] / 2) * max(1, |reference|)",
        },
        "processes": {
            "count": len(results),
            "backend": backend,
            "device": "cuda" if gpu else "cpu",
            "device_names": sorted({r.get("device_name", "?") for r in results}),
            "launched_by": launched_by,
            "tensor_parallel_size": dcp,
            "dcp_group": first.get("dcp_group"),
            "plugin_loaded_by_vllm": [r["patched"] for r in results],
        },
        "stand_ins": first.get("stand_ins", [])
        + sorted({s for g in first.get("groups", []) for s in g.get("stand_ins", [])}),
        "partial_collectives": partial_collectives if patched else None,
        "replica_groups": first.get("replica_groups", []),
        "scale": scale,
        "scaled": scale != 1,
        "shapes": "each group's own (query heads per TP rank, kv_lora_rank "
        "and rope dim or head size, dtype, block size, K; the topology's "
        "interleave)"
        + (
            ""
            if scale == 1
            else f", query heads per rank divided by --scale {scale} "
            "(rounded up, at least 2)"
        ),
        "elapsed_s": round(elapsed, 3),
        "step_time": STEP_TIME_GPU if gpu else STEP_TIME_CPU,
        "groups": rows,
    }
