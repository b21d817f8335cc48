# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Simulated DCP ranks of one MLA cache group, and one forward over them.

See ``tests.mla_harness`` for what is real and what is stood in for. A run
returns, per rank, the layer's output and the LSEs that left its attention
(the combined decode LSE, or the local one where attention runs locally, and
the prefill-context LSE handed to ``merge_attn_states``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.mla_harness import (
    CPU,
    LAYER,
    Batch,
    CooperativeRanks,
    Shape,
    SimulatedGroup,
    model_dir,
    replaced,
)
from tests.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import reference_slot_mapping

# Ranks ----------------------------------------------------------------------------


@contextmanager
def process_groups(
    dcp: SimulatedGroup, tp: SimulatedGroup | None = None
) -> Iterator[None]:
    """vLLM's DCP and TP groups as the given stand-ins (none exist here)."""
    from vllm.distributed import parallel_state

    saved = parallel_state._DCP, parallel_state._TP
    parallel_state._DCP, parallel_state._TP = dcp, tp  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel_state._DCP, parallel_state._TP = saved


def mla_model_config(
    path: Path,
    dcp: int,
    interleave: int,
    shape: Shape = CPU,
    comm_backend: str = "ag_rs",
) -> Any:
    """The shared test config for the MLA model at ``path`` in ``shape``."""
    return make_vllm_config(
        dcp,
        interleave=interleave,
        tp=dcp,
        model_dir=path,
        dtype=shape.dtype,
        max_model_len=shape.max_model_len,
        cache_block_size=shape.block_size,
        max_num_seqs=shape.max_num_seqs,
        dcp_comm_backend=comm_backend,
    )


def mla_spec(
    shard_count: int | None, replicated: bool = False, shape: Shape = CPU
) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # Unpatched vLLM (the baselines) has no dcp_kv_shard_count field.
    extra: dict[str, Any] = {}
    if shard_count is not None:
        extra["dcp_kv_shard_count"] = shard_count
    if replicated:
        extra["dcp_sharded"] = False
    return MLAAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=1,
        head_size=shape.head_size,
        dtype=shape.dtype,
        **extra,
    )


@dataclass
class Rank:
    rank: int
    interleave: int
    layer: Any
    builder: Any
    kv_cache: torch.Tensor


def make_layer(vllm_config: Any, batch: Batch, rank: int, backend: Any) -> Any:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
        CPUSDPAMLAPrefillBackend,
    )

    shape = batch.shape
    prefill = CPUSDPAMLAPrefillBackend if shape.device == "cpu" else None
    with set_current_vllm_config(vllm_config), torch.device(shape.device):
        kv_b_proj = ColumnParallelLinear(
            shape.kv_lora_rank,
            batch.kv_b_weight.shape[0],
            bias=False,
            params_dtype=shape.dtype,
            prefix=LAYER.replace("attn", "kv_b_proj"),
        )
        layer = MLAAttention(
            num_heads=shape.heads_per_rank,
            scale=shape.scale,
            qk_nope_head_dim=shape.nope_dim,
            qk_rope_head_dim=shape.rope_dim,
            v_head_dim=shape.v_head_dim,
            q_lora_rank=None,
            kv_lora_rank=shape.kv_lora_rank,
            kv_b_proj=kv_b_proj,
            prefix=LAYER,
            attn_backend=backend,
            prefill_backend_cls=prefill,
        )
    rows = shape.heads_per_rank * (shape.nope_dim + shape.v_head_dim)
    kv_b_proj.weight.data.copy_(batch.kv_b_weight[rank * rows : (rank + 1) * rows])
    layer.process_weights_after_loading(shape.dtype)
    return layer


