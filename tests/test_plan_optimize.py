# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``: its candidates are exactly what ``plan`` (start-up's
admission) accepts, its frontier is the brute-force Pareto set, its
recommended line pasted back into ``plan`` gives the numbers it promised,
and bad input exits 2 with one line."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_dcp_geometry.tooling.cli.plan import optimize as opt
from vllm_dcp_geometry.tooling.topology import load_profile


def _optimized(run_cli, *args: str) -> dict:
    code, out, err = run_cli("plan", "--optimize", "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    ("profile", "backend"),
    [
        ("gpt-oss-tp32-dcp4", None),
        ("partial-shard-tp8-dcp8", None),
        # A backend taught no partial K: K = 1 (vLLM's own local path for a
        # replicated spec) and K = D are left.
        ("partial-shard-tp8-dcp8", "TRITON_ATTN"),
        ("mla-mixed-tp4-dcp4", None),
    ],
)
def test_candidates_are_what_plan_admits(
    run_cli, profile: str, backend: str | None
) -> None:
    """Every divisor K of D, pasted for one choice (the others at a
    candidate of theirs), is a candidate exactly where ``plan`` (the
    admission start-up applies) exits 0 on it."""
    flags = ["-p", profile, "--device", "H200"]
    if backend:
        flags += ["--attention-backend", backend]
    result = _optimized(run_cli, *flags)
    topology = load_profile(profile)
    dcp = topology.decode_context_parallel_size
    picked = opt.choices(topology)
    others = {c["name"]: c["candidates"][-1] for c in result["choices"]}
    checked = 0
    for choice in result["choices"]:
        if choice["name"] in result["kept"]:
            continue
        admitted = []
        for k in (d for d in range(1, dcp + 1) if dcp % d == 0):
            ks = [k if c.name == choice["name"] else others[c.name] for c in picked]
            line = opt.additional_config(topology, picked, ks)
            code, _, _ = run_cli(
                "plan", *flags[:2], *flags[4:], "--additional-config", json.dumps(line)
            )
            assert code in (0, 2)
            if code == 0:
                admitted.append(k)
        assert choice["candidates"] == admitted, (profile, choice)
        checked += 1
    assert checked


def _brute_force(per_choice, base, budget) -> set[tuple[int, ...]]:
    points = []
    for combo in itertools.product(*per_choice):
        points.append(
            opt.Point(
                ks=tuple(o.k for o in combo),
                request_bytes=base.request_bytes + sum(o.request_bytes for o in combo),
                collective_bytes=sum(o.collective_bytes for o in combo),
                collective_hops=sum(o.collective_hops for o in combo),
                virtual_blocks=(),
            )
        )

    def dominated(p, q) -> bool:
        # q is at least as good on both terms and better on one.
        tp, tq = p.step_seconds(budget), q.step_seconds(budget)
        return (
            q.request_bytes <= p.request_bytes
            and tq <= tp
            and (q.request_bytes < p.request_bytes or tq < tp)
        )

    return {p.ks for p in points if not any(dominated(p, q) for q in points)}


def _terms(profile: str):
    from vllm_dcp_geometry.tooling.cli.plan.document import build_plan

    topology = load_profile(profile)
    picked = opt.choices(topology)
    per_choice = [
        opt.admitted_options(topology, c, lambda t: build_plan(t), []) for c in picked
    ]
    return per_choice


@pytest.fixture(scope="module")
def partial_terms():
    return _terms("partial-shard-tp8-dcp8")


@settings(max_examples=40, deadline=None)
@given(
    hbm=st.floats(100, 10_000),
    link=st.floats(10, 2_000),
    hop=st.floats(0, 50),
)
def test_the_frontier_is_the_brute_force_pareto_set(
    partial_terms, hbm: float, link: float, hop: float
) -> None:
    budget = opt.Budget(100 << 30, 0.9, 0, hbm, link, hop, None)
    base = opt.Point((), 0, 0.0, 0, ())
    merged = opt.frontier(base, partial_terms, budget)
    expected = _brute_force(partial_terms, base, budget)
    # Ties (equal terms) may keep either assignment: compare the terms.
    got = {(p.request_bytes, p.step_seconds(budget)) for p in merged}
    by_ks = {tuple(o.k for o in c): c for c in itertools.product(*partial_terms)}
    want = {
        (
            sum(o.request_bytes for o in by_ks[ks]),
            opt.Point(
                ks,
                sum(o.request_bytes for o in by_ks[ks]),
                sum(o.collective_bytes for o in by_ks[ks]),
                sum(o.collective_hops for o in by_ks[ks]),
                (),
            ).step_seconds(budget),
        )
        for ks in expected
    }
    assert got == want


def test_a_wrong_frontier_is_caught_by_the_brute_force(partial_terms) -> None:
    """The comparison above fails on a frontier that keeps a dominated point."""
    budget = opt.Budget(100 << 30, 0.9, 0, 4800, 450, 5, None)
    base = opt.Point((), 0, 0.0, 0, ())
    everything = [
        opt.Point(
            tuple(o.k for o in combo),
            sum(o.request_bytes for o in combo),
            sum(o.collective_bytes for o in combo),
            sum(o.collective_hops for o in combo),
            (),
        )
        for combo in itertools.product(*partial_terms)
    ]
    assert {p.ks for p in everything} != _brute_force(partial_terms, base, budget)
    assert len(opt.frontier(base, partial_terms, budget)) < len(everything)


