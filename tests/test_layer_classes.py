# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Model-owned attention layer classes: the audit stays true, and each class
runs only a K its code reads the cache with (taught or refused at start-up).

The audit walk parses vLLM's installed model sources (no import: several
need CUDA) for classes that read the DCP world themselves, and fails on one
that ``layer_classes`` neither teaches nor lists in the installed release's
audit."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.attention import (
    cpu_platform,  # noqa: F401
    decode_batch,
    full_attention_spec,
    make_attention_layer,
    set_dcp_group,
    tiny_model_config,
)
from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES, installed_vllm_version
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.attention_admission import (
    AttentionMode,
    admit_attention,
)
from vllm_dcp_geometry.contract.layer_classes import (
    FLINT_ATTENTION,
    LAYER_CLASS_ATTR,
    REFUSED_LAYERS,
    TAUGHT_LAYERS,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.tooling.docs.layer_class_audit import (
    AUDITED_CLASSES,
    Disposition,
    audited_classes,
)

pytestmark = pytest.mark.patches(
    "worker.utils", "worker.flash_attn", "worker.flint_model"
)

LAYER = "model.layers.1.self_attn.attn"
DCP_MARKERS = (
    "decode_context_parallel_size",
    "get_dcp_group",
    "dcp_world_size",
    "dcp_rank",
    "dcp_manager",
    "dcp_query_start_loc",
    "dcp_tot_seq_lens",
    "dcp_local_seq_lens",
    "DcpBox",
    "dcp_size",
)
MODEL_TREES = ("models", "model_executor/models")


def vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent


def _classes(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.ClassDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            yield prefix + node.name, node
            yield from _classes(node, f"{prefix}{node.name}.")


def dcp_reading_classes(root: Path, package: str = "vllm") -> dict[str, str]:
    """``module.qualname`` -> file of every class under the model trees whose
    own source reads the DCP world (any of ``DCP_MARKERS``)."""
    found = {}
    for tree_name in MODEL_TREES:
        for path in sorted((root / tree_name).rglob("*.py")):
            source = path.read_text()
            if not any(marker in source for marker in DCP_MARKERS):
                continue
            module = ".".join((package, *path.relative_to(root).with_suffix("").parts))
            for qualname, node in _classes(ast.parse(source)):
                segment = ast.get_source_segment(source, node) or ""
                if any(marker in segment for marker in DCP_MARKERS):
                    found[f"{module}.{qualname}"] = str(path)
    return found


def installed_audit() -> dict[str, Any]:
    """The audit of the installed vLLM release."""
    release = installed_vllm_version()
    assert release in SUPPORTED_VLLM_RELEASES, release
    return audited_classes(release)


def unaccounted(found: dict[str, str]) -> list[str]:
    return sorted(set(found) - set(installed_audit()) - set(TAUGHT_LAYERS))


def test_every_dcp_reading_model_class_is_taught_or_listed() -> None:
    found = dcp_reading_classes(vllm_root())
    assert len(found) >= 20, found
    assert unaccounted(found) == []
    # Every class the plugin names for this release exists in it.
    defined = set()
    for tree_name in (*MODEL_TREES, "model_executor/layers"):
        for path in (vllm_root() / tree_name).rglob("*.py"):
            module = ".".join(
                ("vllm", *path.relative_to(vllm_root()).with_suffix("").parts)
            )
            defined |= {
                f"{module}.{q}" for q, _ in _classes(ast.parse(path.read_text()))
            }
    assert sorted((set(installed_audit()) | set(TAUGHT_LAYERS)) - defined) == []


def test_the_audit_walk_catches_a_new_model_class(tmp_path: Path) -> None:
    """A fake model-owned class that reads the DCP world is caught."""
    model = tmp_path / "models" / "newmodel"
    model.mkdir(parents=True)
    (model / "attention.py").write_text(
        "class NewAttention:\n"
        "    def __init__(self, parallel_config):\n"
        "        self.dcp_world_size = parallel_config.decode_context_parallel_size\n"
        "class Quiet:\n"
        "    pass\n"
    )
    (tmp_path / "model_executor" / "models").mkdir(parents=True)
    found = dcp_reading_classes(tmp_path)
    assert unaccounted(found) == ["vllm.models.newmodel.attention.NewAttention"]


def test_audited_dispositions_say_what_happens() -> None:
    for entry in AUDITED_CLASSES.values():
        assert entry.note, entry
        assert entry.releases and entry.releases <= set(SUPPORTED_VLLM_RELEASES)
        assert (entry.disposition is Disposition.TAUGHT) == (
            entry.path in TAUGHT_LAYERS
        ), entry


def test_every_class_refused_by_name_is_audited_and_not_taught() -> None:
    """``REFUSED_LAYERS`` names classes of the audit (refused, by the plugin
    or by vLLM), none of them taught."""
    assert set(REFUSED_LAYERS).isdisjoint(TAUGHT_LAYERS)
    for path, refused in REFUSED_LAYERS.items():
        entry = AUDITED_CLASSES[path]
        assert entry.disposition is Disposition.REFUSED, entry
        assert refused.label and refused.why, path


# Admission by layer class -------------------------------------------------------


def _admit(layer_class: str | None, k: int, *, mla: bool, backend: str, **kw: Any):
    from vllm_dcp_geometry.contract.attention_backends import AttentionKind

    return admit_attention(
        owner="g",
        kind=AttentionKind.MLA if mla else AttentionKind.ATTENTION,
        backend=backend,
        shard_count=k,
        dcp_world_size=4,
        default_shard_count=1 if k == 1 else 4,
        layer_class=layer_class,
        layer_name="layer.0",
        **kw,
    )


def test_an_untaught_model_class_runs_only_vllms_k() -> None:
    """Not admitted on the strength of its backend: a model-owned MLA class
    (vLLM reads MLA with K = D) is refused for every K < D, naming it."""
    path = "vllm.models.beam.nvidia.attention.BeamAttention"
    for k in (1, 2):
        admission = _admit(path, k, mla=True, backend="FLASHINFER_MLA")
        assert admission.refused
        assert f"layer layer.0 ({path})" in admission.reason
        assert f"FLASHINFER_MLA, K={k}, D=4" in admission.reason
        assert "not taught" in admission.reason
    assert _admit(path, 4, mla=True, backend="FLASHINFER_MLA").mode is (
        AttentionMode.DCP
    )
    # The generic class on the same backend runs both.
    assert _admit(None, 1, mla=True, backend="FLASHINFER_MLA").mode is (
        AttentionMode.LOCAL
    )
    assert _admit(None, 2, mla=True, backend="FLASHINFER_MLA").mode is (
        AttentionMode.DCP_PARTIAL
    )


def test_flint_runs_k1_and_refuses_partial() -> None:
    assert _admit(FLINT_ATTENTION, 1, mla=False, backend="FLASHINFER").mode is (
        AttentionMode.LOCAL
    )
    refused = _admit(FLINT_ATTENTION, 2, mla=False, backend="FLASHINFER")
    assert refused.refused and FLINT_ATTENTION in refused.reason
    assert "low-latency decode" in refused.reason


def test_a_sharded_cache_on_a_dcp1_impl_is_refused() -> None:
    refused = _admit(None, 4, mla=False, backend="FLASH_ATTN", impl_dcp_world_size=1)
    assert refused.refused and "built for a DCP world of 1" in refused.reason
    assert _admit(
        None, 4, mla=False, backend="FLASH_ATTN", impl_dcp_world_size=4
    ).mode is (AttentionMode.DCP)


def test_flint_patch_names_its_wrapper_under_dcp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Flint patch's constructor names ``FlintAttention`` on the generic
    layer it registers, under DCP only (D = 1 is upstream's constructor)."""
    from vllm.models.flint import model as flint

    from vllm_dcp_geometry.patches.worker.flint_model import _make_init
    from vllm_dcp_geometry.runtime.patching import original_of

    assert (
        original_of(flint.FlintAttention.__init__) is not flint.FlintAttention.__init__
    )

    def upstream(self: Any, *args: Any, **kwargs: Any) -> None:
        self.attn = SimpleNamespace()

    for world, named in ((1, False), (4, True)):
        set_dcp_group(monkeypatch, world, 0)
        wrapper = SimpleNamespace()
        _make_init(upstream)(wrapper, None, 0, None, None)
        assert (
            getattr(wrapper.attn, LAYER_CLASS_ATTR, None) == FLINT_ATTENTION
        ) is named


def test_dots3_sliding_window_builder_runs_k1_only() -> None:
    from vllm_dcp_geometry.runtime.worker_admission import backend_label

    path = "vllm.models.dots3_note.nvidia.attention.Dots3NoteMLAMetadataBuilder"
    module, _, name = path.rpartition(".")
    builder = type(name, (), {"__module__": module, "__qualname__": name})
    label = backend_label("TRITON_MLA", builder)
    assert label == f"TRITON_MLA ({path})"
    assert _admit(None, 1, mla=True, backend=label).mode is AttentionMode.LOCAL
    refused = _admit(None, 2, mla=True, backend=label)
    assert refused.refused and "taught K=1 only" in refused.reason


# Real builders --------------------------------------------------------------------


def _shell(path: str) -> Any:
    """An instance of a model-owned layer class made without ``__init__``
    (admission and binding read only its class and attributes)."""
    import importlib

    from torch import nn

    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


INKLING = "vllm.models.inkling.nvidia.attention.InklingAttention"


@pytest.mark.usefixtures("cpu_platform")
def test_inkling_runs_k1_with_dcp1_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inkling's layer has no impl; its kernel reads the FlashAttention
    metadata's lengths and block table. A replicated group gets a world-1
    builder whose metadata equals a DCP1 builder's, nothing bound; a partial
    group is refused naming the class."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    replicated = dataclasses.replace(full_attention_spec(16, None), dcp_sharded=False)
    batch = decode_batch([5, 40, 17], max_blocks=4)

    def build(dcp: int, spec: Any) -> Any:
        vllm_config = tiny_model_config(dcp, 1)
        set_dcp_group(monkeypatch, dcp, dcp - 1)
        layer = _shell(INKLING)
        layer.num_heads = 1  # what the builder reads of the layer
        vllm_config.compilation_config.static_forward_context[LAYER] = layer
        group = AttentionGroup(FlashAttentionBackend, [LAYER], spec, 1)
        group.create_metadata_builders(vllm_config, torch.device("cpu"))
        return layer, group.get_metadata_builder()

    layer, builder = build(4, replicated)
    assert (builder.dcp_world_size, builder.dcp_rank) == (1, 0)
    assert not hasattr(layer, BOUND_GEOMETRY_ATTR) and "impl" not in vars(layer)
    assert vars(layer)["num_heads"] == 1
    got = builder.build(0, batch)
    _, reference = build(1, replicated)
    want = reference.build(0, batch)
    assert torch.equal(got.seq_lens, want.seq_lens)
    assert torch.equal(got.block_table, want.block_table)
    with pytest.raises(DcpGeometryError) as excinfo:
        build(4, full_attention_spec(16, 2))
    assert INKLING in str(excinfo.value) and "runs only K=1" in str(excinfo.value)


@pytest.mark.usefixtures("cpu_platform")
def test_glm5next_tail_cache_stays_on_upstreams_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GLM-5.3-Flash's tail ring is replicated by its own spec (K = 1 =
    vLLM's K): admitted, nothing bound on the builder or the layer, and the
    spec's width is upstream's."""
    from vllm.v1.kv_cache_interface import CircularBufferSpec
    from vllm.v1.worker.utils import AttentionGroup

    from vllm_dcp_geometry.runtime.patching import original_of

    vllm_config = tiny_model_config(4, 1)
    set_dcp_group(monkeypatch, 4, 2)
    layer = _shell("vllm.models.glm5next.common.attention.Glm5NextTailCache")
    before = dict(vars(layer))
    vllm_config.compilation_config.static_forward_context[LAYER] = layer
    spec = CircularBufferSpec(
        block_size=8,
        num_kv_heads=2,
        head_size=128,
        head_size_v=0,
        dtype=torch.bfloat16,
        dcp_sharded=False,
    )
    group = AttentionGroup(layer.get_attn_backend(), [LAYER], spec, 3)
    group.create_metadata_builders(vllm_config, torch.device("cpu"))
    builder = group.get_metadata_builder()
    assert not hasattr(builder, BOUND_GEOMETRY_ATTR)
    assert vars(layer) == before
    upstream = original_of(type(spec).max_num_blocks_per_req)
    assert spec.max_num_blocks_per_req(vllm_config, 4096) == upstream(
        spec, vllm_config, 4096
    )


@pytest.mark.usefixtures("cpu_platform")
def test_sharded_override_on_a_dcp1_draft_impl_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dense draft vLLM built at DCP 1 (replicated spec, impl world 1), an
    operator's ``"sharded"`` on it: refused when the specs are collected,
    naming layer, class, backend, K and D; an impl built for D passes."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    from vllm_dcp_geometry.runtime.spec_overrides import apply_to_kv_cache_specs

    vllm_config = tiny_model_config(4, 1)
    vllm_config.additional_config = {"dcp_geometry": {"layers": {LAYER: "sharded"}}}
    specs = {
        LAYER: dataclasses.replace(full_attention_spec(16, None), dcp_sharded=False)
    }
    set_dcp_group(monkeypatch, 1, 0)
    make_attention_layer(vllm_config, LAYER, FlashAttentionBackend)
    set_dcp_group(monkeypatch, 4, 1)
    with pytest.raises(DcpGeometryError) as excinfo:
        apply_to_kv_cache_specs(specs, vllm_config)
    message = str(excinfo.value)
    assert (
        f"layer {LAYER} (vllm.model_executor.layers.attention.attention.Attention)"
        in message
    )
    assert "FLASH_ATTN, K=4, D=4" in message and "DCP world of 1" in message

    vllm_config = tiny_model_config(4, 1)
    vllm_config.additional_config = {"dcp_geometry": {"layers": {LAYER: "sharded"}}}
    make_attention_layer(vllm_config, LAYER, FlashAttentionBackend)
    assert apply_to_kv_cache_specs(specs, vllm_config)[LAYER].dcp_sharded
