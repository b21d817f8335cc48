# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' text: the summary, one table row per group, the baseline."""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.common.text_table import render_table


def _error(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def format_table(report: dict[str, Any]) -> str:
    rows = []
    for g in report["groups"]:
        if g["status"] == "run":
            status = "ok" if g["ok"] else "WRONG"
            if not g["traffic_matches_formula"]:
                status += ", traffic differs from formula"
        else:
            status = g["reason"]
        rows.append(
            [
                g["name"],
                "-" if g["shard_count"] is None else str(g["shard_count"]),
                g["attention_mode"],
                "-"
                if g.get("collective_world_size") is None
                else str(g["collective_world_size"]),
                _error(g["max_abs_error"]),
                _error(g["max_lse_error"]),
                _bytes(g["collective_bytes_per_rank_per_step"]),
                status,
            ]
        )
    return render_table(
        [
            "group",
            "K",
            "mode",
            "W",
            "max abs err",
            "max LSE err",
            "bytes/rank/step",
            "result",
        ],
        rows,
        right={1, 3, 4, 5, 6},
    )


def format_report(report: dict[str, Any]) -> str:
    procs = report["processes"]
    shape = report["shape"]
    version = report.get("vllm_version") or ""
    ran = (
        f"{report['ranks']} worker processes ({procs['backend']}, "
        f"{procs['device']}, TP = DCP = {report['ranks']}), "
        f"{report['groups_run']} group(s) run in {report['elapsed_s']:.1f} s"
    )
    if not report["groups_run"]:
        ran = f"D = {report['ranks']}, no group runs here: no worker started"
    lines = [
        f"ranks {report['topology']} on {report['mode']} vLLM {version}: {ran}",
        "  each worker loads the plugin through vLLM's plugin loader "
        "(vllm.general_plugins)"
        + ("" if report["mode"] == "patched" else "; unpatched: VLLM_PLUGINS=''"),
        f"  sizes scaled down: {shape['heads_per_rank']} heads per rank, latent "
        f"{shape['kv_lora_rank']} + rope {shape['rope_dim']}, {shape['dtype']}, "
        f"contexts up to {shape['max_model_len']:,} tokens; K, block sizes and "
        "interleave as the topology's",
        "  per group: one decode step and one chunked prefill over a context, "
        "every rank against a float64 single-device reference; W: ranks its "
        "collectives span; bytes: sent + received per rank through the DCP and "
        "replica groups in the decode step",
    ]
    if report.get("partial_collectives"):
        where = (
            "within their K-rank replica groups (K = "
            + ", ".join(str(k) for k in report["replica_groups"])
            + ")"
            if report["replica_groups"]
            else "within their replica groups"
        )
        if report["partial_collectives"] != "replica":
            where = "on the D-wide DCP group, replicas masked"
        lines.append(f"  partial groups' collectives: {where}")
    if report["stand_ins"]:
        lines.append(
            "  torch stand-ins for missing compiled ops: "
            + ", ".join(report["stand_ins"])
        )
    lines.append("")
    lines.append(format_table(report))
    lines.append("")
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def format_baseline(baseline: dict[str, Any]) -> str:
    lines = [
        "",
        "baseline: the same ranks on unpatched vLLM (VLLM_PLUGINS='')",
        format_table(baseline),
    ]
    wrong = [
        g["name"] for g in baseline["groups"] if g["status"] == "run" and not g["ok"]
    ]
    if wrong:
        lines.append("unpatched vLLM is wrong on: " + ", ".join(wrong))
    else:
        lines.append("unpatched vLLM is right on every group run")
    return "\n".join(lines)
