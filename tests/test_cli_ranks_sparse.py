# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks`` runs DeepSeek-V3.2's sparse MLA layer with its DSA indexer across
real worker processes (``tooling/cli/ranks/sparse_mla.py``): its two groups,
the latent cache and the indexer cache of one layer, run together and report a
row each.

Three real runs (gloo, vLLM's Triton kernels interpreted; about 3.5 min on 2
cores together):

- a D = 4 topology of three DeepSeek-V3.2 layers at K = 4, K = 2 (within its
  replica) and K = 1, top-k 512, 16-token blocks, with ``--baseline``:
  patched every rank's merged selection is the float64 top-k (ties to the
  smaller id), its output and LSE within the bfloat16 tolerance of float64,
  every collective's bytes those restated here from the tensors vLLM moves
  (the query all-gather, the LSE all-gather and the output reduce-scatter
  for the latent row; the all-gather of the packed (score, id) candidates for
  the indexer row), over the W each group's collectives span; unpatched vLLM
  right at K = D and wrong below it (its merge reads every shard as a D-th);
- the K = 2 layer alone on the D-wide group (``--partial-collectives dcp``):
  right, with the D-wide bytes, more than within the replica;
- the built-in ``deepseek-v32-tp8-dcp8`` at ``--dcp 4 --scale 8`` (its own
  top-k of 2,048, block 64, K = 4): both groups run, right, bytes the
  formula's.

Then, with no new process: ``plan``'s cost of every group of the first run
against the NCCL figure ranks held it to, and merges of the first run's
results that must fail (another top-k, a rank whose selection is wrong). The
planning of the pair, the stand-ins and the runner's pins are in
``test_cli_ranks_sparse_plan``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.deepseek_v32_layers import (
    BLOCK,
    HEADS,
    PROFILE,
    TOPK,
    D,
    L,
    R,
    layer_groups,
    topology_mapping,
)
from tests.support.ranks import ranks_run as _ranks_run
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
)
from vllm_dcp_geometry.tooling.cli import EXIT_OK, EXIT_VIOLATION
from vllm_dcp_geometry.tooling.cli.ranks import cases, results, shapes
from vllm_dcp_geometry.tooling.cli.ranks.report import format_report
from vllm_dcp_geometry.tooling.topology import topology_from_mapping

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "common.kv_cache_interface",
        "worker.deepseek_v32_attention",
        "worker.flashmla_sparse",
        "worker.gpu_worker",
        "worker.mla_dcp_manager",
        "worker.mla_indexer",
        "worker.sparse_attn_indexer",
        "worker.sparse_mla_attention",
    ),
]


def _topology_file(tmp_path: Path, *layers: list[dict[str, Any]], **kw: Any) -> str:
    path = tmp_path / "dsv32.json"
    path.write_text(json.dumps(topology_mapping(*layers, **kw)))
    return str(path)


# Restated from the tensors vLLM moves -----------------------------------------------


def _ring(op: str, world: int, tensor_bytes: int, gloo: bool) -> int:
    """Bytes one rank sends plus receives in a ring collective over
    ``world`` ranks of a ``tensor_bytes`` input: an all-gather passes W - 1
    peers' pieces each way; a reduce-scatter W - 1 of the W slices each way;
    gloo runs a reduce-scatter as an all-reduce, twice as much."""
    if world == 1:
        return 0
    if op == "all_gather":
        return 2 * (world - 1) * tensor_bytes
    scattered = 2 * (world - 1) * tensor_bytes // world
    return 2 * scattered if gloo else scattered


def _attention_bytes(world: int, tokens: int, heads: int, gloo: bool) -> int:
    """The latent row: the layer all-gathers each rank's [T, h, L + R]
    bfloat16 query, the combine all-gathers the [T, W h] float32 LSEs the
    sparse kernel returns and reduce-scatters the [T, W h, L] bfloat16
    partial outputs."""
    query = tokens * heads * (L + R) * 2
    lse = tokens * world * heads * 4
    partial = tokens * world * heads * L * 2
    return (
        _ring("all_gather", world, query, gloo)
        + _ring("all_gather", world, lse, gloo)
        + _ring("reduce_scatter", world, partial, gloo)
    )


def _merge_bytes(world: int, tokens: int, topk: int) -> int:
    """The indexer row: ``_merge_dcp_topk_global`` all-gathers each rank's
    packed [T, top-k, 2] float32 (score, id) candidates."""
    return _ring("all_gather", world, tokens * topk * 2 * 4, gloo=False)


# The three runs -------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = _topology_file(
        tmp_path_factory.mktemp("sparse"),
        layer_groups(0, "k4", 4),
        layer_groups(1, "k2", 2),
        layer_groups(2, "k1", 1),
    )
    return {"path": path, **_ranks_run("-t", path, "--baseline")}


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in report["groups"]}


