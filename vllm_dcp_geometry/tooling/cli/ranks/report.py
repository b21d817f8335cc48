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


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _shape(shape: dict[str, Any] | None) -> str:
    """``h x L+R dtype`` (heads per rank, latent and rope dims), or a non-MLA
    group's ``h x d dtype`` (head size) with its window and sinks."""
    if shape is None or shape.get("heads_per_rank") is None:
        return "-"
    if shape.get("head_size") is not None:
        words = f"{shape['heads_per_rank']}x{shape['head_size']} {shape['dtype']}"
        if shape.get("sliding_window") is not None:
            words += f" window {shape['sliding_window']}"
        return words + (" sinks" if shape.get("sinks") else "")
    if shape.get("kv_lora_rank") is None:
        return f"{shape['heads_per_rank']}x? {shape['dtype']}"
    return (
        f"{shape['heads_per_rank']}x{shape['kv_lora_rank']}+{shape['rope_dim']} "
        f"{shape['dtype']}"
    )


def _result(g: dict[str, Any]) -> str:
    if g["status"] != "run":
        return str(g["reason"])
    if g.get("crashed"):
        phases = " in " + ", ".join(g["crashed_in"]) if g.get("crashed_in") else ""
        return f"CRASHED{phases}: " + "; ".join(g["crashed"])
    status = "ok" if g["numerics_ok"] else "WRONG"
    if g.get("selection_ok") is False:
        # A DeepSeek-V3.2 layer: some rank's merged top-k is not the float64 one.
        status += ", selection not the float64 top-k"
        if g.get("selection_repeats"):
            status += " (ids selected twice)"
    if g.get("local_lengths_ok") is False:
        status += ", indexer local lengths not the contract's"
    if not g.get("graph_ok", True):
        status += ", CUDA-graph replay WRONG"
    if not g["layer_class_matches"]:
        status += f", ran {', '.join(g['layer_class_run'])}: FAILED"
    if not g["traffic_matches_formula"]:
        status += ", bytes differ from the formula: FAILED"
    return status


def format_table(report: dict[str, Any]) -> str:
    rows = []
    for g in report["groups"]:
        rows.append(
            [
                g["name"],
                "-" if g["shard_count"] is None else str(g["shard_count"]),
                _shape(g["shape"] or g["topology_shape"]),
                g["attention_mode"],
                "-"
                if g.get("collective_world_size") is None
                else str(g["collective_world_size"]),
                _error(g["max_abs_error"]),
                _error(g["max_lse_error"]),
                _bytes(g["collective_bytes_per_rank_per_step"]),
                _milliseconds(g.get("decode_step_s")),
                _result(g),
            ]
        )
    return render_table(
        [
            "group",
            "K",
            "shape (h x L+R | h x d)",
            "mode",
            "W",
            "max abs err",
            "max LSE err",
            "bytes/rank/step",
            "step ms",
            "result",
        ],
        rows,
        right={1, 4, 5, 6, 7, 8},
    )


def _shapes_line(report: dict[str, Any]) -> str:
    line = _scaled_shapes(report)
    if report.get("dtype_override"):
        line += (
            f"; every group in {report['dtype_override']} (--float32), not its "
            "own dtype"
        )
    return line


def _scaled_shapes(report: dict[str, Any]) -> str:
    ran = [g["shape"] for g in report["groups"] if g["shape"] is not None]
    longest = max(shape["max_model_len"] for shape in ran)
    mla = [shape for shape in ran if shape.get("head_size") is None]
    if not report["scaled"]:
        nope = (
            f"; nope and value head dims {mla[0]['nope_dim']} (not in a "
            "topology: they size only the up-projection, no cache or collective)"
            if mla
            else ""
        )
        return (
            "  shapes: each group's own (query heads per TP rank h, kv_lora_rank "
            "L and rope dim R or head size d, dtype, block size, K; the "
            f"topology's interleave), contexts up to {longest:,} tokens{nope}"
        )
    return (
        f"  shapes SCALED by --scale {report['scale']}: each group's query heads "
        "per rank h divided by it (rounded up, at least 2; the table shows "
        "what ran); L, R or d, "
        f"dtype, block size, K and interleave the topology's; contexts up to "
        f"{longest:,} tokens"
    )