@pytest.mark.parametrize(
    ("profile", "weight_gib"),
    [
        ("kimi-k3-tp16-dcp16", "8"),
        ("deepseek-v32-tp8-dcp8", "8"),
        # Sliding windows: vLLM's rule is a lower bound (``capacity_proof``).
        ("gpt-oss-tp64-dcp8", "100"),
    ],
)
def test_the_recommended_line_plans_what_it_promised(
    run_cli, profile: str, weight_gib: str
) -> None:
    """The pasted line, fed back, gives the same numbers: ``plan``'s request
    bytes, start-up's pool for the budget and what vLLM's scheduler holds in
    it; the recommended point and K=max pass the scheduler check."""
    from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import (
        scheduler_admission,
    )
    from vllm_dcp_geometry.tooling.topology import apply_additional_config

    result = _optimized(
        run_cli, "-p", profile, "--device", "H200", "--weight-gib", weight_gib
    )
    chosen = result["recommended"]
    code, out, err = run_cli(
        "plan",
        "-p",
        profile,
        "--json",
        "--additional-config",
        chosen["additional_config"],
    )
    assert code == 0, err
    plan = json.loads(out)
    assert (
        plan["totals"]["kv_bytes_per_request_per_rank"]
        == (chosen["request_bytes_per_rank"])
    )
    # vLLM's rule on vLLM's pool, and vLLM's scheduler holds it.
    assert (
        chosen["requests"]
        == (chosen["pool_blocks"] - 1) // chosen["blocks_per_request"]
    )
    check = result["capacity_check"]
    assert check["holds"]
    exact = profile != "gpt-oss-tp64-dcp8"
    for point in (check["recommended"], check["largest_k"]):
        assert point["agrees"], point
        assert point["rule"] == ("exact" if exact else "lower bound")
        if exact:
            assert point["admitted_requests"] == point["predicted_requests"] > 0
        else:
            assert point["admitted_requests"] >= point["predicted_requests"] > 0
            assert point["admitted_requests"] < point["submitted_requests"]
    recommended = check["recommended"]
    assert recommended["predicted_requests"] == chosen["requests"]
    assert recommended["num_blocks"] == chosen["pool_blocks"]
    # The pasted line's own pool and scheduler: the same numbers.
    pasted = apply_additional_config(
        load_profile(profile), json.loads(chosen["additional_config"])
    )
    backends = {
        g["attention_backend"] for g in plan["groups"] if g["attention_backend"]
    }
    pool = opt.vllm_pool(pasted, backends, result["budget"]["kv_bytes_per_rank"])
    assert (pool.num_blocks, pool.blocks_per_request, pool.requests) == (
        chosen["pool_blocks"],
        chosen["blocks_per_request"],
        chosen["requests"],
    )
    assert (
        scheduler_admission(pasted, pool).admitted == recommended["admitted_requests"]
    )
    # Within the overhead bound, no frontier point holds more requests.
    allowed = [
        e
        for e in result["frontier"]
        if e["decode_overhead"] <= result["max_decode_overhead"]
    ]
    assert chosen["requests"] == max(e["requests"] for e in allowed)


def test_latency_objective_takes_the_fastest_point(run_cli) -> None:
    # 100 GiB of weights: a pool of ~200 requests keeps the scheduler check
    # of K=max (sliding windows: more held than predicted) short.
    result = _optimized(
        run_cli, "-p", "gpt-oss-tp64-dcp8", "--device", "H200",
        "--weight-gib", "100", "--objective", "latency",
    )  # fmt: skip
    fastest = min(e["step_seconds"] for e in result["frontier"])
    assert result["recommended"]["step_seconds"] == fastest
    assert result["recommended"]["shard_counts"]["full"] == 1
    # The full layers' partial K collective within their replica (rule A6):
    # K = 2 and 4 are on the frontier, each moving fewer bytes per token
    # than K = 8 (on the D-wide group they moved K = 8's and were dominated).
    by_k = {e["shard_counts"]["full"]: e for e in result["frontier"]}
    assert {2, 4, 8} <= set(by_k)
    moved = {k: by_k[k]["collective_bytes_per_token_per_rank"] for k in (2, 4, 8)}
    assert 0 < moved[2] < moved[4] < moved[8]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--device", "A100"], "--device 'A100' is not in the table"),
        (["--device", "H100", "--weight-gib", "100"], "leave no KV memory"),
        ([], "--optimize needs --device or --gpu-memory-gib"),
        (
            ["--device", "H200", "--max-decode-overhead", "0.01"],
            "within --max-decode-overhead 0.01",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(run_cli, flags: list[str], words: str) -> None:
    code, out, err = run_cli("plan", "--optimize", "-p", "gpt-oss-tp32-dcp4", *flags)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert words in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ("-p gpt-oss-tp32-dcp4 --shard-counts 3", "must divide"),
        # FLASHINFER keeps gpt-oss's sinks at K = 1 only: nothing listed is left.
        (
            "-p gpt-oss-tp32-dcp4 --attention-backend FLASHINFER --shard-counts 2,4",
            "admits none of them for any group (sliding: K = 1; full: K = 1)",
        ),
        # TRITON_ATTN admits K = 1 and K = D only.
        (
            "-p partial-shard-tp8-dcp8 --attention-backend TRITON_ATTN --shard-counts 2,4",
            "admits none of them for",
        ),
    ],
)
def test_a_k_list_start_up_refuses_exits_2(run_cli, flags: str, words: str) -> None:
    code, out, err = run_cli("plan", "--optimize", "--device", "H200", *flags.split())
    assert (code, out) == (2, "")
    assert len(err.strip().splitlines()) == 1
    assert words in err


