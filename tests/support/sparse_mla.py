# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's sparse MLA (DSA) over D simulated DCP ranks, on CPU or a GPU.

What ``ranks`` shares with these simulated ranks lives in the tooling:
the float64 references, the selection helpers, the indexer op's stand-in and
the specs in ``vllm_dcp_geometry.tooling.sparse_rank_run``; the CuteDSL
selector's stand-in (``stable_topk_stand_in``, ``cutedsl_merge_stand_ins``)
and the Triton sparse impl (``triton_sparse_impl_class``, ``sparse_attention``:
vLLM's Triton sparse MLA kernel, with its output store kept in the output's
dtype by default, generated at run time into a temporary directory) in
``vllm_dcp_geometry.tooling.cpu_stand_ins``. What this module adds:

- the sparse **layers**: shells of vLLM's ``DeepseekV32Attention`` and
  ``DeepseekV32IndexerCache`` with the Triton sparse impl, bound by the
  library's own ``bind_group_layers``, and the forward context that holds
  them per rank;
- the **builders**' set-up: a real ``VllmConfig`` of a tiny DeepSeek-V3.2
  (``dsv32_config``), one rank's process groups (``rank_process``), its layers
  in the forward context (``install_sparse_layers``) and a group's builder as
  the worker makes it (``build_group_builder``);
- one case's **inputs** (``SparseShape``, ``make_sparse_case``), its paged
  cache, metadata and the single-device run.

The selection over ranks is in ``sparse_selection``, one end-to-end case in
``sparse_mla_case``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support.mla import process_groups
from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import cdiv, reference_slot_mapping
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    LATENT_DIM,
    VALUE_DIM,
    reference_attention,
    reference_topk,
    tied_scores,
    write_dsv32_config,
)
from vllm_dcp_geometry.tooling.sparse_stand_ins import (
    sparse_attention,
    triton_sparse_impl_class,
)

SCALE = LATENT_DIM**-0.5
PREFIX = "model.layers.0.self_attn"
LATENT_LAYER = f"{PREFIX}.attn"
"""Where ``DeepseekV32Attention`` (an ``MLAAttention``) registers itself."""
INDEXER_LAYER = f"{PREFIX}.indexer.k_cache"
"""Where its indexer's ``DeepseekV32IndexerCache`` registers itself."""
FP32_TOLERANCE = 1e-5


# The sparse kernel --------------------------------------------------------------

# Layers -------------------------------------------------------------------------


def layer_shell(cls: type) -> Any:
    """An instance of vLLM layer class ``cls`` without its constructor (a
    real model builds it on a GPU): what the plugin binds reads only the
    attributes the caller sets on it."""
    from torch import nn

    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


def make_impl(num_heads: int, topk_buffer: torch.Tensor) -> Any:
    """A ``TritonSparseMLAImpl`` as vLLM makes every impl: ``__new__`` takes
    the DCP world and rank from the current config and DCP group."""
    cls = triton_sparse_impl_class()
    impl = cls.__new__(cls)
    impl.num_heads = num_heads
    impl.scale = SCALE
    impl.init_topk_indices_buffer(None, topk_buffer)
    impl.index_group = None
    impl.index_group_index = 0
    return impl


def make_dcp_manager(vllm_config: Any, num_heads: int, device: str) -> Any:
    """The layer's real ``MLADCPManager`` (query all-gather and LSE combine
    over the current DCP group), fp32, natural-log LSE."""
    from vllm.v1.attention.ops.dcp import MLADCPManager

    return MLADCPManager(
        vllm_config,
        torch.device(device),
        num_heads,
        LATENT_DIM,
        VALUE_DIM,
        torch.float32,
        torch.float32,
        None,
        True,
        False,
    )


