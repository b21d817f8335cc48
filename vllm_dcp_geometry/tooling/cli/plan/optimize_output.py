# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s text and plot: the budget and choices, the frontier
table, the recommended line and the scheduler check, from the JSON result of
``optimize_shard_counts``."""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.plan.optimize_budget import GIB
from vllm_dcp_geometry.tooling.cli.plan.optimize_candidates import (
    COLLECTIVES_PER_LAYER,
)
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError
from vllm_dcp_geometry.tooling.vllm_release import vllm_release


def format_optimize(result: dict[str, Any], topology: Topology) -> str:
    """``plan --optimize``'s text for ``optimize_shard_counts``' result."""
    lines = [
        *_inputs(result, topology),
        "",
        "frontier (of the assignments on the exact request-bytes / step-time "
        "frontier, those no other holds more requests at a lower step time):",
        _frontier_table(result),
        "",
        *_recommendation(result, topology),
    ]
    for reason in result["dropped_points"]:
        lines.append(f"dropped, start-up's KV-cache grouping refuses it: {reason}")
    lines += capacity_lines(result["capacity_check"], topology)
    return "\n".join(lines)


def _inputs(result: dict[str, Any], topology: Topology) -> list[str]:
    # The budget, the choices and every K left out, before the table.
    budget = result["budget"]
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
    return lines


def _frontier_table(result: dict[str, Any]) -> str:
    from vllm_dcp_geometry.tooling.cli.common.text_table import render_table

    names = [c["name"] for c in result["choices"]]
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
    return render_table(header, rows, right=set(range(len(header))))


def _recommendation(result: dict[str, Any], topology: Topology) -> list[str]:
    # The step model's terms, then the recommended point and its line.
    budget = result["budget"]
    chosen = result["recommended"]
    return [
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


def capacity_lines(check: dict[str, Any], topology: Topology) -> list[str]:
    """The scheduler check in ``format_optimize``'s text: per point, vLLM's
    rule against what vLLM's scheduler held at once."""
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


def admission_line(label: str, check: dict[str, Any]) -> str:
    """One point's check in ``format_optimize``'s text (``check``: its
    ``capacity_check`` entry); a failed one names both numbers."""
    if "refused" in check:
        return f"{label}: not checked, start-up refuses its pool: {check['refused']}"
    predicted = check["predicted_requests"]
    admitted = check["admitted_requests"]
    line = (
        f"{label}: {check['num_blocks']:,} blocks, "
        f"{check['blocks_per_request']:,} per request: vLLM's rule {predicted:,}"
    )
    if admitted is None:
        return f"{line}: MISMATCH, predicted {predicted:,}, but {check['not_run']}"
    line += (
        f", vLLM's scheduler held {admitted:,} of "
        f"{check['submitted_requests']:,} at once"
    )
    preempted = ", ".join(f"{n:,}" for n in check["preempted_requests"])
    if check["cycling"]:
        line += (
            f"; request {preempted} is admitted and preempted over and over "
            "(vLLM's admission gate counts fewer blocks than its prefill takes)"
        )
    elif preempted:
        line += f"; vLLM preempted request {preempted} when blocks ran out"
    if check["agrees"] and admitted > predicted:
        line += (
            " (more: once prefilled, a sliding-window request holds its window "
            "and last chunks, fewer blocks than the prefill peak the rule "
            "reserves)"
        )
    if not check["agrees"]:
        line += f": MISMATCH, predicted {predicted:,}, admitted {admitted:,}"
        if check["not_run"]:
            line += f" ({check['not_run']})"
    return line


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
