# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan``'s decode-collective bytes for DeepSeek-V3.2's sparse MLA: the DSA
indexer's top-k merge and quantized latent caches, each formula restated
here from vLLM 0.33.0's tensor shapes (not from ``collectives``) and each
check shown to catch a wrong formula.

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
from pathlib import Path

import pytest

from tests.support.processes import run_python
from vllm_dcp_geometry.contract import collectives as col
from vllm_dcp_geometry.contract.collectives import LSE_IN_QUERY_DTYPE_BACKENDS
from vllm_dcp_geometry.tooling.cli.plan.cost import (
    INDEXER_TOPK_MERGE,
    QUANT_QUERY_INPUT_MLA_BACKENDS,
)

pytestmark = pytest.mark.patches("common.kv_cache_interface")

DSV32 = "deepseek-v32-tp8-dcp8"
# DeepSeek-V3.2 at TP8: 128 query heads, 16 a rank; latent 512 + rope 64;
# bfloat16 activations; float32 LSEs from FlashMLA; index_topk 2048.
DSV32_HEADS, LATENT, ROPE, BF16, TOPK = 128 // 8, 512, 64, 2, 2048


def ring_all_gather(world: int, input_bytes: int) -> int:
    """A ring all-gather of ``input_bytes`` per rank: W - 1 sends and W - 1
    receives of it."""
    return 2 * (world - 1) * input_bytes


def ring_reduce_scatter(world: int, input_bytes: int, backend: str) -> int:
    """A ring reduce-scatter of ``input_bytes``: (W - 1)/W of it each way;
    gloo runs it as an all-reduce, twice that."""
    moved = 2 * (world - 1) * input_bytes // world
    return moved if backend == "nccl" else 2 * moved


def merge_bytes(world: int, tokens: int, topk: int) -> int:
    """The packed ``[T, topk, 2]`` float32 candidates, all-gathered."""
    return ring_all_gather(world, tokens * topk * 2 * 4)


def latent_bytes(
    world: int,
    tokens: int,
    heads: int,
    query: int,
    output: int,
    lse: int,
    backend: str = "nccl",
) -> int:
    """Query ``[T, h, L + R]`` and LSE ``[T, W h]`` all-gathers, output
    ``[T, W h, L]`` reduce-scatter, each in its element size."""
    return (
        ring_all_gather(world, tokens * heads * (LATENT + ROPE) * query)
        + ring_all_gather(world, tokens * world * heads * lse)
        + ring_reduce_scatter(world, tokens * world * heads * LATENT * output, backend)
    )


def query_element(activation: int, cache: str, quantized: bool, fp8_query: bool) -> int:
    """``MLAAttention.__init__``'s query dtype, as bytes."""
    if quantized and cache != "fp8_ds_mla" and fp8_query:
        return 1
    return activation


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


def dsv32_file(tmp_path: Path, old: str, new: str) -> str:
    """The DeepSeek-V3.2 profile with ``old`` replaced by ``new``."""
    from importlib import resources

    text = (
        resources.files("vllm_dcp_geometry.tooling")
        .joinpath(f"profiles/{DSV32}.toml")
        .read_text(encoding="utf-8")
    )
    assert old in text, old
    path = tmp_path / "dsv32.toml"
    path.write_text(text.replace(old, new))
    return str(path)


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


# A plain fp8 latent cache --------------------------------------------------------

FP8_MLA = """[parallel]
tensor_parallel_size = 4
decode_context_parallel_size = 4

[[groups]]
name = "latent"
kind = "mla"
layers = ["model.layers.0.self_attn.attn"]
block_size = 64
head_size = 576
dtype = "uint8"
cache_dtype_str = "fp8"
kv_quant_mode = "FP8_PER_TENSOR"
num_kv_heads = 1
query_heads = 128
kv_lora_rank = 512
activation_dtype = "bfloat16"
"""


@pytest.mark.parametrize("backend", ["FLASHMLA", "FLASHINFER_MLA", "TRITON_MLA"])
def test_a_plain_fp8_cache_gathers_fp8_queries_where_the_impl_takes_them(
    run_cli, tmp_path, backend
) -> None:
    path = tmp_path / "fp8.toml"
    path.write_text(FP8_MLA)
    code, out, err = run_cli(
        "plan", "-t", str(path), "--json", "--attention-backend", backend
    )
    assert code == 0, err
    (latent,) = json.loads(out)["groups"]
    takes_fp8 = QUANT_QUERY_INPUT_MLA_BACKENDS[backend]
    query = query_element(BF16, "fp8", True, takes_fp8)
    assert query == (1 if backend != "TRITON_MLA" else BF16)
    # TRITON_MLA returns its LSEs in the query's dtype, the others float32.
    lse = query if backend in LSE_IN_QUERY_DTYPE_BACKENDS else 4
    assert latent["collective_world_size"] == 4
    assert latent["decode_collective_bytes_per_rank_per_token"] == latent_bytes(
        4, 1, 128 // 4, query, BF16, lse
    )


