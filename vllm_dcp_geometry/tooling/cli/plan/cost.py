# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What each group's decode collectives span and move, for ``plan``.

Every number comes from ``vllm_dcp_geometry.contract.collectives``, the model
``ranks`` measures in real processes: the collective world W of a group with
K shards under D (rule A6: a partial group on a dense or sparse MLA backend
or the DSA indexer runs within its K-rank replica unless the topology's
``partial_collectives`` is ``"dcp"``), the bytes one rank sends plus
receives per decoded token in one layer of the group, and the attention work
per rank relative to K = D. A partial group also gets the D-wide
alternative, so the saving shows.

The bytes of an attention group are its query all-gather, LSE all-gather and
output reduce-scatter (``dcp_decode_step_bytes_by_dtype`` with one token),
each tensor in the dtype vLLM 0.33.0 moves it in: queries and outputs in the
model's activation dtype (the group's ``activation_dtype``; without it, an
unquantized cache's own dtype), but an MLA query in fp8 where vLLM gathers it
so (``mla_query_element_bytes``); LSEs as the backend's kernel returns them.
A DSA indexer cache's bytes are its top-k merge (``indexer_topk_merge_bytes``)
of the top-k its latent cache's ``topk_buffer_width`` holds. Bytes are None,
with a reason, when the topology lacks what they need; refused and recurrent
groups get no cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract.attention_backends import collectives_within_replica
from vllm_dcp_geometry.contract.collectives import (
    FLOAT32_BYTES,
    FP8_DS_MLA,
    LSE_IN_QUERY_DTYPE_BACKENDS,
    REPLICA,
    attention_work_ratio,
    collective_world_size,
    dcp_decode_step_bytes_by_dtype,
    indexer_topk_merge_bytes,
    mla_query_element_bytes,
)
from vllm_dcp_geometry.contract.layer_classes import indexer_latent_name
from vllm_dcp_geometry.tooling.topology import (
    ACTIVATION_DTYPE_BYTES,
    CacheGroup,
    Topology,
)

ATTENTION_COLLECTIVES = "attention"
"""A group whose decode step runs the query all-gather, the LSE all-gather
and the output reduce-scatter."""

INDEXER_TOPK_MERGE = "indexer_topk_merge"
"""A DSA indexer cache, whose decode step runs the top-k merge: one
all-gather of each rank's top-k (score, id) float32 candidates."""

COST_KEYS = (
    "decode_collectives",
    "collective_world_size",
    "decode_collective_bytes_per_rank_per_token",
    "attention_work_vs_sharded",
    "dcp_group_bytes_per_rank_per_token",
    "dcp_group_attention_work_vs_sharded",
    "decode_collective_bytes_reason",
)
"""The fields ``group_cost`` adds to each plan group (all present, None where
they do not apply)."""

_NO_COST_MODES = {
    "refused": "refused at start-up",
    "none": "no attention (recurrent state)",
}
# A cache_dtype_str that leaves the cache in the model's dtype.
_UNQUANTIZED_CACHE = (None, "auto")

QUANT_QUERY_INPUT_MLA_BACKENDS: dict[str, bool] = {
    "FLASHMLA": True,
    "FLASH_ATTN_MLA": True,
    "FLASHINFER_MLA": True,
    "CUTLASS_MLA": True,
    "TRITON_MLA": False,
    "FLASHMLA_SPARSE": False,
    "FLASHINFER_MLA_SPARSE": True,
    "FLASH_ATTN_MLA_SPARSE_FA4": True,
}
"""Whether each MLA backend's impl, built for a quantized cache, takes
quantized queries (vLLM 0.33.0's ``impl.supports_quant_query_input``). It is
an instance attribute, not a class one: ``MLACommonImpl.__init__`` sets True
(FLASHMLA, FLASH_ATTN_MLA, FLASHINFER_MLA and CUTLASS_MLA keep it),
``TritonMLAImpl.__init__`` sets False for a quantized cache (it dequantizes
in its kernel), ``FlashInferMLASparseImpl.__init__`` True (its FA4 subclass
keeps it), and ``FlashMLASparseImpl`` keeps ``AttentionImpl``'s False. The
suite builds each impl to check this table. A backend not listed has no
answer here, and a quantized cache on it gets no bytes, said why."""


