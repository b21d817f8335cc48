# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``replay``'s text output: the run, the per-group table, the baseline."""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.common.text_table import render_table
from vllm_dcp_geometry.tooling.cli.replay.checks import CATEGORIES


def format_replay(report: dict[str, Any]) -> str:
    mode = report["mode"]
    version = report.get("vllm_version") or ""
    lines = [
        f"replay {report['topology']} on {mode} vLLM {version}".rstrip(),
        f"  {report['tokens_replayed']:,} of {report['tokens']:,} tokens in "
        f"{report['step_tokens']:,}-token steps: {report['allocation_steps']:,} "
        f"allocation steps in {report['elapsed_s']:.2f} s",
        f"  pool: {report['num_pages']:,} pages ({report['pages_per_request']:,} "
        "per max-length request by vLLM's rule, + the null page); "
        f"{report['free_pages']:,} free at the end; peak "
        f"{report['peak_pages_in_use']:,} in use",
        f"  scheduler block size {report['scheduler_block_size']:,}, hash block "
        f"size {report['hash_block_size']:,}",
        "",
    ]
    headers = [
        "group",
        "kind",
        "K",
        "V=B*K",
        "manager unit",
        "width",
        "max column",
        "pages held",
        "first unaddressable",
    ]
    rows = []
    for g in report["groups"]:
        first = g["first_unaddressable_position"]
        rows.append(
            [
                g["name"],
                g["kind"] + (" (draft)" if g["draft"] else ""),
                str(g["shard_count"]),
                f"{g['virtual_block_size']:,}",
                f"{g['manager_block_size']:,}",
                f"{g['block_table_width']:,}",
                f"{g['max_column_used']:,}",
                f"{g['pages_held']:,}",
                "-" if first is None else f"{first:,}",
            ]
        )
    lines.append(render_table(headers, rows, right=set(range(2, len(headers)))))
    lines.append("")
    counts = report["violation_counts"]
    lines.append("violations: " + ", ".join(f"{c} {counts[c]:,}" for c in CATEGORIES))
    for item in report["violations"]:
        where = f" [{item['group']}]" if item["group"] else ""
        lines.append(
            f"  step {item['step']}{where} {item['category']}: {item['message']}"
        )
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def format_baseline(baseline: dict[str, Any], diffs: list[dict[str, Any]]) -> str:
    lines = ["", "baseline: the same replay on unpatched vLLM (fresh process)"]
    if not diffs and baseline["ok"]:
        lines.append(
            "  no divergence: unpatched vLLM allocates and addresses this "
            "topology the same way"
        )
        return "\n".join(lines)
    for d in diffs:
        where = f"[{d['group']}] " if d["group"] else ""
        lines.append(
            f"  {where}{d['field']}: patched {d['patched']}, unpatched {d['unpatched']}"
        )
    for item in baseline["violations"]:
        where = f" [{item['group']}]" if item["group"] else ""
        pos = "" if item["position"] is None else f" at position {item['position']:,}"
        lines.append(
            f"  unpatched fails{where}{pos} (step {item['step']}): {item['message']}"
        )
    return "\n".join(lines)
