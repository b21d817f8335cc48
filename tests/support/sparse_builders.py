# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's indexer and FlashMLA sparse builders on simulated ranks at
D = 4 (``tests.support.sparse_mla``): each rank's builder for a group, made
as a worker makes it (``build_on_rank``, with its replica groups), the same
class by vLLM's own constructor, the runner's common metadata of a mixed
batch, and ``plan``'s restatement of the sparse builder's DCP refusal.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.simulated_collectives import replica_groups_of
from tests.support.sparse_mla import (
    LATENT_LAYER,
    build_group_builder,
    dsv32_config,
    install_sparse_layers,
    rank_process,
)
from vllm_dcp_geometry.contract.overrides import partial_collectives
from vllm_dcp_geometry.runtime.patching import original_of

D = 4
B = 64  # fp8_ds_mla pages hold 64 tokens
# (context, new tokens): two decodes, then a chunked prefill and a fresh one.
REQUESTS = [(36, 1), (130, 1), (45, 6), (0, 9)]
NUM_DECODES = 2


def indexer_backend() -> type:
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend

    return DeepseekV32IndexerBackend


def flashmla_sparse_backend() -> type:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()


def spec_count(k: int) -> int | None:
    return None if k == D else k


def build_on_rank(
    vllm_config: Any, rank: int, backend: type, name: str, spec: Any, dcp: int = D
) -> tuple[Any, dict[str, Any]]:
    """Rank ``rank``'s builder for the group of ``name``, its layers fresh; a
    partial K within its replica gets its replica groups (what the worker
    makes at KV-cache initialisation)."""
    k = spec.dcp_shard_count(dcp)
    within = partial_collectives(vllm_config.additional_config) == "replica"
    replicas = [k] if 1 < k < dcp and within else []
    with (
        rank_process(vllm_config, dcp, rank) as group,
        replica_groups_of(group, replicas),
    ):
        layers = install_sparse_layers(vllm_config, 4, 64)
        return build_group_builder(backend, name, spec, vllm_config), layers


def builder_config(interleave: int = 1, collectives: str = "replica", **kw: Any) -> Any:
    vllm_config = dsv32_config(D, interleave, **kw)
    if collectives != "replica":
        vllm_config.additional_config = {
            "dcp_geometry": {"partial_collectives": collectives}
        }
    return vllm_config


def upstream_builder(builder: Any, spec: Any, name: str, vllm_config: Any, **kw: Any):
    """The same builder class constructed by vLLM's own constructor."""
    cls = type(builder)
    other = cls.__new__(cls)
    original_of(cls.__init__)(
        other, spec, [name], vllm_config, torch.device("cpu"), **kw
    )
    return other


def common_metadata(vllm_config: Any, rank: int) -> Any:
    """The runner's ``CommonAttentionMetadata``, its ``dcp_local_seq_lens``
    vLLM's global (D, r) ones as both runners compute them."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    seq = torch.tensor([c + n for c, n in REQUESTS], dtype=torch.int32)
    query = torch.tensor([n for _, n in REQUESTS], dtype=torch.int32)
    starts = torch.zeros(len(REQUESTS) + 1, dtype=torch.int32)
    starts[1:] = query.cumsum(0)
    tokens = int(query.sum())
    interleave = vllm_config.parallel_config.cp_kv_cache_interleave_size
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts.clone(),
        seq_lens=seq,
        num_reqs=len(REQUESTS),
        num_actual_tokens=tokens,
        max_query_len=int(query.max()),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.arange(len(REQUESTS) * 8, dtype=torch.int32).view(
            len(REQUESTS), 8
        ),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq, D, rank, interleave),
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def plan_refusal(
    k: int, collectives: str, heads_per_rank: int, cache_dtype: str = "fp8_ds_mla"
) -> str | None:
    """``plan``'s restatement of the FlashMLA sparse builder's DCP refusal for
    a latent group of ``heads_per_rank`` heads, K shards at D = 4."""
    from vllm_dcp_geometry.contract.layer_classes import DEEPSEEK_V32_ATTENTION
    from vllm_dcp_geometry.tooling.cli.plan.attention import flashmla_sparse_refusal
    from vllm_dcp_geometry.tooling.topology import topology_from_mapping

    group: dict[str, Any] = {
        "name": "latent",
        "kind": "mla",
        "block_size": B,
        "layers": [LATENT_LAYER],
        "layer_class": DEEPSEEK_V32_ATTENTION,
        "num_kv_heads": 1,
        "head_size": 576,
        "kv_lora_rank": 512,
        "query_heads": D * heads_per_rank,
        "dtype": "bfloat16",
        "cache_dtype_str": cache_dtype,
    }
    if k != D:
        group["dcp_kv_shard_count"] = k
    topology = topology_from_mapping(
        {
            "name": "envelope",
            "parallel": {
                "tensor_parallel_size": D,
                "decode_context_parallel_size": D,
                "partial_collectives": collectives,
            },
            "groups": [group],
        },
        source="test",
    )
    return flashmla_sparse_refusal(
        topology.groups[0], 0, "FLASHMLA_SPARSE", topology, k
    )
