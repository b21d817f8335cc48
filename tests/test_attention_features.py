# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention features a backend's DCP path does not keep. vLLM 0.33.0's
``FlashAttentionImpl._forward_with_dcp`` passes neither ``s_aux`` (attention
sinks, gpt-oss's full layers) nor a ``mask_mod`` (R-SWA, multimodal prefix)
to its kernels; the plugin folds the sinks into it (rule A7, numerics in
``test_attention_sinks``), so every K is admitted for them, while every K > 1
(K = D included) on a layer using a mask_mod is refused at start-up, naming
layer, feature and backend. FlashInfer's DCP path keeps no sinks, so they are
refused there. K = 1 runs the single-device path, which keeps all of them.
Built on vLLM's real layer, impl and builder objects, each feature set as the
model sets it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.attention import (
    HEAD_SIZE,
    cpu_platform,  # noqa: F401
    flashinfer_impls_without_a_gpu,
    full_attention_spec,
    replica_groups_for,
    set_dcp_group,
    tiny_model_config,
)
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.patches.worker.utils import admit_attention_group

pytestmark = pytest.mark.patches("worker.utils", "worker.flash_attn")

LAYER = "model.layers.0.self_attn.attn"


def _group(
    monkeypatch: pytest.MonkeyPatch,
    spec: Any,
    *,
    sinks: bool = False,
    configure: Callable[[Any], None] | None = None,
    backend: Any = None,
) -> Any:
    """A FlashAttention (or ``backend``) group at D = 4 over one real
    ``Attention`` layer, its builders made as start-up makes them (for
    another backend, only admitted: FlashInfer's builder needs CUDA)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    # The CPU build has no FlashAttention kernels to ask; FA3 and FA4 have
    # sinks, and the impl keeps them as a GPU build does.
    monkeypatch.setattr(
        flash_attn, "flash_attn_supports_sinks", lambda: True, raising=False
    )
    backend = backend or FlashAttentionBackend
    vllm_config = tiny_model_config(4, 1)
    if configure is not None:
        configure(vllm_config)
    set_dcp_group(monkeypatch, 4, 1)
    with set_current_vllm_config(vllm_config):
        # gpt-oss passes its learned per-head sinks to Attention.
        Attention(
            1,
            HEAD_SIZE,
            HEAD_SIZE**-0.5,
            1,
            prefix=LAYER,
            attn_backend=backend,
            sinks=torch.zeros(1) if sinks else None,
        )
    group = AttentionGroup(backend, [LAYER], spec, 0)
    if backend is FlashAttentionBackend:
        with replica_groups_for([spec.dcp_kv_shard_count or 4]):
            group.create_metadata_builders(vllm_config, torch.device("cpu"))
    else:
        admit_attention_group(group, vllm_config)
    return group


def _arch(**changes: Any) -> Callable[[Any], None]:
    def configure(vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        model_config.model_arch_config = dataclasses.replace(
            model_config.model_arch_config, **changes
        )

    return configure


SHARDED = full_attention_spec(16, None)
PARTIAL = full_attention_spec(16, 2)
REPLICATED = dataclasses.replace(SHARDED, dcp_sharded=False)


@pytest.mark.usefixtures("cpu_platform")
@pytest.mark.parametrize(
    ("feature", "kwargs", "words"),
    [
        ("rswa", {"configure": _arch(rswa_window=64)}, "the R-SWA mask_mod"),
        (
            "mm_prefix",
            {"configure": _arch(is_mm_prefix_lm=True)},
            "the multimodal-prefix mask_mod",
        ),
    ],
)
def test_a_dropped_feature_is_refused_for_every_k_above_1(
    monkeypatch: pytest.MonkeyPatch, feature: str, kwargs: dict[str, Any], words: str
) -> None:
    for spec, k in ((SHARDED, 4), (PARTIAL, 2)):
        with pytest.raises(DcpGeometryError) as excinfo:
            _group(monkeypatch, spec, **kwargs)
        message = str(excinfo.value)
        assert message.startswith(f"KV-cache group 0 ({LAYER}): layer {LAYER} ")
        assert f"attention backend FLASH_ATTN, K={k}, D=4" in message, feature
        assert f"does not keep {words}" in message
    # Replicated: FlashAttention's single-device path, which keeps it.
    (builder,) = _group(monkeypatch, REPLICATED, **kwargs).metadata_builders
    assert (builder.dcp_world_size, builder.dcp_rank) == (1, 0)


@pytest.mark.usefixtures("cpu_platform")
def test_a_layer_without_them_keeps_vllms_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker is not a blanket refusal: the same group without the
    feature starts, on vLLM's own K = D builder."""
    (builder,) = _group(monkeypatch, SHARDED).metadata_builders
    assert (builder.dcp_world_size, builder.dcp_rank) == (4, 1)


@pytest.mark.usefixtures("cpu_platform")
def test_sinks_are_admitted_on_flash_attention_at_every_k(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plugin folds sinks into FlashAttention's DCP path (rule A7): a
    layer with sinks starts at K = D on vLLM's own builder, at 1 < K < D on
    the plugin's, and at K = 1 on the single-device one."""
    for spec, world in ((SHARDED, (4, 1)), (PARTIAL, (2, 1)), (REPLICATED, (1, 0))):
        (builder,) = _group(monkeypatch, spec, sinks=True).metadata_builders
        assert (builder.dcp_world_size, builder.dcp_rank) == world


@pytest.mark.usefixtures("cpu_platform")
def test_sinks_are_refused_on_flashinfer_above_k_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FlashInfer's DCP prefill wrapper raises on sinks at the first step
    and its TRTLLM decode counts them on every rank's partial: K > 1 is
    refused before any builder is made; without sinks the group is admitted."""
    from vllm.v1.attention.backends import flashinfer

    flashinfer_impls_without_a_gpu(monkeypatch)
    FlashInferBackend = flashinfer.FlashInferBackend
    for spec, k in ((SHARDED, 4), (PARTIAL, 2)):
        with pytest.raises(DcpGeometryError) as excinfo:
            _group(monkeypatch, spec, sinks=True, backend=FlashInferBackend)
        message = str(excinfo.value)
        assert f"attention backend FLASHINFER, K={k}, D=4" in message
        assert "does not keep attention sinks (s_aux)" in message
    _group(monkeypatch, REPLICATED, sinks=True, backend=FlashInferBackend)
    _group(monkeypatch, SHARDED, backend=FlashInferBackend)


def test_vllms_dcp_path_still_drops_them() -> None:
    """Pinned on vLLM's source: the DCP path passes no ``s_aux`` or
    ``mask_mod``, the single-device path passes both. When vLLM fixes its
    DCP path this fails: the sink fold can go, and ``DCP_DROPPED_FEATURES``
    can shrink. The installed DCP path is the plugin's sink-folding wrapper."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from vllm_dcp_geometry.runtime.patching import ORIGINAL_ATTR, original_of

    assert hasattr(FlashAttentionImpl._forward_with_dcp, ORIGINAL_ATTR)

    dcp_path = inspect.getsource(original_of(FlashAttentionImpl._forward_with_dcp))
    forward = inspect.getsource(original_of(FlashAttentionImpl.forward))
    for word in ("s_aux", "mask_mod"):
        assert word not in dcp_path
        assert word in forward
    # What admission reads is what the single-device path passes on.
    assert "s_aux=self.sinks" in forward
    assert "self.sinks = sinks" in inspect.getsource(FlashAttentionImpl.__init__)


def test_plan_refuses_what_start_up_refuses(tmp_path: Path, capsys) -> None:
    """Sinks: FlashAttention admits them at K = D, FlashInfer refuses."""
    from vllm_dcp_geometry.tooling.cli import main

    topology = tmp_path / "sinks.toml"
    topology.write_text(
        'name = "sinks"\n[parallel]\ntensor_parallel_size = 16\n'
        "decode_context_parallel_size = 4\n[limits]\nmax_model_len = 4096\n"
        f'[[groups]]\nname = "full"\nkind = "full_attention"\nlayers = ["{LAYER}"]\n'
        f"block_size = 16\nnum_kv_heads = 1\nhead_size = {HEAD_SIZE}\n"
        'dtype = "float32"\nattention_features = ["sinks"]\n'
    )
    assert main(["plan", "-t", str(topology), "--attention-backend", "FLASHINFER"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not keep attention sinks (s_aux)" in err
    assert "attention backend FLASHINFER, K=4, D=4" in err
    assert err.startswith(f"vllm-dcp-geometry: error: KV-cache group 0 ({LAYER})")
    assert main(["plan", "-t", str(topology)]) == 0
