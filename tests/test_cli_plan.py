# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry plan``: widths and bytes from the patched specs, the
unpatched column from vLLM 0.33.0's own methods."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import run_python
from vllm_dcp_geometry._version import installed_vllm_version
from vllm_dcp_geometry.contract import (
    attention_block_table_width,
    recurrent_align_block_table_width,
)
from vllm_dcp_geometry.runtime.geometry import upstream_get_block_table_width
from vllm_dcp_geometry.tooling.cli import EXIT_OK, main
from vllm_dcp_geometry.tooling.topology import load_profile

pytestmark = pytest.mark.patches("common.kv_cache_interface")


def _plan(capsys, *args: str) -> dict:
    assert main(["plan", "--json", *args]) == EXIT_OK
    return json.loads(capsys.readouterr().out)


def test_default_profile_widths_follow_the_contract(capsys):
    plan = _plan(capsys)
    topology = load_profile("kimi-k3-tp16-dcp16")
    length, seqs = topology.max_model_len, topology.max_num_seqs
    # vLLM's planner: 14 KDA groups and 5 MLA groups of up to five layers,
    # one draft group; its hybrid rule sets every block to 384 tokens.
    assert len(plan["groups"]) == 20
    by_kind: dict[str, list[dict]] = {}
    for g in plan["groups"]:
        by_kind.setdefault("draft" if g["draft"] else g["kind"], []).append(g)
    assert (len(by_kind["mamba"]), len(by_kind["mla"])) == (14, 5)
    for g in by_kind["mamba"]:
        assert g["shard_count"] == 1
        assert g["block_table_width"] == 2612
        assert g["block_table_width"] == recurrent_align_block_table_width(
            length, 384, 7
        )
    for g in by_kind["mla"]:
        assert g["shard_count"] == 16
        assert g["block_table_width"] == attention_block_table_width(length, 384, 16)
        assert g["block_table_width"] == g["block_table_width_aligned"] == 163
    (draft,) = by_kind["draft"]
    assert draft["shard_count"] == 1
    assert draft["block_table_width"] == attention_block_table_width(length, 384, 1)
    assert draft["block_table_width"] == draft["block_table_width_aligned"] == 2605
    for g in plan["groups"]:
        alignment = None if g["kind"] == "mamba" else 128
        aligned = upstream_get_block_table_width()(
            g["block_table_width"], g["block_size"], token_alignment=alignment
        )
        assert g["block_table_width_aligned"] == aligned
        assert g["block_table_bytes_per_rank"] == seqs * aligned * 4
    assert plan["totals"]["block_table_bytes_per_rank"] == sum(
        g["block_table_bytes_per_rank"] for g in plan["groups"]
    )
    # Upstream 0.33.0 already sizes these three kinds of group the same way.
    assert all(v == 0 for v in plan["totals"]["delta"].values())
    assert plan["vllm_version"] and plan["plugin_version"]


def test_partial_group_differs_from_upstream_and_scales_with_max_num_seqs(capsys):
    plan = _plan(capsys, "--profile", "partial-shard-tp8-dcp8", "--max-num-seqs", "3")
    length = plan["inputs"]["max_model_len"]
    assert plan["inputs"]["max_num_seqs"] == 3
    rows = {g["name"]: g for g in plan["groups"]}
    k4 = rows["attn.k4"]
    assert k4["shard_count"] == 4 and k4["upstream"]["shard_count"] == 8
    assert k4["block_table_width"] == attention_block_table_width(length, 64, 4)
    assert k4["upstream"]["block_table_width"] == attention_block_table_width(
        length, 64, 8
    )
    assert k4["delta"]["block_table_bytes_per_rank"] == 3 * 4 * (
        k4["block_table_width_aligned"] - k4["upstream"]["block_table_width_aligned"]
    )
    assert rows["attn.k8"]["delta"]["block_table_bytes_per_rank"] == 0
    assert (
        plan["totals"]["delta"]["block_table_bytes_per_rank"]
        == (k4["delta"]["block_table_bytes_per_rank"])
    )


def test_upstream_column_matches_a_fresh_unpatched_vllm(capsys, tmp_path: Path):
    """The plan's "unpatched" numbers equal what an unpatched process computes
    for the same specs (which cannot carry a partial shard count)."""
    names = ["partial-shard-tp8-dcp8", "kimi-k3-tp16-dcp16", "mamba-hybrid-tp4-dcp4"]
    plans = {name: _plan(capsys, "--profile", name) for name in names}
    unpatched = run_python(
        f"""
        import json
        from vllm_dcp_geometry.tooling import vllm_objects as _vllm
        from vllm_dcp_geometry.tooling.topology import load_profile
        assert not _vllm.is_vllm_patched()
        out = {{}}
        for name in {names!r}:
            t = load_profile(name)
            cfg = _vllm.sizing_config(t)
            out[name] = [
                [s.max_num_blocks_per_req(cfg, t.max_model_len),
                 _vllm.pages_per_request(s, cfg)]
                for s in (_vllm.build_spec(g, t, patched=False) for g in t.groups)
            ]
        print(json.dumps(out))
        """,
        patched=False,
    )
    for name in names:
        ours = [
            [g["upstream"]["block_table_width"], g["upstream"]["pages_per_request"]]
            for g in plans[name]["groups"]
        ]
        assert ours == unpatched[name], name


def test_text_table_and_console_script(capsys):
    assert main(["plan", "--profile", "partial-shard-tp8-dcp8"]) == EXIT_OK
    text = capsys.readouterr().out
    # The unpatched columns and the header name the release the plan ran on.
    release = installed_vllm_version()
    assert text.startswith(f"topology partial-shard-tp8-dcp8 on vLLM {release}: ")
    assert "attn.k4" in text and f"vs {release}" in text
    assert f"differs from {release} in: attn.k4" in text

    script = Path(sys.executable).with_name("vllm-dcp-geometry")
    result = subprocess.run(
        [str(script), "plan", "--json", "--profile", "dense-gqa-tp8-dcp8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout.splitlines()[-1])
    (group,) = plan["groups"]
    length = plan["inputs"]["max_model_len"]
    assert group["shard_count"] == 8
    assert group["block_table_width"] == attention_block_table_width(length, 16, 8)
