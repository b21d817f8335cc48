# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks`` runs vLLM's generic ``Attention`` on FLASH_ATTN across real
worker processes (``tooling/cli/ranks/runners/flash_attention.py``): the
full-attention and sliding-window groups of a GQA model such as gpt-oss.

Every run is at gpt-oss's shapes (2 query heads per rank over one KV head
of 64, bfloat16, 16-token blocks, attention sinks, a 128-token window on the
sliding layers); on CPU the FlashAttention kernel, its KV write and its
version detection are ``flash_attn_stand_ins``' (named in the report), the
DCP combine and merge vLLM's Triton kernels, interpreted. Three runs of real
processes, most of each D vLLM imports (on 2 cores shared with another test
run: the D = 4 ones under 2 min each, the D = 8 one (``slow``) 3 to 7 min;
6 to 10 min in all):

- D = 4 (patched): a replicated sliding-window group (K = 1, sinks), a
  partial full-attention group (K = 2, sinks) and vLLM's own K = D (no
  sinks): every rank within the bfloat16 tolerance of float64 (its output
  for its own heads, and the combined context LSE the DCP path hands its
  merge), every collective's bytes the ring formula's (restated here) over
  the world the bound impl attends over, which is the W ``plan`` names;
- the same D = 4 unpatched (``unpatched_baseline``): K = D right, the
  replicated and partial groups wrong beyond their tolerance (vLLM reads
  them as D shards: the wrong K for their caches);
- D = 8: two partial groups with sinks, K = 2 and K = 4, in one run.

Then, with no new process: a merge with one wrong rank failing. The checker
failing a kernel one position off, the stand-ins against plain torch, the
planning of gpt-oss's profiles and what is not run are in
``test_cli_ranks_flash_attention_plan``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.gpt_oss_groups import (
    BLOCK,
    HEAD_SIZE,
    WINDOW,
    gpt_oss_group,
)
from tests.support.ranks import ranks_run
from vllm_dcp_geometry.contract.layer_classes import GENERIC_LAYERS
from vllm_dcp_geometry.tooling.cli import EXIT_OK
from vllm_dcp_geometry.tooling.cli.ranks import cases, results
from vllm_dcp_geometry.tooling.cli.ranks.report import format_report
from vllm_dcp_geometry.tooling.flash_attn_stand_ins import (
    FLASH_ATTN,
)

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "common.kv_cache_interface",
        "worker.flash_attn",
        "worker.gpu_worker",
        "worker.utils",
    ),
]

EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
"""Machine epsilon of each dtype, restated."""


def _topology(path: Path, dcp: int, groups: list[Any]) -> Path:
    path.write_text(
        json.dumps(
            {
                "name": path.stem,
                "parallel": {
                    "tensor_parallel_size": 32,
                    "decode_context_parallel_size": dcp,
                },
                "limits": {"max_model_len": 4096, "max_num_seqs": 8},
                "groups": groups,
            }
        )
    )
    return path


SLIDING = {"kind": "sliding_window", "sliding_window": WINDOW}
SINKS = {"attention_features": ["sinks"]}


def _four_ranks_topology(path: Path) -> Path:
    return _topology(
        path,
        4,
        [
            gpt_oss_group("sliding", 0, 1, 4, **SLIDING, **SINKS),
            gpt_oss_group("full.k2", 1, 2, 4, **SINKS),
            gpt_oss_group("full.k4", 2, None, 4),
        ],
    )


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = _four_ranks_topology(tmp_path_factory.mktemp("fa") / "fa4.json")
    return {"path": path, **ranks_run("-t", str(path))}


