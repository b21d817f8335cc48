# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks`` runs the topology's own shapes, refuses what it cannot run, and
fails a run whose bytes differ from the traffic formula.

One real run (D = 2 worker processes, about 90 s on 2 cores) of a topology
in ``tmp_path`` whose shapes are none of ``ranks``' old fixed ones: 3 query
heads per rank (6 over TP 2), vLLM's DeepSeek latent row (kv_lora_rank 512
+ rope 64), one group in bfloat16 sharded over K = 2 and a replicated draft
in float16. Checked: each group ran at exactly the topology's shapes (no
scaling), every rank within the tolerance of its dtype against the float64
reference (restated here from the dtype's epsilon) yet above float32's (the
dtype was really run), and every rank's decode bytes equal to the formula at
those shapes (restated here). Then, with no new process: the same workers'
results through a deliberately wrong formula fail the run (exit 1); a
topology with no group to run exits 2 naming each group's reason; and
``partial_collectives`` comes from the topology as ``plan`` reads it, so
both name the same W (the flag overrides it).

vLLM's MLA admits latent rows of 320, 512 or 576 only
(``MLACommonBackend.get_supported_head_sizes``) and its DCP combine kernel
needs a power-of-two kv_lora_rank, so a smaller odd latent such as 96 + 32
is refused (shown below), not run.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.tooling.cli import (
    EXIT_BAD_INPUT,
    EXIT_OK,
    EXIT_VIOLATION,
    main,
)
from vllm_dcp_geometry.tooling.cli.common.status import CliError
from vllm_dcp_geometry.tooling.cli.ranks import report as ranks_report
from vllm_dcp_geometry.tooling.cli.ranks import run, shapes

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "worker.gpu_worker",
    "worker.mla_attention",
    "worker.mla_dcp_manager",
    "worker.utils",
)

EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
"""Machine epsilon of each dtype, restated."""

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _group(name: str, **fields: Any) -> str:
    lines = [f'name = "{name}"', 'kind = "mla"', "block_size = 16"]
    lines += ["num_kv_heads = 1", f'layers = ["model.layers.{name}.attn"]']
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    return "[[groups]]\n" + "\n".join(lines) + "\n"


def _topology(
    path: Path, groups: list[str], *, dcp: int = 2, partial: str | None = None
) -> Path:
    where = "" if partial is None else f'partial_collectives = "{partial}"\n'
    path.write_text(
        f'name = "{path.stem}"\n[parallel]\ntensor_parallel_size = {dcp}\n'
        f"decode_context_parallel_size = {dcp}\n{where}"
        "[limits]\nmax_model_len = 4096\nmax_num_seqs = 8\n" + "".join(groups)
    )
    return path


LATENT = {"head_size": 576, "kv_lora_rank": 512}
SHAPES = {
    "mla.k2": {"heads_per_rank": 3, "kv_lora_rank": 512, "rope_dim": 64}
    | {"dtype": "bfloat16"},
    "draft": {"heads_per_rank": 3, "kv_lora_rank": 512, "rope_dim": 64}
    | {"dtype": "float16"},
}


@contextlib.contextmanager
def _stdout() -> Iterator[io.StringIO]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        yield out


@pytest.fixture(scope="module")
def own_shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The one real run: its path, JSON report and the workers' results."""
    path = _topology(
        tmp_path_factory.mktemp("ranks") / "own-shapes.toml",
        [
            _group("mla.k2", query_heads=6, dtype="bfloat16", **LATENT),
            _group("draft", draft=True, query_heads=6, dtype="float16", **LATENT),
        ],
    )
    launched: list[Any] = []
    real_launch = run.launch

    def recording(*args: Any, **kwargs: Any) -> Any:
        launched.append(real_launch(*args, **kwargs))
        return launched[-1]

    with pytest.MonkeyPatch.context() as patch, _stdout() as out:
        patch.setattr(run, "launch", recording)
        code = main(["ranks", "-t", str(path), "--json", "--no-progress"])
    return {
        "path": path,
        "code": code,
        "report": json.loads(out.getvalue()),
        "launched": launched[0],
    }


