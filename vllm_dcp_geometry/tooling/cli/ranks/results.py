# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' report, merged from its workers' results (``merge``).

Per group: the worst error over every rank against the float64 reference,
held to a tolerance from the group's dtype's epsilon (``tolerance``), and the bytes
each rank moved through the DCP and replica groups in one decode step (the
same on every rank), against what ``collectives.mla_decode_step_bytes`` says
the group's collective world W moves at its shapes. A group is ``ok`` only
where both hold: numerics within tolerance and every rank's bytes equal to
the formula's over the W the plan names; the run is ``ok`` only where every
group run is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract.collectives import (
    GLOO,
    NCCL,
    attention_work_ratio,
    indexer_topk_merge_bytes,
)
from vllm_dcp_geometry.tooling.cli.ranks.cases import (
    MLA_ATTENTION_CLASS,
    Shape,
    phase_requests,
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

EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
"""Machine epsilon of each dtype a group runs in (the gap from 1 to the next
value); one rounding to the dtype is within half of it of the value's size
(the unit roundoff u = eps / 2)."""

DTYPE_ROUNDINGS = 16
"""Units of the dtype's roundoff u (times the reference's size) the output
and LSE may be off by. The decode path rounds to the dtype after the inputs
(which the reference shares) about 8 times: the absorbed latent query, the
softmax weights before P.V, each rank's partial latent output and its LSE
(TRITON_MLA keeps both in the query's dtype), the combine's corrected
output, the up-projected output; the reduce-scatter adds W - 1 more (up to
15), and a rounded LSE moves the combine's weights by up to u * |LSE|
(|LSE| <= 8 over these contexts). Independent roundings add up as the
square root of their count: sqrt(8 + 15) u + 8 u < 13 u, within 16 u.
The prefill path (up-projected context K/V, two attention outputs, their
merge) rounds fewer times."""


def tolerance(dtype: str, magnitude: float, dot_lengths: tuple[int, ...]) -> float:
    """The largest error allowed for a value of the reference's
    ``magnitude`` (at least 1: errors near zero are of the inputs' size)
    computed in ``dtype``: ``DTYPE_ROUNDINGS`` roundoffs of the dtype, plus
    the float32 accumulation of the sums the kernels form (the
    ``dot_lengths``: the score over L + R, the weighted sum over the longest
    context), whose rounding grows as sqrt(n) float32 roundoffs."""
    roundoff = EPSILON[dtype] / 2
    accumulated = sum(n**0.5 for n in dot_lengths) * EPSILON["float32"] / 2
    return (DTYPE_ROUNDINGS * roundoff + accumulated) * max(1.0, magnitude)


def attention_mode(shard_count: int, dcp: int) -> str:
    """The contract's attention mode of a group with K shards (``plan``'s
    names): ``local`` (K = 1), ``dcp-partial`` (1 < K < D), ``dcp`` (K = D)."""
    if shard_count == 1:
        return "local"
    return "dcp" if shard_count == dcp else "dcp-partial"


def _worst(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


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


def _errors(ranks: list[dict[str, Any]], g: dict[str, Any]) -> dict[str, Any]:
    """The worst errors over the ranks of a group, by phase, then overall,
    and whether each is within the dtype's tolerance of its magnitude."""
    shape = Shape(**g["shape"])
    phases = phase_requests(g["block_size"], g["shard_count"], g["non_causal"])
    longest = max(c + n for requests in phases.values() for c, n in requests)
    dots = (shape.kv_lora_rank + shape.rope_dim, longest)
    worst: dict[str, Any] = {}
    within = True
    for phase, lse in (("decode", "decode"), ("prefill", "context")):
        for kind, key, into in (
            ("output", "max_abs_error", f"{phase}_max_abs_error"),
            ("lse", "max_lse_error", f"{lse}_max_lse_error"),
        ):
            error = _worst([r[f"{phase}_{key}"] for r in ranks])
            size = max(r[f"{phase}_{kind}_magnitude"] for r in ranks)
            allowed = tolerance(shape.dtype, size, dots)
            worst[into] = error
            worst[f"{phase}_{kind}_magnitude"] = size
            worst[f"{into}_tolerance"] = allowed
            missing = kind == "output" and error is None
            if missing or (error is not None and not error <= allowed):
                within = False
    return {
        **worst,
        "max_abs_error": _worst(
            [worst["decode_max_abs_error"], worst["prefill_max_abs_error"]]
        ),
        "max_lse_error": _worst(
            [worst["decode_max_lse_error"], worst["context_max_lse_error"]]
        ),
        "numerics_ok": within,
    }


def _traffic_and_class(
    g: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    dcp: int,
    patched: bool,
    backend: str,
    formula: Callable[[int, int, str], int],
    unmodeled: list[str],
    planned_class: str,
) -> dict[str, Any]:
    """The fields every run group's row has: the decode step's bytes per rank
    against ``formula(W, tokens, backend)`` over the W the plan names (and on
    NCCL, what ``plan`` reports), the worlds attended and seen, and the class
    the ranks ran against the one the plan names."""
    attended = max(r["impl_dcp_world_size"] for r in ranks)
    # What the plan says the group's collectives span; unpatched vLLM runs
    # every MLA group on the D-wide group.
    planned = g["collective_world_size"] if patched else dcp
    decode = [r["decode_bytes"] for r in ranks]
    tokens = ranks[0]["decode_tokens"]
    expected = formula(planned, tokens, backend)
    ran_class = {r["layer_class_run"] for r in ranks}
    return {
        "attention_mode": attention_mode(g["shard_count"], dcp)
        if patched
        else ("local" if attended == 1 else "dcp"),
        "collective_bytes_per_rank_per_step": max(decode),
        "collective_bytes_by_rank": decode,
        "collective_bytes_by_op": ranks[0]["decode_bytes_by_op"],
        "collective_bytes_by_group": ranks[0]["decode_bytes_by_group"],
        "unmodeled_collectives": unmodeled,
        "decode_tokens_per_step": tokens,
        "formula_bytes_per_rank_per_step": expected,
        "nccl_formula_bytes_per_rank_per_step": formula(planned, tokens, NCCL),
        "traffic_matches_formula": all(b == expected for b in decode)
        and attended == planned
        and not unmodeled,
        "attention_world_size": attended,
        "collective_world_size": planned,
        "collective_worlds_seen": sorted(
            {w for r in ranks for w in r["decode_collective_worlds"]}
        ),
        "attention_work_vs_sharded": attention_work_ratio(
            attended, g["shard_count"], dcp
        ),
        "layer_class_run": sorted(ran_class),
        "layer_class_matches": ran_class == {planned_class},
    }


def _measured(
    g: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    dcp: int,
    patched: bool,
    backend: str,
) -> dict[str, Any]:
    """What the ranks of a run group measured, against the plan and the
    traffic formula at the group's shapes on the run's ``backend`` (every
    collective the process groups and vLLM's NCCL communicators ran, none
    unmodeled); the fields it adds to (or sets in) the group's row, with
    what the same step moves on NCCL (what ``plan`` reports)."""
    shape = Shape(**g["shape"])
    errors = _errors(ranks, g)
    unmodeled = sorted(
        {
            c
            for r in ranks
            for phase in ("decode", "prefill")
            for c in r[f"{phase}_unmodeled_collectives"]
        }
    )
    row = _traffic_and_class(
        g,
        ranks,
        dcp=dcp,
        patched=patched,
        backend=backend,
        formula=shape.decode_step_bytes,
        unmodeled=unmodeled,
        # The class every rank ran must be the one the plan names.
        planned_class=g["layer_class"] or MLA_ATTENTION_CLASS,
    )
    # A decode step replayed from a CUDA graph (--cuda-graph) must be as
    # right as the eager one.
    graph = _worst([r.get("graph_max_abs_error") for r in ranks])
    graph_ok = graph is None or graph <= errors["decode_max_abs_error_tolerance"]
    return {
        **row,
        **errors,
        "prefill_collective_bytes_per_rank": max(r["prefill_bytes"] for r in ranks),
        "decode_step_s": max(r["decode_step_s"] for r in ranks),
        "graph_max_abs_error": graph,
        "graph_ok": graph_ok,
        "ok": errors["numerics_ok"]
        and row["traffic_matches_formula"]
        and graph_ok
        and row["layer_class_matches"],
    }


ATTENTION_COLLECTIVES = "attention"
INDEXER_TOPK_MERGE = "indexer_topk_merge"
"""What a sparse row's decode step moves (``plan``'s ``decode_collectives``):
the attention's query all-gather and combine, or the indexer's top-k merge."""


def _sparse_numerics(g: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A sparse row's worst errors over the ranks (the latent row: output
    after ``W_UV`` and LSE, each within the dtype's tolerance of its
    magnitude; the indexer row has none) and whether every rank's merged
    selection is the float64 top-k (and, for the indexer row, every rank's
    builder gave its op the contract's local lengths)."""
    selections_ok = all(r["selection_ok"] for r in ranks)
    if ranks[0]["sparse_role"] != "latent":
        lengths_ok = all(r["local_lengths_ok"] for r in ranks)
        return {
            "max_abs_error": None,
            "max_lse_error": None,
            "selection_ok": selections_ok,
            "selection_repeats": any(r["selection_repeats"] for r in ranks),
            "local_lengths_ok": lengths_ok,
            "numerics_ok": selections_ok and lengths_ok,
        }
    shape = Shape(**g["shape"])
    # The sums the kernels form: the score over L + R, the softmax-weighted
    # sum over the top-k selected rows.
    dots = (shape.kv_lora_rank + shape.rope_dim, int(g["indexer_topk"]))
    worst: dict[str, Any] = {"selection_ok": selections_ok}
    within = selections_ok
    for kind, key in (("output", "max_abs_error"), ("lse", "max_lse_error")):
        error = _worst([r[f"decode_{key}"] for r in ranks])
        size = max(r[f"decode_{kind}_magnitude"] for r in ranks)
        allowed = tolerance(shape.dtype, size, dots)
        worst[key] = error
        worst[f"decode_{key}"] = error
        worst[f"decode_{kind}_magnitude"] = size
        worst[f"decode_{key}_tolerance"] = allowed
        if (kind == "output" and error is None) or (
            error is not None and not error <= allowed
        ):
            within = False
    return {**worst, "numerics_ok": within}


def _measured_sparse(
    g: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    dcp: int,
    patched: bool,
    backend: str,
) -> dict[str, Any]:
    """What the ranks of a DeepSeek-V3.2 layer measured for one of its two
    groups: the latent row against the MLA decode step's formula
    (``Shape.decode_step_bytes``: the query all-gather and combine), the
    indexer row against the top-k merge's
    (``collectives.indexer_topk_merge_bytes``), each over the W the plan
    names on the run's ``backend``, with the NCCL figure beside."""
    shape = Shape(**g["shape"])
    latent = ranks[0]["sparse_role"] == "latent"
    topk = int(g["indexer_topk"])

    def merge_bytes(world: int, tokens: int, on: str) -> int:
        return indexer_topk_merge_bytes(world, tokens=tokens, topk=topk, backend=on)

    row = _traffic_and_class(
        g,
        ranks,
        dcp=dcp,
        patched=patched,
        backend=backend,
        formula=shape.decode_step_bytes if latent else merge_bytes,
        unmodeled=sorted({c for r in ranks for c in r["decode_unmodeled_collectives"]}),
        planned_class=g["layer_class"],
    )
    numerics = _sparse_numerics(g, ranks)
    steps = [r["decode_step_s"] for r in ranks if r["decode_step_s"] is not None]
    return {
        **row,
        **numerics,
        "decode_collectives": ATTENTION_COLLECTIVES if latent else INDEXER_TOPK_MERGE,
        "indexer_topk": topk,
        "prefill_collective_bytes_per_rank": None,
        "decode_step_s": max(steps) if steps else None,
        "graph_max_abs_error": None,
        "graph_ok": True,
        "ok": numerics["numerics_ok"]
        and row["traffic_matches_formula"]
        and row["layer_class_matches"],
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
            measure = _measured_sparse if "sparse_role" in ranks[0] else _measured
            if crashed:
                row.update(_crashed(ranks, crashed, dcp=dcp, patched=patched))
            else:
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
            "(sqrt(L + R) + sqrt(longest context)) * epsilon[float32] / 2) * "
            "max(1, |reference|)",
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
        "shapes": "each group's own (query heads per TP rank, kv_lora_rank, "
        "rope dim, dtype, block size, K; the topology's interleave)"
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