@dataclass(frozen=True)
class AttentionTraffic:
    """One decoded token of one attention layer: per rank, ``heads`` query
    heads of ``query_dim`` elements gathered, and latent or value outputs
    of ``output_dim`` elements combined, each in its own element size."""

    heads: int
    query_dim: int
    output_dim: int
    query_bytes: int
    output_bytes: int
    lse_bytes: int

    def bytes_over(self, world: int) -> int:
        """Bytes one rank sends plus receives over ``world`` ranks."""
        return dcp_decode_step_bytes_by_dtype(
            world,
            tokens=1,
            heads_per_rank=self.heads,
            query_head_dim=self.query_dim,
            output_head_dim=self.output_dim,
            query_bytes=self.query_bytes,
            output_bytes=self.output_bytes,
            lse_bytes=self.lse_bytes,
        )


@dataclass(frozen=True)
class IndexerMergeTraffic:
    """One decoded token of one DSA indexer layer: its top-k merge of
    ``topk`` candidates per rank."""

    topk: int

    def bytes_over(self, world: int) -> int:
        """Bytes one rank sends plus receives over ``world`` ranks."""
        return indexer_topk_merge_bytes(world, tokens=1, topk=self.topk)


Traffic = AttentionTraffic | IndexerMergeTraffic


def _stored_as(group: CacheGroup) -> str:
    return str(group.spec_fields.get("cache_dtype_str") or group.spec_fields["dtype"])


def _is_quantized(group: CacheGroup) -> bool:
    """Whether the cache stores something other than a float of the
    model's: vLLM's ``is_quantized_kv_cache`` of its ``cache_dtype_str``
    (MLA), or a quantization mode or a dtype narrower than two bytes."""
    import torch
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    cache_dtype = group.spec_fields.get("cache_dtype_str")
    if cache_dtype is not None and is_quantized_kv_cache(cache_dtype):
        return True
    if group.spec_fields.get("kv_quant_mode", "NONE") != "NONE":
        return True
    dtype = getattr(torch, str(group.spec_fields["dtype"]), None)
    return (
        not isinstance(dtype, torch.dtype)
        or not dtype.is_floating_point
        or dtype.itemsize < 2
    )


def _activation_bytes(group: CacheGroup, quantized: bool) -> int | None:
    """Bytes of one element of the attention's queries and outputs: the
    group's ``activation_dtype``; without it, the cache's own dtype where
    the cache holds the model's dtype (``cache_dtype_str`` unset or
    ``"auto"``, not quantized); else None (unknown)."""
    if group.activation_dtype is not None:
        return ACTIVATION_DTYPE_BYTES[group.activation_dtype]
    if quantized or group.spec_fields.get("cache_dtype_str") not in _UNQUANTIZED_CACHE:
        return None
    import torch

    return int(getattr(torch, str(group.spec_fields["dtype"])).itemsize)


def _attention_traffic(
    group: CacheGroup, topology: Topology, backend: str | None
) -> AttentionTraffic | str:
    """The group's decode traffic on ``backend``, or why the topology cannot
    size it."""
    heads = topology.heads_per_rank(group)
    if heads is None:
        return "the topology gives no query_heads"
    if group.kind == "mla" and group.kv_lora_rank is None:
        return "the topology gives no kv_lora_rank"
    quantized = _is_quantized(group)
    activation = _activation_bytes(group, quantized)
    if activation is None:
        return (
            f"the cache is stored as {_stored_as(group)}, which is not the dtype "
            "of the queries and outputs, and the topology gives no "
            "activation_dtype (the model's dtype)"
        )
    query = activation
    if quantized and group.kind != "mla":
        return (
            f"the cache is stored as {_stored_as(group)}: whether {backend} "
            "gathers fp8 or activation-dtype queries depends on its kernel "
            "version on the device, which plan does not model"
        )
    if quantized:
        cache_dtype = group.spec_fields.get("cache_dtype_str")
        takes_quant_query = QUANT_QUERY_INPUT_MLA_BACKENDS.get(backend or "")
        if cache_dtype is None:
            return (
                f"the cache is stored as {_stored_as(group)} and the topology "
                "gives no cache_dtype_str (vLLM's kv_cache_dtype), which decides "
                "the dtype vLLM gathers the queries in"
            )
        if takes_quant_query is None and cache_dtype != FP8_DS_MLA:
            return (
                f"the cache is stored as {cache_dtype}, and whether {backend}'s "
                "impl then takes fp8 queries (supports_quant_query_input) is not "
                "in plan's table"
            )
        query = mla_query_element_bytes(
            activation,
            cache_dtype=str(cache_dtype),
            quantized_cache=True,
            quant_query_input=bool(takes_quant_query),
        )
    if group.kind == "mla":
        assert group.kv_lora_rank is not None and group.rope_dim is not None
        query_dim, output_dim = group.kv_lora_rank + group.rope_dim, group.kv_lora_rank
    else:
        query_dim = int(group.spec_fields["head_size"])
        output_dim = int(group.spec_fields.get("head_size_v", query_dim))
    return AttentionTraffic(
        heads=heads,
        query_dim=query_dim,
        output_dim=output_dim,
        query_bytes=query,
        output_bytes=activation,
        lse_bytes=query if backend in LSE_IN_QUERY_DTYPE_BACKENDS else FLOAT32_BYTES,
    )


