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

from vllm_dcp_geometry.attention_admission import (
    AttentionKind,
    admit_attention,
    is_mla_backend_name,
    vllm_shard_count,
)
from vllm_dcp_geometry.cli import _vllm
from vllm_dcp_geometry.contract import scheduler_block_size, virtual_block_size
from vllm_dcp_geometry.geometry import default_shard_count, group_name
from vllm_dcp_geometry.topology import CacheGroup, Topology, TopologyError

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


DEFAULT_ATTENTION_BACKENDS = {
    "mla": "FLASH_ATTN_MLA",
    "full_attention": "FLASH_ATTN",
    "sliding_window": "FLASH_ATTN",
}
"""What vLLM 0.33.0 picks first for a group's kind on a Hopper (SM90) GPU
(``vllm.platforms.cuda``'s backend priorities). ``--attention-backend NAME``
replaces it for the groups of NAME's kind (MLA backends for MLA groups)."""

_ATTENTION_KINDS = {
    "mla": AttentionKind.MLA,
    "full_attention": AttentionKind.ATTENTION,
    "sliding_window": AttentionKind.ATTENTION,
    "mamba": AttentionKind.NONE,
}


def check_attention_backend(name: str | None) -> str | None:
    """``name`` if it is one of vLLM's attention backends (exit 2 otherwise)."""
    if name is None:
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = [member.name for member in AttentionBackendEnum]
    if name not in names:
        raise TopologyError(
            f"--attention-backend {name!r} is not a vLLM attention backend; "
            f"one of: {', '.join(names)}"
        )
    return name


def group_attention(
    group: CacheGroup,
    index: int,
    spec: Any,
    topology: Topology,
    attention_backend: str | None,
) -> dict[str, Any]:
    """How the group's attention runs at start-up: the admission rule the
    runtime calls, with the group named as the runtime names KV-cache group
    ``index``."""
    dcp = topology.decode_context_parallel_size
    kind = _ATTENTION_KINDS[group.kind]
    backend = None
    if kind is not AttentionKind.NONE:
        backend = DEFAULT_ATTENTION_BACKENDS[group.kind]
        if attention_backend is not None and is_mla_backend_name(attention_backend) == (
            kind is AttentionKind.MLA
        ):
            backend = attention_backend
    admission = admit_attention(
        owner=group_name(group.layers, index),
        kind=kind,
        backend=backend,
        shard_count=spec.dcp_shard_count(dcp),
        dcp_world_size=dcp,
        default_shard_count=default_shard_count(spec, dcp),
        interleave_size=topology.interleave_size,
    )
    return {
        "attention_backend": backend,
        "attention_mode": admission.mode.value,
        "attention_refusal": admission.reason or None,
    }


def upstream_attention_shard_count(
    group: CacheGroup, spec: Any, dcp: int
) -> int | None:
    """The K unpatched vLLM 0.33.0's attention reads the group's cache with
    (None: no attention): its MLA always reads D, other backends follow
    ``dcp_sharded``."""
    kind = _ATTENTION_KINDS[group.kind]
    if kind is AttentionKind.NONE:
        return None
    return vllm_shard_count(kind, dcp, default_shard_count(spec, dcp))


def misread_by_upstream(group: dict[str, Any]) -> bool:
    """Whether unpatched vLLM 0.33.0 writes the group's cache with one K and
    its attention reads it with another."""
    up = group["upstream"]
    read = up["attention_shard_count"]
    return read is not None and read != up["shard_count"]


def first_refusal(plan: dict[str, Any]) -> str | None:
    """The start-up error of the first group whose attention is refused."""
    for group in plan["groups"]:
        if group["attention_refusal"]:
            return str(group["attention_refusal"])
    return None


