# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The text output of ``vllm-dcp-geometry plan`` (``document.build_plan``'s
document as a table and summary lines)."""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import grouping_lines
from vllm_dcp_geometry.tooling.cli.common.text_table import RULE, render_table
from vllm_dcp_geometry.tooling.cli.plan.cost import INDEXER_TOPK_MERGE
from vllm_dcp_geometry.tooling.cli.plan.document import misread_by_upstream


def _fmt_int(value: int) -> str:
    return f"{value:,}"


def _fmt_delta(value: float) -> str:
    if value == 0:
        return "="
    text = f"{value:+,.2f}" if isinstance(value, float) else f"{value:+,}"
    return text.replace(".00", "")


def _fmt_float(value: float) -> str:
    return f"{value:,.2f}".replace(".00", "")


_HEADERS = [
    "group",
    "kind",
    "layers",
    "B",
    "K",
    "attention",
    "width",
    "aligned",
    "table B/rank",
    "KV B/token/rank",
    "pages/req",
    "vs {release}: K",
    "width",
    "table B/rank",
]
_LEFT_COLUMNS = {0, 1, 5}


def _release(plan: dict[str, Any]) -> str:
    """The vLLM release the plan was made on: the unpatched columns are that
    release's own rules (recorded by ``runs.versions``)."""
    return str(plan.get("vllm_version") or "(unknown)")


def _plan_head(plan: dict[str, Any]) -> str:
    inputs = plan["inputs"]
    return (
        f"topology {plan['topology']} on vLLM {_release(plan)}: "
        f"DCP={inputs['decode_context_parallel_size']} "
        f"TP={inputs['tensor_parallel_size']} "
        f"interleave={inputs['cp_kv_cache_interleave_size']} "
        f"max_model_len={inputs['max_model_len']:,} "
        f"max_num_seqs={inputs['max_num_seqs']:,} "
        f"mamba_cache_mode={inputs['mamba_cache_mode']}"
    )


def _group_row(g: dict[str, Any]) -> list[str]:
    up, delta = g["upstream"], g["delta"]
    return [
        g["name"],
        g["kind"] + (" (draft)" if g["draft"] else ""),
        str(g["num_layers"]),
        str(g["block_size"]),
        str(g["shard_count"]),
        g["attention_mode"],
        _fmt_int(g["block_table_width"]),
        _fmt_int(g["block_table_width_aligned"]),
        _fmt_int(g["block_table_bytes_per_rank"]),
        _fmt_float(g["kv_bytes_per_token_per_rank"]),
        _fmt_int(g["pages_per_request"]),
        str(up["shard_count"]),
        _fmt_int(up["block_table_width"]),
        _fmt_delta(delta["block_table_bytes_per_rank"]),
    ]


def _totals_row(plan: dict[str, Any]) -> list[str]:
    totals = plan["totals"]
    row = [""] * len(_HEADERS)
    row[0] = "total"
    row[2] = str(sum(g["num_layers"] for g in plan["groups"]))
    row[8] = _fmt_int(totals["block_table_bytes_per_rank"])
    row[9] = _fmt_float(totals["kv_bytes_per_token_per_rank"])
    row[10] = _fmt_int(totals["pages_per_request"])
    row[13] = _fmt_delta(totals["delta"]["block_table_bytes_per_rank"])
    return row


_COST_HEADERS = [
    "group",
    "W",
    "over",
    "B/token/rank/layer",
    "work vs K=D",
    "D-wide: W",
    "B/token/rank/layer",
    "work",
]


def _fmt_optional_int(value: int | None) -> str:
    return "-" if value is None else _fmt_int(value)


def _fmt_optional_float(value: float | None) -> str:
    return "-" if value is None else _fmt_float(value)


def _collective_scope(g: dict[str, Any], dcp: int) -> str:
    world = g["collective_world_size"]
    if world == 1:
        return "local"
    return "DCP group" if world == dcp else "replica"


