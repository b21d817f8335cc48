# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``: each attention group's K for a memory budget, the
trade-off between KV capacity and decode cost, and the line to paste.

Candidates. Groups that must share one K are one choice: a latent cache and
its indexer cache (start-up hands the indexer its latent's override) and,
conservatively, every sparse latent group (start-up requires one K per sparse
index group, which a topology does not record). A draft keeps its K
(start-up refuses sharding a draft vLLM builds replicated where its impl
runs for fewer than D ranks, which a topology cannot tell), named in the
line all the same; recurrent state has none to choose. For the rest, every
divisor K of D is planned by ``build_plan`` on the topology with
that choice applied through ``apply_additional_config`` (start-up's override
rules) and kept only where start-up's admission rule admits every group of
the choice: a K start-up would refuse is never a candidate.

Terms, per rank and additive over choices: the KV bytes one request of the
target context occupies (vLLM's page rule, ``kv_bytes_per_request_per_rank``)
and the decode collective bytes and ring steps per token over all the
choice's layers (a quantized cache's activation size is unknown to the
topology, so its collective bytes count 0 and are named). A modeled decode
step time per request is request bytes / HBM bandwidth + collective bytes /
link bandwidth + ring steps x a hop latency (a model from public figures,
labelled as one, overridable). The search keeps the exact Pareto frontier of
(request bytes, step time) by merging the choices' candidates one at a time
and dropping dominated sums, so it is exact without enumerating every
assignment.

Every frontier point is then planned from its pasted ``--additional-config``
(the same totals, or an error) and given vLLM's own pool for the budget
(device memory x utilization - weights): start-up's planner groups, padding
and sizing (``vllm_pool``); the requests it holds are vLLM's rule. A point
start-up's planner refuses is dropped, named. The recommended pool and the
pool of every choice at its largest admitted K then run through vLLM's real
scheduler (``capacity_proof``), which must hold exactly as many
target-context requests at once as the rule predicts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, scheduler_block_size
from vllm_dcp_geometry.contract.overrides import CONFIG_KEY, REPLICATED, SHARDED
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError
from vllm_dcp_geometry.tooling.vllm_release import vllm_release

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    """Public figures for one GPU, per device."""

    name: str
    memory_gib: float
    hbm_gbps: float
    link_gbps: float


DEVICES = {
    d.name: d
    for d in (
        # Vendor datasheets: HBM bandwidth, NVLink bandwidth per direction.
        Device("H100", 80, 3350, 450),
        Device("H200", 141, 4800, 450),
        Device("B200", 180, 8000, 900),
    )
}


BUDGET_FLAGS: tuple[tuple[str, Any, Any, str | None, str], ...] = (
    # flag, type, default, metavar, help: ``make_budget``'s parameters.
    ("--device", str, None, "NAME", f"GPU figures: {', '.join(DEVICES)}"),
    ("--gpu-memory-gib", float, None, "GIB", "memory per GPU"),
    ("--gpu-memory-utilization", float, 0.9, None, "as vLLM reads it (0.9)"),
    (
        "--weight-gib",
        float,
        None,
        "GIB",
        "weights and other non-KV memory per rank (default: --model's "
        "parameters, else 0)",
    ),
    ("--hbm-gbps", float, None, "GB/S", "HBM bandwidth per GPU"),
    ("--link-gbps", float, None, "GB/S", "GPU-to-GPU bandwidth per direction"),
    ("--hop-latency-us", float, 5.0, "US", "latency of one ring step (5)"),
)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one rank has for KV and how fast it moves bytes."""

    memory_bytes: int
    utilization: float
    weight_bytes: int
    hbm_gbps: float
    link_gbps: float
    hop_latency_us: float
    device: str | None
    weights_from: str = "--weight-gib"

    @property
    def kv_bytes(self) -> int:
        return int(self.memory_bytes * self.utilization) - self.weight_bytes


def make_budget(
    *,
    device: str | None,
    gpu_memory_gib: float | None,
    gpu_memory_utilization: float,
    weight_gib: float | None,
    hbm_gbps: float | None,
    link_gbps: float | None,
    hop_latency_us: float = 5.0,
    model_weight_bytes: int | None = None,
) -> Budget:
    """The budget from a device name and/or explicit figures; bad input
    raises ``TopologyError`` with one line."""
    known = None
    if device is not None:
        known = DEVICES.get(device.upper())
        if known is None:
            raise TopologyError(
                f"--device {device!r} is not in the table "
                f"({', '.join(DEVICES)}); give --gpu-memory-gib, --hbm-gbps and "
                "--link-gbps instead"
            )
    memory = (
        gpu_memory_gib if gpu_memory_gib is not None else known and known.memory_gib
    )
    hbm = hbm_gbps if hbm_gbps is not None else known and known.hbm_gbps
    link = link_gbps if link_gbps is not None else known and known.link_gbps
    missing = [
        flag
        for flag, value in (
            ("--gpu-memory-gib", memory),
            ("--hbm-gbps", hbm),
            ("--link-gbps", link),
        )
        if not value
    ]
    if missing:
        raise TopologyError(
            f"--optimize needs --device or {', '.join(missing)} (per rank)"
        )
    utilization = gpu_memory_utilization
    if not 0 < utilization <= 1:
        raise TopologyError(
            f"--gpu-memory-utilization must be in (0, 1], got {utilization}"
        )
    budget = Budget(
        memory_bytes=int(float(memory) * GIB),  # type: ignore[arg-type]
        utilization=utilization,
        weight_bytes=(
            int(weight_gib * GIB) if weight_gib is not None else model_weight_bytes or 0
        ),
        weights_from=(
            "--weight-gib"
            if weight_gib is not None
            else "the model's parameters"
            if model_weight_bytes
            else "none given"
        ),
        hbm_gbps=float(hbm),  # type: ignore[arg-type]
        link_gbps=float(link),  # type: ignore[arg-type]
        hop_latency_us=hop_latency_us,
        device=known.name if known else None,
    )
    if budget.kv_bytes <= 0:
        raise TopologyError(
            f"the weights ({budget.weight_bytes / GIB:,.1f} GiB per rank, "
            f"{budget.weights_from}) leave no KV memory in {memory} GiB x "
            f"{utilization}"
        )
    return budget


@dataclasses.dataclass(frozen=True)
class Choice:
    """Groups that take one K together, and the layers an override names."""

    name: str
    groups: tuple[str, ...]
    layers: tuple[str, ...]
    fixed_k: int | None = None
    """The K a draft keeps (named in the line all the same, so the line
    states every attention layer's K)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One K of one choice and its additive terms."""

    k: int
    request_bytes: int
    collective_bytes: float
    collective_hops: int
    virtual_blocks: tuple[int, ...]
    unknown_collectives: tuple[str, ...]


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


def choices(topology: Topology) -> list[Choice]:
    """The topology's attention groups as choices (recurrent state has none)."""
    dcp = topology.decode_context_parallel_size
    by_choice: dict[str, list[CacheGroup]] = {}
    indexers: list[CacheGroup] = []
    for group in topology.groups:
        fields = group.spec_fields
        if not group.is_attention:
            continue
        if fields.get("cache_role") == "indexer":
            indexers.append(group)
        else:
            # A sparse latent cache of an index group (its top-k buffer).
            indexed = "is_index_group_leader" in fields or "topk_buffer_width" in fields
            key = "sparse" if indexed and not group.draft else group.name
            by_choice.setdefault(key, []).append(group)
    result = []
    for name, groups in by_choice.items():
        layers = tuple(layer for g in groups for layer in g.layers)
        ids = {_layer_id(layer) for layer in layers}
        # An indexer cache goes with its latent cache (the same layer).
        tied = [g for g in indexers if {_layer_id(x) for x in g.layers} <= ids]
        result.append(
            Choice(
                name=name,
                groups=tuple(g.name for g in (*groups, *tied)),
                layers=layers,
                fixed_k=groups[0].shard_count(dcp) if groups[0].draft else None,
            )
        )
    return result


def _layer_id(layer: str) -> str:
    # "model.layers.7.self_attn.attn" and its indexer cache
    # "model.layers.7.self_attn.indexer.k_cache" share "model.layers.7".
    parts = layer.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return layer


def override_value(k: int, dcp: int) -> int | str:
    return REPLICATED if k == 1 else SHARDED if k == dcp else k


def additional_config(
    topology: Topology, picked: Sequence[Choice], ks: Sequence[int]
) -> dict[str, Any]:
    """The ``--additional-config`` that gives each choice its K."""
    dcp = topology.decode_context_parallel_size
    layers = {
        layer: override_value(k, dcp)
        for choice, k in zip(picked, ks, strict=True)
        for layer in choice.layers
    }
    return {CONFIG_KEY: {"layers": layers}}


def candidate_shard_counts(dcp: int, wanted: Sequence[int] | None) -> list[int]:
    """Every divisor of D, or the operator's list (each must divide D)."""
    divisors = [k for k in range(1, dcp + 1) if dcp % k == 0]
    if wanted is None:
        return divisors
    bad = sorted({k for k in wanted if k not in divisors})
    if bad or not wanted:
        raise TopologyError(
            f"--shard-counts {','.join(map(str, wanted))}: every K must divide "
            f"the DCP world size {dcp} ({', '.join(map(str, divisors))})"
        )
    return sorted(set(wanted))


def _options(
    topology: Topology,
    choice: Choice,
    plan_of: Any,
    refused: list[str],
) -> list[Option]:
    dcp = topology.decode_context_parallel_size
    roles = {g.name: g.spec_fields.get("cache_role") for g in topology.groups}
    options = []
    ks = [choice.fixed_k] if choice.fixed_k else candidate_shard_counts(dcp, None)
    for k in ks:
        try:
            candidate = _applied(topology, [choice], [k])
            rows = {row["name"]: row for row in plan_of(candidate)["groups"]}
        except (DcpGeometryError, TopologyError) as exc:  # start-up's rules
            refused.append(f"{choice.name} K={k}: {exc}")
            continue
        mine = [rows[name] for name in choice.groups]
        refusal = next(
            (r["attention_refusal"] for r in mine if r["attention_refusal"]), None
        )
        if refusal:
            refused.append(f"{choice.name} K={k}: {refusal}")
            continue
        unknown = tuple(
            r["name"]
            for r in mine
            if r["decode_collective_bytes_per_rank_per_token"] is None
            and r["attention_mode"] not in ("local", "none")
        )
        options.append(
            Option(
                k=k,
                request_bytes=sum(r["kv_bytes_per_request_per_rank"] for r in mine),
                collective_bytes=sum(
                    r["num_layers"]
                    * (r["decode_collective_bytes_per_rank_per_token"] or 0)
                    for r in mine
                ),
                collective_hops=sum(
                    r["num_layers"]
                    * _hops(r["collective_world_size"], roles.get(r["name"]))
                    for r in mine
                ),
                virtual_blocks=tuple(r["virtual_block_size"] for r in mine),
                unknown_collectives=unknown,
            )
        )
    if not options:
        raise TopologyError(f"--optimize: no K is admitted for {choice.name}")
    return options


def restricted(
    picked: Sequence[Choice],
    per_choice: Sequence[list[Option]],
    dcp: int,
    wanted: Sequence[int] | None,
) -> list[list[Option]]:
    """Each choice's admitted options within ``--shard-counts``. A choice
    start-up admits at one K only (a draft, a sliding window, a backend that
    refuses DCP) keeps that K; a list no choice admits is bad input."""
    if wanted is None:
        return list(per_choice)
    candidates = candidate_shard_counts(dcp, wanted)
    listed = ",".join(map(str, candidates))
    result, matched = [], False
    for choice, options in zip(picked, per_choice, strict=True):
        kept = [o for o in options if o.k in candidates]
        if len(options) > 1 and not kept:
            admitted = ", ".join(str(o.k) for o in options)
            raise TopologyError(
                f"--shard-counts {listed}: start-up admits none of them for "
                f"{choice.name} (it admits K = {admitted})"
            )
        matched |= bool(kept) and choice.fixed_k is None
        result.append(kept or options)
    if not matched:
        admitted = "; ".join(
            f"{c.name}: K = {', '.join(str(o.k) for o in options)}"
            for c, options in zip(picked, per_choice, strict=True)
            if c.fixed_k is None
        )
        raise TopologyError(
            f"--shard-counts {listed}: start-up admits none of them for any "
            f"group ({admitted})"
        )
    return result


COLLECTIVES_PER_LAYER = 3
"""A DCP decode step's collectives per attention layer: the query
all-gather, the LSE all-gather and the output reduce-scatter
(``contract.collectives``); an indexer cache's layer adds one, its top-k
merge's all-gather."""


def _hops(world_size: int | None, cache_role: str | None) -> int:
    # A ring collective over W ranks takes W - 1 steps, each paying latency.
    if not world_size:
        return 0
    collectives = 1 if cache_role == "indexer" else COLLECTIVES_PER_LAYER
    return collectives * (world_size - 1)


def _applied(
    topology: Topology, picked: Sequence[Choice], ks: Sequence[int]
) -> Topology:
    from vllm_dcp_geometry.tooling.topology.overrides import apply_additional_config

    return apply_additional_config(topology, additional_config(topology, picked, ks))


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
    from vllm_dcp_geometry.tooling.cli.plan.document import build_plan

    def plan_of(candidate: Topology) -> dict[str, Any]:
        return build_plan(
            candidate,
            attention_backend,
            draft_attention_backend=draft_attention_backend,
        )

    picked = choices(topology)
    if not any(c.fixed_k is None for c in picked):
        raise TopologyError(
            "--optimize: the topology has no target attention group to choose K for"
        )
    refused: list[str] = []
    per_choice = restricted(
        picked,
        [_options(topology, c, plan_of, refused) for c in picked],
        topology.decode_context_parallel_size,
        shard_counts,
    )
    rows = {row["name"]: row for row in plan_of(topology)["groups"]}
    chosen_groups = {name for c in picked for name in c.groups}
    fixed_rows = [r for name, r in rows.items() if name not in chosen_groups]
    # Recurrent state: per request, the same at every K.
    base = Point(
        ks=(),
        request_bytes=sum(r["kv_bytes_per_request_per_rank"] for r in fixed_rows),
        collective_bytes=0.0,
        collective_hops=0,
        virtual_blocks=tuple(r["virtual_block_size"] for r in fixed_rows),
    )
    unknown = sorted(
        {n for options in per_choice for o in options for n in o.unknown_collectives}
    )
    points = frontier(base, per_choice, budget)
    # Each point planned as pasted: the same totals, a grouping start-up takes.
    checked, dropped = [], []
    backends = {r["attention_backend"] for r in rows.values() if r["attention_backend"]}
    for point in points:
        applied = _applied(topology, picked, point.ks)
        totals = plan_of(applied)["totals"]
        if totals["kv_bytes_per_request_per_rank"] != point.request_bytes:
            raise TopologyError(
                f"--optimize: K={point.ks} plans "
                f"{totals['kv_bytes_per_request_per_rank']} "
                f"request bytes, the search summed {point.request_bytes}"
            )
        try:
            pool = vllm_pool(applied, backends, budget.kv_bytes)
        except TopologyError as exc:
            dropped.append(f"K={list(point.ks)}: {exc}")
        else:
            checked.append((point, pool))
    if not checked:
        raise TopologyError(
            "--optimize: start-up's KV-cache grouping refuses every frontier point: "
            + "; ".join(dropped)
        )
    largest = [max(options, key=lambda o: o.k) for options in per_choice]
    sharded = Point(
        ks=tuple(o.k for o in largest),
        request_bytes=base.request_bytes + sum(o.request_bytes for o in largest),
        collective_bytes=sum(o.collective_bytes for o in largest),
        collective_hops=sum(o.collective_hops for o in largest),
        virtual_blocks=(),
    )
    reference = sharded.step_seconds(budget)
    entries = [
        _entry(topology, picked, point, pool, budget, reference)
        for point, pool in checked
    ]
    chosen_ks = {id(e): p.ks for e, (p, _) in zip(entries, checked, strict=True)}
    # vLLM's pool counts whole requests of whole blocks (padding layers
    # included): a point on the bytes frontier can hold no more requests than
    # a faster one. Those are not shown or chosen.
    entries = [e for e in entries if not any(_beats(other, e) for other in entries)]
    if objective == "latency":
        chosen = min(entries, key=lambda e: (e["step_seconds"], -e["requests"]))
    else:
        allowed = [e for e in entries if e["decode_overhead"] <= max_decode_overhead]
        if not allowed:
            raise TopologyError(
                f"--optimize: no admitted assignment is within "
                f"--max-decode-overhead {max_decode_overhead} of every group at its "
                "largest K"
            )
        chosen = max(allowed, key=lambda e: (e["requests"], -e["step_seconds"]))
    # The recommended pool and, for comparison, every choice at its largest
    # K, through vLLM's own scheduler: each must hold what the rule predicts.
    pools = {point.ks: pool for point, pool in checked}
    capacity = capacity_check(
        topology,
        picked,
        {"recommended": chosen_ks[id(chosen)], "largest_k": sharded.ks},
        lambda ks: (
            pools.get(ks)
            or vllm_pool(_applied(topology, picked, ks), backends, budget.kv_bytes)
        ),
    )
    return {
        "capacity_check": capacity,
        "budget": {
            "device": budget.device,
            "gpu_memory_bytes": budget.memory_bytes,
            "gpu_memory_utilization": budget.utilization,
            "weight_bytes_per_rank": budget.weight_bytes,
            "weights_from": budget.weights_from,
            "kv_bytes_per_rank": budget.kv_bytes,
            "hbm_gbps": budget.hbm_gbps,
            "link_gbps": budget.link_gbps,
            "hop_latency_us": budget.hop_latency_us,
        },
        "objective": objective,
        "max_decode_overhead": max_decode_overhead,
        "choices": [
            {
                "name": c.name,
                "groups": list(c.groups),
                "candidates": [o.k for o in opts],
            }
            for c, opts in zip(picked, per_choice, strict=True)
        ],
        "kept": [c.name for c in picked if c.fixed_k],
        "refused_candidates": refused,
        "unknown_collective_groups": unknown,
        "dropped_points": dropped,
        "reference_step_seconds": reference,
        "frontier": entries,
        "recommended": chosen,
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


def format_optimize(result: dict[str, Any], topology: Topology) -> str:
    budget = result["budget"]
    names = [c["name"] for c in result["choices"]]
    lines = [
        f"--optimize {topology.name} on vLLM {vllm_release()}: "
        f"DCP={topology.decode_context_parallel_size}, "
        f"max_model_len={topology.max_model_len:,}; per rank "
        f"{budget['kv_bytes_per_rank'] / GIB:,.1f} GiB for KV "
        f"({budget['gpu_memory_bytes'] / GIB:,.0f} GiB x "
        f"{budget['gpu_memory_utilization']} - "
        f"{budget['weight_bytes_per_rank'] / GIB:,.1f} "
        f"GiB weights from {budget['weights_from']}"
        f"{', ' + budget['device'] if budget['device'] else ''})",
        "choices (groups that take one K): "
        + "; ".join(
            f"{c['name']} ({', '.join(c['groups'])}): K in {c['candidates']}"
            for c in result["choices"]
        ),
    ]
    if result["kept"]:
        lines.append(
            "drafts keep the K vLLM builds them with: " + ", ".join(result["kept"])
        )
    for reason in result["refused_candidates"]:
        lines.append(f"not a candidate, start-up would refuse: {reason}")
    if result["unknown_collective_groups"]:
        lines.append(
            "collective bytes unknown (quantized cache, activation size not in the "
            "topology), counted 0: " + ", ".join(result["unknown_collective_groups"])
        )
    header = [
        *names,
        "requests",
        "B/request/rank",
        "coll B/token",
        "step (model)",
        "vs K=max",
        "sched B",
    ]
    rows = [
        [
            *(str(e["shard_counts"][n]) for n in names),
            f"{e['requests']:,}",
            f"{e['request_bytes_per_rank']:,}",
            f"{e['collective_bytes_per_token_per_rank']:,.0f}",
            f"{e['step_seconds'] * 1e3:.3f} ms",
            f"{e['decode_overhead']:.3f}",
            f"{e['scheduler_block_size']:,}",
        ]
        for e in result["frontier"]
    ]
    from vllm_dcp_geometry.tooling.cli.common.text_table import render_table

    chosen = result["recommended"]
    lines += [
        "",
        "frontier (of the assignments on the exact request-bytes / step-time "
        "frontier, those no other holds more requests at a lower step time):",
        render_table(header, rows, right=set(range(len(header)))),
        "",
        "step (model): request bytes / HBM "
        f"{budget['hbm_gbps']:,.0f} GB/s + collective bytes / link "
        f"{budget['link_gbps']:,.0f} GB/s + {budget['hop_latency_us']} us per ring "
        f"step of {COLLECTIVES_PER_LAYER} collectives per DCP layer (1 per indexer), "
        "one request per decode step; a model, not a measurement. requests: what "
        "vLLM's pool for the budget holds by vLLM's rule. vs K=max: against every "
        "choice at its largest admitted K. sched B: the scheduler block (LCM of "
        "B x K; prefix-cache hits are counted in it).",
        f"recommended ({result['objective']}"
        + (
            f", within {result['max_decode_overhead']}x"
            if result["objective"] == "capacity"
            else ""
        )
        + f"): K {chosen['shard_counts']}, {chosen['requests']:,} requests of "
        f"{topology.max_model_len:,} tokens per rank's KV",
        f"vllm serve ... --additional-config '{chosen['additional_config']}'",
    ]
    for reason in result["dropped_points"]:
        lines.append(f"dropped, start-up's KV-cache grouping refuses it: {reason}")
    lines += capacity_lines(result["capacity_check"], topology)
    return "\n".join(lines)


def capacity_lines(check: dict[str, Any], topology: Topology) -> list[str]:
    """The scheduler check in ``format_optimize``'s text: per point, vLLM's
    rule against what vLLM's scheduler held at once."""
    from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import admission_line

    recommended, largest = check["recommended"], check["largest_k"]
    ran = next(
        (e for e in (recommended, largest) if e.get("admitted_requests") is not None),
        None,
    )
    lines = []
    if ran:
        lines.append(
            f"vLLM's {ran['scheduler']} on the pool for this budget "
            f"({ran['batches_in_flight']} steps in flight, "
            f"{ran['step_tokens']:,}-token chunks), requests of "
            f"{topology.max_model_len - 1:,} prompt tokens submitted at once, "
            "each held once prefilled:"
        )
    if recommended is largest:
        lines.append("  " + admission_line("recommended K (= K=max)", recommended))
    else:
        lines.append("  " + admission_line("recommended K", recommended))
        lines.append("  " + admission_line(f"K=max {largest['shard_counts']}", largest))
    return lines


@dataclasses.dataclass(frozen=True)
class Pool:
    """vLLM's pool for a budget and the max-length requests its rule holds."""

    num_blocks: int
    blocks_per_request: int
    kv_cache_config: Any
    config: Any

    @property
    def requests(self) -> int:
        # Every group's blocks come from one pool, less its null block.
        return (self.num_blocks - 1) // self.blocks_per_request


def vllm_pool(topology: Topology, backend_names: set[str], kv_bytes: int) -> Pool:
    """Start-up's pool for ``kv_bytes`` per rank (vLLM's planner, padding
    layers included, and its sizing) and the blocks one ``max_model_len``
    request takes from it at its peak, summed over vLLM's groups
    (``max_memory_usage_bytes`` per page, vLLM's concurrency rule)."""
    from vllm_dcp_geometry.contract import cdiv
    from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import (
        start_up_pool,
    )

    kv_cache_config, config = start_up_pool(topology, backend_names, kv_bytes)
    per_request = sum(
        cdiv(
            g.kv_cache_spec.max_memory_usage_bytes(config),
            g.kv_cache_spec.page_size_bytes,
        )
        for g in kv_cache_config.kv_cache_groups
    )
    return Pool(kv_cache_config.num_blocks, per_request, kv_cache_config, config)


def capacity_check(
    topology: Topology,
    picked: Sequence[Choice],
    points: dict[str, tuple[int, ...]],
    pool_of: Any,
) -> dict[str, Any]:
    """vLLM's scheduler on each named point's pool (``pool_of(ks)``, a
    ``Pool``): predicted and admitted requests per point. ``holds`` only
    where every point whose pool start-up makes admits exactly the
    prediction (at least it where the rule is a bound: ``capacity_proof``);
    one start-up's planner refuses is named, not run."""
    from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import (
        scheduler_admission,
    )

    result: dict[str, Any] = {}
    measured: dict[tuple[int, ...], dict[str, Any]] = {}
    for label, ks in points.items():
        if ks not in measured:
            entry: dict[str, Any] = {
                "shard_counts": {c.name: k for c, k in zip(picked, ks, strict=True)}
            }
            try:
                pool = pool_of(ks)
            except TopologyError as exc:
                entry["refused"] = str(exc)
            else:
                admission = scheduler_admission(_applied(topology, picked, ks), pool)
                entry |= {
                    "num_blocks": pool.num_blocks,
                    "blocks_per_request": pool.blocks_per_request,
                    "step_tokens": pool.config.scheduler_config.max_num_batched_tokens,
                    **admission.as_json(),
                }
            measured[ks] = entry
        result[label] = measured[ks]
    result["holds"] = all(e["agrees"] for e in measured.values() if "refused" not in e)
    return result


def plot_frontier(result: dict[str, Any], topology: Topology, path: str) -> None:
    """Capacity against modeled step time: the frontier, the point at every
    choice's largest K and the recommended one, as an image at ``path``
    (matplotlib, the ``plot`` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import pyplot
    except ImportError as exc:
        raise TopologyError(
            "--plot needs matplotlib: pip install 'vllm-dcp-geometry[plot]'"
        ) from exc
    frontier = sorted(result["frontier"], key=lambda e: e["step_seconds"])
    chosen = result["recommended"]
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    axes.plot(
        [e["step_seconds"] * 1e3 for e in frontier],
        [e["requests"] for e in frontier],
        "o-",
        label="frontier",
    )
    axes.axvline(
        result["reference_step_seconds"] * 1e3,
        linestyle=":",
        color="grey",
        label="every choice at its largest K",
    )
    axes.plot(
        [chosen["step_seconds"] * 1e3],
        [chosen["requests"]],
        "*",
        markersize=16,
        label=f"recommended: {chosen['shard_counts']}",
    )
    axes.set_xlabel("modeled decode step per request (ms; a model)")
    axes.set_ylabel(f"{topology.max_model_len:,}-token requests per rank's KV")
    axes.set_title(f"plan --optimize {topology.name}")
    axes.legend(fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(path)
    except OSError as exc:
        raise TopologyError(f"--plot {path}: {exc.strerror or exc}") from exc
    finally:
        pyplot.close(figure)
