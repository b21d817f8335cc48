# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Which ranks a group's attention collectives span, and what they move.

Contract rule A6: a partial MLA group (1 < K < D) runs its query all-gather,
LSE combine and chunked-prefill context gather within its replica: the K
ranks ``q*K .. q*K + K - 1`` of the DCP group, which hold shards
``0 .. K-1`` once each (rank ``r`` holds shard ``r % K``). Every replica is
then a sharded group of world K: nothing is masked, each rank attends K*h
query heads instead of D*h, and the collectives are K-rank ones. The operator
may keep such groups on the D-wide DCP group instead (``DCP_GROUP``: replicas
masked by rule A3), as every non-MLA partial group runs.

The traffic model (``collective_bytes`` and the decode-step formulas) is what
``vllm-dcp-geometry ranks`` measures in real processes and what ``plan``
reports: an attention layer's query all-gather and combine
(``dcp_decode_step_bytes``, ``mla_decode_step_bytes``, and
``dcp_decode_step_bytes_by_dtype`` where the query travels in another dtype
than the output, ``mla_query_element_bytes``), and the DSA indexer's top-k
merge (``indexer_topk_merge_bytes``). Pure Python: no vLLM or torch import.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    GroupGeometry,
    check_shard_count_divides,
)

REPLICA = "replica"
"""Partial MLA groups collective within their replica (K ranks): the default."""

DCP_GROUP = "dcp"
"""Partial groups collective over the whole DCP group (D ranks), masked."""

PARTIAL_COLLECTIVES = (REPLICA, DCP_GROUP)
"""The values of ``additional_config["dcp_geometry"]["partial_collectives"]``."""


# Replica grouping ----------------------------------------------------------------


def replica_rank_lists(
    dcp_groups: Sequence[Sequence[int]], shard_count: int
) -> list[list[int]]:
    """The replica groups of every DCP group for K shards: DCP group ``g``
    (global ranks in DCP-rank order) splits into ``g[q*K : (q+1)*K]`` for
    ``q < D/K``. The list is checked (``check_replica_grouping``)."""
    replicas = []
    for ranks in dcp_groups:
        owner = f"the DCP group {list(ranks)}"
        check_shard_count_divides(owner, shard_count, len(ranks), name="shard count")
        for first in range(0, len(ranks), shard_count):
            members = GroupGeometry(owner, shard_count, len(ranks), first)
            replicas.append([ranks[i] for i in members.replica_dcp_ranks])
    check_replica_grouping(replicas, dcp_groups, shard_count)
    return replicas


def check_replica_grouping(
    replicas: Sequence[Sequence[int]],
    dcp_groups: Sequence[Sequence[int]],
    shard_count: int,
) -> None:
    """Rule A6: every rank of every DCP group is in exactly one replica, and a
    replica is K ranks of one DCP group holding shards ``0 .. K-1`` in order
    (the rank of DCP rank ``i`` holds shard ``i % K``), so a K-rank collective
    over it sees every shard once; anything else raises, naming the group."""
    position = {
        rank: (g, i)
        for g, ranks in enumerate(dcp_groups)
        for i, rank in enumerate(ranks)
    }
    seen: set[int] = set()
    for replica in replicas:
        where = f"replica group {list(replica)} (K={shard_count})"
        if len(replica) != shard_count:
            raise DcpGeometryError(f"{where}: holds {len(replica)} ranks, not K")
        unknown = [r for r in replica if r not in position]
        if unknown:
            raise DcpGeometryError(f"{where}: ranks {unknown} are in no DCP group")
        again = sorted(seen.intersection(replica))
        if again:
            raise DcpGeometryError(f"{where}: ranks {again} are in another replica")
        seen.update(replica)
        groups = {position[r][0] for r in replica}
        if len(groups) != 1:
            raise DcpGeometryError(f"{where}: spans several DCP groups")
        shards = [
            GroupGeometry(
                where, shard_count, len(dcp_groups[position[r][0]]), position[r][1]
            ).shard
            for r in replica
        ]
        if shards != list(range(shard_count)):
            raise DcpGeometryError(
                f"{where}: holds shards {shards}, not each of 0..{shard_count - 1} "
                "once in order, so a collective over it would count a shard twice"
            )
    missing = sorted(set(position) - seen)
    if missing:
        raise DcpGeometryError(
            f"replica groups (K={shard_count}): ranks {missing} are in none"
        )


def collective_world_size(
    shard_count: int, dcp_world_size: int, *, replica_collectives: bool
) -> int:
    """Ranks a group's attention collectives span: 1 for K = 1 (local, none),
    D for K = D, and for a partial group K within its replica (rule A6) or D
    on the DCP group."""
    if shard_count == 1:
        return 1
    if shard_count < dcp_world_size and replica_collectives:
        return shard_count
    return dcp_world_size


