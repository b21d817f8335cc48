# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every bad input exits 2 with one line naming the flag, field or group and
the allowed range; sizes are bounded by what vLLM can represent.

Runs the command in this (patched) process; each case is milliseconds except
the sliding-window replays (about a second each).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.simulate import attention_group
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.topology.limits import (
    INT32_MAX,
    REPLAY_MAX_POOL_PAGES,
    REPLAY_MAX_TOKENS,
)

PREFIX = "vllm-dcp-geometry: error: "


def bad(capsys: pytest.CaptureFixture, argv: list[str], pattern: str) -> str:
    """Run ``argv``; assert exit 2 and exactly one stderr line matching."""
    code = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert code == EXIT_BAD_INPUT, (code, captured.err[-2000:])
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(PREFIX)
    assert re.search(pattern, lines[0]), lines[0]
    return lines[0]


def ok(capsys: pytest.CaptureFixture, argv: list[str]) -> dict[str, Any]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == EXIT_OK, captured.err[-4000:]
    assert captured.err == ""
    return json.loads(captured.out)


def group(**fields: Any) -> dict[str, Any]:
    return attention_group(**fields)


def topology_file(tmp_path: Path, *groups: dict, dcp: int = 1, **top: Any) -> str:
    path = tmp_path / "t.json"
    data = {
        "parallel": {"tensor_parallel_size": dcp, "decode_context_parallel_size": dcp},
        "groups": list(groups),
        **top,
    }
    path.write_text(json.dumps(data))
    return str(path)


WINDOW = {"kind": "sliding_window", "sliding_window": 128}


# Sliding windows -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dcp", "window"),
    [(4, {**WINDOW, "dcp_sharded": False}), (1, WINDOW)],
    ids=["replicated-dcp4", "dcp1"],
)
def test_sliding_window_topologies_plan_and_replay(tmp_path, capsys, dcp, window):
    path = topology_file(
        tmp_path,
        group(name="window", layers=["w0"], **window),
        group(name="full", layers=["f0"]),
        dcp=dcp,
        limits={"max_model_len": 4096},
    )
    plan = ok(capsys, ["plan", "-t", path])
    assert [g["shard_count"] for g in plan["groups"]] == [1, dcp]
    report = ok(capsys, ["replay", "-t", path, "--no-progress"])
    assert report["ok"] and report["tokens_replayed"] == 4096


def test_a_sharded_sliding_window_under_dcp_is_a_topology_error(tmp_path, capsys):
    path = topology_file(tmp_path, group(**WINDOW), dcp=4)
    for command in ("plan", "replay"):
        bad(
            capsys,
            [command, "-t", path],
            r"group 'g' is a sliding-window cache sharded over DCP \(D=4\).*"
            r"dcp_sharded = false",
        )


MAMBA = {
    "name": "m",
    "kind": "mamba",
    "layers": ["m0"],
    "shapes": [[4, 64]],
    "dtypes": ["float32"],
}


def test_mamba_none_mode_needs_one_block_of_max_model_len(tmp_path, capsys):
    """vLLM keeps one "none"-mode state block of max_model_len tokens; another
    block size is a topology error, not width violations in replay."""
    limits = {"max_model_len": 4096}
    cache = {"mamba_cache_mode": "none"}
    short = topology_file(
        tmp_path, {**MAMBA, "block_size": 1024}, limits=limits, cache=cache
    )
    for command in ("plan", "replay", "simulate"):
        bad(
            capsys,
            [command, "-t", short],
            r"group 'm' has block_size 1,024 but mamba_cache_mode 'none'.*4,096",
        )
    whole = topology_file(
        tmp_path, {**MAMBA, "block_size": 4096}, limits=limits, cache=cache
    )
    assert ok(capsys, ["replay", "-t", whole, "--no-progress"])["ok"]


# Topology files ----------------------------------------------------------------------


@pytest.mark.parametrize("template", ["l.{}.{}", "l.{x}.{}", "l.{0}.{}", "l.{"])
def test_bad_layer_templates(tmp_path, capsys, template):
    g = group(layer_template=template, layer_ids=[0, 1])
    del g["layers"]
    bad(capsys, ["plan", "-t", topology_file(tmp_path, g)], "'layer_template'")


def test_a_file_that_is_not_utf8(tmp_path, capsys):
    path = tmp_path / "t.toml"
    path.write_bytes(b"name = '\xe9'\n")
    bad(capsys, ["plan", "-t", str(path)], r"is not UTF-8 text: byte 0xe9 at offset 8")


def test_json_duplicate_keys(tmp_path, capsys):
    path = tmp_path / "t.json"
    text = json.dumps({"groups": [group()]})
    path.write_text(
        text.replace('"block_size": 16', '"block_size": 0, "block_size": 16')
    )
    bad(capsys, ["plan", "-t", str(path)], "duplicate key 'block_size'")


# Sizes: every one bounded, the limit named -----------------------------------------


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"block_size": 10**18}, "block_size"),
        ({"num_kv_heads": 10**18}, "num_kv_heads"),
        ({"head_size": 10**30}, "head_size"),
    ],
)
def test_spec_fields_beyond_int32(tmp_path, capsys, fields, field):
    path = topology_file(tmp_path, group(**fields))
    bad(
        capsys,
        ["plan", "-t", path],
        rf"{field} must be an integer in \[1, {INT32_MAX}\]",
    )


