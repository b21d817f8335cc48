# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Where ``ranks`` runs: ``--device``, ``--attention-backend``,
``--cuda-graph`` and a run started by ``torchrun`` (each process one rank,
meeting through torch.distributed's environment, rank 0 reporting for all).

The device-independent pieces run here: the choice of device and backend
and their refusals (one line, exit 2, no worker started), the backend a GPU
run would take per group (``plan``'s SM90 choice), the LSE meter of a
compiled backend's impl, and a real ``torchrun`` of two CPU ranks (torch's
own launcher, ``python -m torch.distributed.run``) whose report equals the
launcher's for the same topology. What needs CUDA (the compiled backends,
NCCL, graph capture) is ``tests/gpu/test_gpu_ranks.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.contract.layer_classes import KIMI_K3_MLA
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.cli.ranks import cases, run, shapes
from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
from vllm_dcp_geometry.tooling.topology import load_profile

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

TOPOLOGY = """\
name = "two-ranks"
[parallel]
tensor_parallel_size = 2
decode_context_parallel_size = 2
[limits]
max_model_len = 4096
max_num_seqs = 8
[[groups]]
name = "mla.k2"
kind = "mla"
block_size = 16
num_kv_heads = 1
layers = ["model.layers.0.self_attn.attn"]
query_heads = 4
kv_lora_rank = 512
head_size = 576
dtype = "bfloat16"
[[groups]]
name = "draft"
kind = "mla"
block_size = 16
num_kv_heads = 1
draft = true
dcp_sharded = false
layers = ["model.layers.1.self_attn.attn"]
query_heads = 4
kv_lora_rank = 512
head_size = 576
dtype = "bfloat16"
"""


def _one_line(capsys: Any) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    return line


@pytest.fixture
def no_workers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    spawned: list[Any] = []
    monkeypatch.setattr(run.subprocess, "Popen", lambda *a, **k: spawned.append(a))
    for name in run.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return spawned


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["--device", "cuda"],
            "ranks --device cuda: D=4 needs 4 visible GPUs (one worker per GPU), "
            "0 visible",
        ),
        (["--cuda-graph"], "ranks --cuda-graph captures CUDA graphs: it needs a GPU"),
        (
            ["--attention-backend", "FLASHMLA"],
            "mla.0, mla.1, mla.2, mla.3, mla.4, draft: not run on this machine: "
            "FLASHMLA needs CUDA",
        ),
    ],
)
def test_a_device_or_backend_this_machine_lacks_is_one_line_and_exit_2(
    capsys: Any, no_workers: list[Any], args: list[str], needle: str
) -> None:
    code = main(["ranks", "--dcp", "4", "--scale", "8", "--no-progress", *args])
    assert code == EXIT_BAD_INPUT
    assert needle in _one_line(capsys)
    assert no_workers == []


def test_under_torchrun_the_baseline_and_a_cpu_run_without_switches_are_refused(
    capsys: Any, monkeypatch: pytest.MonkeyPatch, no_workers: list[Any]
) -> None:
    for name, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ):
        monkeypatch.setenv(name, value)
    assert run.torchrun_environment() is not None
    base = ["ranks", "--dcp", "4", "--scale", "8", "--no-progress"]
    assert main([*base, "--baseline"]) == EXIT_BAD_INPUT
    assert "run the baseline as its own torchrun with VLLM_PLUGINS=''" in (
        _one_line(capsys)
    )
    # The test process has the switches (conftest): take one away.
    switch = sorted(child_environment())[0]
    monkeypatch.delenv(switch)
    assert main([*base, "--device", "cpu"]) == EXIT_BAD_INPUT
    assert "needs the CPU switches in its environment" in _one_line(capsys)