def test_a_k_list_limits_every_choice_with_a_choice(run_cli) -> None:
    """``--shard-counts 1,4`` leaves only those K where a choice has more
    than one; a choice admitted at one K only keeps it."""
    full = _optimized(run_cli, "-p", "partial-shard-tp8-dcp8", "--device", "H200")
    limited = _optimized(
        run_cli, "-p", "partial-shard-tp8-dcp8", "--device", "H200",
        "--shard-counts", "1,4",
    )  # fmt: skip
    for whole, part in zip(full["choices"], limited["choices"], strict=True):
        expected = [k for k in whole["candidates"] if k in (1, 4)]
        assert part["candidates"] == (expected or whole["candidates"])
    assert any(len(c["candidates"]) > 1 for c in limited["choices"])
    assert {k for e in limited["frontier"] for k in e["shard_counts"].values()} <= {
        1,
        4,
    }


def test_the_capacity_check_fails_on_an_overpromise() -> None:
    """A pool that claims one request more than its blocks hold is caught by
    vLLM's scheduler: it holds what the blocks hold."""
    import dataclasses as dc

    from vllm_dcp_geometry.tooling.cli.plan.capacity_proof import (
        scheduler_admission,
    )

    topology = load_profile("dense-gqa-tp8-dcp8")
    pool = opt.vllm_pool(topology, set(), 4 << 30)
    held = scheduler_admission(topology, pool)
    assert held.agrees and held.admitted == pool.requests > 0
    wrong = dc.replace(pool, num_blocks=pool.num_blocks + pool.blocks_per_request)
    caught = scheduler_admission(topology, wrong)
    assert caught.predicted == pool.requests + 1
    assert caught.admitted == pool.requests
    assert not caught.agrees


def test_plot_draws_the_frontier(run_cli, tmp_path, monkeypatch) -> None:
    path = tmp_path / "frontier.png"
    code, _, err = run_cli(
        "plan", "--optimize", "-p", "gpt-oss-tp64-dcp8", "--device", "H200",
        "--weight-gib", "100", "--plot", str(path),
    )  # fmt: skip
    assert code == 0, err
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without the plot extra: one line naming it, exit 2.
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run_cli(
        "plan", "--optimize", "-p", "gpt-oss-tp64-dcp8", "--device", "H200",
        "--weight-gib", "100", "--plot", str(tmp_path / "none.png"),
    )  # fmt: skip
    assert code == 2
    assert "pip install 'vllm-dcp-geometry[plot]'" in err
    assert not (tmp_path / "none.png").exists()


@pytest.mark.slow
def test_weights_come_from_the_built_models_parameters(run_cli) -> None:
    """``--model``: the budget's weights are the parameters vLLM built on one
    rank (here Llama at TP16: the fused QKV projection with one replicated KV
    head, the vocab and MLP split 16 ways), counted independently from the
    config; ``--weight-gib`` overrides them."""
    from vllm_dcp_geometry.tooling.topology import model_configs_dir

    model = model_configs_dir() / "llama"
    config = json.loads((model / "config.json").read_text())
    tp, hidden, head = 16, config["hidden_size"], config["head_dim"]
    q_heads = config["num_attention_heads"] // tp
    per_layer = (
        (q_heads + 2) * head * hidden  # qkv: its heads, one K and one V head
        + hidden * q_heads * head  # o_proj
        + 3 * (config["intermediate_size"] // tp) * hidden  # gate, up, down
        + 2 * hidden  # the two norms
    )
    vocab = 2 * (config["vocab_size"] // tp) * hidden  # embedding, lm_head
    expected = 2 * (config["num_hidden_layers"] * per_layer + vocab + hidden)
    flags = (
        "--model", str(model), "--tensor-parallel-size", str(tp),
        "--decode-context-parallel-size", "2", "--device", "H200",
        # A smaller device keeps the scheduler check's pool small.
        "--gpu-memory-gib", "24",
    )  # fmt: skip
    result = _optimized(run_cli, *flags)
    assert result["budget"]["weight_bytes_per_rank"] == expected
    assert result["budget"]["weights_from"] == "the model's parameters"
    given = _optimized(run_cli, *flags, "--weight-gib", "1")
    assert given["budget"]["weight_bytes_per_rank"] == 1 << 30
