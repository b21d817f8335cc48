# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How long ``plan --optimize`` takes to search, against one plan of the same
topology, measured in one run.

    python -m benchmarks.optimize_search [--output FILE]

Two topologies: the default profile at D = 16 (5 target MLA groups x 5
divisors, the DSpark draft kept) and a synthetic 60-group MLA model at
D = 32 (60 groups x 6 divisors: 6^60 assignments). Per topology: the
assignments an exhaustive search would visit, the plans the search runs
(one per candidate K of each choice, one per frontier point, one of the
topology), the frontier's size, the search's wall time (and the part of it
spent planning; the rest is sizing vLLM's pool per frontier point and the
recommended and largest-K pools' runs through vLLM's scheduler), one
``build_plan`` of the unmodified topology, and the ratio search / one plan,
measured in one run. The merge is exact (``optimize.frontier``), so the
work grows with choices x divisors plus the frontier, never with the number
of assignments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.text_table import render_table
from vllm_dcp_geometry.tooling.topology import (
    Topology,
    load_profile,
    topology_from_mapping,
)

DEFAULT_PROFILE = "kimi-k3-tp16-dcp16"
WIDE_GROUPS = 60
WIDE_DCP = 32


def wide_topology(groups: int = WIDE_GROUPS, dcp: int = WIDE_DCP) -> Topology:
    """``groups`` MLA groups of one layer each, of differing shapes so that
    no two choices are interchangeable."""
    return topology_from_mapping(
        {
            "name": f"mla-{groups}-groups-dcp{dcp}",
            "parallel": {
                "tensor_parallel_size": dcp,
                "decode_context_parallel_size": dcp,
            },
            "limits": {"max_model_len": 131072, "max_num_seqs": 64},
            "groups": [
                {
                    "name": f"mla.{i}",
                    "kind": "mla",
                    "layers": [f"model.layers.{i}.self_attn.attn"],
                    "block_size": 64,
                    "num_kv_heads": 1,
                    "head_size": 576 if i % 2 else 320,
                    "kv_lora_rank": 512 if i % 2 else 256,
                    "query_heads": dcp * (1 + i % 4),
                    "dtype": "bfloat16",
                }
                for i in range(groups)
            ],
        },
        source="benchmarks.optimize_search",
    )


def measure(topology: Topology) -> dict[str, Any]:
    from vllm_dcp_geometry.tooling.cli.common import runs
    from vllm_dcp_geometry.tooling.cli.plan import document, optimize
    from vllm_dcp_geometry.tooling.cli.plan.document import build_plan

    runs.prepare_vllm(argparse.Namespace(), patched=True)
    budget = optimize.make_budget(
        device="H200",
        gpu_memory_gib=None,
        gpu_memory_utilization=0.9,
        weight_gib=None,
        hbm_gbps=None,
        link_gbps=None,
    )
    build_plan(topology, None)  # vLLM's first imports, outside both timings
    start = time.perf_counter()
    build_plan(topology, None)
    plan_seconds = time.perf_counter() - start
    plans = 0
    counted = document.build_plan

    in_plans = 0.0

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        nonlocal plans, in_plans
        plans += 1
        began = time.perf_counter()
        try:
            return counted(*args, **kwargs)
        finally:
            in_plans += time.perf_counter() - began

    document.build_plan = counting  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        result = optimize.optimize_shard_counts(
            topology,
            budget,
            objective="capacity",
            max_decode_overhead=1.10,
            attention_backend=None,
            draft_attention_backend=None,
        )
        search_seconds = time.perf_counter() - start
    finally:
        document.build_plan = counted  # type: ignore[assignment]
    candidates = [len(c["candidates"]) for c in result["choices"]]
    return {
        "topology": topology.name,
        "dcp": topology.decode_context_parallel_size,
        "choices": len(candidates),
        "candidates": sum(candidates),
        "assignments": math.prod(candidates),
        "plans_run": plans,
        "frontier_points": len(result["frontier"]),
        "search_seconds": search_seconds,
        "seconds_in_plans": in_plans,
        "one_plan_seconds": plan_seconds,
        "search_over_one_plan": search_seconds / plan_seconds,
        "recommended": result["recommended"]["shard_counts"],
        "capacity_holds": result["capacity_check"]["holds"],
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    return render_table(
        [
            "topology",
            "D",
            "choices",
            "assignments",
            "plans run",
            "frontier",
            "search s",
            "in plans s",
            "one plan s",
            "search / plan",
        ],
        [
            [
                r["topology"],
                str(r["dcp"]),
                str(r["choices"]),
                f"{r['assignments']:.3g}",
                str(r["plans_run"]),
                str(r["frontier_points"]),
                f"{r['search_seconds']:.2f}",
                f"{r['seconds_in_plans']:.2f}",
                f"{r['one_plan_seconds']:.3f}",
                f"{r['search_over_one_plan']:.0f}",
            ]
            for r in rows
        ],
        right=set(range(1, 10)),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimize_search")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    rows = [measure(load_profile(DEFAULT_PROFILE)), measure(wide_topology())]
    print(format_rows(rows))
    if args.output is not None:
        args.output.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0 if all(r["capacity_holds"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
