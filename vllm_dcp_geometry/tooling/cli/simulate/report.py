# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``simulate``'s report: the JSON document, the text table, the baseline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.tooling.cli.common.text_table import render_table
from vllm_dcp_geometry.tooling.cli.simulate.checks import KINDS

if TYPE_CHECKING:
    from vllm_dcp_geometry.tooling.cli.simulate.checks import Checker
    from vllm_dcp_geometry.tooling.cli.simulate.engine import Engine
    from vllm_dcp_geometry.tooling.cli.simulate.options import SimulationOptions
    from vllm_dcp_geometry.tooling.cli.simulate.views import GroupInfo
    from vllm_dcp_geometry.tooling.cli.simulate.workloads import Workload
    from vllm_dcp_geometry.tooling.topology import Topology


def build_report(
    topology: Topology,
    options: SimulationOptions,
    workload: Workload,
    engine: Engine,
    groups: list[GroupInfo],
    workers: Any,
    checker: Checker,
    tally: Any,
    *,
    patched: bool,
    kernel_note: str,
    elapsed: float,
) -> dict[str, Any]:
    v = checker.violations
    counts = {kind: v.counts.get(kind, 0) for kind in KINDS}
    workers_info = workers.describe()
    promised = promised_events(workload, tally)
    missing = [name for name, n in promised.items() if not n]
    return {
        "command": "simulate",
        "mode": "patched" if patched else "unpatched",
        "topology": topology.name,
        "source": topology.source,
        "runner": options.runner,
        "workload": workload.name,
        "ranks": topology.decode_context_parallel_size,
        "requests": len(workload.requests),
        "finished_requests": tally.finished_requests,
        "steps": tally.steps,
        "scheduled_tokens": tally.scheduled_tokens,
        "slot_writes_checked": checker.slot_writes_checked,
        "violations": counts,
        "preemptions": tally.preemptions,
        "prefix_hit_tokens": tally.prefix_hit_tokens,
        "draft_tokens": tally.scheduled_draft_tokens,
        "accepted_draft_tokens": tally.accepted_tokens,
        "events": promised,
        "missing_events": missing,
        "ok": not any(counts.values())
        and tally.finished_requests == len(workload.requests)
        and not missing,
        "first_violation": v.first,
        "violation_items": v.items,
        "step_tokens": workload.step_tokens,
        "num_pages": engine.num_pages,
        "pages_per_request": engine.pages_per_request,
        "scheduler_block_size": engine.scheduler_block_size,
        "hash_block_size": engine.hash_block_size,
        "prefix_caching": workload.enable_prefix_caching,
        "num_speculative_tokens": workload.num_speculative_tokens,
        "seed": workload.seed,
        "shape": _shape(workload),
        "slot_mapping": {
            "path": "vectorized twin of vLLM's slot-mapping kernel "
            "(the contract's reference mapping with each table's kernel "
            "arguments)",
            "real_kernels": kernel_note,
            "cross_checked_steps": tally.cross_checked_steps,
        },
        "worker_tables": workers_info["tables"],
        "restated": workers_info["restated"],
        "scheduler_digest": tally.scheduler_digest.hexdigest(),
        "slot_digest": tally.slot_digest.hexdigest(),
        "elapsed_s": round(elapsed, 3),
        "groups": [_group_report(g, workers, v) for g in groups],
    }


def _group_report(group: GroupInfo, workers: Any, violations: Any) -> dict[str, Any]:
    return {
        "name": group.name,
        "kind": group.kind,
        "shard_count": group.shard_count,
        "builder_shard_count": group.builder_shard_count,
        "virtual_block_size": group.virtual_block_size,
        "block_table_width": workers.widths[group.index],
        "slot_mapped": group.slot_mapped,
        "violations": {
            kind: n
            for (name, kind), n in violations.by_group.items()
            if name == group.name
        },
    }


def promised_events(workload: Workload, tally: Any) -> dict[str, int]:
    """How often each event the workload promised happened (a mixed run:
    preemptions, prefix-hit tokens where caching is on, accepted draft tokens
    where there are drafts); any at 0 fails the run."""
    counts = {
        "preemptions": tally.preemptions,
        "prefix_hit_tokens": tally.prefix_hit_tokens,
        "accepted_draft_tokens": tally.accepted_tokens,
    }
    return {name: counts[name] for name in workload.promised_events()}


EVENT_NAMES = {
    "preemptions": "preemptions",
    "prefix_hit_tokens": "prefix-hit tokens",
    "accepted_draft_tokens": "accepted draft tokens",
}
"""What the text calls each event a workload promises."""


def _shape(workload: Workload) -> dict[str, Any] | None:
    """What the mixed workload took from the profile's geometry."""
    if not workload.scheduler_block:
        return None
    wave = workload.requests[: workload.wave]
    return {
        "scheduler_block": workload.scheduler_block,
        "wave_requests": len(wave),
        "wave_prompt": wave[0].prompt_len if wave else None,
        "prefixes": [n for n in workload.prefixes if n],
    }


