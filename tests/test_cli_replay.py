# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry replay``: vLLM's real KV-cache manager, no weights.

The full default replay (1,000,000 tokens, 17 groups, DCP16) runs here: it
takes a few seconds on two cores.
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata
from pathlib import Path

import pytest

from vllm_dcp_geometry.contract import (
    attention_block_table_width,
    cdiv,
    recurrent_align_block_table_width,
)
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_VIOLATION, main
from vllm_dcp_geometry.tooling.topology import load_profile

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "engine_core.kv_cache_utils",
    "engine_core.single_type_kv_cache_manager",
    "engine_core.kv_cache_coordinator",
)


def _replay(capsys, *args: str) -> tuple[int, dict]:
    code = main(["replay", "--json", "--no-progress", *args])
    return code, json.loads(capsys.readouterr().out)


def _check_clean(report: dict) -> None:
    assert report["ok"], report["violations"]
    assert report["ownership_violations"] == 0
    assert not any(report["violation_counts"].values())
    assert report["tokens_replayed"] == report["tokens"]
    assert report["allocation_steps"] == cdiv(report["tokens"], report["step_tokens"])
    held = sum(g["pages_held"] for g in report["groups"])
    # Pages held by the request plus free pages plus the null page = the pool.
    assert report["free_pages"] == report["num_pages"] - 1 - held
    for g in report["groups"]:
        assert g["max_column_used"] < g["block_table_width"], g
        assert g["manager_block_size"] == g["virtual_block_size"], g
        assert g["first_unaddressable_position"] is None, g


def test_default_replay_one_million_tokens_with_receipt(capsys, tmp_path: Path):
    receipt_path = tmp_path / "receipt.json"
    code, report = _replay(capsys, "--receipt", str(receipt_path))
    assert code == EXIT_OK
    _check_clean(report)
    topology = load_profile("kimi-k3-tp16-dcp16")
    length = topology.max_model_len
    assert report["tokens"] == 1_000_000 and report["step_tokens"] == 768
    assert report["allocation_steps"] == cdiv(1_000_000, 768)
    widths = {}
    for g in report["groups"]:
        widths.setdefault(g["kind"] + ("/draft" if g["draft"] else ""), set()).add(
            g["block_table_width"]
        )
    assert widths == {
        "mla": {attention_block_table_width(length, 384, 16)},
        "mamba": {recurrent_align_block_table_width(length, 384, 7)},
        "mla/draft": {attention_block_table_width(length, 384, 1)},
    }
    # Full attention holds every page of the request to the end; align-mode
    # recurrent groups keep the running state plus the speculative blocks.
    for g in report["groups"]:
        if g["kind"] == "mla":
            assert g["pages_held"] == g["block_table_width"]
            assert g["max_column_used"] == cdiv(1_000_000, g["virtual_block_size"]) - 1
        else:
            assert g["pages_held"] <= 2 + 7
    assert report["num_pages"] == report["pages_per_request"] + 1

    receipt = json.loads(receipt_path.read_text())
    assert receipt["vllm_version"] == metadata.version("vllm")
    assert receipt["plugin_version"] == metadata.version("vllm-dcp-geometry")
    assert receipt["inputs"]["profile"] == "kimi-k3-tp16-dcp16"
    assert receipt["inputs"]["topology"] == topology.to_dict()
    assert receipt["inputs"]["tokens"] == 1_000_000
    assert receipt["argv"][1:] == [
        "replay",
        "--json",
        "--no-progress",
        "--receipt",
        str(receipt_path),
    ]
    for key in ("groups", "allocation_steps", "num_pages", "free_pages", "created"):
        assert key in receipt


@pytest.mark.parametrize("profile", ["dense-gqa-tp8-dcp8", "mamba-hybrid-tp4-dcp4"])
def test_small_profiles_replay_clean(capsys, profile):
    code, report = _replay(capsys, "--profile", profile)
    assert code == EXIT_OK
    _check_clean(report)