def test_a_backend_outside_the_table_says_why(run_cli, tmp_path, monkeypatch):
    from vllm_dcp_geometry.tooling.cli.plan import cost

    monkeypatch.delitem(cost.QUANT_QUERY_INPUT_MLA_BACKENDS, "FLASHMLA")
    path = tmp_path / "fp8.toml"
    path.write_text(FP8_MLA)
    code, out, _ = run_cli(
        "plan", "-t", str(path), "--json", "--attention-backend", "FLASHMLA"
    )
    assert code == 0
    (latent,) = json.loads(out)["groups"]
    assert latent["decode_collective_bytes_per_rank_per_token"] is None
    assert latent["decode_collective_bytes_reason"] == (
        "the cache is stored as fp8, and whether FLASHMLA's impl then takes fp8 "
        "queries (supports_quant_query_input) is not in plan's table"
    )


# The table against vLLM's impls ---------------------------------------------------

# Each impl built as MLAAttention builds it, in a planning process (the CUDA
# platform answering as an H200, process groups of the right sizes, no
# kernel run), with a quantized cache it accepts (plain fp8 where it does).
BUILD_IMPLS = """
import json, os
from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
os.environ.update(child_environment())
from vllm_dcp_geometry.tooling.serve import prepare_planning
prepare_planning()
import torch
import vllm.platforms
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.worker.workspace import init_workspace_manager
from vllm_dcp_geometry.tooling.planning_stand_ins import ops_bound_not_run
from vllm_dcp_geometry.tooling.serve.model_build import install_sizing_groups

# TritonMLAImpl names the device in its fp8 check.
type(vllm.platforms.current_platform).get_device_name = classmethod(
    lambda cls, device_id=0: "NVIDIA H200"
)
config = VllmConfig()
install_sizing_groups(config.parallel_config)
init_workspace_manager(torch.device("meta"))
answers = {}
for name, cache in CACHES.items():
    impl_cls = AttentionBackendEnum[name].get_class().get_impl_cls()
    sparse = {"topk_indices_buffer": torch.empty(4, 2048, dtype=torch.int32)}
    with set_current_vllm_config(config), torch.device("meta"), ops_bound_not_run():
        impl = impl_cls(
            num_heads=16, head_size=576, scale=1.0, num_kv_heads=1,
            alibi_slopes=None, sliding_window=None, kv_cache_dtype=cache,
            logits_soft_cap=None, attn_type=AttentionType.DECODER,
            kv_sharing_target_layer_name=None, q_lora_rank=None,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            qk_head_dim=192, v_head_dim=128, kv_b_proj=None, indexer=None,
            **(sparse if "SPARSE" in name else {}),
        )
    answers[name] = [
        impl.supports_quant_query_input,
        type(impl).supports_quant_query_input,
    ]
print(json.dumps(answers))
"""
QUANTIZED_CACHES = {
    "FLASHMLA": "fp8",
    "FLASHINFER_MLA": "fp8",
    "TRITON_MLA": "fp8",
    "FLASHINFER_MLA_SPARSE": "fp8",
    # These refuse a plain fp8 cache when built, and their impls' answer
    # does not depend on the cache (FlashMLASparseImpl never assigns it,
    # the others assign True unconditionally): built with their default.
    "FLASHMLA_SPARSE": "auto",
    "FLASH_ATTN_MLA": "auto",
    "FLASH_ATTN_MLA_SPARSE_FA4": "auto",
}


@pytest.mark.slow
def test_the_quant_query_table_is_what_vllm_builds() -> None:
    answers = run_python(
        f"CACHES = {QUANTIZED_CACHES!r}\n" + BUILD_IMPLS,
        patched=False,
        cpu_prelude=False,
    )
    built = {name: instance for name, (instance, _) in answers.items()}
    assert built == {
        name: QUANT_QUERY_INPUT_MLA_BACKENDS[name] for name in QUANTIZED_CACHES
    }
    # The class attribute is AttentionImpl's False everywhere: __init__
    # decides, which is why the table exists.
    assert {name: cls for name, (_, cls) in answers.items()} == dict.fromkeys(
        QUANTIZED_CACHES, False
    )