def _cost_lines(plan: dict[str, Any]) -> list[str]:
    """The decode collectives of the groups whose attention runs: a small
    table of their own (the geometry table is wide already), then why any
    bytes are missing."""
    dcp = plan["inputs"]["decode_context_parallel_size"]
    costed = [g for g in plan["groups"] if g["collective_world_size"] is not None]
    if not costed:
        return []
    rows = []
    for g in costed:
        partial = g["dcp_group_attention_work_vs_sharded"] is not None
        rows.append(
            [
                g["name"],
                str(g["collective_world_size"]),
                _collective_scope(g, dcp),
                _fmt_optional_int(g["decode_collective_bytes_per_rank_per_token"]),
                _fmt_float(g["attention_work_vs_sharded"]),
                str(dcp) if partial else "",
                _fmt_optional_int(g["dcp_group_bytes_per_rank_per_token"])
                if partial
                else "",
                _fmt_optional_float(g["dcp_group_attention_work_vs_sharded"])
                if partial
                else "",
            ]
        )
    reasons: dict[str, list[str]] = {}
    for g in costed:
        if g["decode_collective_bytes_reason"]:
            reasons.setdefault(g["decode_collective_bytes_reason"], []).append(
                g["name"]
            )
    indexers = [
        g["name"] for g in costed if g["decode_collectives"] == INDEXER_TOPK_MERGE
    ]
    what_moves = (
        "attention: query all-gather, LSE all-gather, output reduce-scatter; "
        "a DSA indexer cache (" + ", ".join(indexers) + "): its top-k merge, an "
        "all-gather of each rank's top-k (score, id) float32 candidates"
        if indexers
        else "query all-gather, LSE all-gather, output reduce-scatter"
    )
    return [
        "",
        "decode collectives (partial_collectives="
        f"{plan['inputs']['partial_collectives']}): W ranks, over the group's "
        "replica (rule A6), the DCP group or none (local); bytes one rank sends "
        f"plus receives per decoded token in one layer ({what_moves}); "
        "attention work per rank vs a K=D group; partial groups also on the "
        "D-wide DCP group.",
        render_table(_COST_HEADERS, rows, right={1, 3, 4, 5, 6, 7}),
        *(
            f"no collective bytes ({reason}): {', '.join(names)}"
            for reason, names in reasons.items()
        ),
        "",
    ]


def _attention_lines(plan: dict[str, Any]) -> list[str]:
    backends: dict[str, list[str]] = {}
    for g in plan["groups"]:
        if g["attention_backend"] is not None:
            backends.setdefault(g["attention_backend"], []).append(g["name"])
    used = "; ".join(f"{name}: {', '.join(names)}" for name, names in backends.items())
    source = "vLLM's first choice on SM90"
    target = plan["inputs"]["attention_backend"]
    draft = plan["inputs"].get("draft_attention_backend")
    named = []
    if target:
        # Drafts inherit it unless the speculative config names theirs.
        whom = "the target" if draft else "the target and the EAGLE/MTP drafts"
        named.append(f"--attention-backend {target} for {whom}")
    if draft:
        named.append(f"--speculative-config attention_backend {draft} for the drafts")
    if named:
        source = f"{'; '.join(named)}, for the groups of its kind; else {source}"
    sources: dict[str, list[str]] = {}
    for g in plan["groups"]:
        sources.setdefault(g.get("source", "topology"), []).append(g["name"])
    if "model" in sources:
        source = "as vLLM built the layers for the serve flags, on SM90"
    classes: dict[str, list[str]] = {}
    for g in plan["groups"]:
        if g["layer_class"] is not None:
            classes.setdefault(g["layer_class"], []).append(g["name"])
    by_class = "; ".join(f"{name}: {', '.join(gs)}" for name, gs in classes.items())
    where = "; ".join(f"{name}: {', '.join(gs)}" for name, gs in sources.items())
    lines = [
        f"group sources (model: built from vLLM's model code): {where}",
        f"attention backends ({source}): {used or 'none'}",
        f"attention layer classes: {by_class or 'none'}",
    ]
    refusals = [g["attention_refusal"] for g in plan["groups"]]
    return lines + [f"refused: {reason}" for reason in refusals if reason]