def test_max_model_len_beyond_int32(tmp_path, capsys):
    path = topology_file(tmp_path, group(), limits={"max_model_len": 10**18})
    bad(capsys, ["plan", "-t", path], r"max_model_len must be .*MAX_MODEL_LEN")
    bad(
        capsys,
        ["plan", "--max-model-len", str(10**18)],
        r"argument --max-model-len: must be an integer in \[1, 2147483647\] "
        r"\(MAX_MODEL_LEN",
    )
    bad(
        capsys,
        ["replay", "--max-model-len", str(10**18), "--tokens", str(10**18)],
        r"argument --max-model-len: .*MAX_MODEL_LEN",
    )


def test_sizes_no_rank_can_hold(capsys):
    bad(
        capsys,
        ["plan", "-p", "dense-gqa-tp8-dcp8", "--max-model-len", str(INT32_MAX)],
        r"one max-length request needs \d+ bytes of KV cache per rank .*"
        r"LARGEST_DEVICE_MEMORY_BYTES=288000000000",
    )
    bad(
        capsys,
        ["plan", "-p", "dense-gqa-tp8-dcp8", "--max-num-seqs", str(INT32_MAX)],
        r"block tables of one rank need \d+ bytes .*LARGEST_DEVICE_MEMORY_BYTES",
    )


def tiny(**fields: Any) -> dict[str, Any]:
    """A replicated group of 2-byte slots: only its page count is large."""
    return group(num_kv_heads=1, head_size=1, dtype="int8", dcp_sharded=False, **fields)


def test_pools_beyond_int32_block_ids_and_slots(tmp_path, capsys):
    # One request of 2**31 - 1 one-token pages (plus the null page) fits the
    # int32 block ids exactly; a second such group does not.
    groups = (tiny(block_size=1), tiny(name="h", layers=["l1"], block_size=1))
    path = topology_file(tmp_path, *groups, limits={"max_model_len": INT32_MAX})
    bad(capsys, ["plan", "-t", path], r"MAX_POOL_PAGES=2147483648 .*int32 block ids")
    path = topology_file(
        tmp_path, tiny(block_size=2**16), limits={"max_model_len": INT32_MAX}
    )
    bad(capsys, ["plan", "-t", path], r"MAX_POOL_SLOTS=2147483648 .*in int32")


def test_replays_that_would_not_end(tmp_path, capsys):
    bad(
        capsys,
        ["replay", "--tokens", str(REPLAY_MAX_TOKENS + 1)],
        rf"argument --tokens: must be an integer in \[1, {REPLAY_MAX_TOKENS}\]",
    )
    bad(
        capsys,
        ["replay", "--num-pages", str(REPLAY_MAX_POOL_PAGES + 1)],
        rf"argument --num-pages: must be an integer in \[2, {REPLAY_MAX_POOL_PAGES}\]",
    )
    path = topology_file(tmp_path, tiny(), limits={"max_model_len": 2**28})
    bad(capsys, ["replay", "-t", path], rf"REPLAY_MAX_TOKENS={REPLAY_MAX_TOKENS}")
    path = topology_file(tmp_path, tiny(block_size=1), limits={"max_model_len": 2**27})
    bad(capsys, ["replay", "-t", path], r"REPLAY_MAX_POOL_PAGES=16777216")
    bad(
        capsys,
        [
            "replay",
            "-p",
            "dense-gqa-tp8-dcp8",
            "--max-model-len",
            str(2**20),
            "--tokens",
            str(2**20),
            "--step-tokens",
            "1",
        ],
        r"REPLAY_MAX_CHECKED_COLUMNS=2147483648 .*raise --step-tokens",
    )


# Flags --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["plan", "--dcp", "0"], r"argument --dcp: must be an integer in \[1, "),
        (["plan", "--dcp", "-4"], r"argument --dcp: .*got '-4'"),
        (["plan", "--tp", "abc"], r"argument --tp: .*got 'abc'"),
        (["plan", "--interleave", "1.5"], r"argument --interleave: "),
        (["replay", "--step-tokens", ""], r"argument --step-tokens: .*got ''"),
        (["plan", "--bogus"], r"unrecognized arguments: --bogus"),
        ([], r"required: COMMAND"),
        (["plan", "-p", "no-such"], r"unknown profile 'no-such'"),
        (["plan", "-p", "x", "-t", "y.json"], r"not allowed with argument"),
    ],
)
def test_bad_flags(capsys, argv, pattern):
    bad(capsys, argv, pattern)


def test_receipt_needs_a_file_it_can_write(tmp_path, capsys):
    bad(capsys, ["replay", "--receipt", ""], r"argument --receipt: needs a file name")
    bad(capsys, ["replay", "--receipt", str(tmp_path)], r"--receipt: .* is a directory")
    bad(
        capsys,
        ["replay", "--receipt", str(tmp_path / "missing" / "r.json")],
        r"--receipt: the directory .*missing.* does not exist",
    )