@pytest.mark.parametrize(
    ("name", "k", "world"), [("k4", 4, 4), ("k2", 2, 2), ("k1", 1, 1)]
)
def test_every_rank_is_right_and_moves_the_restated_bytes(
    three_layers: dict[str, Any], name: str, k: int, world: int
) -> None:
    """Patched: both rows of the layer ran its own class on every rank, its
    merged selection the float64 top-k with vLLM's ties (no id twice), the
    indexer's builder giving its op the contract's local lengths, output and
    LSE within the bfloat16 tolerance of float64; the attention's and the
    merge's bytes on every rank exactly those of the tensors vLLM moves over
    W ranks (K within the replica, 1 for a local layer)."""
    report = three_layers["report"]
    assert report["patched_ok"] is True, format_report(report)
    rows = _rows(report)
    latent, indexer = rows[f"latent.{name}"], rows[f"indexer.{name}"]
    assert latent["layer_class_run"] == [DEEPSEEK_V32_ATTENTION]
    assert indexer["layer_class_run"] == [DEEPSEEK_V32_INDEXER_CACHE]
    for row in (latent, indexer):
        assert row["ok"] is True and row["shard_count"] == k
        assert row["attention_world_size"] == row["collective_world_size"] == world
        assert row["selection_ok"] is True
        assert row["unmodeled_collectives"] == []
    assert indexer["selection_repeats"] is False and indexer["local_lengths_ok"]
    tokens = latent["decode_tokens_per_step"]
    assert tokens == len(shapes.sparse_decode_requests(BLOCK, k, TOPK)) == 4
    heads = latent["shape"]["heads_per_rank"]
    assert heads == HEADS // D
    assert (
        latent["collective_bytes_by_rank"]
        == [_attention_bytes(world, tokens, heads, gloo=True)] * D
    )
    assert latent["nccl_formula_bytes_per_rank_per_step"] == _attention_bytes(
        world, tokens, heads, gloo=False
    )
    assert (
        indexer["collective_bytes_by_rank"] == [_merge_bytes(world, tokens, TOPK)] * D
    )
    assert indexer["nccl_formula_bytes_per_rank_per_step"] == _merge_bytes(
        world, tokens, TOPK
    )
    # bfloat16 bounds the output (the kernel rounds P and stores bfloat16);
    # the kernel's LSE is float32.
    assert latent["max_abs_error"] <= latent["decode_max_abs_error_tolerance"]
    assert 1e-3 < latent["max_abs_error"] < 5e-2
    assert latent["max_lse_error"] <= 1e-5


def test_plan_prices_each_row_as_ranks_counted_it(
    three_layers: dict[str, Any],
) -> None:
    """``plan``'s per-token bytes of each group (its cost table's traffic,
    on the backend ranks ran, over the W it plans) times the step's tokens
    are the NCCL figure ranks held the row to."""
    from vllm_dcp_geometry.tooling.cli.plan.cost import decode_traffic

    topology = topology_from_mapping(
        json.loads(Path(three_layers["path"]).read_text()), source="test"
    )
    rows = _rows(three_layers["report"])
    for group in topology.groups:
        row = rows[group.name]
        traffic = decode_traffic(group, topology, row["backend"])
        assert not isinstance(traffic, str), traffic
        per_token = traffic.bytes_over(row["collective_world_size"])
        assert (
            per_token * row["decode_tokens_per_step"]
            == (row["nccl_formula_bytes_per_rank_per_step"])
        ), group.name


def test_unpatched_vllm_is_right_at_d_and_wrong_below(
    three_layers: dict[str, Any],
) -> None:
    """Unpatched vLLM reads every cache as sharded over D: right for K = D;
    below it the layer hands its indexer (r, D), so the merge maps each
    rank's local positions as a D-th of the cache (ids of positions its
    shard does not hold), the indexer builder's local lengths are D-shard
    ones, the attention reads the wrong tokens, and the run exits 1. On
    0.34.0 the merge keys only the id bits of the cache's positions: those
    ids lie past them, which the selector's stand-in refuses (a crash the
    report names, where the CUDA kernel would alias them)."""
    assert three_layers["code"] == EXIT_VIOLATION
    baseline = _rows(three_layers["report"]["baseline"])
    for role in ("latent", "indexer"):
        assert baseline[f"{role}.k4"]["ok"] is True
        for name in ("k2", "k1"):
            row = baseline[f"{role}.{name}"]
            assert row["ok"] is False, row
            if row.get("crashed"):
                assert all(
                    "past id_bits" in c and "in _merge_dcp_topk_global)" in c
                    for c in row["crashed"]
                ), row
                continue
            assert row["selection_ok"] is False, row
            assert row["attention_world_size"] == D
            if role == "indexer":
                assert row["local_lengths_ok"] is False
            else:
                assert row["max_abs_error"] > 0.1
    assert baseline["indexer.k4"]["local_lengths_ok"] is True