def _grouping_lines(plan: dict[str, Any]) -> list[str]:
    return grouping_lines(
        plan.get("start_up_grouping"),
        len(plan["groups"]),
        "the rows above price the topology's groups, not start-up's",
    )


def _totals_lines(plan: dict[str, Any]) -> list[str]:
    totals = plan["totals"]
    up_totals = totals["upstream"]
    changed = [
        g["name"] for g in plan["groups"] if any(v != 0 for v in g["delta"].values())
    ]
    misread = [g for g in plan["groups"] if misread_by_upstream(g)]
    changed += [g["name"] for g in misread if g["name"] not in changed]
    release = _release(plan)
    lines = []
    if misread:
        lines.append(
            f"unpatched vLLM {release} would read these caches with another K than it "
            "writes them with (wrong attention, no error): "
            + ", ".join(
                f"{g['name']} (written K={g['upstream']['shard_count']}, read "
                f"K={g['upstream']['attention_shard_count']})"
                for g in misread
            )
        )
    return [
        *lines,
        f"scheduler block size (LCM of B*K): {totals['scheduler_block_size']:,} "
        f"({release}: {up_totals['scheduler_block_size']:,})",
        f"block tables per rank: {totals['block_table_bytes_per_rank']:,} bytes "
        f"({release}: {up_totals['block_table_bytes_per_rank']:,}; "
        f"{_fmt_delta(totals['delta']['block_table_bytes_per_rank'])})",
        f"KV per request per rank: {totals['kv_bytes_per_request_per_rank']:,} "
        f"bytes in {totals['pages_per_request']:,} pages ({release}: "
        f"{up_totals['kv_bytes_per_request_per_rank']:,} bytes in "
        f"{up_totals['pages_per_request']:,} pages)",
        *_capacity_lines(plan),
        f"differs from {release} in: " + ", ".join(changed)
        if changed
        else f"identical to unpatched vLLM {release} for this input",
    ]


def _capacity_lines(plan: dict[str, Any]) -> list[str]:
    """What DCP buys: max-length requests per rank's KV memory against the
    same layout at D = 1."""
    dcp = plan["inputs"]["decode_context_parallel_size"]
    totals = plan["totals"]
    here = totals["kv_bytes_per_request_per_rank"]
    alone = totals["without_dcp"]["kv_bytes_per_request_per_rank"]
    if dcp == 1 or here == 0:
        return []
    length = plan["inputs"]["max_model_len"]
    return [
        f"without DCP (D=1, same TP): {alone:,} bytes per request per rank; "
        f"DCP={dcp} holds {alone / here:.2f}x the {length:,}-token requests "
        "in the same KV memory"
    ]


def format_plan(plan: dict[str, Any]) -> str:
    rows = [_group_row(g) for g in plan["groups"]]
    rows += [RULE, _totals_row(plan)]
    release = _release(plan)
    headers = [h.format(release=release) for h in _HEADERS]
    right = set(range(len(headers))) - _LEFT_COLUMNS
    return "\n".join(
        [
            _plan_head(plan),
            "",
            render_table(headers, rows, right=right),
            "",
            "width: block-table columns (spec.max_num_blocks_per_req); aligned: after "
            "the runner's token alignment; table B/rank: max_num_seqs x aligned x 4 "
            "(int32). attention: how the group's attention runs (local, dcp, "
            f"dcp-partial, refused, none). vs {release}: unpatched vLLM's K and width; "
            "table B/rank as a difference (= means identical).",
            *_attention_lines(plan),
            *_cost_lines(plan),
            *_grouping_lines(plan),
            *_totals_lines(plan),
        ]
    )
