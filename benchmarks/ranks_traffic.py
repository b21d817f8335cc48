# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DCP collective bytes per rank per MLA decode step, across real processes:
partial groups within their replica (rule A6) versus on the D-wide group.

    python -m benchmarks.ranks_traffic               # D = 4 and D = 8
    python -m benchmarks.ranks_traffic --skip-8      # D = 4 only (D = 8 is slow)
    python -m benchmarks.ranks_traffic --baseline    # also unpatched vLLM

For D in {4, 8}, one MLA topology with a group of every K dividing D (K = 1
replicated, partial K, K = D) runs twice through ``vllm-dcp-geometry ranks``'
own launcher (``cli.ranks.run.run_ranks``), in one invocation: before, with
partial groups on the D-wide DCP group and duplicate replicas masked
(``partial_collectives: "dcp"``, the plugin's earlier path); after, within
their K-rank replica groups (the default). Each run is D worker processes,
vLLM's real collectives over gloo on CPU (NCCL on GPUs), every collective
its process groups ran counted in every rank. Printed per (D, K): the bytes
each rank sends plus receives in one decode step before and after (the same
on every rank), whether they equal ``collectives.mla_decode_step_bytes`` on
the run's backend for the group's collective world, their ratio, the same
ratio on NCCL (gloo runs the output reduce-scatter as an all-reduce), next
to (K - 1)/(D - 1); the decode step's time before and after (the slowest
rank's median of ``group.TIMED_STEPS``) and their ratio; the worst error of
each run against the float64 reference; and the two runs' wall times as a
ratio (after / before; the whole run, every group). Counts are exact on any
machine; times on CPU are the Triton interpreter's with D processes sharing
the cores, a ratio within one run, never a GPU's time. A replicated group
(K = 1) attends locally and moves nothing; K = D moves what unpatched vLLM
moves (``--baseline``).

``--output FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.text_table import render_table
from vllm_dcp_geometry.tooling.topology import Topology, topology_from_mapping

WORLDS = (4, 8)
BLOCK_SIZE = 16


def traffic_topology(dcp: int) -> Topology:
    """A DCP ``dcp`` MLA topology with one group for every K dividing it."""
    groups = []
    for k in (k for k in range(1, dcp + 1) if dcp % k == 0):
        group: dict[str, Any] = {
            "name": f"mla.k{k}",
            "kind": "mla",
            "layers": [f"model.layers.{k}.self_attn.attn"],
            "block_size": BLOCK_SIZE,
            "num_kv_heads": 1,
            "head_size": 576,
            "kv_lora_rank": 512,
            # Two query heads per rank: the traffic per head is what is
            # compared, and a rank's work stays small on CPU.
            "query_heads": 2 * dcp,
            "dtype": "bfloat16",
        }
        if k != dcp:
            group["dcp_kv_shard_count"] = k
        groups.append(group)
    return topology_from_mapping(
        {
            "name": f"ranks-traffic-dcp{dcp}",
            "parallel": {
                "tensor_parallel_size": dcp,
                "decode_context_parallel_size": dcp,
            },
            "limits": {"max_model_len": 4096, "max_num_seqs": 8},
            "groups": groups,
        },
        source="benchmarks.ranks_traffic",
    )


def measure(dcp: int, *, baseline: bool, progress: bool) -> list[dict[str, Any]]:
    from vllm_dcp_geometry.contract.collectives import DCP_GROUP, REPLICA
    from vllm_dcp_geometry.tooling.cli.ranks.run import run_ranks

    topology = traffic_topology(dcp)
    before = run_ranks(
        topology, patched=True, progress=progress, partial_collectives=DCP_GROUP
    )
    after = run_ranks(
        topology, patched=True, progress=progress, partial_collectives=REPLICA
    )
    unpatched = (
        run_ranks(topology, patched=False, progress=progress) if baseline else None
    )
    wall_ratio = after["elapsed_s"] / before["elapsed_s"]
    rows = []
    for index, g in enumerate(after["groups"]):
        b = before["groups"][index]
        u = None if unpatched is None else unpatched["groups"][index]
        k = g["shard_count"]
        moved, wide = (
            g["collective_bytes_per_rank_per_step"],
            b["collective_bytes_per_rank_per_step"],
        )
        rows.append(
            {
                "dcp": dcp,
                "shard_count": k,
                "attention_mode": g["attention_mode"],
                "collective_world_size": g["collective_world_size"],
                "decode_tokens_per_step": g["decode_tokens_per_step"],
                "bytes_per_rank_per_step": moved,
                "formula_bytes_per_rank_per_step": g["formula_bytes_per_rank_per_step"],
                "nccl_bytes_per_rank_per_step": g[
                    "nccl_formula_bytes_per_rank_per_step"
                ],
                "dcp_group_nccl_bytes_per_rank_per_step": b[
                    "nccl_formula_bytes_per_rank_per_step"
                ],
                "decode_step_s": g["decode_step_s"],
                "dcp_group_decode_step_s": b["decode_step_s"],
                "step_time_ratio_vs_dcp_group": g["decode_step_s"] / b["decode_step_s"],
                "matches_formula": g["traffic_matches_formula"]
                and b["traffic_matches_formula"],
                "dcp_group_bytes_per_rank_per_step": wide,
                "bytes_ratio_vs_dcp_group": None if not wide else moved / wide,
                "nccl_bytes_ratio_vs_dcp_group": None
                if not wide
                else g["nccl_formula_bytes_per_rank_per_step"]
                / b["nccl_formula_bytes_per_rank_per_step"],
                "ring_ratio_k_over_d": (k - 1) / (dcp - 1),
                "attention_work_vs_sharded": g["attention_work_vs_sharded"],
                "dcp_group_attention_work_vs_sharded": b["attention_work_vs_sharded"],
                "max_abs_error": max(g["max_abs_error"], g["max_lse_error"] or 0.0),
                "dcp_group_max_abs_error": max(
                    b["max_abs_error"], b["max_lse_error"] or 0.0
                ),
                "unpatched_bytes_per_rank_per_step": None
                if u is None
                else u["collective_bytes_per_rank_per_step"],
                "unpatched_max_abs_error": None if u is None else u["max_abs_error"],
                "wall_time_ratio_after_over_before": round(wall_ratio, 3),
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    def err(value: float | None) -> str:
        return "-" if value is None else f"{value:.1e}"

    def count(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    table = [
        [
            str(r["dcp"]),
            str(r["shard_count"]),
            r["attention_mode"],
            str(r["collective_world_size"]),
            count(r["dcp_group_bytes_per_rank_per_step"]),
            count(r["bytes_per_rank_per_step"]),
            "yes" if r["matches_formula"] else "NO",
            ratio(r["bytes_ratio_vs_dcp_group"]),
            ratio(r["nccl_bytes_ratio_vs_dcp_group"]),
            ratio(r["ring_ratio_k_over_d"]),
            f"{r['dcp_group_decode_step_s'] * 1e3:.1f} -> "
            f"{r['decode_step_s'] * 1e3:.1f}",
            ratio(r["step_time_ratio_vs_dcp_group"]),
            f"{r['dcp_group_attention_work_vs_sharded']:g} -> "
            f"{r['attention_work_vs_sharded']:g}",
            err(r["dcp_group_max_abs_error"]),
            err(r["max_abs_error"]),
            count(r["unpatched_bytes_per_rank_per_step"]),
        ]
        for r in rows
    ]
    return render_table(
        [
            "D",
            "K",
            "mode",
            "W",
            "before bytes",
            "after bytes",
            "formula",
            "after/before",
            "NCCL after/before",
            "(K-1)/(D-1)",
            "step ms",
            "step after/before",
            "work vs K=D",
            "before err",
            "after err",
            "unpatched bytes",
        ],
        table,
        right={0, 1, 3, 4, 5, 7, 8, 9, 10, 11, 13, 14, 15},
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ranks_traffic")
    parser.add_argument(
        "--skip-8", action="store_true", help="D = 4 only (D = 8 starts 8 processes)"
    )
    parser.add_argument(
        "--baseline", action="store_true", help="also run on unpatched vLLM"
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    worlds = [d for d in WORLDS if not (args.skip_8 and d == 8)]
    rows: list[dict[str, Any]] = []
    for dcp in worlds:
        rows += measure(dcp, baseline=args.baseline, progress=not args.no_progress)
    print(
        "MLA decode step: bytes each rank sends + receives through the DCP and "
        f"replica groups ({rows[0]['decode_tokens_per_step']} decode tokens, 2 "
        "heads per rank, latent 512 + rope 64, bfloat16, gloo; counted in every "
        "worker process); before: partial groups on the D-wide group, after: within "
        "their K-rank replica"
    )
    print(format_rows(rows))
    for dcp in worlds:
        wall = next(r for r in rows if r["dcp"] == dcp)
        print(
            f"D = {dcp}: wall time after / before = "
            f"{wall['wall_time_ratio_after_over_before']:.3f} (one run each)"
        )
    if args.output is not None:
        args.output.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0 if all(r["matches_formula"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
