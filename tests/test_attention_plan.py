# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --attention-backend``: each group's attention mode from the same
admission rule start-up applies, and a refused group exits 2 with the very
message start-up raises.

About 10 s on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.attention import attention_modes
from tests.support.mla import cpu_shims, mla_model_config, model_dir, process_groups
from tests.support.simulated_collectives import SimulatedGroup
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.tooling.cli import EXIT_BAD_INPUT, EXIT_OK, main
from vllm_dcp_geometry.tooling.topology import load_profile

pytestmark = pytest.mark.patches("worker.utils")


def _plan(capsys, *args: str, status: int = EXIT_OK) -> tuple[dict, str]:
    assert main(["plan", "--json", *args]) == status
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_default_profile_runs_every_group(capsys) -> None:
    plan, err = _plan(capsys)
    modes = attention_modes(plan)
    assert err == ""
    # The DSpark draft: vLLM selects FLASHINFER_MLA for it under DCP.
    assert modes["draft"] == ("local", "FLASHINFER_MLA")
    assert all(modes[f"mla.{i}"] == ("dcp", "FLASH_ATTN_MLA") for i in range(5))
    classes = {g["name"]: g["layer_class"] for g in plan["groups"]}
    assert (
        {classes[f"mla.{i}"] for i in range(5)}
        == {classes["draft"]}
        == {"vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention"}
    )
    assert all(classes[f"kda.{i}"] is None for i in range(14))
    assert all(modes[f"kda.{i}"] == ("none", None) for i in range(14))
    assert all(g["attention_refusal"] is None for g in plan["groups"])
    assert plan["inputs"]["attention_backend"] is None


def test_partial_profile_and_the_table(capsys) -> None:
    plan, _ = _plan(capsys, "-p", "partial-shard-tp8-dcp8")
    assert attention_modes(plan) == {
        "attn.k8": ("dcp", "FLASH_ATTN"),
        "attn.k4": ("dcp-partial", "FLASH_ATTN"),
        "draft": ("local", "FLASH_ATTN"),
    }
    assert main(["plan", "-p", "partial-shard-tp8-dcp8"]) == EXIT_OK
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("group"))
    assert "attention" in header.split()
    assert any(
        line.startswith("attn.k4") and " dcp-partial " in line
        for line in table.splitlines()
    )


@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA", "CUTLASS_MLA"])
def test_an_mla_backend_applies_to_mla_groups_only(capsys, backend: str) -> None:
    """The target's MLA groups run it; the DSpark draft does not inherit it
    (vLLM's selector picks FLASHINFER_MLA); named for the draft through
    ``--speculative-config``, vLLM's selector refuses it under DCP (no
    DSpark DCP support), and plan says so."""
    plan, _ = _plan(capsys, "--attention-backend", backend)
    modes = attention_modes(plan)
    assert modes["draft"] == ("local", "FLASHINFER_MLA")
    assert modes["mla.0"] == ("dcp", backend)
    assert modes["kda.0"] == ("none", None)
    plan, err = _plan(
        capsys,
        "--speculative-config",
        json.dumps({"attention_backend": backend}),
        status=EXIT_BAD_INPUT,
    )
    modes = attention_modes(plan)
    assert modes["draft"] == ("refused", backend)
    assert "refuses non-causal multi-token MLA decode" in err
    assert modes["mla.0"] == ("dcp", "FLASH_ATTN_MLA")
    plan, _ = _plan(
        capsys, "-p", "partial-shard-tp8-dcp8", "--attention-backend", backend
    )
    assert attention_modes(plan)["attn.k4"] == ("dcp-partial", "FLASH_ATTN")


