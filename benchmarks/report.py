# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The benchmarks' results document: its required shape and the printed table.

Imports nothing from vLLM (the table renderer is the CLI's).
"""

from __future__ import annotations

from typing import Any

TARGETS = {"scheduler_ratio": 1.02, "register_ms": 50.0, "import_ms": 20.0}


REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "scheduler": (
        "workload",
        "profile",
        "dcp",
        "unpatched_us",
        "patched_us",
        "ratio_median",
        "ratio_min",
        "ratio_max",
    ),
    "memory": ("profile", "contract_bytes", "minimum_bytes", "single_width_bytes"),
    "capacity": ("profile", "budget_bytes", "configured", "replicated", "sharded"),
}


def validate_results(doc: dict[str, Any]) -> list[str]:
    """Problems with a results document's shape (empty: well-formed)."""
    problems = []
    for key in ("date", "vllm_version", "plugin_version", "machine", "sections"):
        if key not in doc:
            problems.append(f"missing top-level {key!r}")
    sections = doc.get("sections", [])
    for section, keys in REQUIRED_KEYS.items():
        owner = "memory" if section == "capacity" else section
        if owner not in sections:
            continue
        rows = doc.get(section)
        if not isinstance(rows, list) or not rows:
            problems.append(f"{section}: expected a non-empty list")
            continue
        for i, row in enumerate(rows):
            problems.extend(
                f"{section}[{i}]: missing {k!r}" for k in keys if k not in row
            )
    if "startup" in sections:
        startup = doc.get("startup", {})
        problems.extend(
            f"startup: missing {k!r}"
            for k in ("register_ms", "import_ms")
            if k not in startup
        )
    machine = doc.get("machine", {})
    problems.extend(
        f"machine: missing {k!r}"
        for k in ("cpu_count", "cpu_model", "ram_bytes")
        if k not in machine
    )
    return problems


def _fmt_bytes(n: int) -> str:
    return f"{n:,}"


def _plugin_share(row: dict[str, Any]) -> str:
    # Share of the profiled patched repeat spent in this plugin's own code.
    if "plugin_code_ms_in_profiled_repeat" not in row:
        return "-"
    share = row["plugin_code_ms_in_profiled_repeat"] / row["profiled_repeat_ms"]
    return f"{share:.2%}"


def _same_calls(row: dict[str, Any]) -> str:
    if "same_vllm_calls" not in row:
        return "-"
    return "yes" if row["same_vllm_calls"] else "no"


def _scheduler_table(doc: dict[str, Any]) -> list[str]:
    from vllm_dcp_geometry.tooling.cli.common.text_table import render_table

    rows = []
    for r in doc["scheduler"]:
        label = (
            "replay 1M tokens"
            if r["workload"] == "replay"
            else "64 requests, prefix caching"
        )
        unfrozen = r.get("unfrozen")
        rows.append(
            [
                label,
                r["profile"],
                str(r["dcp"]),
                f"{r['unpatched_us']:.1f}",
                f"{r['patched_us']:.1f}",
                f"{r['ratio_median']:.3f}",
                f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}",
                "-" if unfrozen is None else f"{unfrozen['ratio_median']:.3f}",
                f"{r['wall']['ratio_median']:.3f}",
                _plugin_share(r),
                _same_calls(r),
                "yes" if r["within_target"] else "NO",
            ]
        )
    return [
        "",
        "scheduler: thread CPU us inside KVCacheManager per allocate_slots call "
        "(GC heap frozen after set-up, as vLLM's engine core runs it), median "
        f"over {doc['scheduler'][0]['pairs']} fresh-process pairs; ratio = "
        "patched/unpatched per pair; unfrozen = the same ratio without the "
        "freeze; plugin code = share of a cProfile'd patched repeat spent in "
        "vllm_dcp_geometry code; same vLLM calls = both sides' profiled repeats "
        "called the same vLLM functions the same number of times",
        render_table(
            [
                "workload",
                "profile",
                "DCP",
                "unpatched us",
                "patched us",
                "ratio",
                "min-max",
                "unfrozen",
                "wall ratio",
                "plugin code",
                "same vLLM calls",
                f"<= {TARGETS['scheduler_ratio']}",
            ],
            rows,
            right={3, 4, 5, 6, 7, 8, 9},
        ),
    ]


def _memory_tables(doc: dict[str, Any]) -> list[str]:
    from vllm_dcp_geometry.tooling.cli.common.text_table import render_table

    out: list[str] = []
    if doc.get("memory"):
        rows = [
            [
                m["profile"],
                _fmt_bytes(m["contract_bytes"]),
                _fmt_bytes(m["minimum_bytes"]),
                _fmt_bytes(m["single_width_bytes"]),
                _fmt_bytes(m["vllm_0_33_bytes"]),
            ]
            for m in doc["memory"]
        ]
        out += [
            "",
            "block tables per rank (bytes, max_num_seqs x columns x int32):",
            render_table(
                ["profile", "contract", "minimum", "single width", "vLLM 0.33.0"],
                rows,
                right={1, 2, 3, 4},
            ),
        ]
    if doc.get("capacity"):
        out += _capacity_table(doc["capacity"])
    return out


def _capacity_table(capacity: list[dict[str, Any]]) -> list[str]:
    from vllm_dcp_geometry.tooling.cli.common.text_table import render_table

    first = capacity[0]
    rows = []
    for c in capacity:
        cells = [c["profile"]]
        for scenario in ("configured", "replicated", "sharded"):
            s = c[scenario]
            tokens = s["tokens_per_rank"]
            cells.append(
                f"{s['max_concurrent_requests']:,} / "
                + ("-" if tokens is None else f"{tokens / 1e6:,.1f}M")
            )
        rows.append(cells)
    return [
        "",
        f"KV capacity per rank, {first['budget_bytes'] / 2**30:.0f} GiB budget: "
        f"concurrent {first['request_tokens']:,}-token requests / attention "
        "tokens held (Mamba state K = 1 throughout)",
        render_table(
            ["profile", "K as configured", "all replicated", "all sharded"],
            rows,
            right={1, 2, 3},
        ),
    ]


def format_table(doc: dict[str, Any]) -> str:
    out = [
        f"vllm-dcp-geometry {doc['plugin_version']} on vLLM {doc['vllm_version']}, "
        f"{doc['machine']['usable_cores']} cores ({doc['machine']['cpu_model']}), "
        f"load {doc.get('load_average_start')} -> {doc.get('load_average_end')}"
    ]
    if doc.get("scheduler"):
        out += _scheduler_table(doc)
    if doc.get("startup"):
        s = doc["startup"]
        out += [
            "",
            f"startup: register() {s['register_ms']:.1f} ms (target <= "
            f"{s['register_target_ms']:.0f}; {len(s['register_ms_samples'])} "
            f"processes), import without vLLM {s['import_ms']:.1f} ms (target <= "
            f"{s['import_target_ms']:.0f})",
        ]
    out += _memory_tables(doc)
    return "\n".join(out)