def indexer_topk(group: CacheGroup, topology: Topology) -> int | str:
    """The top-k a DSA indexer cache's merge gathers per rank: the
    ``topk_buffer_width`` of its layers' latent caches (vLLM's DeepSeek-V3.2
    model allocates that buffer ``index_topk`` wide, the ``topk_tokens`` its
    indexer hands the merge; a model build checks they agree), or why the
    topology cannot say it."""
    by_layer = {layer: g for g in topology.groups for layer in g.layers}
    widths: dict[Any, list[str]] = {}
    for layer in group.layers:
        latent = indexer_latent_name(layer)
        if latent is None or latent not in by_layer:
            return (
                f"the top-k merge gathers the top-k of layer {layer!r}'s latent "
                f"cache ({latent or 'none: not named P.indexer.k_cache'}), which "
                "is in no group of the topology"
            )
        owner = by_layer[latent]
        width = owner.spec_fields.get("topk_buffer_width")
        widths.setdefault(width, []).append(owner.name)
    if None in widths:
        return (
            f"the latent group {widths[None][0]!r} gives no topk_buffer_width, "
            "the top-k the merge gathers"
        )
    if len(widths) > 1:
        shown = ", ".join(
            f"{width} ({sorted(set(names))[0]})" for width, names in widths.items()
        )
        return (
            f"its layers' latent caches have different top-k widths ({shown}); "
            "split the indexer group by width"
        )
    return int(next(iter(widths)))


def decode_traffic(
    group: CacheGroup, topology: Topology, backend: str | None
) -> Traffic | str:
    """What one decoded token of one of the group's layers moves on
    ``backend``, or why the topology cannot size it."""
    if group.spec_fields.get("cache_role") == "indexer":
        # Its layer's attention collectives are the latent group's row.
        topk = indexer_topk(group, topology)
        return topk if isinstance(topk, str) else IndexerMergeTraffic(topk)
    return _attention_traffic(group, topology, backend)


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
    backend = attention["attention_backend"]
    # Rule A6 needs both the operator's choice and a taught backend (whose
    # patch binds the replica group).
    replica = topology.partial_collectives == REPLICA and collectives_within_replica(
        backend
    )
    world = collective_world_size(k, dcp, replica_collectives=replica)
    traffic = decode_traffic(group, topology, backend)
    cost["decode_collectives"] = (
        INDEXER_TOPK_MERGE
        if group.spec_fields.get("cache_role") == "indexer"
        else ATTENTION_COLLECTIVES
    )
    cost["collective_world_size"] = world
    cost["attention_work_vs_sharded"] = attention_work_ratio(world, k, dcp)
    if isinstance(traffic, str):
        cost["decode_collective_bytes_reason"] = traffic
    else:
        cost["decode_collective_bytes_per_rank_per_token"] = traffic.bytes_over(world)
    if 1 < k < dcp:
        dcp_world = collective_world_size(k, dcp, replica_collectives=False)
        cost["dcp_group_attention_work_vs_sharded"] = attention_work_ratio(
            dcp_world, k, dcp
        )
        if not isinstance(traffic, str):
            cost["dcp_group_bytes_per_rank_per_token"] = traffic.bytes_over(dcp_world)
    return cost
