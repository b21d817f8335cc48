# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What MLA cannot run for a group is refused at start-up, through vLLM's own
``AttentionGroup.create_metadata_builders`` and builder constructors, with a
message naming the group's layer, the backend, K and D. Also: the decode
kernels that take a cp world (FLASHINFER_MLA here; FLASH_ATTN_MLA needs a GPU
to import) get the group's ``(K, r % K)``.

About 15 s on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.mla import (
    CPU,
    LAYER,
    cpu_shims,
    make_batch,
    make_ranks,
    mla_model_config,
    mla_spec,
    model_dir,
    process_groups,
    replaced,
)
from tests.support.mla_forward import common_metadata
from tests.support.simulated_collectives import CooperativeRanks, SimulatedGroup
from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry, local_seq_len
from vllm_dcp_geometry.runtime.mla_geometry import check_context_workspace

pytestmark = pytest.mark.patches(
    "worker.mla_attention", "worker.mla_dcp_manager", "worker.utils"
)


def _refused(k: int, dcp: int = 4, rank: int = 1, **kwargs: Any) -> str:
    batch = make_batch(dcp, k, seed=3)
    spec = kwargs.pop("spec", mla_spec(k))
    with cpu_shims(), pytest.raises(DcpGeometryError) as excinfo:
        make_ranks(batch, dcp, k, kwargs.pop("interleave", 1), spec=spec, only=[rank],
                   **kwargs)  # fmt: skip
    message = str(excinfo.value)
    assert "\n" not in message
    assert LAYER in message and f"K={k}" in message and f"D={dcp}" in message
    return message


@pytest.mark.parametrize(
    ("backend", "k"),
    [
        ("FLASHMLA_SPARSE", 1),
        ("FLASHMLA_SPARSE", 2),
        ("FLASHINFER_MLA_SPARSE", 1),
        ("DEEPSEEK_V32_INDEXER", 1),
    ],
)
def test_sparse_mla_and_its_indexer_are_refused_on_generic_layers(
    backend: str, k: int
) -> None:
    """Refused before any builder is made: the sparse backends and the
    indexer are taught only for DeepSeek-V3.2's own layer classes, whose
    indexer call takes the group's K; the generic ``MLAAttention`` here (as
    on vLLM's non-CUDA DeepSeek path) is not."""
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import AttentionGroup

    backend_cls = (
        DeepseekV32IndexerBackend
        if backend == "DEEPSEEK_V32_INDEXER"
        else AttentionBackendEnum[backend].get_class()
    )
    spec = mla_spec(None, replicated=True) if k == 1 else mla_spec(k)
    group = AttentionGroup(backend_cls, [LAYER], spec, 5)
    with cpu_shims(), process_groups(SimulatedGroup(None, 8, 6)):
        config = mla_model_config(model_dir(8), 8, 1)
        with pytest.raises(DcpGeometryError) as excinfo:
            group.create_metadata_builders(config, torch.device("cpu"))
    message = str(excinfo.value)
    assert message.startswith(f"KV-cache group 5 ({LAYER})")
    assert f"attention backend {backend}, K={k}, D=8" in message
    assert "not taught" in message and "vLLM's K=8" in message


def _replicating_queries(vllm_config: Any) -> None:
    # What MLAAttention records when its q projection is DCP-group sharded
    # (its weights would then be all-gathered over a real DCP group).
    context = vllm_config.compilation_config.static_forward_context
    context[LAYER].dcp_q_replicate = True


@pytest.mark.parametrize("k", [1, 2])
def test_query_replication_is_refused_below_d(k: int) -> None:
    message = _refused(k, configure=_replicating_queries)
    assert "TRITON_MLA" in message and "dcp_q_replicate" in message


def _with_pcp(vllm_config: Any) -> None:
    # The config validator needs a real PCP group; builders read the size.
    vllm_config.parallel_config.prefill_context_parallel_size = 2


def test_replicated_mla_with_pcp_is_refused() -> None:
    message = _refused(1, configure=_with_pcp)
    assert "TRITON_MLA" in message and "PCP=2" in message