def sparse_layers(impl: Any, dcp_manager: Any) -> dict[str, Any]:
    """The forward context of one rank's DeepSeek-V3.2 sparse layer: shells of
    ``DeepseekV32Attention`` (impl, DCP manager, no prefill backend) and of
    its ``DeepseekV32IndexerCache``, under the names the model gives them."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
    from vllm.models.deepseek_v32.attention import DeepseekV32Attention

    attention = layer_shell(DeepseekV32Attention)
    attention.impl = impl
    attention.dcp_manager = dcp_manager
    attention.prefill_backend = None
    attention.layer_name = LATENT_LAYER
    cache = layer_shell(DeepseekV32IndexerCache)
    cache.prefix = INDEXER_LAYER
    cache.kv_cache = torch.empty(0)
    return {LATENT_LAYER: attention, INDEXER_LAYER: cache}


def forward_context_of(layers: Mapping[str, Any]) -> Any:
    """What ``bind_group_layers`` reads of a ``VllmConfig``: its forward
    context."""
    return types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context=layers)
    )


class PerRankLayers(Mapping[str, Any]):
    """A forward context's ``no_compile_layers`` shared by simulated ranks in
    one process: each ``CooperativeRanks`` thread sees its own rank's."""

    def __init__(self, coop: CooperativeRanks, layers: list[dict[str, Any]]):
        self.coop = coop
        self.layers = layers

    def _mine(self) -> dict[str, Any]:
        return self.layers[self.coop.local.rank]

    def __getitem__(self, name: str) -> Any:
        return self._mine()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mine())

    def __len__(self) -> int:
        return len(self._mine())


@functools.cache
def _cached_model_dir(num_heads: int, index_topk: int) -> Path:
    return write_dsv32_config(num_heads, index_topk=index_topk)


def dsv32_config(
    dcp: int,
    interleave: int,
    *,
    heads_per_rank: int = 4,
    block_size: int = 64,
    cache_dtype: str = "fp8_ds_mla",
    index_topk: int = 64,
    max_model_len: int = 1024,
) -> Any:
    """A real ``VllmConfig`` of the tiny DeepSeek-V3.2 model at TP = D."""
    config = make_vllm_config(
        dcp,
        interleave=interleave,
        tp=dcp,
        model_dir=_cached_model_dir(dcp * heads_per_rank, index_topk),
        dtype="bfloat16",
        max_model_len=max_model_len,
        cache_block_size=block_size,
        max_num_seqs=8,
    )
    config.cache_config.cache_dtype = cache_dtype
    return config


# Builders -----------------------------------------------------------------------


@contextlib.contextmanager
def rank_process(
    vllm_config: Any, dcp: int, rank: int, coop: CooperativeRanks | None = None
) -> Iterator[SimulatedGroup]:
    """What a worker process of DCP rank ``rank`` has while it builds: the DCP
    and TP groups (``SimulatedGroup``) and the current config."""
    from vllm.config import set_current_vllm_config

    group = SimulatedGroup(coop, dcp, rank)
    with process_groups(group, group), set_current_vllm_config(vllm_config):
        yield group


def install_sparse_layers(
    vllm_config: Any, num_heads: int, topk_tokens: int, device: str = "cpu"
) -> dict[str, Any]:
    """Put one rank's sparse layer (``sparse_layers``: a
    ``TritonSparseMLAImpl`` and a real ``MLADCPManager``) into the config's
    forward context, replacing any earlier rank's; call inside
    ``rank_process``."""
    buffer = torch.full((8, topk_tokens), -1, dtype=torch.int32).to(device)
    impl = make_impl(num_heads, buffer)
    layers = sparse_layers(impl, make_dcp_manager(vllm_config, num_heads, device))
    vllm_config.compilation_config.static_forward_context.update(layers)
    return layers


def build_group_builder(
    backend: type, layer_name: str, spec: Any, vllm_config: Any, device: str = "cpu"
) -> Any:
    """A group's metadata builder as the worker makes it
    (``AttentionGroup.create_metadata_builders``)."""
    from vllm.v1.worker.utils import AttentionGroup

    group = AttentionGroup(backend, [layer_name], spec, 0)
    group.create_metadata_builders(vllm_config, torch.device(device))
    return group.get_metadata_builder()


# One end-to-end case --------------------------------------------------------------


@dataclass(frozen=True)
class SparseShape:
    """Sizes of one end-to-end sparse case."""

    block_size: int = 16
    heads_per_rank: int = 4
    # A multiple of the kernel's 16 and of the filter's and conversion's
    # default BLOCK_N (128), which ``forward_mqa`` uses.
    topk: int = 128
    num_blocks: int = 96
    # (request, causal length) per query token: a long decode, a three-token
    # chunked prefill, a decode shorter than top-k (padding), one more decode.
    # Most lengths exceed top-k, so the selection selects.
    queries: tuple[tuple[int, int], ...] = (
        (0, 300),
        (1, 158),
        (1, 159),
        (1, 160),
        (2, 5),
        (3, 190),
    )
    seq_lens: tuple[int, ...] = (300, 160, 5, 190)
    device: str = "cpu"


CPU_SPARSE = SparseShape()