def build_plan(
    topology: Topology, attention_backend: str | None = None
) -> dict[str, Any]:
    """The plan as a JSON-ready mapping. vLLM must be patched (registered).

    ``attention_backend`` (a vLLM backend name) replaces the default backend
    of the groups of its kind; every group gets its ``attention_mode``.
    """
    if not _vllm.is_vllm_patched():
        raise TopologyError(
            "plan needs the vllm-dcp-geometry plugin registered in this process"
        )
    dcp = topology.decode_context_parallel_size
    length = topology.max_model_len
    config = _vllm.sizing_config(topology)
    attention_backend = check_attention_backend(attention_backend)
    groups: list[dict[str, Any]] = []
    patched_rows: list[dict[str, Any]] = []
    upstream_rows: list[dict[str, Any]] = []
    for index, group in enumerate(topology.groups):
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
        upstream["attention_shard_count"] = upstream_attention_shard_count(
            group, spec, dcp
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
                **group_attention(group, index, spec, topology, attention_backend),
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
        "inputs": {**layout_inputs(topology), "attention_backend": attention_backend},
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
    "vs 0.33.0: K",
    "width",
    "table B/rank",
]
_LEFT_COLUMNS = {0, 1, 5}


def _plan_head(plan: dict[str, Any]) -> str:
    inputs = plan["inputs"]
    return (
        f"topology {plan['topology']}: DCP={inputs['decode_context_parallel_size']} "
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


def _attention_lines(plan: dict[str, Any]) -> list[str]:
    backends: dict[str, list[str]] = {}
    for g in plan["groups"]:
        if g["attention_backend"] is not None:
            backends.setdefault(g["attention_backend"], []).append(g["name"])
    used = "; ".join(f"{name}: {', '.join(names)}" for name, names in backends.items())
    chosen = plan["inputs"]["attention_backend"]
    source = "vLLM's first choice on SM90"
    if chosen:
        source = f"--attention-backend {chosen} for its kind, else {source}"
    lines = [f"attention backends ({source}): {used or 'none'}"]
    refusals = [g["attention_refusal"] for g in plan["groups"]]
    return lines + [f"refused: {reason}" for reason in refusals if reason]


def _totals_lines(plan: dict[str, Any]) -> list[str]:
    totals = plan["totals"]
    up_totals = totals["upstream"]
    changed = [
        g["name"] for g in plan["groups"] if any(v != 0 for v in g["delta"].values())
    ]
    misread = [g for g in plan["groups"] if misread_by_upstream(g)]
    changed += [g["name"] for g in misread if g["name"] not in changed]
    lines = []
    if misread:
        lines.append(
            "unpatched vLLM 0.33.0 would read these caches with another K than it "
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
        f"(0.33.0: {up_totals['scheduler_block_size']:,})",
        f"block tables per rank: {totals['block_table_bytes_per_rank']:,} bytes "
        f"(0.33.0: {up_totals['block_table_bytes_per_rank']:,}; "
        f"{_fmt_delta(totals['delta']['block_table_bytes_per_rank'])})",
        f"KV per request per rank: {totals['kv_bytes_per_request_per_rank']:,} "
        f"bytes in {totals['pages_per_request']:,} pages (0.33.0: "
        f"{up_totals['kv_bytes_per_request_per_rank']:,} bytes in "
        f"{up_totals['pages_per_request']:,} pages)",
        "differs from 0.33.0 in: " + ", ".join(changed)
        if changed
        else "identical to unpatched vLLM 0.33.0 for this input",
    ]


def format_plan(plan: dict[str, Any]) -> str:
    rows = [_group_row(g) for g in plan["groups"]]
    rows += [_RULE, _totals_row(plan)]
    right = set(range(len(_HEADERS))) - _LEFT_COLUMNS
    return "\n".join(
        [
            _plan_head(plan),
            "",
            render_table(_HEADERS, rows, right=right),
            "",
            "width: block-table columns (spec.max_num_blocks_per_req); aligned: after "
            "the runner's token alignment; table B/rank: max_num_seqs x aligned x 4 "
            "(int32). attention: how the group's attention runs (local, dcp, "
            "dcp-partial, refused, none). vs 0.33.0: unpatched vLLM's K and width; "
            "table B/rank as a difference (= means identical).",
            *_attention_lines(plan),
            *_totals_lines(plan),
        ]
    )