def write_cache(batch: Batch, shard_count: int, interleave: int, shard: int) -> Any:
    """The rank's paged cache holding its shard of every request, written by
    vLLM's KV-write op (stood in for on CPU) at the contract's slots - what
    the plugin's block tables give the runner."""
    import vllm._custom_ops as ops

    shape = batch.shape
    cache = torch.zeros(
        shape.num_blocks,
        shape.block_size,
        shape.head_size,
        dtype=shape.dtype,
        device=shape.device,
    )
    for i, (context, new) in enumerate(shape.requests):
        slots = reference_slot_mapping(
            range(context + new),
            batch.rows[i],
            block_size=shape.block_size,
            shard_count=shard_count,
            interleave_size=interleave,
            shard=shard,
        )
        ops.concat_and_cache_mla(
            batch.kv_c[i].to(shape.device, shape.dtype),
            batch.k_pe[i].to(shape.device, shape.dtype),
            cache,
            torch.as_tensor(slots, device=shape.device),
            "auto",
            torch.ones((), device=shape.device),
        )
    return cache


def make_ranks(
    batch: Batch,
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    spec: Any,
    backend_name: str = "TRITON_MLA",
    coop: CooperativeRanks | None = None,
    only: Sequence[int] | None = None,
    configure: Callable[[Any], None] | None = None,
    comm_backend: str = "ag_rs",
) -> list[Rank]:
    """One rank per DCP rank (or the ranks in ``only``), built as a worker
    builds them (the builder through ``AttentionGroup.create_metadata_builders``).
    ``configure`` may adjust each rank's ``VllmConfig`` before the builder."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import AttentionGroup

    shape = batch.shape
    backend = AttentionBackendEnum[backend_name].get_class()
    path = model_dir(dcp, shape)
    ranks = []
    for r in range(dcp) if only is None else only:
        group = SimulatedGroup(coop, dcp, r)
        with process_groups(group, SimulatedGroup(coop, dcp, r)):
            vllm_config = mla_model_config(path, dcp, interleave, shape, comm_backend)
            layer = make_layer(vllm_config, batch, r, backend)
            if configure is not None:
                configure(vllm_config)
            attn_group = AttentionGroup(backend, [LAYER], spec, 0)
            attn_group.create_metadata_builders(vllm_config, torch.device(shape.device))
        cache = write_cache(batch, shard_count, interleave, r % shard_count)
        builder = attn_group.get_metadata_builder()
        ranks.append(Rank(r, interleave, layer, builder, cache))
    return ranks


def common_metadata(batch: Batch, dcp: int, rank: int, interleave: int) -> Any:
    """The runner's ``CommonAttentionMetadata``: its ``dcp_local_seq_lens`` are
    vLLM's global (D, r) ones, as both model runners compute them."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    shape = batch.shape
    seq_cpu = torch.tensor([c + n for c, n in shape.requests], dtype=torch.int32)
    query = torch.tensor([n for _, n in shape.requests], dtype=torch.int32)
    starts_cpu = torch.zeros(len(shape.requests) + 1, dtype=torch.int32)
    starts_cpu[1:] = query.cumsum(0)
    seq, starts = seq_cpu.to(shape.device), starts_cpu.to(shape.device)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts_cpu,
        seq_lens=seq,
        num_reqs=len(shape.requests),
        num_actual_tokens=batch.num_tokens,
        max_query_len=int(query.max()),
        max_seq_len=int(seq_cpu.max()),
        block_table_tensor=torch.stack(batch.rows).to(shape.device, torch.int32),
        slot_mapping=torch.zeros(
            batch.num_tokens, dtype=torch.int64, device=seq.device
        ),
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq, dcp, rank, interleave),
        seq_lens_cpu_upper_bound=seq_cpu,
    )


# One forward --------------------------------------------------------------------


@dataclass
class RankResult:
    out: torch.Tensor  # [tokens, h * V], this rank's heads
    decode_lse: torch.Tensor | None  # [decode tokens, heads]: combined, or local
    decode_lse_is_combined: bool  # over all D*h heads (else this rank's h)
    context_lse: torch.Tensor | None  # [h, prefill tokens] merged with new tokens
    metadata: Any


