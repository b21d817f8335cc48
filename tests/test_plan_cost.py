# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan``'s decode-collective cost per group (rule A6): the collective world
W, the bytes a rank moves per decoded token in one layer, and the attention
work vs a K = D group, checked against numbers restated here from first
principles, not from ``collectives``."""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

import pytest

from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.topology import (
    TopologyError,
    load_profile,
    load_topology_file,
    topology_from_mapping,
)

pytestmark = pytest.mark.patches("common.kv_cache_interface")

MLA_MIXED = "mla-mixed-tp4-dcp4"
# DeepSeek-V3-shaped MLA at TP4: 128 query heads (32 a rank), latent rank 512,
# rope 64, bfloat16 (2 bytes), float32 LSEs.
HEADS, LATENT, ROPE, ELEMENT, LSE = 128 // 4, 512, 64, 2, 4


def mla_bytes(world: int) -> int:
    """One rank's bytes per decoded token in one MLA layer over ``world``
    ranks: ring all-gathers of its queries (h(L+R) elements) and its LSEs
    (W h floats) each move 2(W-1) times their input; the reduce-scatter of
    the W h latent outputs moves 2(W-1)/W of them, i.e. 2(W-1) h L."""
    per_rank = HEADS * (LATENT + ROPE) * ELEMENT + world * HEADS * LSE
    return 2 * (world - 1) * (per_rank + HEADS * LATENT * ELEMENT)


def plan_groups(capsys: pytest.CaptureFixture, *args: str) -> dict[str, dict]:
    """``plan --json``'s groups by name."""
    assert main(["plan", "--json", *args]) == EXIT_OK
    return {g["name"]: g for g in json.loads(capsys.readouterr().out)["groups"]}


def profile_toml(name: str, tmp_path: Path, **edits: str) -> str:
    """The built-in profile's TOML text, each ``old=new`` line replaced, as a
    file under ``tmp_path``."""
    text = resources.files("vllm_dcp_geometry.tooling").joinpath(
        f"profiles/{name}.toml"
    )
    source = text.read_text(encoding="utf-8")
    for old, new in edits.items():
        assert old in source, old
        source = source.replace(old, new)
    path = tmp_path / f"{name}.toml"
    path.write_text(source)
    return str(path)


def test_mla_groups_collective_within_their_replica(capsys):
    groups = plan_groups(capsys, "--profile", MLA_MIXED)
    k4, k2, draft = groups["mla.k4"], groups["mla.k2"], groups["draft"]
    assert [g["shard_count"] for g in (k4, k2, draft)] == [4, 2, 1]
    assert [g["collective_world_size"] for g in (k4, k2, draft)] == [4, 2, 1]
    for g in (k4, k2, draft):
        world = g["collective_world_size"]
        assert g["decode_collective_bytes_per_rank_per_token"] == mla_bytes(world)
        assert g["attention_work_vs_sharded"] == 1.0
        assert g["decode_collective_bytes_reason"] is None
    assert draft["decode_collective_bytes_per_rank_per_token"] == 0
    assert k4["decode_collective_bytes_per_rank_per_token"] == 420_864
    # Only the partial group has a D-wide alternative: W = D = 4 for K = 2,
    # which moves 281,088 bytes more per token and layer and attends twice
    # the heads per rank.
    assert k2["dcp_group_bytes_per_rank_per_token"] == mla_bytes(4)
    saving = (
        k2["dcp_group_bytes_per_rank_per_token"]
        - k2["decode_collective_bytes_per_rank_per_token"]
    )
    assert saving == mla_bytes(4) - mla_bytes(2) == 281_088
    assert k2["dcp_group_attention_work_vs_sharded"] == 2.0
    for g in (k4, draft):
        assert g["dcp_group_bytes_per_rank_per_token"] is None
        assert g["dcp_group_attention_work_vs_sharded"] is None


def test_partial_collectives_dcp_keeps_the_partial_group_d_wide(capsys, tmp_path):
    path = profile_toml(
        MLA_MIXED,
        tmp_path,
        **{"[parallel]\n": '[parallel]\npartial_collectives = "dcp"\n'},
    )
    topology = load_topology_file(path)
    assert topology.partial_collectives == "dcp"
    assert topology_from_mapping(topology.to_dict()).to_dict() == topology.to_dict()
    groups = plan_groups(capsys, "-t", path)
    k2 = groups["mla.k2"]
    assert k2["collective_world_size"] == 4
    assert k2["decode_collective_bytes_per_rank_per_token"] == mla_bytes(4)
    assert k2["attention_work_vs_sharded"] == 2.0
    assert k2["dcp_group_bytes_per_rank_per_token"] == mla_bytes(4)
    # The sharded and local groups do not depend on the choice.
    assert groups["mla.k4"]["collective_world_size"] == 4
    assert groups["mla.k4"]["attention_work_vs_sharded"] == 1.0
    assert groups["draft"]["collective_world_size"] == 1
    assert groups["draft"]["attention_work_vs_sharded"] == 1.0