def test_flashinfer_mla_below_d_needs_interleave_one() -> None:
    message = _refused(1, backend_name="FLASHINFER_MLA", interleave=CPU.block_size)
    assert "FLASHINFER_MLA" in message
    assert f"cp_kv_cache_interleave_size={CPU.block_size}" in message


def test_a_builder_the_plugin_did_not_teach_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the exact taught builder classes run K < D; a subclass (a
    platform variant, a re-registered backend) is named and refused."""
    from vllm.v1.attention.backends.mla import triton_mla

    class PlatformMLAMetadataBuilder(triton_mla.TritonMLAMetadataBuilder):
        pass

    monkeypatch.setattr(
        triton_mla.TritonMLABackend,
        "get_builder_cls",
        staticmethod(lambda: PlatformMLAMetadataBuilder),
    )
    message = _refused(1)
    assert "TRITON_MLA (" in message and "PlatformMLAMetadataBuilder" in message


def test_partial_context_workspace_must_hold_an_aligned_step() -> None:
    geometry = GroupGeometry("KV-cache group 0 (l)", 2, 16, 3, interleave_size=64)
    check_context_workspace(geometry, 1024, 64)  # 128 rows >= lcm(64, 128)
    with pytest.raises(DcpGeometryError, match="fewer than one aligned step"):
        check_context_workspace(geometry, 512, 64)  # 64 rows < 128


@pytest.mark.parametrize(("k", "rank"), [(1, 3), (2, 3), (4, 3)])
def test_flashinfer_mla_kernel_gets_the_groups_cp_world(k: int, rank: int) -> None:
    """The real ``FlashInferMLAImpl.forward_mqa`` of a bound layer, its kernel
    replaced by a recorder: cp world ``(K, r % K)`` and the group's local
    lengths for K < D (no DCP and no LSE for K = 1), vLLM's (D, r) at K = D."""
    from vllm.v1.attention.backends.mla import flashinfer_mla

    dcp = 4
    calls: list[dict[str, Any]] = []

    def kernel(**kwargs: Any) -> Any:
        calls.append(kwargs)
        out = torch.zeros(*kwargs["query"].shape[:-1], 256)
        lse = torch.zeros(kwargs["query"].shape[:-1])
        return (out, lse) if kwargs["return_lse"] else out

    batch = make_batch(dcp, k, seed=5)
    with (
        cpu_shims(),
        replaced(flashinfer_mla, "trtllm_batch_decode_with_kv_cache_mla", kernel),
        replaced(flashinfer_mla, "_get_workspace_buffer", lambda _: torch.zeros(1)),
    ):
        (built,) = make_ranks(
            batch, dcp, k, 1, spec=mla_spec(None if k == dcp else k),
            backend_name="FLASHINFER_MLA", coop=CooperativeRanks(dcp), only=[rank],
        )  # fmt: skip
        metadata = built.builder.build(0, common_metadata(batch, dcp, rank, 1))
        # The query gathered over the group's collective world (its replica).
        heads = 2 * k
        query = torch.zeros(CPU.num_decodes, heads, 256 + 64)
        built.layer.impl.forward_mqa(query, built.kv_cache, metadata, built.layer)
    (call,) = calls
    seq_lens = [c + n for c, n in CPU.requests[: CPU.num_decodes]]
    shard = rank % k
    local = [local_seq_len(n, CPU.block_size, k, 1, shard) for n in seq_lens]
    assert call["seq_lens"].tolist() == local
    if k == 1:
        assert "enable_dcp" not in call and call["return_lse"] is False
        assert call["max_seq_len"] == max(c + n for c, n in CPU.requests)
        return
    assert call["enable_dcp"] and call["return_lse"]
    assert (call["cp_world"], call["cp_rank"]) == (k, shard)
    assert call["causal_seqlens_kv_global"].tolist() == seq_lens
    assert call["max_seq_len"] >= max(local)
    # The impl runs in the group's collective world: the replica's (K, r % K)
    # for a partial group (rule A6), vLLM's (D, r) at K = D.
    impl = built.layer.impl
    assert (impl.dcp_world_size, impl.dcp_rank) == (k, shard)
