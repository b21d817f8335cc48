# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``: each attention group's K for a memory budget, the
trade-off between KV capacity and decode cost, and the line to paste.

The search runs its parts in order: the budget (``optimize_budget``), each
choice's admitted K and terms (``optimize_candidates``), their exact Pareto
frontier (``optimize_frontier``), vLLM's pool for every frontier point and
the scheduler's proof that it holds what vLLM's rule predicts
(``capacity_proof``); ``optimize_output`` prints the result.

Every frontier point is planned from its pasted ``--additional-config``
(the same totals, or an error) and given vLLM's own pool for the budget
(device memory x utilization - weights): start-up's planner groups, padding
and sizing (``vllm_pool``); the requests it holds are vLLM's rule. A point
start-up's planner refuses is dropped, named. The recommended pool and the
pool of every choice at its largest admitted K then run through vLLM's real
scheduler (``capacity_proof``), which must hold exactly as many
target-context requests at once as the rule predicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

from vllm_dcp_geometry.contract import scheduler_block_size
from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import (
    Pool,
    capacity_check,
    vllm_pool,
)
from vllm_dcp_geometry.tooling.cli.plan.optimize_budget import (
    BUDGET_FLAGS,
    Budget,
    make_budget,
)
from vllm_dcp_geometry.tooling.cli.plan.optimize_candidates import (
    Choice,
    Option,
    additional_config,
    admitted_options,
    applied,
    choices,
    restricted,
)
from vllm_dcp_geometry.tooling.cli.plan.optimize_frontier import (
    Point,
    frontier,
    largest_k_point,
    most_requests_per_step,
)
from vllm_dcp_geometry.tooling.cli.plan.optimize_output import (
    format_optimize,
    plot_frontier,
)
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError

__all__ = [
    "BUDGET_FLAGS",
    "format_optimize",
    "make_budget",
    "optimize_shard_counts",
    "plot_frontier",
]

Plan = Callable[[Topology], dict[str, Any]]


