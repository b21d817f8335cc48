# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DCP collective bytes per rank per MLA decode step, across real processes.

    python -m benchmarks.ranks_traffic               # D = 4 and D = 8
    python -m benchmarks.ranks_traffic --skip-8      # D = 4 only (D = 8 is slow)
    python -m benchmarks.ranks_traffic --baseline    # also unpatched vLLM

For D in {4, 8}, one MLA topology with a group of every K dividing D (K = 1
replicated, partial K, K = D) runs through ``vllm-dcp-geometry ranks``' own
launcher (``cli.ranks.run.run_ranks``): D worker processes, vLLM's real
collectives over gloo on CPU (NCCL on GPUs), every collective through the DCP
group counted in every rank. Printed per (D, K): the bytes each rank sends
plus receives in one decode step (the same on every rank), what
``mla_rank_run.mla_decode_step_bytes`` says vLLM's D-wide all-gather /
reduce-scatter path moves, and the worst error against the float64 reference.
Counts, not times: they are exact on any machine. Today a partial group
(1 < K < D) still runs on the D-wide group, so it moves what K = D moves; a
replicated group (K = 1) attends locally and moves nothing.

``--output FILE`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.cli.common.text_table import render_table
from vllm_dcp_geometry.topology import Topology, topology_from_mapping

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
    from vllm_dcp_geometry.cli.ranks.run import run_ranks

    topology = traffic_topology(dcp)
    patched = run_ranks(topology, patched=True, progress=progress)
    unpatched = (
        run_ranks(topology, patched=False, progress=progress) if baseline else None
    )
    rows = []
    for index, g in enumerate(patched["groups"]):
        u = None if unpatched is None else unpatched["groups"][index]
        rows.append(
            {
                "dcp": dcp,
                "shard_count": g["shard_count"],
                "attention_mode": g["attention_mode"],
                "decode_tokens_per_step": g["decode_tokens_per_step"],
                "bytes_per_rank_per_step": g["collective_bytes_per_rank_per_step"],
                "formula_bytes_per_rank_per_step": g["formula_bytes_per_rank_per_step"],
                "matches_formula": g["traffic_matches_formula"],
                "max_abs_error": g["max_abs_error"],
                "unpatched_bytes_per_rank_per_step": None
                if u is None
                else u["collective_bytes_per_rank_per_step"],
                "unpatched_max_abs_error": None if u is None else u["max_abs_error"],
                "elapsed_s": patched["elapsed_s"],
            }
        )
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    def err(value: float | None) -> str:
        return "-" if value is None else f"{value:.1e}"

    def count(value: int | None) -> str:
        return "-" if value is None else f"{value:,}"

    table = [
        [
            str(r["dcp"]),
            str(r["shard_count"]),
            r["attention_mode"],
            count(r["bytes_per_rank_per_step"]),
            count(r["formula_bytes_per_rank_per_step"]),
            "yes" if r["matches_formula"] else "NO",
            err(r["max_abs_error"]),
            count(r["unpatched_bytes_per_rank_per_step"]),
            err(r["unpatched_max_abs_error"]),
        ]
        for r in rows
    ]
    return render_table(
        [
            "D",
            "K",
            "mode",
            "bytes/rank/step",
            "formula",
            "exact",
            "max err",
            "unpatched bytes",
            "unpatched err",
        ],
        table,
        right={0, 1, 3, 4, 6, 7, 8},
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
        "MLA decode step: bytes each rank sends + receives through the DCP group "
        f"({rows[0]['decode_tokens_per_step']} decode tokens, 2 heads per rank, "
        "latent 256 + rope 64, fp32; counted in every worker process)"
    )
    print(format_rows(rows))
    if args.output is not None:
        args.output.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    return 0 if all(r["matches_formula"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
