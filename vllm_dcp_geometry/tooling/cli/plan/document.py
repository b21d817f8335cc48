# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The ``plan`` document: per-group geometry and cost, against vLLM 0.33.0.

For each cache group: its shard count K, block-table width (before and after
the runner's alignment), block-table bytes per rank and KV bytes per token and
per request per rank, with the same numbers from unpatched vLLM 0.33.0. The
patched numbers come from the specs (``spec.dcp_shard_count``,
``spec.max_num_blocks_per_req``, ``spec.max_memory_usage_bytes``); upstream's
from the original methods behind the patches (``patching.original_of``).
How each group's attention runs comes from ``attention``, what its decode
collectives span and move from ``cost``.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from vllm_dcp_geometry.contract import scheduler_block_size, virtual_block_size
from vllm_dcp_geometry.runtime.geometry import (
    BLOCK_TABLE_ENTRY_BYTES,
    default_shard_count,
    runner_table_width,
)
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.plan.attention import (
    check_attention_backend,
    draft_backend,
    group_attention,
)
from vllm_dcp_geometry.tooling.cli.plan.cost import group_cost
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError

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
    aligned = runner_table_width(spec, width)
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


def _plan_group(
    group: CacheGroup,
    index: int,
    topology: Topology,
    config: Any,
    attention_backend: str | None,
) -> dict[str, Any]:
    """One group's row: the patched geometry, unpatched vLLM's (its original
    methods), how its attention runs (``attention_backend``: the backend
    named for the group) and what its decode collectives cost."""
    from vllm_dcp_geometry.runtime.worker_admission import upstream_read_shard_count

    dcp = topology.decode_context_parallel_size
    length = topology.max_model_len
    spec = vllm_objects.build_spec(group, topology, patched=True)
    k = spec.dcp_shard_count(dcp)
    if k != group.shard_count(dcp):
        raise TopologyError(
            f"group {group.name!r}: the spec reports K={k} but the contract "
            f"gives K={group.shard_count(dcp)}"
        )
    common = {"num_layers": len(group.layers), "max_num_seqs": topology.max_num_seqs}
    patched = _geometry(
        spec,
        k=k,
        width=spec.max_num_blocks_per_req(config, length),
        pages=vllm_objects.pages_per_request(spec, config),
        **common,
    )
    upstream = _geometry(
        spec,
        k=default_shard_count(spec, dcp),
        width=vllm_objects.upstream_method(spec, "max_num_blocks_per_req")(
            config, length
        ),
        pages=vllm_objects.pages_per_request(spec, config, upstream=True),
        **common,
    )
    upstream["attention_shard_count"] = upstream_read_shard_count(spec, dcp)
    # At D = 1 the patched and unpatched rules are the same (byte-identical).
    pages_without_dcp = vllm_objects.pages_per_request(
        spec, vllm_objects.without_dcp(config), upstream=True
    )
    attention = group_attention(group, index, spec, topology, attention_backend)
    return {
        "name": group.name,
        "source": group.source,
        "kind": group.kind,
        "draft": group.draft,
        "layout": group.layout.value,
        "num_layers": len(group.layers),
        "layers": list(group.layers),
        "block_size": group.block_size,
        "query_heads": group.query_heads,
        "kv_lora_rank": group.kv_lora_rank,
        "page_size_bytes": spec.page_size_bytes,
        **patched,
        **attention,
        **group_cost(group, topology, attention, k),
        "upstream": upstream,
        "delta": _delta(patched, upstream),
        "without_dcp": {
            "pages_per_request": pages_without_dcp,
            "kv_bytes_per_request_per_rank": len(group.layers)
            * pages_without_dcp
            * spec.page_size_bytes,
        },
    }


def build_plan(
    topology: Topology,
    attention_backend: str | None = None,
    *,
    draft_attention_backend: str | None = None,
) -> dict[str, Any]:
    """The plan as a JSON-ready mapping. vLLM must be patched (registered).

    ``attention_backend`` (a vLLM backend name, ``--attention-backend``)
    replaces the default backend of the target's groups of its kind;
    ``draft_attention_backend`` (``--speculative-config``'s) the drafts', which
    otherwise follow vLLM's rule (``attention.draft_backend``). Every group
    gets its ``attention_mode``.
    """
    if not vllm_objects.is_vllm_patched():
        raise TopologyError(
            "plan needs the vllm-dcp-geometry plugin registered in this process"
        )
    config = vllm_objects.sizing_config(topology)
    attention_backend = check_attention_backend(attention_backend)
    groups = [
        _plan_group(
            group,
            index,
            topology,
            config,
            draft_backend(group, attention_backend, draft_attention_backend),
        )
        for index, group in enumerate(topology.groups)
    ]
    totals = _totals(groups)
    upstream_totals = _totals([g["upstream"] for g in groups])
    totals["upstream"] = upstream_totals
    totals["without_dcp"] = {
        key: sum(g["without_dcp"][key] for g in groups)
        for key in ("pages_per_request", "kv_bytes_per_request_per_rank")
    }
    totals["delta"] = _delta(totals, upstream_totals)
    totals["scheduler_block_size"] = scheduler_block_size(
        g["virtual_block_size"] for g in groups
    )
    upstream_totals["scheduler_block_size"] = scheduler_block_size(
        g["upstream"]["virtual_block_size"] for g in groups
    )
    return {
        "command": "plan",
        "topology": topology.name,
        "source": topology.source,
        "inputs": {
            **layout_inputs(topology),
            "attention_backend": attention_backend,
            "draft_attention_backend": draft_attention_backend,
        },
        "groups": groups,
        "totals": totals,
    }


def layout_inputs(topology: Topology) -> dict[str, Any]:
    return {
        "decode_context_parallel_size": topology.decode_context_parallel_size,
        "tensor_parallel_size": topology.tensor_parallel_size,
        "cp_kv_cache_interleave_size": topology.interleave_size,
        "partial_collectives": topology.partial_collectives,
        "max_model_len": topology.max_model_len,
        "max_num_seqs": topology.max_num_seqs,
        "mamba_cache_mode": topology.mamba_cache_mode,
    }