def _decode_bytes(world: int, tokens: int, h: int, d: int, *, gloo: bool) -> int:
    """FlashAttention's DCP decode step over W ranks, restated: ring
    all-gathers of the [T, h, d] query and of the [T, W h] float32 LSE, and
    the reduce-scatter of the [T, W h, d] partial output, which gloo runs as
    a ring all-reduce of all of it (twice NCCL's bytes)."""
    if world == 1:
        return 0
    query, lse = tokens * h * d * 2, tokens * world * h * 4
    out = tokens * world * h * d * 2
    return 2 * (world - 1) * (query + lse) + (4 if gloo else 2) * (world - 1) * (
        out // world
    )


def _allowed(g: dict[str, Any], phase: str) -> float:
    """The output tolerance, restated: 16 roundoffs of bfloat16 plus sqrt(n)
    float32 roundoffs for the score over the head size and the sum over the
    longest context, times max(1, |reference|)."""
    k = g["shard_count"]
    longest = max(2 * BLOCK * k + BLOCK // 2 + 4, 2 * BLOCK * k + 3)
    if g["shape"]["sliding_window"] is not None:
        longest = max(longest, WINDOW + BLOCK + BLOCK // 2 + 1 + 3)
    per_unit = 16 * EPSILON["bfloat16"] / 2 + (HEAD_SIZE**0.5 + longest**0.5) * 2.0**-24
    return per_unit * max(1.0, g[f"{phase}_output_magnitude"])


def check_clean(g: dict[str, Any], dcp: int) -> None:
    """A group right on every rank, its bytes the restated ring formula's
    over the world its impl attends over, which is plan's W."""
    assert g["status"] == "run" and not g.get("crashed"), g
    assert g["layer_class_run"] == [GENERIC_LAYERS[False]], g
    for phase in ("decode", "prefill"):
        allowed = _allowed(g, phase)
        assert g[f"{phase}_max_abs_error_tolerance"] == pytest.approx(allowed)
        assert g[f"{phase}_max_abs_error"] <= allowed, (phase, g)
    assert g["numerics_ok"] is True
    world = g["attention_world_size"]
    assert world == g["collective_world_size"], g
    k = g["shard_count"]
    assert world in ({1} if k == 1 else {k, dcp})
    if world > 1:
        # The combined context LSE, float32 end to end.
        assert g["max_lse_error"] is not None and g["max_lse_error"] < 1e-5, g
    assert g["collective_worlds_seen"] == ([] if world == 1 else [world])
    tokens = g["decode_tokens_per_step"]
    h = g["shape"]["heads_per_rank"]
    expected = _decode_bytes(world, tokens, h, HEAD_SIZE, gloo=True)
    assert g["collective_bytes_by_rank"] == [expected] * dcp, g
    assert g["formula_bytes_per_rank_per_step"] == expected
    assert g["nccl_formula_bytes_per_rank_per_step"] == _decode_bytes(
        world, tokens, h, HEAD_SIZE, gloo=False
    )
    assert g["traffic_matches_formula"] is True and g["ok"] is True


def test_four_ranks_every_group_right_and_its_bytes_the_ring_formulas(
    four_ranks: dict[str, Any],
) -> None:
    code, report = four_ranks["code"], four_ranks["report"]
    assert code == EXIT_OK and report["ok"] is True, report
    groups = {g["name"]: g for g in report["groups"]}
    assert set(groups) == {"sliding", "full.k2", "full.k4"}
    for g in groups.values():
        assert g["backend"] == "FLASH_ATTN"
        assert g["shape"]["heads_per_rank"] == 2
        assert g["shape"]["head_size"] == HEAD_SIZE
        check_clean(g, 4)
    sliding, partial, own = groups["sliding"], groups["full.k2"], groups["full.k4"]
    assert sliding["shape"]["sliding_window"] == WINDOW and sliding["shape"]["sinks"]
    assert sliding["attention_mode"] == "local"
    assert sliding["collective_bytes_per_rank_per_step"] == 0
    assert partial["attention_mode"] == "dcp-partial" and partial["shape"]["sinks"]
    assert own["attention_mode"] == "dcp" and own["attention_world_size"] == 4
    for name in ("flash_attn_varlen_func", "reshape_and_cache_flash"):
        assert any(s.startswith(f"{FLASH_ATTN}.{name} (") for s in report["stand_ins"])
    text = format_report(report)
    assert "2x64 bfloat16 window 128 sinks" in text and text.rstrip().endswith("OK")


@pytest.mark.unpatched_baseline
def test_unpatched_vllm_is_right_at_d_and_wrong_below(
    four_ranks: dict[str, Any],
) -> None:
    """Unpatched vLLM reads every cache as D shards: the replicated window
    group (its impl attends over D with no context for a replicated spec)
    and the K = 2 group (written K = 2, read K = 4) are wrong beyond their
    tolerance; vLLM's own K = D is right with the same bytes."""
    from vllm_dcp_geometry.tooling.cli.ranks.run import run_ranks
    from vllm_dcp_geometry.tooling.topology import load_topology_file

    report = run_ranks(
        load_topology_file(four_ranks["path"]), patched=False, progress=False
    )
    assert report is not None and report["ok"] is False
    patched = {g["name"]: g for g in four_ranks["report"]["groups"]}
    for g in report["groups"]:
        assert g["attention_world_size"] == 4 and g["attention_mode"] == "dcp", g
        if g["shard_count"] == 4:
            assert g["ok"] is True, g
            assert (
                g["collective_bytes_by_rank"]
                == patched[g["name"]]["collective_bytes_by_rank"]
            )
            continue
        assert g["ok"] is False and g["numerics_ok"] is False, g
        assert g["max_abs_error"] > 10 * g["decode_max_abs_error_tolerance"], g


@pytest.mark.slow
# The D = 4 partial run shows the same patched code on both releases.
@pytest.mark.larger_repeat
def test_eight_ranks_partial_groups_of_k_2_and_4_with_sinks(tmp_path: Path) -> None:
    path = _topology(
        tmp_path / "fa8.json",
        8,
        [
            gpt_oss_group("full.k2", 1, 2, 8, **SINKS),
            gpt_oss_group("full.k4", 2, 4, 8, **SINKS),
        ],
    )
    ran = ranks_run("-t", str(path))
    assert ran["code"] == EXIT_OK, ran["report"]
    groups = {g["name"]: g for g in ran["report"]["groups"]}
    assert {g["shard_count"] for g in groups.values()} == {2, 4}
    for g in groups.values():
        assert g["attention_mode"] == "dcp-partial"
        check_clean(g, 8)


def test_a_rank_beyond_its_tolerance_fails_the_group(
    four_ranks: dict[str, Any],
) -> None:
    """The first run's workers' results, merged again with one rank's
    prefill output one tolerance too far: its group is WRONG, the run
    FAILED."""
    topology, groups, worker_results = _relaunch_inputs(four_ranks)
    broken = copy.deepcopy(worker_results)
    row = next(g for g in broken[3]["groups"] if g["name"] == "full.k2")
    right = {g["name"]: g for g in four_ranks["report"]["groups"]}["full.k2"]
    row["prefill_max_abs_error"] = 1.5 * right["prefill_max_abs_error_tolerance"]
    report = results.merge(
        topology,
        groups,
        broken,
        patched=True,
        elapsed=0.0,
        gpu=False,
        scale=1,
        partial_collectives="replica",
    )
    wrong = {g["name"]: g for g in report["groups"]}["full.k2"]
    assert wrong["numerics_ok"] is False and wrong["ok"] is False
    assert report["ok"] is False
    assert "WRONG" in format_report(report)


def _relaunch_inputs(four_ranks: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The first run's topology, plan and workers' results."""
    from vllm_dcp_geometry.tooling.topology import load_topology_file

    topology = load_topology_file(four_ranks["path"])
    groups = cases.plan_groups(
        topology, gpu=False, scale=1, partial_collectives="replica"
    )
    (launched,) = four_ranks["launched"]
    return topology, groups, launched[0]
