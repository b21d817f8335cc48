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
with the same numerics; the KV-write stand-in at the contract's slots, and
bad input. Unscaled
shapes, other dtypes and the byte check failing are in
``test_cli_ranks_shapes``.

Cost on 2 cores (idle): about 2 min for D = 2 with its baseline and 3 min for
each D = 4 run (two, the default one shared by a module fixture); the D = 4
unpatched run is ``slow``.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.contract import reference_slot_mapping
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


# The KV-write stand-in against the contract --------------------------------------


@pytest.mark.parametrize(
    ("shard_count", "interleave"), [(1, 1), (2, 1), (4, 4), (2, 8)]
)
def test_the_kv_write_stand_in_writes_the_contracts_slots(
    monkeypatch: pytest.MonkeyPatch, shard_count: int, interleave: int
) -> None:
    """``group.write_cache`` (through ``vllm._custom_ops.concat_and_cache_mla``,
    the stand-in) puts every position of every request on the shard the
    contract names, at the slot it names, once across the K shards."""
    import torch
    import vllm._custom_ops as ops

    from vllm_dcp_geometry.tooling import custom_op_stand_ins as cpu_stand_ins
    from vllm_dcp_geometry.tooling.cli.ranks.runners import inputs as group

    monkeypatch.setattr(ops, "concat_and_cache_mla", cpu_stand_ins.concat_and_cache_mla)
    shape = Shape(2, kv_lora_rank=5, rope_dim=3, dtype="float32", max_model_len=64)
    block, num_blocks = 8, 40
    requests = [(37, 1), (3, 1), (16, 5)]
    width = -(-64 // (block * shard_count))
    inputs = group.make_inputs(requests, 2, shape, num_blocks, width, seed=3)
    written = torch.zeros(len(requests), 64, dtype=torch.int64)
    for shard in range(shard_count):
        layout = group.ShardLayout(block, shard_count, interleave, shard)
        cache = group.write_cache(inputs, layout, shape, num_blocks, "cpu")
        flat = cache.view(-1, cache.shape[-1])
        for i, (context, new) in enumerate(requests):
            slots = reference_slot_mapping(
                range(context + new),
                inputs.rows[i],
                block_size=block,
                shard_count=shard_count,
                interleave_size=interleave,
                shard=shard,
            )
            for position, slot in enumerate(slots):
                if slot < 0:
                    continue
                written[i, position] += 1
                want = torch.cat([inputs.kv_c[i][position], inputs.k_pe[i][position]])
                assert torch.equal(flat[slot], want.float()), (shard, i, position)
    for i, (context, new) in enumerate(requests):
        assert written[i, : context + new].tolist() == [1] * (context + new)


# The worker's pins and start-up ---------------------------------------------------


def test_the_worker_pins_what_it_wraps_and_stands_in_for() -> None:
    """Every vLLM symbol a worker wraps to measure (``measuring.METERED``
    and ``PYNCCL_METERED``) or stands in for on CPU (``cpu_stand_ins.STAND_IN_SYMBOLS``) has, in the
    installed vLLM, the parameters its code was written against; a changed
    parameter list is refused."""
    import dataclasses

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, verify_symbol
    from vllm_dcp_geometry.tooling.cli.ranks.measuring import METERED
    from vllm_dcp_geometry.tooling.cli.ranks.traffic import PYNCCL_METERED
    from vllm_dcp_geometry.tooling.custom_op_stand_ins import STAND_IN_SYMBOLS

    for symbol in (*METERED, *PYNCCL_METERED, *STAND_IN_SYMBOLS):
        verify_symbol(symbol)
    for symbol in (METERED[0], PYNCCL_METERED[0], STAND_IN_SYMBOLS[0]):
        changed = dataclasses.replace(symbol, parameters="self, x")
        with pytest.raises(UpstreamChangedError, match="parameters changed"):
            verify_symbol(changed)


def test_the_interpreter_dot_stand_in_multiplies_bfloat16_values() -> None:
    """The Triton interpreter's own ``tl.dot`` of bfloat16 operands
    multiplies their uint16 bits (garbage of order 1e9 here); the stand-in
    a CPU worker installs (``cpu_stand_ins.INTERPRETER_DOT``, pinned) widens
    them to the float32 values they are and gets the exact product; float32
    operands pass through unchanged."""
    import dataclasses

    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, verify_symbol
    from vllm_dcp_geometry.tooling import cpu_stand_ins

    verify_symbol(cpu_stand_ins.INTERPRETER_DOT)
    changed = dataclasses.replace(cpu_stand_ins.INTERPRETER_DOT, parameters="a, b")
    with pytest.raises(UpstreamChangedError, match="parameters changed"):
        verify_symbol(changed)
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    exact = (a.double() @ b.double()).numpy()

    def handle(x: Any) -> Any:
        return interpreter.TensorHandle(x.view(torch.uint16).numpy(), tl.bfloat16)

    def dot(create_dot: Any, x: Any, y: Any) -> Any:
        zero = interpreter.TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
        return create_dot(None, x, y, zero, None, None).data

    original = interpreter.InterpreterBuilder.create_dot
    original = getattr(original, "__wrapped__", original)
    stand_in = cpu_stand_ins._dot_of_bfloat16_values(original)
    assert np.abs(dot(original, handle(a), handle(b)) - exact).max() > 1e6
    assert np.abs(dot(stand_in, handle(a), handle(b)) - exact).max() < 1e-4
    floats = [interpreter.TensorHandle(x.float().numpy(), tl.float32) for x in (a, b)]
    assert np.array_equal(dot(stand_in, *floats), dot(original, *floats))


def test_meters_on_a_changed_vllm_wrap_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``install_meters`` is all or nothing: one changed symbol (here the
    last) and no communicator or attention function is wrapped; with torch's
    flight recorder off it refuses to count at all."""
    import importlib

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, UpstreamSymbol
    from vllm_dcp_geometry.tooling.cli.ranks import measuring

    def metered() -> list[object]:
        found = []
        for symbol in (*measuring.METERED, *measuring.PYNCCL_METERED):
            owner: object = importlib.import_module(symbol.module)
            *path, name = symbol.qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            found.append(vars(owner)[name])
        return found

    before = metered()
    monkeypatch.delenv(measuring.FLIGHT_RECORDER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="flight recorder is off"):
        measuring.install_meters.__wrapped__()
    monkeypatch.setenv(measuring.FLIGHT_RECORDER_ENV, "64")
    changed = UpstreamSymbol(measuring.TRITON_MLA, "TritonMLAImpl.forward_mqa", "q")
    monkeypatch.setattr(measuring, "METERED", (*measuring.METERED, changed))
    with pytest.raises(UpstreamChangedError, match=r"TritonMLAImpl\.forward_mqa"):
        measuring.install_meters.__wrapped__()
    monkeypatch.undo()
    assert all(a is b for a, b in zip(metered(), before, strict=True))


def test_the_ranks_make_replica_groups_as_vllm_serve_workers_do(
    tmp_path: Path,
) -> None:
    """A worker calls the start-up function itself
    (``replica_groups.make_replica_groups``, what the ``Worker.init_device``
    patch calls), on the config a ``vllm serve`` worker of the plan holds:
    the plan's partial K only, and none with ``--partial-collectives dcp``."""
    from vllm_dcp_geometry.runtime import replica_groups
    from vllm_dcp_geometry.tooling.cli.ranks import vllm_setup, worker

    assert worker.make_replica_groups is replica_groups.make_replica_groups
    shape = Shape(2, 512, 64, "bfloat16", max_model_len=192)
    path = vllm_setup.model_dir(4, shape)
    groups = [{"index": i, "shard_count": k} for i, k in enumerate((4, 2, 1))]
    for where, counts in (("replica", (2,)), ("dcp", ())):
        plan = {"world": 4, "partial_collectives": where, "groups": groups}
        config = vllm_setup.serving_config(plan, shape, path, "cpu")
        assert replica_groups.replica_shard_counts(config) == counts


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


# Traffic counted where it happens --------------------------------------------------


def test_traffic_is_counted_where_it_happens() -> None:
    """Two gloo ranks with the ``ranks`` worker's distributed state issue a
    collective through each API a forward could use inside the meter's
    counted block (``traffic_worker.CASES``): vLLM's ``GroupCoordinator``,
    ``torch.distributed`` on the DCP device group directly, a functional
    collective, a broadcast on the DCP CPU group and an all-reduce on the TP
    group. Every one is counted, once, at the bytes the ring model gives its
    input, restated here: the coordinator's reduce-scatter as the all-reduce
    gloo runs it, the broadcast as unmodeled (0 bytes, named), the TP one
    under the TP group's vLLM name (``tp:0``); the all-gather before the
    block is not."""
    import socket
    import subprocess
    import sys

    from tests.support.processes import REPO_ROOT
    from tests.support.traffic_worker import CASES, ELEMENTS

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.traffic_worker", str(r), str(port)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    n = ELEMENTS * 4
    gather, reduce = 2 * (2 - 1) * n, 4 * (2 - 1) * n // 2
    want = [
        ("all_gather", "dcp", gather),
        ("all_reduce", "dcp", reduce),
        ("all_gather", "dcp", gather),
        ("all_gather", "dcp", gather),
        (None, "dcp", 0),
        ("all_reduce", "other:tp:0", reduce),
    ]
    assert len(want) == len(CASES)
    for out, _ in outputs:
        result = json.loads(out.strip().splitlines()[-1])
        seen = [(c["op"], c["group"], c["moved"]) for c in result["collectives"]]
        assert seen == want, result
        assert all(
            c["world"] == 2 and c["input_bytes"] == n for c in result["collectives"]
        )
        assert result["total"] == sum(moved for _, _, moved in want)
        assert result["unmodeled"] == ["gloo:broadcast on dcp"]