def compare_runs(patched: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """Whether the unpatched run saw the same scheduler outputs and slots."""
    return {
        "same_scheduler_outputs": patched["scheduler_digest"]
        == baseline["scheduler_digest"],
        "same_slot_mappings": patched["slot_digest"] == baseline["slot_digest"],
        "first_break": baseline["first_violation"],
    }


def _summary_lines(report: dict[str, Any]) -> list[str]:
    version = report.get("vllm_version") or ""
    slots = report["slot_mapping"]
    drafts = "speculative decoding off"
    if report["num_speculative_tokens"]:
        drafts = (
            f"{report['draft_tokens']:,} draft tokens "
            f"({report['accepted_draft_tokens']:,} accepted)"
        )
    hits = f"{report['prefix_hit_tokens']:,} prefix-cache hit tokens"
    if not report["prefix_caching"]:
        hits = "prefix caching off"
    checked = "not cross-checked"
    if slots["cross_checked_steps"]:
        checked = f"{slots['cross_checked_steps']:,} steps cross-checked against them"
    return [
        f"simulate {report['topology']} ({report['workload']}) on {report['mode']} "
        f"vLLM {version}, Model Runner {report['runner'].upper()}, "
        f"{report['ranks']} DCP ranks".replace("  ", " "),
        f"  {report['steps']:,} scheduler steps, {report['scheduled_tokens']:,} "
        f"tokens scheduled, {report['finished_requests']} of {report['requests']} "
        f"requests finished, in {report['elapsed_s']:.1f} s",
        f"  {report['preemptions']:,} preemptions, {hits}, {drafts}",
        f"  pool {report['num_pages']:,} pages; scheduler block "
        f"{report['scheduler_block_size']:,}, hash block {report['hash_block_size']:,}",
        *_shape_lines(report["shape"]),
        f"  slot mappings: {slots['path']}; {slots['real_kernels']}: {checked}",
        f"  worker tables: {report['worker_tables']}; restated from vLLM: "
        + "; ".join(report["restated"]),
        f"  {report['slot_writes_checked']:,} rank-position slot writes checked",
        "",
    ]


def _shape_lines(shape: dict[str, Any] | None) -> list[str]:
    if shape is None:
        return []
    wave = "no wave (too few requests or tokens per step)"
    if shape["wave_requests"]:
        wave = (
            f"a wave of {shape['wave_requests']} prompts of "
            f"{shape['wave_prompt']:,} tokens fills the pool"
        )
    prefixes = ", ".join(f"{n:,}" for n in shape["prefixes"]) or "none"
    return [
        f"  shaped by the {shape['scheduler_block']:,}-token scheduler block: "
        f"{wave}; shared prefixes of {prefixes} tokens"
    ]


def format_report(report: dict[str, Any]) -> str:
    lines = _summary_lines(report)
    rows = [
        [
            g["name"],
            g["kind"],
            str(g["shard_count"]),
            "-" if g["kind"] == "mamba" else str(g["builder_shard_count"]),
            f"{g['virtual_block_size']:,}",
            f"{g['block_table_width']:,}",
            "yes" if g["slot_mapped"] else "no",
            ", ".join(f"{k} {n:,}" for k, n in sorted(g["violations"].items())) or "-",
        ]
        for g in report["groups"]
    ]
    lines.append(
        render_table(
            [
                "group",
                "kind",
                "K",
                "builder K",
                "V=B*K",
                "width",
                "slots",
                "violations",
            ],
            rows,
            right={2, 3, 4, 5},
        )
    )
    lines.append("")
    counts = report["violations"]
    lines.append("violations: " + ", ".join(f"{k} {counts[k]:,}" for k in KINDS))
    for item in report["violation_items"]:
        where = f" [{item['group']}]" if item["group"] else ""
        lines.append(f"  step {item['step']}{where} {item['kind']}: {item['message']}")
    lines.extend(_event_lines(report))
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def _event_lines(report: dict[str, Any]) -> list[str]:
    """The events the workload promised, and any it never saw."""
    events = report["events"]
    if not events:
        return []
    shown = ", ".join(
        f"{EVENT_NAMES[name]} {n:,}" + (" (missing)" if not n else "")
        for name, n in events.items()
    )
    lines = [f"{report['workload']} workload's events: {shown}"]
    missing = [EVENT_NAMES[name] for name in report["missing_events"]]
    if missing:
        lines.append(
            f"  the {report['workload']} workload promised {' and '.join(missing)} "
            "and the run had none: a workload that proves nothing is a failure "
            "(see --num-pages, --requests, --step-tokens)"
        )
    return lines


def format_baseline(baseline: dict[str, Any], comparison: dict[str, Any]) -> str:
    lines = ["", "baseline: the same simulation on unpatched vLLM (fresh process)"]
    same = "the same" if comparison["same_scheduler_outputs"] else "different"
    lines.append(
        f"  {same} scheduler outputs; slot mappings "
        f"{'identical' if comparison['same_slot_mappings'] else 'differ'}"
    )
    first = comparison["first_break"]
    if first is None:
        lines.append("  unpatched vLLM passes every check on this input")
        return "\n".join(lines)
    where = f" [{first['group']}]" if first["group"] else ""
    position = "" if first["position"] is None else f", position {first['position']:,}"
    lines.append(
        f"  unpatched vLLM first breaks at step {first['step']}{position}"
        f"{where}: {first['kind']}: {first['message']}"
    )
    counts = {k: n for k, n in baseline["violations"].items() if n}
    lines.append(
        "  unpatched violations: " + ", ".join(f"{k} {n:,}" for k, n in counts.items())
    )
    return "\n".join(lines)