def optimize_shard_counts(
    topology: Topology,
    budget: Budget,
    *,
    objective: str,
    max_decode_overhead: float,
    attention_backend: str | None,
    draft_attention_backend: str | None,
    shard_counts: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The frontier, the recommended point and its line, as JSON;
    ``shard_counts`` limits the candidate K of every chosen group."""
    plan_of = _planner(attention_backend, draft_attention_backend)
    picked = choices(topology)
    if not any(c.fixed_k is None for c in picked):
        raise TopologyError(
            "--optimize: the topology has no target attention group to choose K for"
        )
    refused: list[str] = []
    per_choice = restricted(
        picked,
        [admitted_options(topology, c, plan_of, refused) for c in picked],
        topology.decode_context_parallel_size,
        shard_counts,
    )
    rows = {row["name"]: row for row in plan_of(topology)["groups"]}
    backends = {r["attention_backend"] for r in rows.values() if r["attention_backend"]}
    base = _unchosen(rows, picked)
    pooled, dropped = _pooled(
        topology, picked, frontier(base, per_choice, budget), plan_of, backends, budget
    )
    largest = largest_k_point(base, per_choice)
    reference = largest.step_seconds(budget)
    entries = most_requests_per_step(
        {
            point.ks: _entry(topology, picked, point, pool, budget, reference)
            for point, pool in pooled
        }
    )
    chosen = _recommended(entries, objective, max_decode_overhead)
    # The recommended pool and, for comparison, every choice at its largest
    # K, through vLLM's own scheduler: each must hold what the rule predicts.
    pools = {point.ks: pool for point, pool in pooled}
    capacity = capacity_check(
        topology,
        picked,
        {"recommended": chosen, "largest_k": largest.ks},
        lambda ks: (
            pools.get(ks)
            or vllm_pool(applied(topology, picked, ks), backends, budget.kv_bytes)
        ),
    )
    return {
        "capacity_check": capacity,
        "budget": budget.as_json(),
        "objective": objective,
        "max_decode_overhead": max_decode_overhead,
        "choices": _choices_json(picked, per_choice),
        "kept": [c.name for c in picked if c.fixed_k],
        "refused_candidates": refused,
        "unknown_collective_groups": _unknown_collectives(per_choice),
        "dropped_points": dropped,
        "reference_step_seconds": reference,
        "frontier": list(entries.values()),
        "recommended": entries[chosen],
    }


def _planner(
    attention_backend: str | None, draft_attention_backend: str | None
) -> Plan:
    # Imported per search, not with this module: the search benchmark counts
    # the plans by replacing ``document.build_plan``.
    from vllm_dcp_geometry.tooling.cli.plan.document import build_plan

    def plan_of(candidate: Topology) -> dict[str, Any]:
        return build_plan(
            candidate,
            attention_backend,
            draft_attention_backend=draft_attention_backend,
        )

    return plan_of


def _unchosen(rows: dict[str, dict[str, Any]], picked: Sequence[Choice]) -> Point:
    """The groups no choice holds (recurrent state): per request, the same
    at every K."""
    chosen_groups = {name for c in picked for name in c.groups}
    fixed_rows = [r for name, r in rows.items() if name not in chosen_groups]
    return Point(
        ks=(),
        request_bytes=sum(r["kv_bytes_per_request_per_rank"] for r in fixed_rows),
        collective_bytes=0.0,
        collective_hops=0,
        virtual_blocks=tuple(r["virtual_block_size"] for r in fixed_rows),
    )


def _choices_json(
    picked: Sequence[Choice], per_choice: Sequence[Sequence[Option]]
) -> list[dict[str, Any]]:
    return [
        {"name": c.name, "groups": list(c.groups), "candidates": [o.k for o in opts]}
        for c, opts in zip(picked, per_choice, strict=True)
    ]


def _unknown_collectives(per_choice: Sequence[Sequence[Option]]) -> list[str]:
    return sorted(
        {n for options in per_choice for o in options for n in o.unknown_collectives}
    )


def _pooled(
    topology: Topology,
    picked: Sequence[Choice],
    points: Sequence[Point],
    plan_of: Plan,
    backends: set[str],
    budget: Budget,
) -> tuple[list[tuple[Point, Pool]], list[str]]:
    """Each point planned as pasted (the same totals, or an error) with
    start-up's pool for the budget; a point whose grouping start-up refuses
    is dropped, named."""
    pooled, dropped = [], []
    for point in points:
        pasted = applied(topology, picked, point.ks)
        totals = plan_of(pasted)["totals"]
        if totals["kv_bytes_per_request_per_rank"] != point.request_bytes:
            raise TopologyError(
                f"--optimize: K={point.ks} plans "
                f"{totals['kv_bytes_per_request_per_rank']} "
                f"request bytes, the search summed {point.request_bytes}"
            )
        try:
            pool = vllm_pool(pasted, backends, budget.kv_bytes)
        except TopologyError as exc:
            dropped.append(f"K={list(point.ks)}: {exc}")
        else:
            pooled.append((point, pool))
    if not pooled:
        raise TopologyError(
            "--optimize: start-up's KV-cache grouping refuses every frontier point: "
            + "; ".join(dropped)
        )
    return pooled, dropped


def _recommended(
    entries: dict[tuple[int, ...], dict[str, Any]],
    objective: str,
    max_decode_overhead: float,
) -> tuple[int, ...]:
    """The recommended point's K: the fastest for ``latency``, else the one
    holding the most requests within ``max_decode_overhead``."""
    if objective == "latency":
        return min(
            entries,
            key=lambda ks: (entries[ks]["step_seconds"], -entries[ks]["requests"]),
        )
    allowed = [
        ks for ks, e in entries.items() if e["decode_overhead"] <= max_decode_overhead
    ]
    if not allowed:
        raise TopologyError(
            f"--optimize: no admitted assignment is within "
            f"--max-decode-overhead {max_decode_overhead} of every group at its "
            "largest K"
        )
    return max(
        allowed, key=lambda ks: (entries[ks]["requests"], -entries[ks]["step_seconds"])
    )


def _entry(
    topology: Topology,
    picked: Sequence[Choice],
    point: Point,
    pool: Pool,
    budget: Budget,
    reference: float,
) -> dict[str, Any]:
    step = point.step_seconds(budget)
    blocks = [b for b in point.virtual_blocks if b]
    return {
        "shard_counts": {c.name: k for c, k in zip(picked, point.ks, strict=True)},
        "request_bytes_per_rank": point.request_bytes,
        "requests": pool.requests,
        "pool_blocks": pool.num_blocks,
        "blocks_per_request": pool.blocks_per_request,
        "collective_bytes_per_token_per_rank": point.collective_bytes,
        "step_seconds": step,
        "decode_overhead": step / reference if reference else 1.0,
        "scheduler_block_size": scheduler_block_size(blocks),
        "hash_block_size": math.gcd(*blocks) if blocks else None,
        "additional_config": json.dumps(
            additional_config(topology, picked, point.ks), separators=(",", ":")
        ),
    }
