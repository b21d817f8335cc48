# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry ranks``: MLA attention across D real worker processes.

Each run starts D processes that load the plugin through vLLM's own plugin
loader, initialise vLLM's distributed state over gloo and run every MLA group
of ``mla-mixed-tp4-dcp4`` (K = D, a partial K and a replicated draft) with
vLLM's real collectives, at the profile's latent row (512 + 64) and dtype
(bfloat16) with its 32 query heads per rank scaled down by ``--scale 16``
to 2 (what two CPU cores can run in a minute). Checked: every rank within
the bfloat16 tolerance of the float64 reference (restated here from the
dtype's epsilon), the unpatched baseline wrong for K < D and right for
K = D, the bytes each rank moves in a decode step exactly the all-gather /
reduce-scatter traffic of its collective world
(``collectives.mla_decode_step_bytes``, and restated here): K ranks for a
partial group within its replica groups (rule A6, made by the workers'
start-up code), D ranks on the D-wide group (``--partial-collectives dcp``),
with the same numerics; and bad input. Unscaled shapes, other dtypes and
the byte check failing are in ``test_cli_ranks_shapes``; what a worker
relies on, checked without a run, in ``test_cli_ranks_worker``.

Cost on 2 cores (idle): about 2 min for D = 2 with its baseline and 3 min for
each D = 4 run (two, the default one shared by a module fixture); the D = 4
unpatched run is ``slow``.
"""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from vllm_dcp_geometry.contract.collectives import (
    collective_bytes,
)
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_VIOLATION, main
from vllm_dcp_geometry.tooling.cli.ranks.report import format_report
from vllm_dcp_geometry.tooling.cli.ranks.results import EPSILON
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "common.kv_cache_interface",
        "worker.gpu_worker",
        "worker.mla_attention",
        "worker.mla_dcp_manager",
        "worker.utils",
    ),
]

PROFILE = "mla-mixed-tp4-dcp4"
SCALE = 16
RAN = {"heads_per_rank": 2, "kv_lora_rank": 512, "rope_dim": 64, "dtype": "bfloat16"}
"""What the profile's groups run at with ``--scale 16`` (32 heads / 16)."""
FIELDS = (
    "name",
    "shard_count",
    "attention_mode",
    "max_abs_error",
    "max_lse_error",
    "collective_bytes_per_rank_per_step",
)


def _ranks(capsys: Any, *args: str) -> tuple[int, dict[str, Any]]:
    scaled = ["-p", PROFILE, "--scale", str(SCALE)]
    code = main(["ranks", *scaled, *args, "--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


def _decode_bytes(
    world: int, tokens: int, shape: dict[str, Any], *, gloo: bool = True
) -> int:
    """vLLM's MLA decode step over W ranks on gloo, restated: a ring
    all-gather of the [T, h, L + R] query and of the [T, W h] LSE (TRITON_MLA
    keeps it in the query's dtype), and the reduce-scatter of the [T, W h, L]
    partial output, which gloo runs as a ring all-reduce of all of it (a
    reduce-scatter then an all-gather: each rank sends and receives
    (W - 1) / W of it twice, each way); NCCL runs the reduce-scatter itself
    (once)."""
    if world == 1:
        return 0
    h = shape["heads_per_rank"]
    e = {"float32": 4, "bfloat16": 2, "float16": 2}[shape["dtype"]]
    query = tokens * h * (shape["kv_lora_rank"] + shape["rope_dim"]) * e
    lse = tokens * world * h * e
    out = tokens * world * h * shape["kv_lora_rank"] * e
    ways = 4 if gloo else 2
    return 2 * (world - 1) * (query + lse) + ways * (world - 1) * out // world


def _allowed(g: dict[str, Any], phase: str, kind: str, longest: int) -> float:
    """The tolerance of one error, restated: 16 roundoffs (eps / 2) of the
    dtype plus sqrt(n) float32 roundoffs for the score over L + R and the
    sum over the longest context, times max(1, |reference|)."""
    shape = g["shape"]
    dots = (shape["kv_lora_rank"] + shape["rope_dim"]) ** 0.5 + longest**0.5
    per_unit = 16 * EPSILON[shape["dtype"]] / 2 + dots * 2.0**-24
    return per_unit * max(1.0, g[f"{phase}_{kind}_magnitude"])


def _loosest(g: dict[str, Any]) -> float:
    """The larger of a group's two output tolerances (decode, prefill)."""
    return max(
        g["decode_max_abs_error_tolerance"], g["prefill_max_abs_error_tolerance"]
    )


def check_numerics(g: dict[str, Any]) -> None:
    """Every error of a group within its restated tolerance (which the
    report names), and the group's numerics ok."""
    k, block = g["shard_count"], g["block_size"]
    longest = max(2 * block * k + block // 2 + 4, 2 * block * k + 3)
    for phase, error, kind in (
        ("decode", "decode_max_abs_error", "output"),
        ("decode", "decode_max_lse_error", "lse"),
        ("prefill", "prefill_max_abs_error", "output"),
        ("prefill", "context_max_lse_error", "lse"),
    ):
        allowed = _allowed(g, phase, kind, longest)
        assert g[f"{error}_tolerance"] == pytest.approx(allowed, rel=1e-12), error
        assert g[error] is not None and g[error] <= allowed, (error, g)
    assert g["numerics_ok"] is True


def check_unpatched_below_d(g: dict[str, Any], dcp: int) -> None:
    """Unpatched, a group with K < D attends over all D ranks (its impl's
    world) and is not right: wrong beyond its tolerance, or crashed in a
    phase the report names (0.34.0's builder takes world 1 for a replicated
    cache while the layer's impl keeps D, and the chunked prefill asserts)."""
    assert g["ok"] is False and g["attention_mode"] == "dcp", g
    assert g["attention_world_size"] == dcp, g
    if g.get("crashed"):
        assert g["crashed_in"] and set(g["crashed_in"]) <= {"decode", "prefill"}, g
        assert all(" (at vllm/" in c for c in g["crashed"]), g
        return
    assert g["numerics_ok"] is False, g
    assert g["max_abs_error"] > _loosest(g), g


def _check_clean(report: dict[str, Any], dcp: int, within_replica: bool = True) -> None:
    assert report["ranks"] == dcp and report["ok"] is True
    assert report["processes"]["count"] == dcp
    assert report["processes"]["plugin_loaded_by_vllm"] == [True] * dcp
    assert report["processes"]["dcp_group"]["class"] == "GroupCoordinator"
    assert "vllm._custom_ops.concat_and_cache_mla" in report["stand_ins"]
    assert report["scale"] == SCALE and report["scaled"] is True
    groups = {g["name"]: g for g in report["groups"]}
    assert set(groups) == {"mla.k4", "mla.k2", "draft"}
    for g in groups.values():
        for field in FIELDS:
            assert field in g, field
        assert g["status"] == "run", g
        assert {f: g["shape"][f] for f in RAN} == RAN
        assert g["topology_shape"] == {**RAN, "heads_per_rank": 32}
        check_numerics(g)
        k = g["shard_count"]
        assert dcp % k == 0
        mode = "local" if k == 1 else "dcp" if k == dcp else "dcp-partial"
        assert g["attention_mode"] == mode
        # Rule A6: a partial group's collectives span its K-rank replica
        # (or, kept on the DCP group, all D ranks).
        world = 1 if k == 1 else k if within_replica else dcp
        assert g["collective_world_size"] == world, g
        assert g["collective_worlds_seen"] == ([] if world == 1 else [world]), g
        assert g["attention_work_vs_sharded"] == world / k
        expected = _decode_bytes(world, g["decode_tokens_per_step"], g["shape"])
        assert g["collective_bytes_by_rank"] == [expected] * dcp, g
        assert g["collective_bytes_per_rank_per_step"] == expected
        assert g["formula_bytes_per_rank_per_step"] == expected
        assert g["traffic_matches_formula"] is True
        assert g["ok"] is True


def test_two_ranks_clean_and_the_unpatched_baseline_wrong_below_d(
    capsys: Any,
) -> None:
    code, report = _ranks(capsys, "--dcp", "2", "--baseline")
    assert report["patched_ok"] is True
    _check_clean({**report, "ok": report["patched_ok"]}, 2)
    # Unpatched: the replicated draft (K = 1 < D) is attended as sharded:
    # wrong with D-wide traffic (or, on 0.34.0, a crash); the K = D groups
    # are right and move the same bytes.
    assert code == EXIT_VIOLATION and report["ok"] is False
    baseline = report["baseline"]
    assert baseline["mode"] == "unpatched"
    assert baseline["processes"]["plugin_loaded_by_vllm"] == [False, False]
    patched = {g["name"]: g for g in report["groups"]}
    for g in baseline["groups"]:
        if g["shard_count"] < 2:
            check_unpatched_below_d(g, 2)
            if not g.get("crashed"):
                assert g["collective_bytes_per_rank_per_step"] > 0
        else:
            check_numerics(g)
            assert (
                g["collective_bytes_per_rank_per_step"]
                == patched[g["name"]]["collective_bytes_per_rank_per_step"]
            )


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One D = 4 run within the replicas (the default), with a receipt:
    shared by the tests that read it."""
    receipt = tmp_path_factory.mktemp("ranks") / "ranks.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        scaled = ["-p", PROFILE, "--scale", str(SCALE)]
        code = main(
            ["ranks", *scaled, "--json", "--no-progress", "--receipt", str(receipt)]
        )
    return {"code": code, "report": json.loads(out.getvalue()), "receipt": receipt}


def test_four_ranks_clean_with_receipt(four_ranks: dict[str, Any]) -> None:
    code, report, receipt = (four_ranks[k] for k in ("code", "report", "receipt"))
    assert code == EXIT_OK
    _check_clean(report, 4)
    assert {g["shard_count"] for g in report["groups"]} == {4, 2, 1}
    assert report["partial_collectives"] == "replica"
    assert report["replica_groups"] == [2]
    written = json.loads(receipt.read_text())
    assert written["command"] == "ranks" and written["ok"] is True
    text = format_report(report)
    assert "shapes SCALED by --scale 16: each group's query heads per rank" in text
    assert text.count("2x512+64 bfloat16") == 3


def test_partial_group_traffic_within_its_replica_versus_the_dcp_group(
    capsys: Any, four_ranks: dict[str, Any]
) -> None:
    """The same four ranks with the partial group kept on the D-wide group:
    the same numerics (both within tolerance), D-rank traffic; within its
    replica the group moves exactly the K-rank formula's bytes, below the
    D-wide figure; the K = D and K = 1 groups move the same either way."""
    code, wide = _ranks(capsys, "--partial-collectives", "dcp")
    assert code == EXIT_OK
    _check_clean(wide, 4, within_replica=False)
    assert wide["replica_groups"] == []
    within = four_ranks["report"]
    by_name = {g["name"]: g for g in wide["groups"]}
    for g in within["groups"]:
        other = by_name[g["name"]]
        if g["shard_count"] == 2:
            tokens = g["decode_tokens_per_step"]
            assert g["collective_bytes_per_rank_per_step"] == _decode_bytes(
                2, tokens, g["shape"]
            )
            assert other["collective_bytes_per_rank_per_step"] == _decode_bytes(
                4, tokens, g["shape"]
            )
            assert (
                g["collective_bytes_per_rank_per_step"]
                < other["collective_bytes_per_rank_per_step"] / 2
            )
            assert g["attention_work_vs_sharded"] == 1.0
            assert other["attention_work_vs_sharded"] == 2.0
        else:
            assert (
                g["collective_bytes_per_rank_per_step"]
                == other["collective_bytes_per_rank_per_step"]
            )


@pytest.mark.slow
@pytest.mark.unpatched_baseline
def test_four_ranks_unpatched_wrong_for_every_k_below_d() -> None:
    """The unpatched run alone (``ranks --baseline`` runs it after the
    patched one): every group with K < D wrong (or crashed), K = D right,
    every one attending over all D ranks."""
    from vllm_dcp_geometry.tooling.cli.ranks.run import run_ranks
    from vllm_dcp_geometry.tooling.topology import load_profile

    report = run_ranks(
        load_profile(PROFILE), patched=False, progress=False, scale=SCALE
    )
    assert report["ok"] is False and report["mode"] == "unpatched"
    for g in report["groups"]:
        assert g["attention_mode"] == "dcp", g
        if g["shard_count"] < 4:
            check_unpatched_below_d(g, 4)
        else:
            check_numerics(g)


def test_a_crashed_group_keeps_its_phase_and_the_world_it_attended() -> None:
    """A group whose layer raised in a phase on every rank: the row names
    the crash and the phase, is not ok, and (unpatched) takes its mode from
    the world the ranks' impls attended, not the plan's; a group that
    raised before its layer was built keeps the plan's."""
    from types import SimpleNamespace

    from vllm_dcp_geometry.tooling.cli.ranks.results import merge

    topology = SimpleNamespace(name="t", source="test", decode_context_parallel_size=2)
    shape = Shape(2, 512, 64, "bfloat16", max_model_len=64).to_dict()
    planned = {
        "kind": "mla (draft)",
        "layer_class": "MLAAttention",
        "shard_count": 1,
        "block_size": 16,
        "shape": shape,
        "topology_shape": None,
        "interleave": 1,
        "collective_world_size": 1,
        "run": True,
        "reason": None,
    }
    groups = [{**planned, "name": "built"}, {**planned, "name": "unbuilt"}]
    crash = "AssertionError:  (at vllm/x.py:1 in f)"
    results = [
        {
            "patched": False,
            "groups": [
                {
                    "name": "built",
                    "impl_dcp_world_size": 2,
                    "crashed": crash,
                    "crashed_in": "prefill",
                },
                {"name": "unbuilt", "crashed": crash},
            ],
        }
    ] * 2
    for patched in (False, True):
        report = merge(
            topology,
            groups,
            results,
            patched=patched,
            elapsed=1.0,
            gpu=False,
            scale=1,
            partial_collectives="replica",
        )
        built, unbuilt = report["groups"]
        assert report["ok"] is False
        assert built["crashed"] == unbuilt["crashed"] == [crash]
        assert built["ok"] is unbuilt["ok"] is False
        assert built["crashed_in"] == ["prefill"] and "crashed_in" not in unbuilt
        assert built["attention_world_size"] == 2
        assert built["attention_mode"] == ("local" if patched else "dcp")
        assert unbuilt["attention_mode"] == "local"
        assert "CRASHED in prefill: " + crash in format_report(report)


# The traffic formula ----------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
def test_collective_bytes_are_ring_traffic(world: int) -> None:
    n = 48 * world
    assert collective_bytes("all_gather", world, n) == 2 * (world - 1) * n
    assert collective_bytes("all_gather_into_tensor", world, n) == 2 * (world - 1) * n
    assert collective_bytes("reduce_scatter", world, n) == 2 * (world - 1) * 48
    assert collective_bytes("all_to_all_single", world, n) == 2 * (world - 1) * 48
    assert collective_bytes("all_reduce", world, n) == 4 * (world - 1) * 48
    with pytest.raises(ValueError, match="unknown collective"):
        collective_bytes("broadcast", world, n)


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("tokens", [1, 3, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_formula(world: int, tokens: int, dtype: str) -> None:
    shape = Shape(3, 512, 64, dtype, max_model_len=64)
    nccl = shape.decode_step_bytes(world, tokens)
    assert nccl == shape.decode_step_bytes(world, tokens, "nccl")
    assert nccl == _decode_bytes(world, tokens, shape.to_dict(), gloo=False)
    gloo = shape.decode_step_bytes(world, tokens, "gloo")
    assert gloo == _decode_bytes(world, tokens, shape.to_dict())
    assert (gloo > nccl) == (world > 1)
    with pytest.raises(ValueError, match="unknown backend"):
        shape.decode_step_bytes(world, tokens, "mpi")


# Bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-p", "no-such-profile"], "unknown profile 'no-such-profile'"),
        (["-p", PROFILE, "--dcp", "3"], "must divide the tensor-parallel size"),
        (["--dcp", "5"], "must divide the tensor-parallel size"),
        (["-p", PROFILE, "--dcp", "1"], "at least 2"),
        (["-p", PROFILE, "--seed", "-1"], "--seed"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: Any, args: list[str], needle: str
) -> None:
    assert main(["ranks", *args]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines
