# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan``'s decode-collective bytes for DeepSeek-V3.2's sparse MLA: the DSA
indexer's top-k merge and its latent attention, each formula restated from
vLLM 0.33.0's tensor shapes (not from ``collectives``:
``tests.support.sparse_collective_bytes``) and each check shown to catch a
wrong formula; then ``plan``'s rows for DeepSeek-V3.2. Other quantized
latent caches and the backend table are in ``test_plan_cost_sparse_backends``.

- The top-k merge (``sparse_attn_indexer._merge_dcp_topk_global``): each rank
  packs its local top-k as (score, global id) float32 pairs, ``[T, topk, 2]``,
  and all-gathers them over the merge's world W.
- The latent attention (``DeepseekV32Attention._sparse_indexer_and_attn``):
  the query ``cat(ql_nope, mqa_q)``, ``[T, h, L + R]``, all-gathered over the
  heads; the combine all-gathers ``[T, W h]`` LSEs and reduce-scatters
  ``[T, W h, L]`` outputs. ``MLAAttention.__init__`` gathers the query in the
  platform's fp8 dtype where the cache is quantized, not ``fp8_ds_mla``, and
  the impl ``supports_quant_query_input``; else in the model's dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.support.deepseek_v32_layers import PROFILE as DSV32
from tests.support.deepseek_v32_layers import dsv32_file
from tests.support.sparse_collective_bytes import (
    BF16,
    DSV32_HEADS,
    LATENT,
    ROPE,
    TOPK,
    latent_bytes,
    merge_bytes,
    query_element,
    ring_all_gather,
)
from vllm_dcp_geometry.contract import collectives as col
from vllm_dcp_geometry.tooling.cli.plan.cost import (
    INDEXER_TOPK_MERGE,
)

pytestmark = pytest.mark.patches("common.kv_cache_interface")


# The formulas, against a restatement -------------------------------------------

MERGE_CASES = [
    (w, t, k) for w in (1, 2, 3, 4, 8, 16) for t in (1, 3, 64) for k in (1, 512, 2048)
]
LATENT_CASES = [
    (w, t, h, q, o, lse, b)
    for w in (1, 2, 4, 8)
    for t in (1, 5)
    for h in (1, 16, 32)
    for q, o, lse in ((2, 2, 4), (1, 2, 4), (2, 2, 2), (4, 4, 4))
    for b in ("nccl", "gloo")
]


def merge_mismatches(formula: Callable[..., int]) -> list[tuple]:
    """The cases where ``formula`` is not the restated merge, on either
    backend (an all-gather runs as itself on both)."""
    return [
        (w, t, k, b)
        for w, t, k in MERGE_CASES
        for b in (col.NCCL, col.GLOO)
        if formula(w, tokens=t, topk=k, backend=b) != merge_bytes(w, t, k)
    ]


def latent_mismatches(formula: Callable[..., int]) -> list[tuple]:
    """The cases where ``formula`` is not the restated latent step."""
    return [
        case
        for case in LATENT_CASES
        if formula(
            case[0],
            tokens=case[1],
            heads_per_rank=case[2],
            query_head_dim=LATENT + ROPE,
            output_head_dim=LATENT,
            query_bytes=case[3],
            output_bytes=case[4],
            lse_bytes=case[5],
            backend=case[6],
        )
        != latent_bytes(*case)
    ]


def test_the_top_k_merge_is_an_all_gather_of_packed_candidates() -> None:
    assert merge_mismatches(col.indexer_topk_merge_bytes) == []
    assert col.indexer_topk_merge_bytes(1, tokens=64, topk=2048) == 0
    # One token over the replica of 4: 3 sends and 3 receives of 16 KiB.
    assert col.indexer_topk_merge_bytes(4, tokens=1, topk=2048) == 6 * 16_384


def test_a_wrong_merge_formula_is_caught() -> None:
    def gathers_ids_only(world: int, *, tokens: int, topk: int, backend: str) -> int:
        return ring_all_gather(world, tokens * topk * 4)

    def counts_every_rank(world: int, *, tokens: int, topk: int, backend: str) -> int:
        return 2 * world * tokens * topk * 8

    assert merge_mismatches(gathers_ids_only)
    assert merge_mismatches(counts_every_rank)


