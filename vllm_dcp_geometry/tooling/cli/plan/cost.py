# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What each group's decode collectives span and move, for ``plan``.

Every number comes from ``vllm_dcp_geometry.contract.collectives``, the model
``ranks`` measures in real processes: the collective world W of a group with
K shards under D (rule A6: a partial group on a dense MLA backend runs within
its K-rank replica unless the topology's ``partial_collectives`` is
``"dcp"``), the bytes one rank sends plus receives per decoded token in one
layer of the group (``mla_decode_step_bytes`` / ``dcp_decode_step_bytes``
with one token), and the attention work per rank relative to K = D. A partial
group also gets the D-wide alternative, so the saving shows. Bytes are None,
with a reason, when the topology lacks a shape they need; refused and
recurrent groups get no cost.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.contract.attention_backends import (
    collectives_within_replica,
    d_wide_partial_reason,
)
from vllm_dcp_geometry.contract.collectives import (
    REPLICA,
    attention_work_ratio,
    collective_world_size,
    dcp_decode_step_bytes,
    mla_decode_step_bytes,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

COST_KEYS = (
    "collective_world_size",
    "decode_collective_bytes_per_rank_per_token",
    "attention_work_vs_sharded",
    "dcp_group_bytes_per_rank_per_token",
    "dcp_group_attention_work_vs_sharded",
    "decode_collective_bytes_reason",
    "d_wide_reason",
)
"""The fields ``group_cost`` adds to each plan group (all present, None where
they do not apply)."""

_NO_COST_MODES = {
    "refused": "refused at start-up",
    "none": "no attention (recurrent state)",
}
# A cache_dtype_str that leaves the cache in the model's dtype.
_UNQUANTIZED_CACHE = (None, "auto")


def _element_bytes(group: CacheGroup) -> int | None:
    """Bytes of one query/output element: the group's dtype where the cache
    holds the model's activations (a 2- or 4-byte float, no quantized
    ``cache_dtype_str``); None where the cache is quantized (uint8, fp8),
    whose dtype says nothing of the queries and outputs."""
    import torch

    dtype = getattr(torch, str(group.spec_fields["dtype"]), None)
    if (
        not isinstance(dtype, torch.dtype)
        or not dtype.is_floating_point
        or dtype.itemsize < 2
        or group.spec_fields.get("cache_dtype_str") not in _UNQUANTIZED_CACHE
    ):
        return None
    return int(dtype.itemsize)


def _missing_shape(group: CacheGroup) -> str | None:
    """Why the topology cannot size the group's decode traffic (None: it can)."""
    if group.spec_fields.get("cache_role") == "indexer":
        return "an indexer cache: the DSA indexer's top-k merge is not modelled"
    if group.query_heads is None:
        return "the topology gives no query_heads"
    if group.kind == "mla" and group.kv_lora_rank is None:
        return "the topology gives no kv_lora_rank"
    if _element_bytes(group) is None:
        stored = group.spec_fields.get("cache_dtype_str") or group.spec_fields["dtype"]
        return (
            f"the cache is stored as {stored}, which is not the dtype of the "
            "queries and outputs"
        )
    return None


def decode_step_bytes(group: CacheGroup, topology: Topology, world: int) -> int:
    """Bytes one rank sends plus receives per decoded token in one of the
    group's layers over ``world`` ranks (``_missing_shape`` must be None)."""
    heads = topology.heads_per_rank(group)
    element = _element_bytes(group)
    assert heads is not None and element is not None
    if group.kind == "mla":
        assert group.kv_lora_rank is not None and group.rope_dim is not None
        return mla_decode_step_bytes(
            world,
            tokens=1,
            heads_per_rank=heads,
            kv_lora_rank=group.kv_lora_rank,
            rope_dim=group.rope_dim,
            dtype_bytes=element,
        )
    head_size = int(group.spec_fields["head_size"])
    return dcp_decode_step_bytes(
        world,
        tokens=1,
        heads_per_rank=heads,
        query_head_dim=head_size,
        output_head_dim=int(group.spec_fields.get("head_size_v", head_size)),
        dtype_bytes=element,
    )


def group_cost(
    group: CacheGroup, topology: Topology, attention: dict[str, Any], k: int
) -> dict[str, Any]:
    """The ``COST_KEYS`` of one group, from how its attention runs
    (``attention.group_attention``'s fields) and its shard count K."""
    cost: dict[str, Any] = dict.fromkeys(COST_KEYS)
    mode = attention["attention_mode"]
    if mode in _NO_COST_MODES:
        cost["decode_collective_bytes_reason"] = _NO_COST_MODES[mode]
        return cost
    dcp = topology.decode_context_parallel_size
    # Rule A6 needs both the operator's choice and a backend whose patch
    # binds the replica group; every other partial group stays D-wide.
    replica = topology.partial_collectives == REPLICA and collectives_within_replica(
        attention["attention_backend"]
    )
    world = collective_world_size(k, dcp, replica_collectives=replica)
    missing = _missing_shape(group)
    cost["collective_world_size"] = world
    cost["attention_work_vs_sharded"] = attention_work_ratio(world, k, dcp)
    cost["decode_collective_bytes_reason"] = missing
    if missing is None:
        cost["decode_collective_bytes_per_rank_per_token"] = decode_step_bytes(
            group, topology, world
        )
    if 1 < k < dcp and topology.partial_collectives == REPLICA and not replica:
        # The operator asked for the replica; this backend keeps D-wide.
        cost["d_wide_reason"] = d_wide_partial_reason(attention["attention_backend"])
    if 1 < k < dcp:
        dcp_world = collective_world_size(k, dcp, replica_collectives=False)
        cost["dcp_group_attention_work_vs_sharded"] = attention_work_ratio(
            dcp_world, k, dcp
        )
        if missing is None:
            cost["dcp_group_bytes_per_rank_per_token"] = decode_step_bytes(
                group, topology, dcp_world
            )
    return cost