def test_flash_attention_partial_group_runs_within_its_replica(capsys):
    groups = plan_groups(capsys, "--profile", "partial-shard-tp8-dcp8")
    k4 = groups["attn.k4"]
    assert k4["attention_backend"] == "FLASH_ATTN"
    assert k4["shard_count"] == 4 and k4["collective_world_size"] == 4
    assert k4["attention_work_vs_sharded"] == 1.0
    # 64 query heads at TP8 (8 a rank) of 128 dims in bfloat16: queries and
    # outputs of h*128*2 bytes, LSEs of W*h*4; the D-wide alternative at 8.
    h, d = 8, 128

    def ring(w: int) -> int:
        return 2 * (w - 1) * (h * d * 2 + w * h * 4 + h * d * 2)

    assert k4["decode_collective_bytes_per_rank_per_token"] == ring(4)
    assert k4["dcp_group_bytes_per_rank_per_token"] == ring(8)
    assert k4["dcp_group_attention_work_vs_sharded"] == 2.0
    assert groups["attn.k8"]["collective_world_size"] == 8
    assert groups["draft"]["collective_world_size"] == 1
    assert "d_wide_reason" not in k4


def test_choosing_the_d_wide_group(capsys, tmp_path):
    path = profile_toml(
        "partial-shard-tp8-dcp8",
        tmp_path,
        **{"[parallel]\n": '[parallel]\npartial_collectives = "dcp"\n'},
    )
    groups = plan_groups(capsys, "-t", path)
    assert groups["attn.k4"]["collective_world_size"] == 8
    assert groups["attn.k4"]["attention_work_vs_sharded"] == 2.0


def test_text_output_has_a_cost_table(capsys):
    assert main(["plan", "--profile", MLA_MIXED]) == EXIT_OK
    text = capsys.readouterr().out
    assert "decode collectives (partial_collectives=replica)" in text
    rows = {
        line.split()[0]: line.split()
        for line in text.split("decode collectives", 1)[1].splitlines()
        if line.split() and line.split()[0] in ("mla.k4", "mla.k2", "draft")
    }
    assert rows["mla.k4"] == ["mla.k4", "4", "DCP", "group", "420,864", "1"]
    assert rows["mla.k2"] == [
        *("mla.k2", "2", "replica", "139,776", "1"),
        *("4", "420,864", "2"),
    ]
    assert rows["draft"] == ["draft", "1", "local", "0", "1"]
    assert mla_bytes(2) == 139_776


def test_missing_shapes_print_a_dash_with_the_reason(capsys, tmp_path):
    path = profile_toml(
        MLA_MIXED, tmp_path, **{"kv_lora_rank = 512\nquery_heads = 128\n": ""}
    )
    groups = plan_groups(capsys, "-t", path)
    for g in groups.values():
        assert g["collective_world_size"] is not None
        assert g["decode_collective_bytes_per_rank_per_token"] is None
        assert (
            g["decode_collective_bytes_reason"] == "the topology gives no query_heads"
        )
    assert groups["mla.k2"]["dcp_group_bytes_per_rank_per_token"] is None
    assert groups["mla.k2"]["dcp_group_attention_work_vs_sharded"] == 2.0
    assert main(["plan", "-t", path]) == EXIT_OK
    text = capsys.readouterr().out
    assert (
        "no collective bytes (the topology gives no query_heads): mla.k4, mla.k2, draft"
    ) in text
    (k2,) = [
        line.split()
        for line in text.split("decode collectives", 1)[1].splitlines()
        if line.startswith("mla.k2 ")
    ]
    assert k2 == ["mla.k2", "2", "replica", "-", "1", "4", "-", "2"]


def test_sparse_mla_and_its_indexer_collective_within_their_replica(capsys):
    # Their bytes: tests/test_plan_cost_sparse*.py.
    groups = plan_groups(capsys, "--profile", "deepseek-v32-tp8-dcp8")
    # Sparse MLA and its indexer collective within their replica (rule A6):
    # 4 ranks of the 8, one rank's work; the D-wide option is 8 and twice it.
    assert groups["latent.k4"]["attention_backend"] == "FLASHMLA_SPARSE"
    assert groups["latent.k4"]["decode_collectives"] == "attention"
    assert groups["indexer.k4"]["decode_collectives"] == "indexer_topk_merge"
    for name in ("latent.k4", "indexer.k4"):
        assert groups[name]["collective_world_size"] == 4
        assert groups[name]["attention_work_vs_sharded"] == 1.0
        assert groups[name]["dcp_group_attention_work_vs_sharded"] == 2.0


def test_recurrent_groups_have_no_cost(capsys):
    groups = plan_groups(capsys, "--profile", "mamba-hybrid-tp4-dcp4")
    for g in groups.values():
        if g["kind"] == "mamba":
            assert g["collective_world_size"] is None
            assert g["decode_collective_bytes_per_rank_per_token"] is None
            assert g["attention_work_vs_sharded"] is None
    assert groups["attn"]["collective_world_size"] == 4


