# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Start-up rejection of partial K by backends that cannot honour it, and the
hand-back to upstream at D = 1 and K = D (compared with unpatched vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.attention import (
    cpu_platform,  # noqa: F401
    decode_batch,
    full_attention_spec,
    make_attention_layer,
    replica_groups_for,
    set_dcp_group,
    tiny_model_config,
)
from tests.support.processes import run_python
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR

pytestmark = pytest.mark.patches(
    "worker.utils", "worker.flash_attn", "worker.flashinfer", "worker.mla_attention"
)

LAYER = "model.layers.3.self_attn.attn"


def _mla_spec(shard_count: int | None):
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(
        block_size=16,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.float32,
        dcp_kv_shard_count=shard_count,
    )


@pytest.mark.usefixtures("cpu_platform")
def test_untaught_mla_builder_refuses_every_k_but_d(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``MLACommonMetadataBuilder`` itself (CPU_MLA's builder) was not taught a
    group's K: a replicated or partial MLA group is refused, naming the layer,
    the builder, K and D; K = D reaches the upstream constructor."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    vllm_config = tiny_model_config(4, 1)
    set_dcp_group(monkeypatch, 4, 3)
    for shard_count in (2, 1):
        with pytest.raises(DcpGeometryError) as excinfo:
            MLACommonMetadataBuilder(
                _mla_spec(shard_count), [LAYER], vllm_config, torch.device("cpu")
            )
        message = str(excinfo.value)
        assert LAYER in message and f"K={shard_count}" in message
        assert "D=4" in message and "MLACommonMetadataBuilder" in message
    # Sharded MLA reaches the upstream constructor, which on this CPU test
    # then misses the MLA layer in the forward context.
    for sharded in (None, 4):
        with pytest.raises(KeyError, match=LAYER):
            MLACommonMetadataBuilder(
                _mla_spec(sharded), [LAYER], vllm_config, torch.device("cpu")
            )


@pytest.mark.usefixtures("cpu_platform")
def test_partial_group_needs_a_backend_that_honours_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionMetadataBuilder,
    )
    from vllm.v1.attention.backends.mla.flashmla_sparse import (
        FlashMLASparseBackend,
    )
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.worker.utils import AttentionGroup

    vllm_config = tiny_model_config(8, 1)
    set_dcp_group(monkeypatch, 8, 6)
    for backend, spec in (
        (FlashMLASparseBackend, _mla_spec(2)),
        (TritonAttentionBackend, full_attention_spec(16, 4)),
    ):
        group = AttentionGroup(backend, [LAYER], spec, 2)
        with pytest.raises(DcpGeometryError) as excinfo:
            group.create_metadata_builders(vllm_config, torch.device("cpu"))
        message = str(excinfo.value)
        assert LAYER in message and "group 2" in message
        assert f"K={spec.dcp_kv_shard_count}" in message and "D=8" in message
        assert backend.get_name() in message
    make_attention_layer(vllm_config, LAYER, FlashAttentionBackend)
    group = AttentionGroup(
        FlashAttentionBackend, [LAYER], full_attention_spec(16, 4), 0
    )
    with replica_groups_for([4]):
        group.create_metadata_builders(vllm_config, torch.device("cpu"))
    (builder,) = group.metadata_builders
    assert isinstance(builder, FlashAttentionMetadataBuilder)
    assert (builder.dcp_world_size, builder.dcp_rank) == (4, 2)


@pytest.mark.usefixtures("cpu_platform")
def test_partial_group_with_pcp_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder

    vllm_config = tiny_model_config(4, 1)
    # PCP is read from the config; the config validator needs a real PCP group.
    monkeypatch.setattr(vllm_config.parallel_config, "prefill_context_parallel_size", 2)
    set_dcp_group(monkeypatch, 4, 1)
    with pytest.raises(DcpGeometryError, match="prefill context parallelism"):
        FlashAttentionMetadataBuilder(
            full_attention_spec(16, 2), [LAYER], vllm_config, torch.device("cpu")
        )


# Hand-back: D = 1 and K = D are upstream's builders, byte for byte ------------

HAND_BACK_CASES = [(1, 0, 1), (4, 0, 1), (4, 3, 16), (8, 5, 16)]
SEQ_LENS = [1, 2, 17, 100, 1000, 4096]

_PROBE = """
import json, types, torch
from vllm.platforms import current_platform
current_platform.device_type = "cpu"
from vllm.distributed import parallel_state
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend, FlashAttentionMetadataBuilder)
from tests.support.attention import (
    decode_batch, full_attention_spec, make_attention_layer, tiny_model_config)

def probe(dcp, rank, interleave, seq_lens):
    parallel_state._DCP = (
        types.SimpleNamespace(world_size=dcp, rank_in_group=rank) if dcp > 1 else None
    )
    config = tiny_model_config(dcp, interleave)
    name = "model.layers.0.self_attn.attn"
    layer = make_attention_layer(config, name, FlashAttentionBackend)
    builder = FlashAttentionMetadataBuilder(
        full_attention_spec(32, None), [name], config, torch.device("cpu"))
    metadata = builder.build(0, decode_batch(seq_lens, 128))
    lens = metadata.dcp_context_kv_lens
    return {
        "builder": [builder.dcp_world_size, builder.dcp_rank, builder.num_heads_q,
                    builder.supports_draft_decode_metadata_update],
        "lens": None if lens is None else lens.tolist(),
        "max": metadata.max_dcp_context_kv_len,
        "seq_lens": metadata.seq_lens.tolist(),
        "impl": [layer.impl.dcp_world_size, layer.impl.dcp_rank,
                 getattr(layer.impl.dcp_combine, "__qualname__", None)],
    }
"""


@pytest.mark.usefixtures("cpu_platform")
def test_d1_and_sharded_groups_hand_back_to_upstream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    repo = str(Path(__file__).resolve().parent.parent)
    unpatched = run_python(
        _PROBE
        + f"""
print(json.dumps([probe(d, r, i, {SEQ_LENS!r})
                  for d, r, i in {HAND_BACK_CASES!r}]))
""",
        patched=False,
        env={"PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])},
    )
    namespace: dict = {}
    exec(compile(_PROBE.split("def probe", 1)[0], "probe", "exec"), namespace)
    for (dcp, rank, interleave), expected in zip(
        HAND_BACK_CASES, unpatched, strict=True
    ):
        set_dcp_group(monkeypatch, dcp, rank)
        vllm_config = tiny_model_config(dcp, interleave)
        layer = make_attention_layer(
            vllm_config, LAYER, namespace["FlashAttentionBackend"]
        )
        builder = namespace["FlashAttentionMetadataBuilder"](
            full_attention_spec(32, None), [LAYER], vllm_config, torch.device("cpu")
        )
        metadata = builder.build(0, decode_batch(SEQ_LENS, 128))
        lens = metadata.dcp_context_kv_lens
        got = {
            "builder": [
                builder.dcp_world_size,
                builder.dcp_rank,
                builder.num_heads_q,
                builder.supports_draft_decode_metadata_update,
            ],
            "lens": None if lens is None else lens.tolist(),
            "max": metadata.max_dcp_context_kv_len,
            "seq_lens": metadata.seq_lens.tolist(),
            "impl": [
                layer.impl.dcp_world_size,
                layer.impl.dcp_rank,
                getattr(layer.impl.dcp_combine, "__qualname__", None),
            ],
        }
        assert got == expected, (dcp, rank, interleave)
        # Nothing to bind at D = 1 or at vLLM's own K = D.
        assert getattr(builder, BOUND_GEOMETRY_ATTR, None) is None
        assert not hasattr(layer.impl, BOUND_GEOMETRY_ATTR)


def test_flashinfer_prefill_wrapper_is_replica_masked_or_refused() -> None:
    """A partial group's FlashInfer prefill wrapper (vLLM's own
    ``BatchDCPPrefillWrapper``, whose combine upstream keeps in
    ``_dcp_combine``) gets the replica-masked combine; one without that
    combine is refused, never run unmasked."""
    import functools

    import vllm.v1.attention.backends.flashinfer as flashinfer

    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine

    builder = object.__new__(flashinfer.FlashInferMetadataBuilder)
    geometry = GroupGeometry("g", 2, 4, 3, default_shard_count=4)
    setattr(builder, BOUND_GEOMETRY_ATTR, geometry)
    # Its host buffers need a GPU: the wrapper as upstream's __init__ leaves it.
    wrapper = object.__new__(flashinfer.BatchDCPPrefillWrapper)
    upstream_combine = functools.partial(
        flashinfer.cp_lse_ag_out_rs, is_lse_base_on_e=False
    )
    wrapper._dcp_combine = upstream_combine
    builder._prefill_wrapper = wrapper
    assert builder._get_prefill_wrapper() is wrapper
    masked = wrapper._dcp_combine
    assert isinstance(masked, ReplicaMaskedCombine)
    assert (masked.combine, masked.replica) == (upstream_combine, 1)
    assert builder._get_prefill_wrapper()._dcp_combine is masked  # idempotent

    builder._prefill_wrapper = object.__new__(flashinfer.BatchDCPPrefillWrapper)
    with pytest.raises(DcpGeometryError, match="no DCP combine"):
        builder._get_prefill_wrapper()