def test_a_partial_layer_on_the_d_wide_group_moves_the_d_wide_bytes(
    tmp_path: Path, three_layers: dict[str, Any]
) -> None:
    """``--partial-collectives dcp``: the K = 2 layer's merge, query gather
    and combine span all D ranks (duplicate replicas masked), still right;
    within its replica it moved K-rank bytes, fewer."""
    path = _topology_file(tmp_path, layer_groups(1, "k2", 2))
    done = _ranks_run("-t", path, "--partial-collectives", "dcp")
    assert done["code"] == EXIT_OK, format_report(done["report"])
    wide = _rows(done["report"])
    within = _rows(three_layers["report"])
    latent, indexer = wide["latent.k2"], wide["indexer.k2"]
    assert latent["attention_world_size"] == indexer["attention_world_size"] == D
    assert latent["selection_ok"] and indexer["selection_ok"]
    tokens, heads = latent["decode_tokens_per_step"], latent["shape"]["heads_per_rank"]
    assert (
        latent["collective_bytes_by_rank"]
        == [_attention_bytes(D, tokens, heads, gloo=True)] * D
    )
    assert indexer["collective_bytes_by_rank"] == [_merge_bytes(D, tokens, TOPK)] * D
    for role in ("latent", "indexer"):
        replica = within[f"{role}.k2"]["collective_bytes_per_rank_per_step"]
        assert replica < wide[f"{role}.k2"]["collective_bytes_per_rank_per_step"]


def test_the_deepseek_v32_profile_runs_both_groups() -> None:
    """The built-in profile at D = 4 (its K = 4 is then every rank) with
    two query heads per rank: its own top-k of 2,048, 64-token blocks,
    fp8_ds_mla values in a bfloat16 cache; both groups right, their bytes
    the restated ones, what stood in for what named."""
    done = _ranks_run("-p", PROFILE, "--dcp", str(D), "--scale", "8")
    report = done["report"]
    assert done["code"] == EXIT_OK and report["ok"] is True, format_report(report)
    rows = _rows(report)
    assert sorted(rows) == ["indexer.k4", "latent.k4"]
    latent, indexer = rows["latent.k4"], rows["indexer.k4"]
    assert latent["shape"]["heads_per_rank"] == 2 and latent["block_size"] == 64
    assert latent["indexer_topk"] == indexer["indexer_topk"] == 2048
    tokens = latent["decode_tokens_per_step"]
    assert latent["collective_bytes_per_rank_per_step"] == _attention_bytes(
        D, tokens, 2, gloo=True
    )
    assert indexer["collective_bytes_per_rank_per_step"] == _merge_bytes(
        D, tokens, 2048
    )
    stand_ins = " ".join(report["stand_ins"])
    assert "fp8_ds_mla not run" in stand_ins
    assert "stable_topk_from_gathered_candidates_cutedsl" in stand_ins
    text = format_report(report)
    assert "FLASHMLA_SPARSE: latent.k4; DEEPSEEK_V32_INDEXER: indexer.k4" in text


# The merge's checks can fail ----------------------------------------------------------


def _merged(
    three_layers: dict[str, Any],
    edit: Any = None,
    **planned: Any,
) -> dict[str, Any]:
    """The first run's patched results merged again (a copy, ``edit``ed per
    rank's group row where given), against its plan with ``planned`` set in
    every sparse entry."""
    topology = topology_from_mapping(
        json.loads(Path(three_layers["path"]).read_text()), source="test"
    )
    groups = cases.plan_groups(
        topology, gpu=False, scale=1, partial_collectives="replica"
    )
    groups = [{**g, **planned} if g["sparse_latent"] else g for g in groups]
    by_rank = copy.deepcopy(three_layers["launched"][0][0])
    for result in by_rank:
        for row in result["groups"]:
            if edit is not None:
                edit(result["rank"], row)
    return results.merge(
        topology,
        groups,
        by_rank,
        patched=True,
        elapsed=0.0,
        gpu=False,
        scale=1,
        partial_collectives="replica",
    )


def test_bytes_of_another_topk_fail_the_indexer_rows(
    three_layers: dict[str, Any],
) -> None:
    """Against a top-k of 1,024 the merges moved too few bytes: every
    indexer row but the local one fails; the latent rows' bytes do not
    depend on it."""
    report = _merged(three_layers, indexer_topk=1024)
    rows = _rows(report)
    assert report["ok"] is False
    for name in ("k4", "k2"):
        assert rows[f"indexer.{name}"]["traffic_matches_formula"] is False
        assert rows[f"latent.{name}"]["traffic_matches_formula"] is True
    assert rows["indexer.k1"]["traffic_matches_formula"] is True
    assert "bytes differ from the formula: FAILED" in format_report(report)


def test_one_wrong_selection_fails_its_rows(three_layers: dict[str, Any]) -> None:
    """A rank reporting a selection other than the float64 top-k fails
    both rows of its layer."""

    def wrong_on_rank_2(rank: int, row: dict[str, Any]) -> None:
        if rank == 2 and row["name"] in ("latent.k2", "indexer.k2"):
            row["selection_ok"] = False

    report = _merged(three_layers, wrong_on_rank_2)
    rows = _rows(report)
    assert rows["latent.k2"]["ok"] is False and rows["indexer.k2"]["ok"] is False
    assert rows["latent.k4"]["ok"] is True
    assert "selection not the float64 top-k" in format_report(report)
