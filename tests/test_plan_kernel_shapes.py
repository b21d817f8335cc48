# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan`` refuses the shapes vLLM's kernels cannot run (exit 2, naming the
group, the rule and the kernel), read from the installed vLLM: an MLA latent
row its backend does not admit, and a head dimension DCP's Triton combine
cannot tile. Unpatched vLLM has the same limits; ``plan`` says so before GPUs
are rented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.cli.common.noise import kept_lines
from vllm_dcp_geometry.tooling.cli.plan import kernel_shapes
from vllm_dcp_geometry.tooling.topology import load_profile, profile_names


def topology(tmp_path: Path, group: str, *, dcp: int = 4) -> str:
    """A TP4 topology at DCP ``dcp`` of the one group ``lat`` (TOML lines)."""
    path = tmp_path / "one.toml"
    path.write_text(
        "[parallel]\ntensor_parallel_size = 4\n"
        f"decode_context_parallel_size = {dcp}\n"
        f'[[groups]]\nname = "lat"\nlayers = ["l0"]\nblock_size = 16\n'
        f'dtype = "bfloat16"\n{group}\n'
    )
    return str(path)


def mla(rank: int, rope: int, extra: str = "") -> str:
    return (
        f'kind = "mla"\nhead_size = {rank + rope}\nkv_lora_rank = {rank}\n'
        f"query_heads = 128\n{extra}"
    )


def refusal(capsys: pytest.CaptureFixture, path: str) -> str:
    assert main(["plan", "-t", path]) == EXIT_BAD_INPUT
    # (torch's notes reach pytest's capture past the command's filter)
    lines = kept_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    return lines[0]


def admitted(capsys: pytest.CaptureFixture, path: str) -> dict:
    assert main(["plan", "--json", "-t", path]) == EXIT_OK
    (group,) = json.loads(capsys.readouterr().out)["groups"]
    return group


def test_a_latent_row_the_backend_does_not_admit_exits_2(capsys, tmp_path) -> None:
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    sizes = MLACommonBackend.get_supported_head_sizes()
    line = refusal(capsys, topology(tmp_path, mla(384, 64)))
    assert "KV-cache group 0 (l0)" in line
    assert f"admits MLA latent rows of {', '.join(map(str, sizes))}" in line
    assert "this group's is 448 (kv_lora_rank 384 + rope 64)" in line
    # Without DCP too: vLLM's MLA metadata refuses the row whatever D is.
    line = refusal(capsys, topology(tmp_path, mla(384, 64), dcp=1))
    assert "448" in line


@pytest.mark.parametrize(
    "shard",
    ["dcp_kv_shard_count = 2\n", ""],  # K = 2 (W = 2 within a replica), K = D
)
def test_a_combine_over_a_rank_that_is_no_power_of_two_exits_2(
    capsys, tmp_path, shard: str
) -> None:
    # 448 + 64 = 512: a row vLLM admits, a latent rank its combine cannot tile.
    line = refusal(capsys, topology(tmp_path, mla(448, 64, shard)))
    assert f"Triton kernels of {kernel_shapes.COMBINE_MODULE}" in line
    assert "need a power of two; its kv_lora_rank is 448" in line
    # Replicated (K = 1) attends locally: nothing combined, admitted.
    group = admitted(capsys, topology(tmp_path, mla(448, 64, "dcp_sharded = false")))
    assert group["attention_mode"] != "refused"
    # So does the same group without DCP.
    admitted(capsys, topology(tmp_path, mla(448, 64), dcp=1))


def test_full_attention_heads_follow_the_same_combine_rule(capsys, tmp_path) -> None:
    group = 'kind = "full_attention"\nnum_kv_heads = 1\nhead_size = {}\n'
    line = refusal(capsys, topology(tmp_path, group.format(96)))
    assert "its head_size is 96" in line
    admitted(capsys, topology(tmp_path, group.format(128)))


def test_the_combine_rule_is_read_from_vllms_kernel(
    capsys, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shown failing: where the installed kernel no longer tiles with one
    arange, the rule does not apply (it is vLLM's, not ours)."""
    path = topology(tmp_path, mla(448, 64))
    refusal(capsys, path)
    kernel_shapes.combine_tiles_head_dim.cache_clear()
    monkeypatch.setattr(kernel_shapes, "COMBINE_TILING", "tl.arange(0, HEAD_DIM_P2)")
    try:
        assert admitted(capsys, path)["attention_mode"] != "refused"
    finally:
        kernel_shapes.combine_tiles_head_dim.cache_clear()


def test_every_built_in_profile_passes_the_kernel_rules() -> None:
    for name in profile_names():
        for group in load_profile(name).groups:
            head = kernel_shapes.combined_head_dim(group)
            if head is not None:
                assert head[1] & (head[1] - 1) == 0, (name, group.name, head)
