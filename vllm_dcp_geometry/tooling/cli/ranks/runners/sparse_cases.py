# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The DeepSeek-V3.2 runner (``runners.sparse_mla``) before and after its
workers run: the spec values it runs, the layer's two groups as one pair
with its top-k (``sparse_pair``), the shapes they run at (``sparse_case``),
what a worker allocates for them (``sparse_worker_bytes``) and each row's
report (``measure_sparse``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.contract.collectives import indexer_topk_merge_bytes
from vllm_dcp_geometry.contract.layer_classes import (
    INDEXER_CACHE_SUFFIX,
    LATENT_CACHE_SUFFIX,
    indexer_latent_name,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import GroupCase
from vllm_dcp_geometry.tooling.cli.ranks.shapes import (
    DTYPE_BYTES,
    TRANSIENT_COPIES,
    Shape,
    scaled_heads,
    sparse_decode_requests,
)
from vllm_dcp_geometry.tooling.cli.ranks.verdict import (
    tolerance,
    traffic_and_class,
    worst_of,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

SPARSE_BACKEND = "FLASHMLA_SPARSE"
"""DeepSeek-V3.2's sparse latent groups' backend (vLLM 0.33.0's one sparse
backend with DCP on SM90). Its builder runs on any device; on a CPU its
impl's FlashMLA kernels are stood in for (``sparse_mla``)."""
INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
"""The DSA indexer cache's backend (the layer fixes it)."""

SPARSE_TOPKS = (512, 1024, 2048)
"""The top-k widths vLLM 0.33.0's DCP top-k merge takes
(``_assert_cutedsl_dcp_merge_supported``)."""


SPARSE_LATENT_DIM = 576
"""``kv_lora_rank + rope``: the one latent row the sparse kernels take."""
SPARSE_NOPE_DIM = 128
"""DeepSeek-V3.2's ``qk_nope_head_dim`` and ``v_head_dim`` (not in a
topology: they size only ``kv_b_proj``, never a cache or a collective)."""


SPARSE_LATENT_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("sparse",),
    "cache_dtype_str": ("fp8_ds_mla",),
    "kv_quant_mode": ("FP8_PER_TENSOR",),
    "state_content_bytes": (656,),
    "non_causal_multi_token_decode": (False,),
    "is_index_group_leader": (True,),
    "topk_buffer_width": SPARSE_TOPKS,
}
"""A DeepSeek-V3.2 sparse latent cache as ``ranks`` runs it: FlashMLA's
656-byte ``fp8_ds_mla`` format (vLLM 0.33.0 refuses the bfloat16 sparse path
under DCP), its layer leading its index group with a top-k buffer the DCP
merge takes."""

INDEXER_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("indexer",),
    "non_causal_multi_token_decode": (False,),
}


@dataclass(frozen=True)
class SparsePair:
    """The two groups one DeepSeek-V3.2 layer reads (its latent and indexer
    caches, of one K by rule A5) and the top-k its indexer selects."""

    latent: CacheGroup
    indexer: CacheGroup
    topk: int


def latent_indexer_name(name: str) -> str | None:
    """The indexer cache's layer name for a sparse latent cache's (None:
    ``name`` is not a latent cache's ``P.attn``)."""
    if not name.endswith(LATENT_CACHE_SUFFIX):
        return None
    return name.removesuffix(LATENT_CACHE_SUFFIX) + INDEXER_CACHE_SUFFIX


def sparse_pair(topology: Topology, group: CacheGroup) -> SparsePair | str:
    """The latent and indexer groups of the DeepSeek-V3.2 layers ``group``
    holds a cache of, and the top-k (``plan``'s ``indexer_topk``: the latent
    caches' ``topk_buffer_width``), or why ``ranks`` cannot run them: its
    layers' other caches are not exactly one group, or a top-k the DCP merge
    does not take."""
    from vllm_dcp_geometry.tooling.cli.plan.cost import indexer_topk

    indexer = group.spec_fields.get("cache_role") == "indexer"
    partner_of = indexer_latent_name if indexer else latent_indexer_name
    wanted = {partner_of(layer) for layer in group.layers}
    other = "latent" if indexer else "indexer"
    holders = [g for g in topology.groups if wanted & set(g.layers)]
    if None in wanted or len(holders) != 1 or set(holders[0].layers) != wanted:
        return (
            f"not run: its layers' {other} caches are not one group of the "
            "topology (ranks runs each DeepSeek-V3.2 layer with both caches)"
        )
    # One K for both (rule A5): a topology refuses a layer whose caches differ.
    latent, index = (holders[0], group) if indexer else (group, holders[0])
    topk = indexer_topk(index, topology)
    if isinstance(topk, str):
        return f"not run: {topk}"
    if topk not in SPARSE_TOPKS:
        return (
            f"not run: top-k {topk} (vLLM's DCP top-k merge takes "
            f"{', '.join(map(str, SPARSE_TOPKS))})"
        )
    return SparsePair(latent, index, topk)


def sparse_model_len(block_size: int, shard_count: int, topk: int) -> int:
    """``max_model_len`` of a sparse run: its longest request, rounded up to
    a multiple of 64."""
    longest = max(
        c + n for c, n in sparse_decode_requests(block_size, shard_count, topk)
    )
    return cdiv(longest, 64) * 64


def sparse_case(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = SPARSE_BACKEND,
    dtype: str | None = None,
) -> GroupCase | str:
    """The shapes a DeepSeek-V3.2 layer runs at for either of its groups
    (its latent group's: query heads per rank divided by ``scale``, L + R,
    the model's ``activation_dtype`` the queries and outputs are in; the
    cache's own format is ``fp8_ds_mla``), with its pair's names and top-k
    in the plan, or why not."""
    pair = sparse_pair(topology, group)
    if isinstance(pair, str):
        return pair
    latent = pair.latent
    heads = topology.heads_per_rank(latent)
    if heads is None or latent.kv_lora_rank is None or latent.rope_dim is None:
        return (
            f"not run: the topology gives no query_heads or kv_lora_rank for the "
            f"latent group {latent.name!r} (ranks runs each group at its own shapes)"
        )
    if latent.kv_lora_rank + latent.rope_dim != SPARSE_LATENT_DIM:
        return (
            f"not run: latent rows of {latent.kv_lora_rank + latent.rope_dim} "
            f"(the sparse kernels take {SPARSE_LATENT_DIM})"
        )
    run_dtype = dtype or latent.activation_dtype
    if run_dtype not in DTYPE_BYTES:
        return (
            f"not run: the topology gives no activation_dtype for "
            f"{latent.name!r} (the model's dtype, which the queries and outputs "
            f"are in; ranks runs {', '.join(DTYPE_BYTES)})"
        )
    k = latent.shard_count(topology.decode_context_parallel_size)
    shape = Shape(
        heads_per_rank=scaled_heads(heads, scale),
        kv_lora_rank=latent.kv_lora_rank,
        rope_dim=latent.rope_dim,
        dtype=run_dtype,
        max_model_len=sparse_model_len(latent.block_size, k, pair.topk),
        nope_dim=SPARSE_NOPE_DIM,
        v_head_dim=SPARSE_NOPE_DIM,
        backend=backend,
    )
    plan = {
        "sparse_latent": pair.latent.name,
        "sparse_indexer": pair.indexer.name,
        "indexer_topk": pair.topk,
    }
    return GroupCase(shape, plan)


def sparse_worker_bytes(
    case: GroupCase, world: int, block_size: int, shard_count: int
) -> int:
    """The bytes one worker allocates for a DeepSeek-V3.2 layer (both of its
    groups, run together) at its case's shape, counted as
    ``mla_cases.dense_worker_bytes`` counts:
    the ``kv_b_proj`` weights, the paged latent cache, the sparse builder's
    chunked-prefill workspace (vLLM sizes it to at most ``max_num_seqs``
    top-k rows; up to twice under DCP), the float64 latent rows (and their
    fp8_ds_mla copy) and queries, and the reference's selected rows of one
    token, then times ``TRANSIENT_COPIES``."""
    shape, topk = case.shape, int(case.plan["indexer_topk"])
    e, h = shape.dtype_bytes, shape.heads_per_rank
    heads = world * h
    row = shape.kv_lora_rank + shape.rope_dim
    up = shape.nope_dim + shape.v_head_dim
    weight = (heads * 8 + 2 * h * e) * up * shape.kv_lora_rank
    requests = sparse_decode_requests(block_size, shard_count, topk)
    width = cdiv(shape.max_model_len, block_size * shard_count)
    cache = (width * len(requests) + 1) * block_size * row * e
    workspace_rows = min(
        max(8 * shape.max_model_len, 4 * shape.max_num_seqs * block_size),
        64 * 1024,
        shape.max_num_seqs * topk,
    )
    workspace = 2 * workspace_rows * row * e
    latents = 2 * 8 * sum(c + n for c, n in requests) * row
    queries = 8 * len(requests) * heads * row
    reference = 8 * topk * (row + heads)
    return TRANSIENT_COPIES * (
        weight + cache + workspace + latents + queries + reference
    )


ATTENTION_COLLECTIVES = "attention"
INDEXER_TOPK_MERGE = "indexer_topk_merge"
"""What a sparse row's decode step moves (``plan``'s ``decode_collectives``):
the attention's query all-gather and combine, or the indexer's top-k merge."""


def _sparse_numerics(g: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A sparse row's worst errors over the ranks (the latent row: output
    after ``W_UV`` and LSE, each within the dtype's tolerance of its
    magnitude; the indexer row has none) and whether every rank's merged
    selection is the float64 top-k (and, for the indexer row, every rank's
    builder gave its op the contract's local lengths)."""
    selections_ok = all(r["selection_ok"] for r in ranks)
    if ranks[0]["sparse_role"] != "latent":
        lengths_ok = all(r["local_lengths_ok"] for r in ranks)
        return {
            "max_abs_error": None,
            "max_lse_error": None,
            "selection_ok": selections_ok,
            "selection_repeats": any(r["selection_repeats"] for r in ranks),
            "local_lengths_ok": lengths_ok,
            "numerics_ok": selections_ok and lengths_ok,
        }
    shape = Shape(**g["shape"])
    # The sums the kernels form: the score over L + R, the softmax-weighted
    # sum over the top-k selected rows.
    dots = (shape.kv_lora_rank + shape.rope_dim, int(g["indexer_topk"]))
    worst: dict[str, Any] = {"selection_ok": selections_ok}
    within = selections_ok
    for kind, key in (("output", "max_abs_error"), ("lse", "max_lse_error")):
        error = worst_of([r[f"decode_{key}"] for r in ranks])
        size = max(r[f"decode_{kind}_magnitude"] for r in ranks)
        allowed = tolerance(shape.dtype, size, dots)
        worst[key] = error
        worst[f"decode_{key}"] = error
        worst[f"decode_{kind}_magnitude"] = size
        worst[f"decode_{key}_tolerance"] = allowed
        if (kind == "output" and error is None) or (
            error is not None and not error <= allowed
        ):
            within = False
    return {**worst, "numerics_ok": within}


def measure_sparse(
    g: dict[str, Any],
    ranks: list[dict[str, Any]],
    *,
    dcp: int,
    patched: bool,
    backend: str,
) -> dict[str, Any]:
    """What the ranks of a DeepSeek-V3.2 layer measured for one of its two
    groups: the latent row against the MLA decode step's formula
    (``Shape.decode_step_bytes``: the query all-gather and combine), the
    indexer row against the top-k merge's
    (``collectives.indexer_topk_merge_bytes``), each over the W the plan
    names on the run's ``backend``, with the NCCL figure beside."""
    shape = Shape(**g["shape"])
    latent = ranks[0]["sparse_role"] == "latent"
    topk = int(g["indexer_topk"])

    def merge_bytes(world: int, tokens: int, on: str) -> int:
        return indexer_topk_merge_bytes(world, tokens=tokens, topk=topk, backend=on)

    row = traffic_and_class(
        g,
        ranks,
        dcp=dcp,
        patched=patched,
        backend=backend,
        formula=shape.decode_step_bytes if latent else merge_bytes,
        unmodeled=sorted({c for r in ranks for c in r["decode_unmodeled_collectives"]}),
        planned_class=g["layer_class"],
    )
    numerics = _sparse_numerics(g, ranks)
    steps = [r["decode_step_s"] for r in ranks if r["decode_step_s"] is not None]
    return {
        **row,
        **numerics,
        "decode_collectives": ATTENTION_COLLECTIVES if latent else INDEXER_TOPK_MERGE,
        "indexer_topk": topk,
        "prefill_collective_bytes_per_rank": None,
        "decode_step_s": max(steps) if steps else None,
        "graph_max_abs_error": None,
        "graph_ok": True,
        "ok": numerics["numerics_ok"]
        and row["traffic_matches_formula"]
        and row["layer_class_matches"],
    }