def _restated_tolerance(g: dict[str, Any], phase: str, kind: str) -> float:
    """16 roundoffs (eps / 2) of the dtype plus sqrt(n) float32 roundoffs for
    the score over L + R and the sum over the longest context, times
    max(1, |reference|)."""
    shape, block, k = g["shape"], g["block_size"], g["shard_count"]
    longest = max(2 * block * k + block // 2 + 4, 2 * block * k + 3)
    dots = (shape["kv_lora_rank"] + shape["rope_dim"]) ** 0.5 + longest**0.5
    per_unit = 16 * EPSILON[shape["dtype"]] / 2 + dots * EPSILON["float32"] / 2
    return per_unit * max(1.0, g[f"{phase}_{kind}_magnitude"])


def _restated_bytes(
    world: int, tokens: int, shape: dict[str, Any], *, gloo: bool = True
) -> int:
    """All-gathers of the [T, h, L + R] query and the [T, W h] LSE (in the
    query's dtype on TRITON_MLA), reduce-scatter of the [T, W h, L] partial
    output, over W ranks in a ring; gloo runs that reduce-scatter as an
    all-reduce of the whole partial output (twice the bytes)."""
    if world == 1:
        return 0
    h, e = shape["heads_per_rank"], ELEMENT_BYTES[shape["dtype"]]
    gathered = tokens * h * (shape["kv_lora_rank"] + shape["rope_dim"] + world) * e
    scattered = tokens * world * h * shape["kv_lora_rank"] * e
    ways = 4 if gloo else 2
    return 2 * (world - 1) * gathered + ways * (world - 1) * scattered // world


def test_each_group_runs_at_its_own_shapes_within_its_dtype(
    own_shapes: dict[str, Any],
) -> None:
    report = own_shapes["report"]
    assert own_shapes["code"] == EXIT_OK and report["ok"] is True
    assert report["scale"] == 1 and report["scaled"] is False
    assert report["groups_run"] == 2
    groups = {g["name"]: g for g in report["groups"]}
    assert {g["shard_count"] for g in groups.values()} == {2, 1}
    for name, want in SHAPES.items():
        g = groups[name]
        assert g["topology_shape"] == want
        assert {f: g["shape"][f] for f in want} == want, g["shape"]
        assert g["block_size"] == 16 and g["interleave"] == 1
        for phase, error, kind in (
            ("decode", "decode_max_abs_error", "output"),
            ("decode", "decode_max_lse_error", "lse"),
            ("prefill", "prefill_max_abs_error", "output"),
            ("prefill", "context_max_lse_error", "lse"),
        ):
            allowed = _restated_tolerance(g, phase, kind)
            assert g[f"{error}_tolerance"] == pytest.approx(allowed, rel=1e-12)
            assert g[error] <= allowed, (name, error, g[error], allowed)
        # The dtype was run: outputs off by more than float32 would be.
        fp32 = {**g, "shape": {**g["shape"], "dtype": "float32"}}
        assert g["max_abs_error"] > _restated_tolerance(fp32, "decode", "output")
        world = g["collective_world_size"]
        assert world == g["shard_count"]
        expected = _restated_bytes(world, g["decode_tokens_per_step"], g["shape"])
        assert g["collective_bytes_by_rank"] == [expected, expected]
        assert g["formula_bytes_per_rank_per_step"] == expected
        assert g["nccl_formula_bytes_per_rank_per_step"] == _restated_bytes(
            world, g["decode_tokens_per_step"], g["shape"], gloo=False
        )
        assert g["unmodeled_collectives"] == []
        assert g["decode_step_s"] > 0
        assert g["traffic_matches_formula"] is True and g["ok"] is True
    text = ranks_report.format_report(report)
    assert "shapes: each group's own" in text and "SCALED" not in text
    assert "3x512+64 bfloat16" in text and "3x512+64 float16" in text
    assert text.rstrip().endswith("OK")


def test_bytes_that_differ_from_the_formula_fail_the_run(
    own_shapes: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The same workers' results, merged against a formula 8 bytes off for
    every collective world of more than one rank: the K = 2 group fails
    (its numerics still ok), the local draft (0 bytes) does not, and the
    run exits 1."""
    real = shapes.mla_decode_step_bytes

    def wrong(world: int, **shape: Any) -> int:
        return real(world, **shape) + (8 if world > 1 else 0)

    monkeypatch.setattr(shapes, "mla_decode_step_bytes", wrong)
    monkeypatch.setattr(run, "launch", lambda *a, **k: own_shapes["launched"])
    args = ["ranks", "-t", str(own_shapes["path"]), "--no-progress"]
    assert main([*args, "--json"]) == EXIT_VIOLATION
    report = json.loads(capsys.readouterr().out)
    groups = {g["name"]: g for g in report["groups"]}
    assert report["ok"] is False
    k2 = groups["mla.k2"]
    assert k2["numerics_ok"] is True and k2["traffic_matches_formula"] is False
    assert k2["ok"] is False
    assert (
        k2["formula_bytes_per_rank_per_step"] == k2["collective_bytes_by_rank"][0] + 8
    )
    assert groups["draft"]["ok"] is True
    assert main(args) == EXIT_VIOLATION
    text = capsys.readouterr().out
    assert "ok, bytes differ from the formula: FAILED" in text
    assert "  mla.k2: bytes per rank [" in text
    assert text.rstrip().endswith("FAILED")


def test_nothing_to_run_is_one_line_naming_each_group_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A group with no query_heads, one with no kv_lora_rank and one whose
    latent row (96 + 32 = 128) vLLM's MLA metadata does not admit: no
    worker starts, and one line names all three and why."""
    spawned: list[Any] = []
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    path = _topology(
        tmp_path / "unrunnable.toml",
        [
            _group("no.heads", dtype="bfloat16", **LATENT),
            _group("no.latent", query_heads=6, dtype="bfloat16", head_size=576),
            _group(
                "odd.row",
                query_heads=6,
                dtype="bfloat16",
                head_size=128,
                kv_lora_rank=96,
            ),
        ],
    )
    assert main(["ranks", "-t", str(path), "--no-progress"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == "" and spawned == []
    (line,) = captured.err.strip().splitlines()
    assert "ranks: no group of unrunnable can run here (D=2): " in line
    assert "no.heads: not run: the topology gives no query_heads" in line
    assert "no.latent: not run: the topology gives no kv_lora_rank" in line
    assert (
        "odd.row: not run: head_size 128 (kv_lora_rank + rope dim) is not one "
        "vLLM's MLA metadata admits (320, 512, 576)" in line
    )


def _ranks_world(monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[str, int]:
    """What ``ranks`` would hand its workers (where partial groups
    collective, the K = 2 group's W), stopped before any starts."""
    seen: dict[str, Any] = {}

    def stop(topology: Any, groups: list[dict[str, Any]], **kwargs: Any) -> Any:
        seen.update(kwargs, groups=groups)
        raise CliError("stopped before the workers start")

    monkeypatch.setattr(run, "launch", stop)
    assert main(["ranks", *args, "--no-progress"]) == EXIT_BAD_INPUT
    return seen["partial_collectives"], seen["groups"][0]["collective_world_size"]


@pytest.mark.parametrize(("partial", "world"), [("dcp", 4), ("replica", 2)])
def test_partial_collectives_come_from_the_topology_as_for_plan(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: Any,
    partial: str,
    world: int,
) -> None:
    """A K = 2 group at D = 4: ``plan`` and ``ranks`` name the same W from
    the topology's ``[parallel] partial_collectives``; ``ranks``'
    ``--partial-collectives`` overrides it."""
    group = _group(
        "mla.k2", query_heads=8, dtype="bfloat16", dcp_kv_shard_count=2, **LATENT
    )
    path = _topology(tmp_path / "partial.toml", [group], dcp=4, partial=partial)
    assert main(["plan", "-t", str(path), "--json"]) == EXIT_OK
    (planned,) = json.loads(capsys.readouterr().out)["groups"]
    assert planned["collective_world_size"] == world
    assert _ranks_world(monkeypatch, "-t", str(path)) == (partial, world)
    other, other_world = ("replica", 2) if partial == "dcp" else ("dcp", 4)
    flag = ["-t", str(path), "--partial-collectives", other]
    assert _ranks_world(monkeypatch, *flag) == (other, other_world)
    capsys.readouterr()


def test_plan_prices_each_group_as_ranks_counts_it(
    own_shapes: dict[str, Any], capsys: Any
) -> None:
    """``plan`` on the same topology and backend (TRITON_MLA, what the
    workers ran) names each group's W, and its bytes per decoded token times
    the step's tokens are the NCCL figure of the step ``ranks`` counted
    (whose gloo count equals the gloo formula, checked above): the cost
    table is what real processes move."""
    args = ["plan", "-t", str(own_shapes["path"]), "--json"]
    assert main([*args, "--attention-backend", "TRITON_MLA"]) == EXIT_OK
    planned = {g["name"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    for g in own_shapes["report"]["groups"]:
        row = planned[g["name"]]
        assert row["collective_world_size"] == g["collective_world_size"]
        per_token = row["decode_collective_bytes_per_rank_per_token"]
        tokens = g["decode_tokens_per_step"]
        assert g["nccl_formula_bytes_per_rank_per_step"] == per_token * tokens, g
    # On vLLM's SM90 choice (FLASH_ATTN_MLA) the LSEs travel in float32, so
    # plan's figure for the partial group is not the TRITON_MLA run's.
    assert main(args) == EXIT_OK
    sm90 = {g["name"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    k2 = next(g for g in own_shapes["report"]["groups"] if g["name"] == "mla.k2")
    assert (
        sm90["mla.k2"]["decode_collective_bytes_per_rank_per_token"]
        * k2["decode_tokens_per_step"]
        > k2["nccl_formula_bytes_per_rank_per_step"]
    )