@dataclass
class SparseCase:
    """Random fp32 inputs of one case (indexer scores with ties)."""

    shape: SparseShape
    latents: list[torch.Tensor]  # per request [seq_len, 576]
    q: torch.Tensor  # [tokens, D*h, 576]
    scores: torch.Tensor  # [tokens, max seq_len] indexer scores (ties)

    @property
    def requests(self) -> list[int]:
        return [b for b, _ in self.shape.queries]

    @property
    def lengths(self) -> torch.Tensor:
        return torch.tensor([n for _, n in self.shape.queries], dtype=torch.int32)


def make_sparse_case(
    dcp: int, seed: int, shape: SparseShape = CPU_SPARSE
) -> SparseCase:
    gen = torch.Generator().manual_seed(seed)
    latents = [
        torch.randn(n, LATENT_DIM, generator=gen).to(shape.device)
        for n in shape.seq_lens
    ]
    q = torch.randn(
        len(shape.queries), dcp * shape.heads_per_rank, LATENT_DIM, generator=gen
    ).to(shape.device)
    scores = tied_scores(len(shape.queries), max(shape.seq_lens), seed + 1)
    return SparseCase(shape, latents, q, scores.to(shape.device))


def block_table(shape: SparseShape, shard_count: int, seed: int) -> torch.Tensor:
    """One request per row in K geometry (every rank of a DCP group gets the
    same table), one spare column."""
    gen = torch.Generator().manual_seed(seed)
    width = cdiv(max(shape.seq_lens), shape.block_size * shard_count) + 1
    blocks = torch.randperm(shape.num_blocks, generator=gen)
    table = blocks[: len(shape.seq_lens) * width].view(len(shape.seq_lens), width)
    return table.to(torch.int32).to(shape.device)


def paged_cache(
    case: SparseCase,
    table: torch.Tensor,
    shard_count: int,
    interleave: int,
    shard: int,
) -> torch.Tensor:
    """The paged latent cache ``[blocks, B, 576]`` of the rank holding
    ``shard``, written at the contract's slots (rule L1); every slot it does
    not own is NaN, so a wrong read shows."""
    shape = case.shape
    cache = torch.full(
        (shape.num_blocks * shape.block_size, LATENT_DIM),
        float("nan"),
        device=shape.device,
    )
    for request, latent in enumerate(case.latents):
        slots = torch.as_tensor(
            reference_slot_mapping(
                range(latent.shape[0]),
                table[request].cpu(),
                block_size=shape.block_size,
                shard_count=shard_count,
                interleave_size=interleave,
                shard=shard,
            )
        ).to(shape.device)
        mine = slots >= 0
        cache[slots[mine]] = latent[mine]
    return cache.view(shape.num_blocks, shape.block_size, LATENT_DIM)


def sparse_metadata(case: SparseCase, table: torch.Tensor, interleave: int) -> Any:
    """What ``SparseMLACommonImpl.forward_mqa`` reads of a sparse MLA
    metadata."""
    shape = case.shape
    return types.SimpleNamespace(
        num_decode_tokens=len(shape.queries),
        block_size=shape.block_size,
        req_id_per_token=torch.tensor(case.requests, dtype=torch.int32).to(
            shape.device
        ),
        block_table=table,
        cp_kv_cache_interleave_size=interleave,
        # vLLM 0.34: where this step's rows start in the top-k buffer (past
        # ShardQ's prefill rows; none here).
        topk_start=0,
    )


def single_device(case: SparseCase, seed: int) -> dict[str, torch.Tensor]:
    """The same kernel on one device: the whole cache (K = 1 table), all D*h
    heads, the single-device top-k; and the float64 reference."""
    shape = case.shape
    selection = reference_topk(case.scores, case.lengths, shape.topk)
    table = block_table(shape, 1, seed)
    cache = paged_cache(case, table, 1, 1, 0)
    from vllm.v1.attention.backends.mla.sparse_utils import (
        triton_convert_req_index_to_global_index,
    )

    metadata = sparse_metadata(case, table, 1)
    slots = triton_convert_req_index_to_global_index(
        metadata.req_id_per_token,
        table,
        selection,
        BLOCK_SIZE=shape.block_size,
        NUM_TOPK_TOKENS=shape.topk,
    )
    out, lse = sparse_attention(case.q, cache.view(-1, LATENT_DIM), slots, SCALE)
    ref_out, ref_lse = reference_attention(
        case.q, case.latents, case.requests, selection, SCALE
    )
    return {
        "selection": selection,
        "out": out,
        "lse": lse,
        "ref_out": ref_out,
        "ref_lse": ref_lse,
    }