def test_each_tensor_moves_in_its_own_dtype() -> None:
    assert latent_mismatches(col.dcp_decode_step_bytes_by_dtype) == []
    # One dtype throughout is the existing formula.
    for w, t, h, q, _, lse, b in LATENT_CASES:
        assert col.dcp_decode_step_bytes_by_dtype(
            w,
            tokens=t,
            heads_per_rank=h,
            query_head_dim=LATENT + ROPE,
            output_head_dim=LATENT,
            query_bytes=q,
            output_bytes=q,
            lse_bytes=lse,
            backend=b,
        ) == col.mla_decode_step_bytes(
            w,
            tokens=t,
            heads_per_rank=h,
            kv_lora_rank=LATENT,
            rope_dim=ROPE,
            dtype_bytes=q,
            lse_bytes=lse,
            backend=b,
        )


def test_a_wrong_step_formula_is_caught() -> None:
    def output_in_query_dtype(world: int, **shape) -> int:
        return col.dcp_decode_step_bytes_by_dtype(
            world, **{**shape, "output_bytes": shape["query_bytes"]}
        )

    def reduce_scatter_everywhere(world: int, **shape) -> int:
        return col.dcp_decode_step_bytes_by_dtype(world, **{**shape, "backend": "nccl"})

    assert latent_mismatches(output_in_query_dtype)
    assert latent_mismatches(reduce_scatter_everywhere)


QUERY_CASES = [
    (a, cache, quantized, fp8)
    for a in (2, 4)
    for cache, quantized in (
        ("auto", False),
        ("bfloat16", False),
        ("fp8", True),
        ("fp8_e4m3", True),
        ("fp8_ds_mla", True),
        ("nvfp4_ds_mla", True),
    )
    for fp8 in (False, True)
]


def query_mismatches(rule: Callable[..., int]) -> list[tuple]:
    return [
        case
        for case in QUERY_CASES
        if rule(
            case[0],
            cache_dtype=case[1],
            quantized_cache=case[2],
            quant_query_input=case[3],
        )
        != query_element(*case)
    ]


def test_the_query_dtype_follows_mla_attention() -> None:
    assert query_mismatches(col.mla_query_element_bytes) == []

    def ignores_fp8_ds_mla(a: int, *, cache_dtype, quantized_cache, quant_query_input):
        return 1 if quantized_cache and quant_query_input else a

    assert query_mismatches(ignores_fp8_ds_mla)


# plan on DeepSeek-V3.2 ----------------------------------------------------------


def dsv32_groups(run_cli) -> dict[str, dict]:
    code, out, err = run_cli("plan", "-p", DSV32, "--json")
    assert code == 0, err
    return {g["name"]: g for g in json.loads(out)["groups"]}


def test_deepseek_v32_latent_and_indexer_rows_have_bytes(run_cli) -> None:
    groups = dsv32_groups(run_cli)
    latent, indexer = groups["latent.k4"], groups["indexer.k4"]
    for g in (latent, indexer):
        # Rule A6: K = 4 of D = 8 within the replica; the D-wide option is 8.
        assert g["shard_count"] == 4
        assert g["collective_world_size"] == 4
        assert g["decode_collective_bytes_reason"] is None
    assert latent["attention_backend"] == "FLASHMLA_SPARSE"
    assert indexer["attention_backend"] == "DEEPSEEK_V32_INDEXER"
    assert indexer["decode_collectives"] == INDEXER_TOPK_MERGE
    # fp8_ds_mla: the queries and outputs in bfloat16, float32 LSEs.
    for w, key in (
        (4, "decode_collective_bytes_per_rank_per_token"),
        (8, "dcp_group_bytes_per_rank_per_token"),
    ):
        assert latent[key] == latent_bytes(w, 1, DSV32_HEADS, BF16, BF16, 4)
        assert indexer[key] == merge_bytes(w, 1, TOPK)
    assert latent["decode_collective_bytes_per_rank_per_token"] == 210_432
    assert latent["dcp_group_bytes_per_rank_per_token"] == 494_592
    assert indexer["decode_collective_bytes_per_rank_per_token"] == 98_304
    assert indexer["dcp_group_bytes_per_rank_per_token"] == 229_376