def test_cutlass_mla_keeps_the_common_impls_answer() -> None:
    """CUTLASS_MLA's module allocates a CUDA workspace when imported, so its
    impl is read from its source: an ``MLACommonImpl`` (whose ``__init__``
    sets ``supports_quant_query_input = True``) that never assigns it."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.attention.backends.mla.cutlass_mla")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    (impl,) = [
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "CutlassMLAImpl"
    ]
    assert [ast.unparse(base) for base in impl.bases] == [
        "MLACommonImpl[MLACommonMetadata]"
    ]
    assigned = [
        node
        for node in ast.walk(impl)
        if isinstance(node, ast.Attribute) and node.attr == "supports_quant_query_input"
    ]
    assert assigned == []
    assert QUANT_QUERY_INPUT_MLA_BACKENDS["CUTLASS_MLA"] is True
    assert set(QUANT_QUERY_INPUT_MLA_BACKENDS) == {*QUANTIZED_CACHES, "CUTLASS_MLA"}


def test_on_the_d_wide_group_both_rows_move_d_rank_bytes(run_cli, tmp_path):
    # partial_collectives = "dcp": the merge and the attention stay on the
    # D-wide group (duplicate replicas send padding / weigh 0), W = D = 8.
    # With 8 query heads per rank (FlashMLA's sparse builder refuses the
    # profile's 16 gathered over 8 ranks: 128 pad past its 64-head envelope).
    path = dsv32_file(
        tmp_path, 'partial_collectives = "replica"', 'partial_collectives = "dcp"'
    )
    source = Path(path).read_text()
    assert "query_heads = 128" in source
    Path(path).write_text(source.replace("query_heads = 128", "query_heads = 64"))
    code, out, err = run_cli("plan", "-t", path, "--json")
    assert code == 0, err
    groups = {g["name"]: g for g in json.loads(out)["groups"]}
    latent, indexer = groups["latent.k4"], groups["indexer.k4"]
    assert latent["collective_world_size"] == indexer["collective_world_size"] == 8
    assert latent["decode_collective_bytes_per_rank_per_token"] == latent_bytes(
        8, 1, 8, BF16, BF16, 4
    )
    assert indexer["decode_collective_bytes_per_rank_per_token"] == merge_bytes(
        8, 1, TOPK
    )


def test_the_activation_dtype_round_trips_through_a_topology_file(tmp_path) -> None:
    from vllm_dcp_geometry.tooling.topology import (
        load_profile,
        load_topology_file,
        write_topology_file,
    )

    profile = load_profile(DSV32)
    by_name = {g.name: g for g in profile.groups}
    assert by_name["latent.k4"].activation_dtype == "bfloat16"
    assert by_name["indexer.k4"].activation_dtype is None
    assert "activation_dtype" not in by_name["latent.k4"].spec_fields
    for suffix in (".toml", ".json"):
        path = tmp_path / f"emitted{suffix}"
        write_topology_file(profile, str(path))
        assert load_topology_file(str(path)).to_dict() == profile.to_dict()


class _Indexer:
    def __init__(self, topk_tokens: int) -> None:
        self.topk_tokens = topk_tokens


class _Layer:
    """A latent layer as the planning build holds it: its indexer (None on
    a layer that reuses another's top-k) and its top-k buffer width."""

    def __init__(self, topk_tokens: int | None, width: int | None) -> None:
        self.indexer = None if topk_tokens is None else _Indexer(topk_tokens)
        self.topk_buffer_width = width


def test_a_model_whose_merge_is_narrower_than_its_buffer_is_refused() -> None:
    from vllm_dcp_geometry.tooling.serve.deployment import check_indexer_topk
    from vllm_dcp_geometry.tooling.topology import TopologyError

    agreeing = {
        "model.layers.0.self_attn.attn": _Layer(2048, 2048),
        "model.layers.1.self_attn.attn": _Layer(None, 2048),
        "model.layers.0.self_attn.indexer.k_cache": object(),
    }
    check_indexer_topk(agreeing, list(agreeing))
    narrower = {**agreeing, "model.layers.1.self_attn.attn": _Layer(1024, 2048)}
    with pytest.raises(TopologyError) as caught:
        check_indexer_topk(narrower, list(narrower))
    assert str(caught.value) == (
        "layer 'model.layers.1.self_attn.attn': its DSA indexer merges the "
        "top-1024 of each rank but the latent cache's topk_buffer_width is 2048; "
        "plan sizes the top-k merge from topk_buffer_width and cannot describe "
        "this layer"
    )


def test_plan_and_ranks_agree_on_which_lses_travel_in_the_query_dtype() -> None:
    from vllm_dcp_geometry.tooling.cli.ranks import shapes

    assert shapes.LSE_IN_QUERY_DTYPE == LSE_IN_QUERY_DTYPE_BACKENDS
