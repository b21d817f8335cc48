# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry plan``: per-group geometry and cost, before renting GPUs.

For each cache group: its shard count K, block-table width (before and after
the runner's alignment), block-table bytes per rank and KV bytes per token and
per request per rank, with the same numbers from unpatched vLLM 0.33.0. The
patched numbers come from the specs (``spec.dcp_shard_count``,
``spec.max_num_blocks_per_req``, ``spec.max_memory_usage_bytes``); upstream's
from the original methods behind the patches (``_patching.original_of``).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from vllm_dcp_geometry.cli import _vllm
from vllm_dcp_geometry.contract import scheduler_block_size, virtual_block_size
from vllm_dcp_geometry.geometry import default_shard_count
from vllm_dcp_geometry.topology import Topology, TopologyError

BLOCK_TABLE_ENTRY_BYTES = 4
"""vLLM block tables hold int32 block ids."""

_DELTA_KEYS = (
    "shard_count",
    "block_table_width",
    "block_table_width_aligned",
    "block_table_bytes_per_rank",
    "kv_bytes_per_token_per_rank",
    "pages_per_request",
    "kv_bytes_per_request_per_rank",
)


def _bytes_per_token(layers: int, page_bytes: int, block_size: int, k: int) -> float:
    # A rank stores 1/K of the positions of a K-sharded group.
    return float(Fraction(layers * page_bytes, virtual_block_size(block_size, k)))


def _geometry(
    spec: Any,
    *,
    num_layers: int,
    k: int,
    width: int,
    pages: int,
    max_num_seqs: int,
) -> dict[str, Any]:
    from vllm.v1.worker.block_table import get_block_table_width

    aligned = get_block_table_width(
        width, spec.block_size, token_alignment=spec.block_table_token_alignment
    )
    # Recurrent state has a fixed size per request: no per-token cost.
    per_token = (
        _bytes_per_token(num_layers, spec.page_size_bytes, spec.block_size, k)
        if _is_attention_spec(spec)
        else 0.0
    )
    return {
        "shard_count": k,
        "virtual_block_size": virtual_block_size(spec.block_size, k),
        "block_table_width": width,
        "block_table_width_aligned": aligned,
        "block_table_bytes_per_rank": max_num_seqs * aligned * BLOCK_TABLE_ENTRY_BYTES,
        "kv_bytes_per_token_per_rank": per_token,
        "pages_per_request": pages,
        "kv_bytes_per_request_per_rank": num_layers * pages * spec.page_size_bytes,
    }


def _is_attention_spec(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import AttentionSpec

    return isinstance(spec, AttentionSpec)


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "block_table_bytes_per_rank",
        "kv_bytes_per_token_per_rank",
        "pages_per_request",
        "kv_bytes_per_request_per_rank",
    )
    return {key: sum(row[key] for row in rows) for key in keys}


def _delta(patched: dict[str, Any], upstream: dict[str, Any]) -> dict[str, Any]:
    return {
        key: patched[key] - upstream[key]
        for key in _DELTA_KEYS
        if key in patched and key in upstream
    }


def build_plan(topology: Topology) -> dict[str, Any]:
    """The plan as a JSON-ready mapping. vLLM must be patched (registered)."""
    if not _vllm.is_vllm_patched():
        raise TopologyError(
            "plan needs the vllm-dcp-geometry plugin registered in this process"
        )
    dcp = topology.decode_context_parallel_size
    length = topology.max_model_len
    config = _vllm.sizing_config(topology)
    groups: list[dict[str, Any]] = []
    patched_rows: list[dict[str, Any]] = []
    upstream_rows: list[dict[str, Any]] = []
    for group in topology.groups:
        spec = _vllm.build_spec(group, topology, patched=True)
        k = spec.dcp_shard_count(dcp)
        if k != group.shard_count(dcp):
            raise TopologyError(
                f"group {group.name!r}: the spec reports K={k} but the contract "
                f"gives K={group.shard_count(dcp)}"
            )
        common = {
            "num_layers": len(group.layers),
            "max_num_seqs": topology.max_num_seqs,
        }
        patched = _geometry(
            spec,
            k=k,
            width=spec.max_num_blocks_per_req(config, length),
            pages=_vllm.pages_per_request(spec, config),
            **common,
        )
        upstream = _geometry(
            spec,
            k=default_shard_count(spec, dcp),
            width=_vllm.upstream_method(spec, "max_num_blocks_per_req")(config, length),
            pages=_vllm.pages_per_request(spec, config, upstream=True),
            **common,
        )
        patched_rows.append(patched)
        upstream_rows.append(upstream)
        groups.append(
            {
                "name": group.name,
                "kind": group.kind,
                "draft": group.draft,
                "layout": group.layout.value,
                "num_layers": len(group.layers),
                "layers": list(group.layers),
                "block_size": group.block_size,
                "page_size_bytes": spec.page_size_bytes,
                **patched,
                "upstream": upstream,
                "delta": _delta(patched, upstream),
            }
        )
    totals = _totals(patched_rows)
    upstream_totals = _totals(upstream_rows)
    totals["upstream"] = upstream_totals
    totals["delta"] = _delta(totals, upstream_totals)
    totals["scheduler_block_size"] = scheduler_block_size(
        row["virtual_block_size"] for row in patched_rows
    )
    upstream_totals["scheduler_block_size"] = scheduler_block_size(
        row["virtual_block_size"] for row in upstream_rows
    )
    return {
        "command": "plan",
        "topology": topology.name,
        "source": topology.source,
        "inputs": layout_inputs(topology),
        "groups": groups,
        "totals": totals,
    }


def layout_inputs(topology: Topology) -> dict[str, Any]:
    return {
        "decode_context_parallel_size": topology.decode_context_parallel_size,
        "tensor_parallel_size": topology.tensor_parallel_size,
        "cp_kv_cache_interleave_size": topology.interleave_size,
        "max_model_len": topology.max_model_len,
        "max_num_seqs": topology.max_num_seqs,
        "mamba_cache_mode": topology.mamba_cache_mode,
    }


def _fmt_int(value: int) -> str:
    return f"{value:,}"


def _fmt_delta(value: float) -> str:
    if value == 0:
        return "="
    text = f"{value:+,.2f}" if isinstance(value, float) else f"{value:+,}"
    return text.replace(".00", "")


def _fmt_float(value: float) -> str:
    return f"{value:,.2f}".replace(".00", "")


def render_table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    cells = [row for row in rows if row is not _RULE]
    widths = [
        max([len(headers[i])] + [len(row[i]) for row in cells])
        for i in range(len(headers))
    ]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(cells)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    out = [line(headers), rule]
    for row in rows:
        out.append(rule if row is _RULE else line(row))
    return "\n".join(out)


_RULE: list[str] = []


def format_plan(plan: dict[str, Any]) -> str:
    inputs = plan["inputs"]
    head = (
        f"topology {plan['topology']}: DCP={inputs['decode_context_parallel_size']} "
        f"TP={inputs['tensor_parallel_size']} "
        f"interleave={inputs['cp_kv_cache_interleave_size']} "
        f"max_model_len={inputs['max_model_len']:,} "
        f"max_num_seqs={inputs['max_num_seqs']:,} "
        f"mamba_cache_mode={inputs['mamba_cache_mode']}"
    )
    headers = [
        "group",
        "kind",
        "layers",
        "B",
        "K",
        "width",
        "aligned",
        "table B/rank",
        "KV B/token/rank",
        "pages/req",
        "vs 0.33.0: K",
        "width",
        "table B/rank",
    ]
    rows: list[list[str]] = []
    for g in plan["groups"]:
        up, delta = g["upstream"], g["delta"]
        kind = g["kind"] + (" (draft)" if g["draft"] else "")
        rows.append(
            [
                g["name"],
                kind,
                str(g["num_layers"]),
                str(g["block_size"]),
                str(g["shard_count"]),
                _fmt_int(g["block_table_width"]),
                _fmt_int(g["block_table_width_aligned"]),
                _fmt_int(g["block_table_bytes_per_rank"]),
                _fmt_float(g["kv_bytes_per_token_per_rank"]),
                _fmt_int(g["pages_per_request"]),
                str(up["shard_count"]),
                _fmt_int(up["block_table_width"]),
                _fmt_delta(delta["block_table_bytes_per_rank"]),
            ]
        )
    totals = plan["totals"]
    rows.append(_RULE)
    rows.append(
        [
            "total",
            "",
            str(sum(g["num_layers"] for g in plan["groups"])),
            "",
            "",
            "",
            "",
            _fmt_int(totals["block_table_bytes_per_rank"]),
            _fmt_float(totals["kv_bytes_per_token_per_rank"]),
            _fmt_int(totals["pages_per_request"]),
            "",
            "",
            _fmt_delta(totals["delta"]["block_table_bytes_per_rank"]),
        ]
    )
    table = render_table(headers, rows, right=set(range(2, len(headers))))
    up_totals = totals["upstream"]
    lines = [
        head,
        "",
        table,
        "",
        "width: block-table columns (spec.max_num_blocks_per_req); aligned: after "
        "the runner's token alignment; table B/rank: max_num_seqs x aligned x 4 "
        "(int32). vs 0.33.0: unpatched vLLM's K and width; table B/rank as a "
        "difference (= means identical).",
        f"scheduler block size (LCM of B*K): {totals['scheduler_block_size']:,} "
        f"(0.33.0: {up_totals['scheduler_block_size']:,})",
        f"block tables per rank: {totals['block_table_bytes_per_rank']:,} bytes "
        f"(0.33.0: {up_totals['block_table_bytes_per_rank']:,}; "
        f"{_fmt_delta(totals['delta']['block_table_bytes_per_rank'])})",
        f"KV per request per rank: {totals['kv_bytes_per_request_per_rank']:,} "
        f"bytes in {totals['pages_per_request']:,} pages (0.33.0: "
        f"{up_totals['kv_bytes_per_request_per_rank']:,} bytes in "
        f"{up_totals['pages_per_request']:,} pages)",
    ]
    changed = [
        g["name"] for g in plan["groups"] if any(v != 0 for v in g["delta"].values())
    ]
    lines.append(
        "differs from 0.33.0 in: " + ", ".join(changed)
        if changed
        else "identical to unpatched vLLM 0.33.0 for this input"
    )
    return "\n".join(lines)