@contextmanager
def recording(
    coop: CooperativeRanks, merge_owner: Any = None
) -> Iterator[dict[int, dict[str, Any]]]:
    """Record, per rank, the LSEs its attention hands on: the DCP combine's
    and the prefill context's (``merge_attn_states`` as ``merge_owner``, by
    default vLLM's MLA module, imported it)."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.ops import dcp

    records: dict[int, dict[str, Any]] = {}
    owner = mla_attention if merge_owner is None else merge_owner

    def mine() -> dict[str, Any]:
        return records.setdefault(coop.local.rank, {})

    correct, merge = dcp.correct_attn_out, owner.merge_attn_states

    def correct_attn_out(*args: Any, **kwargs: Any) -> Any:
        out, lse = correct(*args, **kwargs)
        mine()["combined_lse"] = lse.clone()
        return out, lse

    def merge_attn_states(*args: Any, **kwargs: Any) -> Any:
        mine()["context_lse"] = kwargs["prefix_lse"].clone()
        return merge(*args, **kwargs)

    with (
        replaced(dcp, "correct_attn_out", correct_attn_out),
        replaced(owner, "merge_attn_states", merge_attn_states),
    ):
        yield records


def run_rank(
    batch: Batch,
    layer: Any,
    rank: int,
    records: dict[int, dict[str, Any]],
    call: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """One rank's attention: ``call(output)`` with the layer's impl recording
    the LSE its decode kernel returns; the rank's output."""
    shape = batch.shape
    local_forward_mqa = layer.impl.forward_mqa

    def forward_mqa(*args: Any) -> Any:
        out, lse = local_forward_mqa(*args)
        records.setdefault(rank, {})["local_lse"] = lse
        return out, lse

    output = torch.zeros(
        batch.num_tokens,
        shape.heads_per_rank * shape.v_head_dim,
        dtype=shape.dtype,
        device=shape.device,
    )
    with replaced(layer.impl, "forward_mqa", forward_mqa):
        call(output)
    return output


def forward_inputs(
    batch: Batch, ranks: list[Rank]
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """The new tokens' latent and rope key (all requests), and every rank's
    metadata from its builder's real ``build``."""
    contexts = [c for c, _ in batch.shape.requests]
    new_kv_c = torch.cat([kv[c:] for kv, c in zip(batch.kv_c, contexts, strict=True)])
    new_k_pe = torch.cat([pe[c:] for pe, c in zip(batch.k_pe, contexts, strict=True)])
    dcp = len(ranks)
    metadata = [
        rank.builder.build(0, common_metadata(batch, dcp, rank.rank, rank.interleave))
        for rank in ranks
    ]
    return new_kv_c, new_k_pe, metadata


def rank_results(
    outputs: Sequence[torch.Tensor],
    layers: Sequence[Any],
    records: dict[int, dict[str, Any]],
    metadata: Sequence[Any],
) -> list[RankResult]:
    """Every rank's output with the LSEs its attention handed on: the
    combined decode LSE where the impl runs DCP (the all-to-all combine keeps
    it to itself: None then), else the local one."""
    results = []
    for r, output in enumerate(outputs):
        seen = records.get(r, {})
        combined = layers[r].impl.dcp_world_size > 1
        results.append(
            RankResult(
                out=output,
                decode_lse=seen.get("combined_lse" if combined else "local_lse"),
                decode_lse_is_combined=combined,
                context_lse=seen.get("context_lse"),
                metadata=metadata[r],
            )
        )
    return results


def forward(
    batch: Batch, ranks: list[Rank], coop: CooperativeRanks
) -> list[RankResult]:
    """Every rank's ``MLAAttention.forward_impl`` over the batch."""
    shape = batch.shape
    new_kv_c, new_k_pe, metadata = forward_inputs(batch, ranks)

    def on_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(shape.device, shape.dtype).contiguous()

    def run(r: int) -> torch.Tensor:
        h = shape.heads_per_rank
        layer = ranks[r].layer

        def call(output: torch.Tensor) -> None:
            layer.forward_impl(
                on_device(batch.q[:, r * h : (r + 1) * h]),
                on_device(new_kv_c),
                on_device(new_k_pe)[:, None, :],
                ranks[r].kv_cache,
                metadata[r],
                output=output,
            )

        return run_rank(batch, layer, r, records, call)

    with recording(coop) as records:
        outputs = coop.run(run)
    return rank_results(outputs, [rank.layer for rank in ranks], records, metadata)