def test_cost_fields_are_not_spec_fields():
    topology = load_profile(MLA_MIXED)
    for group in topology.groups:
        assert group.query_heads == 128 and group.kv_lora_rank == 512
        assert group.rope_dim == 64
        assert not {"query_heads", "kv_lora_rank"} & set(group.spec_fields)
        assert group.to_dict()["query_heads"] == 128
        assert group.to_dict()["kv_lora_rank"] == 512
    assert topology.to_dict()["parallel"]["partial_collectives"] == "replica"


# Bad input ---------------------------------------------------------------------


def one_mla_group(tmp_path: Path, extra: str, *, kind: str = "mla") -> str:
    """A TP4/DCP4 topology of one MLA-shaped group ``lat`` (K = 2) with the
    TOML lines ``extra`` added to the group."""
    path = tmp_path / "one.toml"
    heads = "" if kind == "mla" else "num_kv_heads = 1\n"
    path.write_text(
        "[parallel]\ntensor_parallel_size = 4\ndecode_context_parallel_size = 4\n"
        f'[[groups]]\nname = "lat"\nkind = "{kind}"\nlayers = ["l0"]\n'
        f'block_size = 16\nhead_size = 576\ndtype = "bfloat16"\n{heads}'
        f"dcp_kv_shard_count = 2\n{extra}\n"
    )
    return str(path)


def bad_plan(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """``plan``'s one-line error for ``argv`` (exit 2)."""
    assert main(["plan", *argv]) == EXIT_BAD_INPUT
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "kind", "pattern"),
    [
        (
            "query_heads = 126",
            "mla",
            "group 'lat' has query_heads 126 which tensor_parallel_size 4 does "
            "not divide",
        ),
        (
            "kv_lora_rank = 576",
            "mla",
            "group 'lat' has kv_lora_rank 576 but head_size 576",
        ),
        ("kv_lora_rank = 1024", "mla", "so 0 < kv_lora_rank < head_size"),
        (
            "kv_lora_rank = 0",
            "mla",
            r"group 'lat': kv_lora_rank must be an integer in \[1,",
        ),
        ("query_heads = true", "mla", r"group 'lat': query_heads must be an integer"),
        (
            "kv_lora_rank = 512",
            "full_attention",
            r"unknown key\(s\) \['kv_lora_rank'\]",
        ),
    ],
    ids=[
        "heads-tp",
        "rank-eq-head",
        "rank-gt-head",
        "rank-zero",
        "heads-bool",
        "rank-not-mla",
    ],
)
def test_bad_cost_fields_are_bad_input(capsys, tmp_path, extra, kind, pattern):
    line = bad_plan(capsys, ["-t", one_mla_group(tmp_path, extra, kind=kind)])
    assert re.search(pattern, line), line
    with pytest.raises(TopologyError):
        load_topology_file(one_mla_group(tmp_path, extra, kind=kind))


def test_a_tp_override_rechecks_query_heads(capsys):
    # 128 query heads over TP 12 (DCP 4 divides 12): not a whole number a rank.
    line = bad_plan(capsys, ["--profile", MLA_MIXED, "--tp", "12"])
    assert "group 'mla.k4' has query_heads 128 which tensor_parallel_size 12" in line


def test_unknown_partial_collectives_is_bad_input(capsys, tmp_path):
    path = profile_toml(
        MLA_MIXED,
        tmp_path,
        **{"[parallel]\n": '[parallel]\npartial_collectives = "ring"\n'},
    )
    line = bad_plan(capsys, ["-t", path])
    assert "partial_collectives must be one of ['replica', 'dcp'], got 'ring'" in line


def test_refused_groups_have_no_cost(capsys):
    # FLASHMLA lacks DSpark DCP support: vLLM refuses the non-causal draft.
    argv = [
        "plan",
        "--json",
        "--speculative-config",
        '{"attention_backend": "FLASHMLA"}',
    ]
    assert main(argv) == EXIT_BAD_INPUT
    groups = {g["name"]: g for g in json.loads(capsys.readouterr().out)["groups"]}
    draft = groups["draft"]
    assert draft["attention_mode"] == "refused"
    assert draft["collective_world_size"] is None
    assert draft["decode_collective_bytes_per_rank_per_token"] is None
    assert draft["attention_work_vs_sharded"] is None
    assert draft["decode_collective_bytes_reason"] == "refused at start-up"
    # Kimi-K3's MLA at TP16/DCP16: 96 / 16 = 6 heads a rank, 512 + 64, bfloat16.
    h, w = 6, 16
    expected = 2 * (w - 1) * (h * 576 * 2 + w * h * 4 + h * 512 * 2)
    assert groups["mla.0"]["decode_collective_bytes_per_rank_per_token"] == expected
