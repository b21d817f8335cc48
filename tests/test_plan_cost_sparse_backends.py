# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan``'s decode-collective bytes for quantized MLA latent caches beside
``fp8_ds_mla`` and the backend table they rest on: a plain fp8 cache gathers
fp8 queries where the impl takes them, a backend outside the table says why,
the table against the impls vLLM builds, the D-wide group's bytes, the
activation dtype through a topology file, a merge narrower than its buffer
refused, and ``plan`` and ``ranks`` agreeing on which LSEs travel in the
query's dtype. The formulas and DeepSeek-V3.2's rows are in
``test_plan_cost_sparse``; every byte is restated in
``tests.support.sparse_collective_bytes``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.deepseek_v32_layers import PROFILE as DSV32
from tests.support.deepseek_v32_layers import dsv32_file
from tests.support.processes import run_python
from tests.support.sparse_collective_bytes import (
    BF16,
    TOPK,
    latent_bytes,
    merge_bytes,
    query_element,
)
from vllm_dcp_geometry.contract.collectives import LSE_IN_QUERY_DTYPE_BACKENDS
from vllm_dcp_geometry.tooling.cli.plan.cost import (
    QUANT_QUERY_INPUT_MLA_BACKENDS,
)

pytestmark = pytest.mark.patches("common.kv_cache_interface")


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
