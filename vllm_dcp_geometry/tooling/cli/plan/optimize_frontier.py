# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s frontier: assignments of a K per choice, their
modeled decode step time, and the exact Pareto frontier over them.

A modeled decode step time per request is request bytes / HBM bandwidth +
collective bytes / link bandwidth + ring steps x a hop latency (a model from
public figures, labelled as one, overridable). The search keeps the exact
Pareto frontier of (request bytes, step time) by merging the choices'
candidates one at a time and dropping dominated sums, so it is exact without
enumerating every assignment. Once each point's pool is counted, a point
another beats on requests held and step time is dropped too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, TypeVar

from vllm_dcp_geometry.tooling.cli.plan.optimize_budget import Budget
from vllm_dcp_geometry.tooling.cli.plan.optimize_candidates import Option

Key = TypeVar("Key")


@dataclasses.dataclass(frozen=True)
class Point:
    """One assignment: a K per choice and its summed terms."""

    ks: tuple[int, ...]
    request_bytes: int
    collective_bytes: float
    collective_hops: int
    virtual_blocks: tuple[int, ...]

    def step_seconds(self, budget: Budget) -> float:
        return (
            self.request_bytes / (budget.hbm_gbps * 1e9)
            + self.collective_bytes / (budget.link_gbps * 1e9)
            + self.collective_hops * budget.hop_latency_us * 1e-6
        )


def frontier(
    base: Point, per_choice: Sequence[Sequence[Option]], budget: Budget
) -> list[Point]:
    """The exact Pareto frontier of (request bytes, step time): merge one
    choice's options at a time into the running frontier, keeping only
    non-dominated sums (both terms add over choices)."""
    points = [base]
    for options in per_choice:
        merged = [
            Point(
                ks=(*p.ks, o.k),
                request_bytes=p.request_bytes + o.request_bytes,
                collective_bytes=p.collective_bytes + o.collective_bytes,
                collective_hops=p.collective_hops + o.collective_hops,
                virtual_blocks=(*p.virtual_blocks, *o.virtual_blocks),
            )
            for p in points
            for o in options
        ]
        points = _non_dominated(merged, budget)
    return points


def _non_dominated(points: list[Point], budget: Budget) -> list[Point]:
    ordered = sorted(points, key=lambda p: (p.request_bytes, p.step_seconds(budget)))
    kept: list[Point] = []
    best = math.inf
    for point in ordered:
        t = point.step_seconds(budget)
        if t < best:
            kept.append(point)
            best = t
    return kept


def largest_k_point(base: Point, per_choice: Sequence[Sequence[Option]]) -> Point:
    """Every choice at its largest admitted K: the reference step time."""
    largest = [max(options, key=lambda o: o.k) for options in per_choice]
    return Point(
        ks=tuple(o.k for o in largest),
        request_bytes=base.request_bytes + sum(o.request_bytes for o in largest),
        collective_bytes=sum(o.collective_bytes for o in largest),
        collective_hops=sum(o.collective_hops for o in largest),
        virtual_blocks=(),
    )


def most_requests_per_step(
    entries: dict[Key, dict[str, Any]],
) -> dict[Key, dict[str, Any]]:
    """The entries (``requests``, ``step_seconds``) no other beats. vLLM's
    pool counts whole requests of whole blocks (padding layers included): a
    point on the bytes frontier can hold no more requests than a faster one."""
    return {
        key: entry
        for key, entry in entries.items()
        if not any(_beats(other, entry) for other in entries.values())
    }


def _beats(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """``one`` holds at least as many requests at no more step time, and is
    better in one of them."""
    return (
        one["requests"] >= other["requests"]
        and one["step_seconds"] <= other["step_seconds"]
        and (
            one["requests"] > other["requests"]
            or one["step_seconds"] < other["step_seconds"]
        )
    )
