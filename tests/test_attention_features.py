# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention features vLLM 0.33.0's FlashAttention DCP path drops:
``FlashAttentionImpl._forward_with_dcp`` passes neither ``s_aux`` (attention
sinks, gpt-oss's full layers) nor a ``mask_mod`` (R-SWA, multimodal prefix)
to its kernels. Every K > 1 (K = D included) on a layer using one is refused
at start-up, naming layer, feature and backend; K = 1 runs the single-device
path, which keeps them. Built on vLLM's real layer, impl and builder objects,
each feature set as the model sets it."""

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
    full_attention_spec,
    set_dcp_group,
    tiny_model_config,
)
from vllm_dcp_geometry.contract import DcpGeometryError

pytestmark = pytest.mark.patches("worker.utils", "worker.flash_attn")

LAYER = "model.layers.0.self_attn.attn"


def _group(
    monkeypatch: pytest.MonkeyPatch,
    spec: Any,
    *,
    sinks: bool = False,
    configure: Callable[[Any], None] | None = None,
) -> Any:
    """A FlashAttention group at D = 4 over one real ``Attention`` layer."""
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
            attn_backend=FlashAttentionBackend,
            sinks=torch.zeros(1) if sinks else None,
        )
    group = AttentionGroup(FlashAttentionBackend, [LAYER], spec, 0)
    group.create_metadata_builders(vllm_config, torch.device("cpu"))
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
        ("sinks", {"sinks": True}, "attention sinks (s_aux)"),
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
        assert f"drops {words}" in message
    # Replicated: FlashAttention's single-device path, which keeps it.
    (builder,) = _group(monkeypatch, REPLICATED, **kwargs).metadata_builders
    assert (builder.dcp_world_size, builder.dcp_rank) == (1, 0)


@pytest.mark.usefixtures("cpu_platform")
def test_a_layer_without_them_keeps_vllms_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker is not a blanket refusal: the same group without the
    feature starts, on vLLM's own K = D builder."""
    (builder,) = _group(monkeypatch, SHARDED).metadata_builders
    assert (builder.dcp_world_size, builder.dcp_rank) == (4, 1)


def test_vllms_dcp_path_still_drops_them() -> None:
    """Pinned on vLLM's source: the DCP path passes no ``s_aux`` or
    ``mask_mod``, the single-device path passes both. When vLLM fixes its
    DCP path this fails, and ``DCP_DROPPED_FEATURES`` can shrink."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from vllm_dcp_geometry.runtime.patching import original_of

    dcp_path = inspect.getsource(original_of(FlashAttentionImpl._forward_with_dcp))
    forward = inspect.getsource(original_of(FlashAttentionImpl.forward))
    for word in ("s_aux", "mask_mod"):
        assert word not in dcp_path
        assert word in forward
    # What admission reads is what the single-device path passes on.
    assert "s_aux=self.sinks" in forward
    assert "self.sinks = sinks" in inspect.getsource(FlashAttentionImpl.__init__)


def test_plan_refuses_what_start_up_refuses(tmp_path: Path, capsys) -> None:
    from vllm_dcp_geometry.tooling.cli import main

    topology = tmp_path / "sinks.toml"
    topology.write_text(
        'name = "sinks"\n[parallel]\ntensor_parallel_size = 16\n'
        "decode_context_parallel_size = 4\n[limits]\nmax_model_len = 4096\n"
        f'[[groups]]\nname = "full"\nkind = "full_attention"\nlayers = ["{LAYER}"]\n'
        f"block_size = 16\nnum_kv_heads = 1\nhead_size = {HEAD_SIZE}\n"
        'dtype = "float32"\nattention_features = ["sinks"]\n'
    )
    assert main(["plan", "-t", str(topology)]) == 2
    err = capsys.readouterr().err.strip()
    assert "drops attention sinks (s_aux)" in err
    assert err.startswith(f"vllm-dcp-geometry: error: KV-cache group 0 ({LAYER})")
    assert main(["plan", "-t", str(topology), "--attention-backend", "FLASHINFER"]) == 0