def test_baseline_shows_where_unpatched_vllm_cannot_address_a_partial_group(
    capsys,
):
    step = 2048
    code, report = _replay(capsys, "--profile", "partial-shard-tp8-dcp8", "--baseline")
    assert code == EXIT_OK  # the patched replay is clean
    _check_clean(report)
    baseline = report["baseline"]
    assert baseline["mode"] == "unpatched" and not baseline["ok"]
    assert baseline["ownership_violations"] == 0
    rows = {g["name"]: g for g in baseline["groups"]}
    b, d, k = 64, 8, 4
    k4 = rows["attn.k4"]
    # Unpatched vLLM sizes and allocates the K=4 group as if K = D.
    assert k4["manager_block_size"] == b * d
    assert k4["block_table_width"] == cdiv(report["tokens"], b * d)
    # After the first step it holds cdiv(step, B*D) columns, but the group's
    # K-shard geometry maps the next position to the column after them.
    assert k4["first_unaddressable_position"] == cdiv(step, b * d) * b * k
    categories = {(v["group"], v["category"]) for v in baseline["violations"]}
    assert ("attn.k4", "addressability") in categories
    assert ("attn.k4", "width") in categories
    width_failure = next(
        v
        for v in baseline["violations"]
        if v["group"] == "attn.k4" and v["category"] == "width"
    )
    assert width_failure["position"] == k4["block_table_width"] * b * k
    assert rows["attn.k8"]["first_unaddressable_position"] is None
    diverged = {(x["group"], x["field"]) for x in report["divergence"]}
    assert ("attn.k4", "block_table_width") in diverged
    assert not any(group == "attn.k8" for group, _ in diverged)


def test_too_small_pool_is_a_violation(capsys):
    topology = load_profile("dense-gqa-tp8-dcp8")
    pages = cdiv(topology.max_model_len, 16 * 8)
    code, report = _replay(
        capsys, "--profile", "dense-gqa-tp8-dcp8", "--num-pages", str(pages)
    )
    assert code == EXIT_VIOLATION
    assert not report["ok"]
    assert report["violation_counts"]["pool"] == 1
    assert report["tokens_replayed"] < report["tokens"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", "2000000"], "exceeds max_model_len"),
        (["--step-tokens", "1000"], "must be a multiple of B=384"),
        (["--profile", "dense-gqa-tp8-dcp8", "--interleave", "3"], "interleave"),
    ],
)
def test_bad_replay_input_exits_2(capsys, args, message):
    assert main(["replay", "--no-progress", *args]) == EXIT_BAD_INPUT
    assert message in capsys.readouterr().err


def test_text_output_via_python_m(tmp_path: Path):
    """The report goes to stdout; the progress bar to stderr, and only where
    stderr is a terminal (here a pseudo-terminal)."""
    import fcntl
    import struct
    import subprocess
    import termios
    import threading

    leader, follower = os.openpty()
    # A new pseudo-terminal is 0 columns wide, where tqdm draws nothing.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    bar: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed its end
                return
            if not chunk:
                return
            bar.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_dcp_geometry",
            "replay",
            "--profile",
            "mamba-hybrid-tp4-dcp4",
            "--tokens",
            "65536",
        ],
        stdout=subprocess.PIPE,
        stderr=follower,
        text=True,
        check=False,
    )
    os.close(follower)
    reader.join(timeout=10)
    os.close(leader)
    assert result.returncode == 0, b"".join(bar)[-2000:]
    assert "violations: ownership 0" in result.stdout
    assert result.stdout.rstrip().endswith("OK")
    assert b"tok" in b"".join(bar)


def test_no_progress_bar_where_stderr_is_not_a_terminal(capsys):
    args = ["replay", "-p", "mamba-hybrid-tp4-dcp4", "--tokens", "4096"]
    assert main(args) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("OK")
    assert "tok" not in captured.err
