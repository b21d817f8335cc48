# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Block-table memory and KV capacity per rank, for every built-in profile.

Needs patched vLLM in this process (``vllm_dcp_geometry.register()``): the
numbers come from the specs themselves (``spec.max_num_blocks_per_req``,
``spec.page_size_bytes``, ``spec.dcp_shard_count``) and vLLM's runner rule
(``get_block_table_width``), checked against the contract's formulas.

    python -m benchmarks.memory   # prints one JSON document
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from vllm_dcp_geometry.contract import (
    attention_block_table_width,
    full_attention_pages_per_request,
    recurrent_align_block_table_width,
    virtual_block_size,
)
from vllm_dcp_geometry.runtime.geometry import (
    BLOCK_TABLE_ENTRY_BYTES,
    runner_table_width,
)
from vllm_dcp_geometry.tooling.topology import Topology, load_profile, profile_names

GIB = 1 << 30
CAPACITY_BUDGET_BYTES = 100 * GIB
CAPACITY_REQUEST_TOKENS = 1_000_000
SCENARIOS = ("configured", "replicated", "sharded")


class MemoryCheckError(AssertionError):
    """A block table is not the contract's minimum up to the runner's rule."""


def contract_width(group: Any, topology: Topology, shard_count: int) -> int:
    """Columns the longest request can need, from the contract's formulas."""
    length = topology.max_model_len
    if group.is_attention:
        return attention_block_table_width(length, group.block_size, shard_count)
    if topology.mamba_cache_mode != "align":
        raise NotImplementedError(
            f"group {group.name!r}: only Mamba align mode is modelled here"
        )
    return recurrent_align_block_table_width(
        length, group.block_size, group.spec_fields.get("num_speculative_blocks", 0)
    )


def _block_alignment(block_size: int, token_alignment: int | None) -> int:
    # Columns the runner may add at most, minus one (1: no alignment).
    if token_alignment is None:
        return 1
    return token_alignment // math.gcd(token_alignment, block_size)


def block_table_memory(topology: Topology) -> dict[str, Any]:
    """Block-table bytes per rank: the contract's layout, the exact minimum
    and a single-width layout. Raises ``MemoryCheckError`` if the contract's
    table is not the minimum up to the runner's alignment."""
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm
    from vllm_dcp_geometry.tooling.cli.plan import document as plan

    dcp = topology.decode_context_parallel_size
    seqs = topology.max_num_seqs
    config = _vllm.sizing_config(topology)
    rows = []
    for group in topology.groups:
        spec = _vllm.build_spec(group, topology, patched=True)
        k = spec.dcp_shard_count(dcp)
        minimum = contract_width(group, topology, group.shard_count(dcp))
        width = spec.max_num_blocks_per_req(config, topology.max_model_len)
        alignment = spec.block_table_token_alignment
        aligned = runner_table_width(spec, width)
        slack = aligned - minimum
        if width != minimum or not 0 <= slack < _block_alignment(
            spec.block_size, alignment
        ):
            raise MemoryCheckError(
                f"{topology.name}: group {group.name!r} has {aligned} columns "
                f"({width} before alignment); the contract's minimum is "
                f"{minimum} and the runner aligns to {alignment} tokens"
            )
        rows.append(
            {
                "name": group.name,
                "kind": group.kind,
                "shard_count": k,
                "minimum_width": minimum,
                "width": width,
                "aligned_width": aligned,
                "token_alignment": alignment,
            }
        )
    widest = max(r["aligned_width"] for r in rows)
    per_column = BLOCK_TABLE_ENTRY_BYTES * seqs
    result = {
        "profile": topology.name,
        "dcp": dcp,
        "max_model_len": topology.max_model_len,
        "max_num_seqs": seqs,
        "groups": rows,
        "contract_bytes": per_column * sum(r["aligned_width"] for r in rows),
        "minimum_bytes": per_column * sum(r["minimum_width"] for r in rows),
        "single_width_bytes": per_column * widest * len(rows),
    }
    # vLLM 0.33.0 as the plan command computes it (its own width rules).
    totals = plan.build_plan(topology)["totals"]
    if totals["block_table_bytes_per_rank"] != result["contract_bytes"]:
        raise MemoryCheckError(
            f"{topology.name}: the plan counts "
            f"{totals['block_table_bytes_per_rank']} block-table bytes, this "
            f"benchmark {result['contract_bytes']}"
        )
    result["vllm_0_33_bytes"] = totals["upstream"]["block_table_bytes_per_rank"]
    return result


def is_windowed(group: Any) -> bool:
    """A sliding-window group: a bounded number of pages per request, which
    vLLM 0.33.0 cannot shard over DCP."""
    return group.kind == "sliding_window" or "sliding_window" in group.spec_fields


def scenario_shard_count(group: Any, dcp: int, scenario: str) -> int:
    """K of a group in a capacity scenario; recurrent state and sliding
    windows are always 1."""
    if not group.is_attention or dcp == 1 or is_windowed(group):
        return 1
    if scenario == "configured":
        return int(group.shard_count(dcp))
    if scenario == "replicated":
        return 1
    if scenario == "sharded":
        return dcp
    raise ValueError(f"unknown scenario {scenario!r}")


def kv_capacity(
    topology: Topology,
    *,
    budget_bytes: int = CAPACITY_BUDGET_BYTES,
    request_tokens: int = CAPACITY_REQUEST_TOKENS,
) -> dict[str, Any]:
    """Per rank, for a KV budget: attention tokens it holds and concurrent
    ``request_tokens``-token requests, with K as configured, all attention
    replicated (K = 1) and all attention sharded (K = D)."""
    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    sized = topology.with_layout(max_model_len=request_tokens)
    dcp = sized.decode_context_parallel_size
    config = _vllm.sizing_config(sized)
    specs = [_vllm.build_spec(g, sized, patched=True) for g in sized.groups]
    out: dict[str, Any] = {
        "profile": topology.name,
        "dcp": dcp,
        "budget_bytes": budget_bytes,
        "request_tokens": request_tokens,
    }
    for scenario in SCENARIOS:
        request_bytes = 0
        # Bytes a rank stores per token of context, over the attention
        # groups (recurrent state is per request, not per token).
        per_token = 0.0
        shard_counts = {}
        for group, spec in zip(sized.groups, specs, strict=True):
            layers = len(group.layers)
            k = scenario_shard_count(group, dcp, scenario)
            shard_counts[group.name] = k
            if group.is_attention and not is_windowed(group):
                pages = full_attention_pages_per_request(
                    request_tokens, group.block_size, k
                )
                per_token += (
                    layers
                    * spec.page_size_bytes
                    / virtual_block_size(group.block_size, k)
                )
            else:
                # Per request, not per token: vLLM's own rule.
                pages = _vllm.pages_per_request(spec, config)
            request_bytes += layers * pages * spec.page_size_bytes
        out[scenario] = {
            "shard_counts": shard_counts,
            "request_bytes_per_rank": request_bytes,
            "max_concurrent_requests": budget_bytes // request_bytes,
            "attention_bytes_per_token_per_rank": per_token,
            "tokens_per_rank": int(budget_bytes // per_token) if per_token else None,
        }
    return out


def all_profiles() -> dict[str, Any]:
    """Memory and capacity for every built-in profile."""
    memory, capacity = [], []
    for name in profile_names():
        topology = load_profile(name)
        memory.append(block_table_memory(topology))
        capacity.append(kv_capacity(topology))
    return {"memory": memory, "capacity": capacity}


def main() -> int:
    import vllm_dcp_geometry

    vllm_dcp_geometry.register()
    print(json.dumps(all_profiles()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