def attention_work_ratio(
    collective_world: int, shard_count: int, dcp_world_size: int
) -> float:
    """Decode attention work per rank relative to a sharded group (K = D):
    a rank attends ``W*h`` query heads over ``L/K`` positions, where K = D
    attends ``D*h`` over ``L/D``; so ``W / K`` (1 for local, sharded and
    replica groups; D/K for a partial group on the D-wide group)."""
    check_shard_count_divides("attention work", shard_count, dcp_world_size)
    return collective_world / shard_count


# Traffic -------------------------------------------------------------------------

COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
    "all_reduce",
    "all_gather_into_tensor",
    "all_to_all_single",
)
"""The collectives ``collective_bytes`` models."""

NCCL = "nccl"
GLOO = "gloo"

FLOAT32_BYTES = 4
"""An LSE as most decode kernels return it, and each half of an indexer
candidate."""

FP8_BYTES = 1
"""An element of the platform's fp8 dtype (``float8_e4m3fn`` or its
``fnuz`` variant): what vLLM quantizes MLA queries to."""

FP8_DS_MLA = "fp8_ds_mla"
"""DeepSeek's packed fp8 MLA cache format: quantized, yet vLLM never gathers
its queries in fp8 (``mla_query_element_bytes``)."""

LSE_IN_QUERY_DTYPE_BACKENDS = frozenset({"TRITON_MLA"})
"""Backends whose decode kernel returns its LSEs in the query's dtype
(vLLM 0.33.0's ``TritonMLAImpl.forward_mqa``), which the combine's LSE
all-gather then moves; every other backend's kernel returns float32 LSEs
(``FLOAT32_BYTES``)."""

INDEXER_CANDIDATE_BYTES = 2 * FLOAT32_BYTES
"""One candidate of the DSA indexer's top-k merge: its (score, global token
id) pair, packed as two float32 values."""

BACKEND_RUNS_AS = {NCCL: {}, GLOO: {"reduce_scatter": "all_reduce"}}
"""How a process-group backend runs a requested collective where it does
not run it as itself: torch's gloo backend has no tensor reduce-scatter and
runs ``reduce_scatter_tensor`` as an all-reduce of the whole input (its own
flight recorder names the call ``gloo:all_reduce``, as ``ranks`` counts it).
NCCL runs every collective as itself: GPUs, and what ``plan`` reports."""


def runs_as(op: str, backend: str) -> str:
    """The collective ``backend`` runs for a requested ``op``."""
    if backend not in BACKEND_RUNS_AS:
        raise ValueError(
            f"unknown backend {backend!r}; one of {tuple(BACKEND_RUNS_AS)}"
        )
    return BACKEND_RUNS_AS[backend].get(op, op)


