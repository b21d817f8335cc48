# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How a run group's ranks are held to what they should be: the worst error
over every rank against the float64 reference, within a tolerance from the
group's dtype's epsilon (``tolerance``); the bytes each rank moved in one
decode step against the runner's traffic formula over the collective world W
the plan names (``traffic_and_class``); the class every rank ran against the
plan's. A group is ``ok`` only where all hold.

``measure_dense`` is the row of the dense runners, MLA's and
FlashAttention's (the formula: ``Shape.decode_step_bytes`` at the group's
shapes, ``collectives.mla_decode_step_bytes`` or ``dcp_decode_step_bytes``);
other runners build theirs from the same parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract.collectives import NCCL, attention_work_ratio
from vllm_dcp_geometry.contract.layer_classes import GENERIC_LAYERS
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape, phase_requests

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
    ``dot_lengths``: the score over L + R or the head size, the weighted sum
    over the longest context), whose rounding grows as sqrt(n) float32 roundoffs."""
    roundoff = EPSILON[dtype] / 2
    accumulated = sum(n**0.5 for n in dot_lengths) * EPSILON["float32"] / 2
    return (DTYPE_ROUNDINGS * roundoff + accumulated) * max(1.0, magnitude)


def attention_mode(shard_count: int, dcp: int) -> str:
    """The contract's attention mode of a group with K shards (``plan``'s
    names): ``local`` (K = 1), ``dcp-partial`` (1 < K < D), ``dcp`` (K = D)."""
    if shard_count == 1:
        return "local"
    return "dcp" if shard_count == dcp else "dcp-partial"


def worst_of(values: list[float | None]) -> float | None:
    seen = [v for v in values if v is not None]
    return max(seen) if seen else None


def _errors(ranks: list[dict[str, Any]], g: dict[str, Any]) -> dict[str, Any]:
    """The worst errors over the ranks of a group, by phase, then overall,
    and whether each is within the dtype's tolerance of its magnitude."""
    shape = Shape(**g["shape"])
    phases = phase_requests(
        g["block_size"], g["shard_count"], g["non_causal"], shape.sliding_window
    )
    longest = max(c + n for requests in phases.values() for c, n in requests)
    dots = (shape.score_dim, longest)
    worst: dict[str, Any] = {}
    within = True
    for phase, lse in (("decode", "decode"), ("prefill", "context")):
        for kind, key, into in (
            ("output", "max_abs_error", f"{phase}_max_abs_error"),
            ("lse", "max_lse_error", f"{lse}_max_lse_error"),
        ):
            error = worst_of([r[f"{phase}_{key}"] for r in ranks])
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
        "max_abs_error": worst_of(
            [worst["decode_max_abs_error"], worst["prefill_max_abs_error"]]
        ),
        "max_lse_error": worst_of(
            [worst["decode_max_lse_error"], worst["context_max_lse_error"]]
        ),
        "numerics_ok": within,
    }


def traffic_and_class(
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


def measure_dense(
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
    row = traffic_and_class(
        g,
        ranks,
        dcp=dcp,
        patched=patched,
        backend=backend,
        formula=shape.decode_step_bytes,
        unmodeled=unmodeled,
        # The class every rank ran must be the one the plan names.
        planned_class=g["layer_class"] or GENERIC_LAYERS[shape.is_mla],
    )
    # A decode step replayed from a CUDA graph (--cuda-graph) must be as
    # right as the eager one.
    graph = worst_of([r.get("graph_max_abs_error") for r in ranks])
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