def test_a_gpu_run_takes_each_groups_sm90_backend_unless_one_is_named() -> None:
    """What ``--device cuda`` would run, planned here: the Kimi-K3 target on
    FLASH_ATTN_MLA, its non-causal draft on FLASHINFER_MLA (the one SM90
    backend with DSpark DCP support), as ``plan`` reports; a named backend
    for every group; the combine's LSEs float32 on the compiled backends
    (TRITON_MLA's in the query's dtype)."""
    profile = load_profile("kimi-k3-tp16-dcp16")

    def backends(**kwargs: Any) -> dict[str, Any]:
        planned = cases.plan_groups(
            profile, gpu=True, scale=1, partial_collectives="replica", **kwargs
        )
        return {g["name"]: (g["backend"], g["reason"]) for g in planned if g["shape"]}

    auto = backends()
    assert auto["draft"] == ("FLASHINFER_MLA", None)
    assert {auto[f"mla.{i}"] for i in range(5)} == {("FLASH_ATTN_MLA", None)}
    named = backends(backend="FLASHMLA")
    assert {b for b, _ in named.values()} == {"FLASHMLA"}
    (draft,) = [
        g
        for g in cases.plan_groups(
            profile, gpu=True, scale=1, partial_collectives="replica"
        )
        if g["name"] == "draft"
    ]
    shape = shapes.Shape(**draft["shape"])
    assert shape.lse_bytes == 4
    assert shapes.Shape(**{**draft["shape"], "backend": "TRITON_MLA"}).lse_bytes == 2


def test_a_sharded_non_causal_draft_runs_only_on_a_dspark_dcp_backend() -> None:
    """A DSpark draft sharded over D: TRITON_MLA's and FLASHMLA's builders
    refuse its non-causal block under DCP (named), FLASHINFER_MLA runs it."""
    profile = load_profile("kimi-k3-tp16-dcp16")
    draft = next(g for g in profile.groups if g.name == "draft")
    sharded = dataclasses.replace(
        draft, spec_fields={**draft.spec_fields, "dcp_sharded": True}
    )
    for backend, refused in (
        ("TRITON_MLA", True),
        ("FLASHMLA", True),
        ("FLASHINFER_MLA", False),
    ):
        reason = cases.backend_refused(sharded, backend, 16, gpu=True)
        assert (reason is not None) == refused, (backend, reason)
        if refused:
            assert reason == cases.NON_CAUSAL_DCP_REASON.format(backend=backend)
    assert draft.layer_class == KIMI_K3_MLA


def test_the_lse_meter_wraps_a_compiled_backends_decode_once() -> None:
    """The LSE a compiled backend's decode hands on is recorded at the class
    that defines its ``forward_mqa`` (pinned, wrapped once however often it
    is asked)."""
    from vllm.v1.attention.backends.mla.flashmla import FlashMLAImpl

    from vllm_dcp_geometry.runtime.patching import original_of
    from vllm_dcp_geometry.tooling.cli.ranks.measuring import (
        LseRecorder,
        record_local_lse_of,
    )

    before = FlashMLAImpl.__dict__["forward_mqa"]
    recorder = LseRecorder()
    try:
        record_local_lse_of(FlashMLAImpl, recorder)
        wrapped = FlashMLAImpl.__dict__["forward_mqa"]
        assert wrapped is not before and original_of(wrapped) is before
        record_local_lse_of(FlashMLAImpl, recorder)
        assert FlashMLAImpl.__dict__["forward_mqa"] is wrapped
    finally:
        FlashMLAImpl.forward_mqa = before


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_torchrun_of_two_cpu_ranks_reports_what_the_launcher_reports(
    tmp_path: Path, capsys: Any
) -> None:
    """``python -m torch.distributed.run --nproc-per-node 2 -m
    vllm_dcp_geometry ranks``: each process is one rank (env://), rank 0
    prints the report of both, rank 1 nothing; the groups, worlds, bytes and
    errors equal the launcher's run of the same topology and seed."""
    path = tmp_path / "two.toml"
    path.write_text(TOPOLOGY)
    env = {
        **os.environ,
        **child_environment(),
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    for name in run.TORCHRUN_VARIABLES:
        env.pop(name, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
        "-m",
        "vllm_dcp_geometry",
        "ranks",
        "-t",
        str(path),
        "--json",
        "--no-progress",
    ]
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [
        json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")
    ]
    assert len(reports) == 1, done.stdout[-2000:]  # rank 0 only
    torchrun = reports[0]
    assert torchrun["ok"] is True
    assert torchrun["processes"]["launched_by"] == "torchrun"
    assert torchrun["processes"]["count"] == 2
    assert main(["ranks", "-t", str(path), "--json", "--no-progress"]) == EXIT_OK
    launcher = json.loads(capsys.readouterr().out)
    assert launcher["processes"]["launched_by"] == "vllm-dcp-geometry"
    keys = (
        "name",
        "shard_count",
        "collective_world_size",
        "attention_world_size",
        "collective_bytes_by_rank",
        "decode_max_abs_error",
        "prefill_max_abs_error",
        "ok",
    )
    for mine, theirs in zip(torchrun["groups"], launcher["groups"], strict=True):
        assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}