def collective_bytes(op: str, world_size: int, input_bytes: int) -> int:
    """Bytes one rank sends plus receives in one ``op`` over ``world_size``
    ranks, given the bytes of its input (ring algorithms, as NCCL and gloo
    run them; a one-rank group moves nothing):

    - ``all_gather`` / ``all_gather_into_tensor`` of n bytes per rank: the rank
      sends and receives (W - 1) * n, so 2 (W - 1) n;
    - ``reduce_scatter`` of N bytes (each rank keeps N / W) and
      ``all_to_all_single`` of N bytes: (W - 1) N / W each way, 2 (W - 1) N / W;
    - ``all_reduce`` of N bytes (a reduce-scatter then an all-gather):
      4 (W - 1) N / W.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")
    w = world_size
    if w <= 1:
        return 0
    if op in ("all_gather", "all_gather_into_tensor"):
        return 2 * (w - 1) * input_bytes
    if input_bytes % w:
        raise ValueError(f"{op} of {input_bytes} bytes does not split over {w} ranks")
    share = input_bytes // w
    if op == "all_reduce":
        return 4 * (w - 1) * share
    return 2 * (w - 1) * share


def dcp_decode_step_bytes(
    world_size: int,
    *,
    tokens: int,
    heads_per_rank: int,
    query_head_dim: int,
    output_head_dim: int,
    dtype_bytes: int,
    lse_bytes: int = 4,
    backend: str = NCCL,
) -> int:
    """Bytes one rank sends plus receives in one DCP decode step of
    ``tokens`` tokens over a collective world of ``world_size`` ranks on vLLM
    0.33.0's all-gather / reduce-scatter path (``dcp_comm_backend`` ``ag_rs``),
    as ``collective_bytes`` counts them:

    - the query all-gather: each rank's [T, h, Q] queries;
    - the LSE all-gather of the combine: each rank's [T, W h] float32 LSEs;
    - the output reduce-scatter: [T, W h, O] partial outputs, each rank
      keeping [T, h, O].

    Total 2 (W - 1) T (h Q e + W h l + h O e) for element size e and LSE size
    l on NCCL; 0 for W = 1 (local attention). On gloo the reduce-scatter runs
    as an all-reduce (``BACKEND_RUNS_AS``): its term doubles.
    """
    return dcp_decode_step_bytes_by_dtype(
        world_size,
        tokens=tokens,
        heads_per_rank=heads_per_rank,
        query_head_dim=query_head_dim,
        output_head_dim=output_head_dim,
        query_bytes=dtype_bytes,
        output_bytes=dtype_bytes,
        lse_bytes=lse_bytes,
        backend=backend,
    )


def dcp_decode_step_bytes_by_dtype(
    world_size: int,
    *,
    tokens: int,
    heads_per_rank: int,
    query_head_dim: int,
    output_head_dim: int,
    query_bytes: int,
    output_bytes: int,
    lse_bytes: int = FLOAT32_BYTES,
    backend: str = NCCL,
) -> int:
    """``dcp_decode_step_bytes`` with each tensor in its own dtype: queries of
    ``query_bytes`` per element (1 where vLLM gathers them in fp8,
    ``mla_query_element_bytes``), partial outputs of ``output_bytes`` (the
    model's activation dtype) and LSEs of ``lse_bytes``.

    Total 2 (W - 1) T (h Q q + W h l + h O o) on NCCL for query, LSE and
    output element sizes q, l and o; 0 for W = 1. On gloo the reduce-scatter
    runs as an all-reduce (``BACKEND_RUNS_AS``): its term doubles.
    """
    t, h, w = tokens, heads_per_rank, world_size
    query = t * h * query_head_dim * query_bytes
    lse = t * w * h * lse_bytes
    partial_out = t * w * h * output_head_dim * output_bytes
    return (
        collective_bytes(runs_as("all_gather", backend), w, query)
        + collective_bytes(runs_as("all_gather", backend), w, lse)
        + collective_bytes(runs_as("reduce_scatter", backend), w, partial_out)
    )


def mla_decode_step_bytes(
    world_size: int,
    *,
    tokens: int,
    heads_per_rank: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype_bytes: int,
    lse_bytes: int = 4,
    backend: str = NCCL,
) -> int:
    """``dcp_decode_step_bytes`` of an MLA layer: latent queries of
    ``L + R`` (``kv_lora_rank + rope_dim``) and latent outputs of ``L``. A
    sharded group and a partial one on the D-wide group have W = D; a partial
    one within its replica W = K (rule A6)."""
    return dcp_decode_step_bytes(
        world_size,
        tokens=tokens,
        heads_per_rank=heads_per_rank,
        query_head_dim=kv_lora_rank + rope_dim,
        output_head_dim=kv_lora_rank,
        dtype_bytes=dtype_bytes,
        lse_bytes=lse_bytes,
        backend=backend,
    )


def mla_query_element_bytes(
    activation_bytes: int,
    *,
    cache_dtype: str,
    quantized_cache: bool,
    quant_query_input: bool,
) -> int:
    """Bytes of one element of the queries an MLA layer's DCP manager
    all-gathers (vLLM 0.33.0 ``MLAAttention.__init__``'s ``query_dtype``):
    the platform's fp8 dtype (``FP8_BYTES``) where the cache is quantized
    (``quantized_cache``: vLLM's ``is_quantized_kv_cache(cache_dtype)``) but
    not ``fp8_ds_mla`` and the impl takes quantized queries
    (``quant_query_input``: its ``supports_quant_query_input``); else the
    model's activation dtype, ``activation_bytes``. The partial outputs are
    always in the activation dtype."""
    if quantized_cache and cache_dtype != FP8_DS_MLA and quant_query_input:
        return FP8_BYTES
    return activation_bytes


def indexer_topk_merge_bytes(
    world_size: int, *, tokens: int, topk: int, backend: str = NCCL
) -> int:
    """Bytes one rank sends plus receives in the DSA indexer's top-k merge
    of ``tokens`` decode tokens over ``world_size`` ranks (vLLM 0.33.0's
    ``_merge_dcp_topk_global``): each rank packs its local top-k as (score,
    global id) float32 pairs, a ``[T, topk, 2]`` tensor of
    ``T * topk * 2 * 4`` bytes, and all-gathers it, so every rank selects
    from W x topk candidates per token. W is K within the replica for a
    partial indexer cache (rule A6), else D.

    Total 2 (W - 1) T topk 8 (``collective_bytes`` of an all-gather, which
    NCCL and gloo both run as itself); 0 for W = 1 (vLLM does not merge).
    """
    packed = tokens * topk * INDEXER_CANDIDATE_BYTES
    return collective_bytes(runs_as("all_gather", backend), world_size, packed)