def test_refused_group_exits_2_with_the_start_up_message(capsys) -> None:
    """The plan's reason is, character for character, what vLLM's
    ``AttentionGroup.create_metadata_builders`` raises for that group."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    # TOKENSPEED_MLA runs the DSpark draft under DCP in vLLM, but the plugin
    # has not taught it a K.
    plan, err = _plan(
        capsys,
        "--speculative-config",
        '{"attention_backend": "TOKENSPEED_MLA"}',
        status=EXIT_BAD_INPUT,
    )
    (refused,) = [g for g in plan["groups"] if g["attention_mode"] == "refused"]
    assert refused["name"] == "draft"
    assert err.strip() == f"vllm-dcp-geometry: error: {refused['attention_refusal']}"

    topology = load_profile("kimi-k3-tp16-dcp16")
    index = [g.name for g in topology.groups].index("draft")
    group = topology.groups[index]
    spec = _vllm.build_spec(group, topology, patched=True)
    attention_group = AttentionGroup(
        AttentionBackendEnum["TOKENSPEED_MLA"].get_class(),
        list(group.layers),
        spec,
        index,
    )
    with cpu_shims(), process_groups(SimulatedGroup(None, 16, 9)):
        config = mla_model_config(model_dir(16), 16, 1)
        # The draft's layer, of the class the profile names (admission reads
        # only its class before refusing).
        layer_cls = _import_class(group.layer_class)
        context = config.compilation_config.static_forward_context
        context[group.layers[0]] = layer_cls.__new__(layer_cls)
        with pytest.raises(DcpGeometryError) as excinfo:
            attention_group.create_metadata_builders(config, torch.device("cpu"))
    assert str(excinfo.value) == refused["attention_refusal"]


def _import_class(path: str | None) -> type:
    import importlib

    assert path is not None
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_non_causal_dcp_backends_are_vllms() -> None:
    """``plan``'s list of DSpark-DCP MLA backends is what vLLM's importable
    backend classes say (FLASH_ATTN_MLA and a few others need CUDA)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_dcp_geometry.tooling.cli.plan.attention import NON_CAUSAL_DCP_MLA_BACKENDS

    checked = 0
    for member in AttentionBackendEnum:
        try:
            backend = member.get_class()
        except Exception:
            continue
        if not backend.is_mla():
            continue
        checked += 1
        assert (member.name in NON_CAUSAL_DCP_MLA_BACKENDS) == bool(
            getattr(
                backend.get_builder_cls(), "supports_non_causal_multi_token_dcp", False
            )
        ), member.name
    assert checked >= 3


def test_unknown_backend_is_bad_input(capsys) -> None:
    assert main(["plan", "--attention-backend", "NOT_A_BACKEND"]) == EXIT_BAD_INPUT
    assert "NOT_A_BACKEND" in capsys.readouterr().err


def test_plan_names_the_caches_unpatched_vllm_would_misread(capsys) -> None:
    """vLLM's MLA (0.33.0 and 0.34.0) reads every cache with K = D: a
    replicated MLA draft is written with K = 1 and read with K = 16 there.
    FlashAttention follows dcp_sharded, so a replicated dense draft is read
    as written."""
    from vllm_dcp_geometry.tooling.vllm_release import vllm_release

    plan, _ = _plan(capsys)
    read = {g["name"]: g["upstream"]["attention_shard_count"] for g in plan["groups"]}
    assert read["draft"] == 16 and plan["groups"][-1]["upstream"]["shard_count"] == 1
    assert all(read[f"mla.{i}"] == 16 for i in range(5))
    assert all(read[f"kda.{i}"] is None for i in range(14))
    assert main(["plan"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "(wrong attention, no error): draft (written K=1, read K=16)" in text
    assert text.rstrip().endswith(f"differs from {vllm_release()} in: draft")
    dense, _ = _plan(capsys, "-p", "dense-gqa-tp8-dcp8")
    assert all(
        g["upstream"]["attention_shard_count"] == g["upstream"]["shard_count"]
        for g in dense["groups"]
    )
    assert main(["plan", "-p", "dense-gqa-tp8-dcp8"]) == EXIT_OK
    assert "wrong attention" not in capsys.readouterr().out