def _traffic_lines(report: dict[str, Any]) -> list[str]:
    return [
        f"  {g['name']}: bytes per rank {g['collective_bytes_by_rank']} (W="
        f"{g['attention_world_size']}) differ from the formula's "
        f"{g['formula_bytes_per_rank_per_step']:,} (W={g['collective_world_size']})"
        for g in report["groups"]
        if g["status"] == "run"
        and not g.get("crashed")
        and not g["traffic_matches_formula"]
    ]


def _nccl_line(report: dict[str, Any]) -> list[str]:
    """What the run's steps move on NCCL, where the run's backend moves
    other bytes (gloo runs the reduce-scatter as an all-reduce)."""
    differ = [
        f"{g['name']} {g['nccl_formula_bytes_per_rank_per_step']:,}"
        for g in report["groups"]
        if g["status"] == "run"
        and not g.get("crashed")
        and g["nccl_formula_bytes_per_rank_per_step"]
        != g["formula_bytes_per_rank_per_step"]
    ]
    if not differ:
        return []
    return [
        f"  {report['processes']['backend']} runs the output reduce-scatter as an "
        "all-reduce of the whole input; on NCCL (plan's figures) the same steps "
        "move: " + ", ".join(differ)
    ]


def _backends_line(report: dict[str, Any]) -> str:
    """Which backend each group ran on."""
    by_backend: dict[str, list[str]] = {}
    for g in report["groups"]:
        if g["status"] == "run":
            by_backend.setdefault(str(g.get("backend")), []).append(g["name"])
    return "  attention backends: " + "; ".join(
        f"{backend}: {', '.join(names)}" for backend, names in by_backend.items()
    )


def format_report(report: dict[str, Any]) -> str:
    procs = report["processes"]
    version = report.get("vllm_version") or ""
    where = procs["device"]
    if procs["device"] == "cuda":
        where += " " + ", ".join(procs.get("device_names", []))
    launched = ", started by torchrun" if procs.get("launched_by") == "torchrun" else ""
    ran = (
        f"{report['ranks']} worker processes ({procs['backend']}, "
        f"{where}, TP = DCP = {report['ranks']}{launched}), "
        f"{report['groups_run']} group(s) run in {report['elapsed_s']:.1f} s"
    )
    budget = report["tolerance"]["dtype_roundings"]
    lines = [
        f"ranks {report['topology']} on {report['mode']} vLLM {version}: {ran}",
        "  each worker loads the plugin through vLLM's plugin loader "
        "(vllm.general_plugins)"
        + ("" if report["mode"] == "patched" else "; unpatched: VLLM_PLUGINS=''"),
        _shapes_line(report),
        "  per group: one decode step and one chunked prefill over a context, "
        "every rank against a float64 single-device reference over the same "
        f"dtype values (within {budget} roundoffs of the dtype, plus float32 "
        "accumulation, x max(1, |reference|)); W: ranks its collectives "
        "span; bytes: sent + received per rank in the decode step, every "
        "collective its process groups and vLLM's NCCL communicators ran, "
        f"which must equal the formula's on {procs['backend']}",
        f"  step ms: {report['step_time']}",
    ]
    if any(g.get("decode_collectives") for g in report["groups"]):
        lines.append(
            "  DeepSeek-V3.2 layers (a latent and an indexer group each): one "
            "decode step of the layer's _sparse_indexer_and_attn, both groups "
            "together; every rank's merged top-k against the float64 top-k "
            "(ties to the smaller id); the latent row's bytes are the query "
            "all-gather and combine, the indexer row's the top-k merge (its "
            "step ms: the indexer call)"
        )
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
    lines.append(_backends_line(report))
    lines.append("")
    lines.append(format_table(report))
    lines.extend(_traffic_lines(report))
    lines.extend(_nccl_line(report))
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
    lines[3:3] = _traffic_lines(baseline)
    if wrong:
        lines.append("unpatched vLLM is wrong on: " + ", ".join(wrong))
    else:
        lines.append("unpatched vLLM is right on every group run")
    return "\n".join(lines)