def test_the_table_says_what_the_indexer_row_moves(run_cli) -> None:
    code, out, _ = run_cli("plan", "-p", DSV32)
    assert code == 0
    assert "no collective bytes" not in out
    assert (
        "a DSA indexer cache (indexer.k4): its top-k merge, an all-gather of each "
        "rank's top-k (score, id) float32 candidates"
    ) in out
    rows = {
        line.split()[0]: line.split()
        for line in out.split("decode collectives", 1)[1].splitlines()
        if line.split()[:1] in (["latent.k4"], ["indexer.k4"])
    }
    assert rows["latent.k4"] == [
        *("latent.k4", "4", "replica", "210,432", "1", "8", "494,592", "2")
    ]
    assert rows["indexer.k4"] == [
        *("indexer.k4", "4", "replica", "98,304", "1", "8", "229,376", "2")
    ]


def test_without_the_activation_dtype_the_latent_row_says_why(run_cli, tmp_path):
    path = dsv32_file(tmp_path, 'activation_dtype = "bfloat16"\n', "")
    code, out, _ = run_cli("plan", "-t", path, "--json")
    assert code == 0
    latent = {g["name"]: g for g in json.loads(out)["groups"]}["latent.k4"]
    assert latent["decode_collective_bytes_per_rank_per_token"] is None
    assert latent["decode_collective_bytes_reason"] == (
        "the cache is stored as fp8_ds_mla, which is not the dtype of the queries "
        "and outputs, and the topology gives no activation_dtype (the model's dtype)"
    )


def test_without_the_top_k_width_the_indexer_row_says_why(run_cli, tmp_path):
    path = dsv32_file(tmp_path, "topk_buffer_width = 2048\n", "")
    code, out, _ = run_cli("plan", "-t", path, "--json")
    assert code == 0
    indexer = {g["name"]: g for g in json.loads(out)["groups"]}["indexer.k4"]
    assert indexer["decode_collective_bytes_per_rank_per_token"] is None
    assert indexer["decode_collective_bytes_reason"] == (
        "the latent group 'latent.k4' gives no topk_buffer_width, the top-k the "
        "merge gathers"
    )


def test_a_float32_model_doubles_the_latent_activations(run_cli, tmp_path):
    path = dsv32_file(
        tmp_path, 'activation_dtype = "bfloat16"', 'activation_dtype = "float32"'
    )
    code, out, _ = run_cli("plan", "-t", path, "--json")
    assert code == 0
    groups = {g["name"]: g for g in json.loads(out)["groups"]}
    assert groups["latent.k4"]["decode_collective_bytes_per_rank_per_token"] == (
        latent_bytes(4, 1, DSV32_HEADS, 4, 4, 4)
    )
    # The merge's candidates are float32 whatever the model's dtype.
    assert groups["indexer.k4"]["decode_collective_bytes_per_rank_per_token"] == (
        merge_bytes(4, 1, TOPK)
    )


def test_an_unknown_activation_dtype_is_bad_input(run_cli, tmp_path):
    path = dsv32_file(
        tmp_path, 'activation_dtype = "bfloat16"', 'activation_dtype = "fp8"'
    )
    code, out, err = run_cli("plan", "-t", path)
    assert code == 2 and out == ""
    assert err.strip().endswith(
        "group 'latent.k4': activation_dtype must be the model's dtype, one of "
        "['bfloat16', 'float16', 'float32'], got 'fp8'"
    )


def test_the_new_bytes_feed_the_optimizer(run_cli) -> None:
    code, out, err = run_cli(
        "plan",
        "--optimize",
        "-p",
        DSV32,
        "--device",
        "H200",
        "--weight-gib",
        "8",
        "--json",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["unknown_collective_groups"] == []
    by_k = {e["shard_counts"]["sparse"]: e for e in result["frontier"]}
    # K = 8 gathers 128 heads, past FlashMLA's sparse envelope: not a candidate.
    assert 8 not in result["choices"][0]["candidates"]
    layers = 61
    for k, world in ((4, 4), (2, 2), (1, 1)):
        if k not in by_k:
            continue
        expected = layers * (
            latent_bytes(world, 1, DSV32_HEADS, BF16, BF16, 4)
            + merge_bytes(world, 1, TOPK)
        )
        assert by_k[k]["collective_bytes_per_token_per_rank"] == expected, k
