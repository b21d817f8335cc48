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

- the top-k **selection** over simulated ranks: the stand-ins vLLM's real
  top-k merge ``_merge_dcp_topk_global`` needs in one process
  (``merge_stand_ins``: the D-rank all-gather over ``CooperativeRanks``, the
  selector, its CUDA-only input check) and ``select_on_ranks``, one merged
  selection per rank as DeepSeek-V3.2's indexer call makes it;
- the sparse **attention**: shells of vLLM's ``DeepseekV32Attention`` and
  ``DeepseekV32IndexerCache`` with the Triton sparse impl, bound by the
  library's own ``bind_group_layers``, and ``run_sparse_case``: one (D, K, I)
  forward over the ranks through the DeepSeek-V3.2 indexer call wrapper,
  vLLM's merge, the bound impl and the layer's real ``MLADCPManager`` (query
  all-gather, replica-masked combine), against the same kernel on one device
  and the float64 reference;
- the **builders**' set-up: a real ``VllmConfig`` of a tiny DeepSeek-V3.2
  (``dsv32_config``), one rank's process groups (``rank_process``), its layers
  in the forward context (``install_sparse_layers``) and a group's builder as
  the worker makes it (``build_group_builder``).

Importable without the plugin, so the unpatched baseline runs the very same
code in a fresh process.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.mla import Shape, cpu_shims, mla_spec, process_groups, replaced
from tests.support.mla_forward import recording
from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
    replica_groups_of,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.contract.collectives import REPLICA
from vllm_dcp_geometry.contract.overrides import partial_collectives
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    LATENT_DIM,
    VALUE_DIM,
    IndexerCall,
    has_repeated_ids,
    indexer_op_stand_in,
    reference_attention,
    reference_topk,
    selection_sets,
    shard_logits,
    tied_scores,
    write_dsv32_config,
)
from vllm_dcp_geometry.tooling.sparse_stand_ins import (
    cutedsl_merge_stand_ins,
    selector_reads_rank_major,
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


# Selection ----------------------------------------------------------------------


@dataclass
class MergeCalls:
    """What the merge stand-ins saw: one entry per selector call."""

    selector_calls: list[int] = field(default_factory=list)
    gathered_widths: list[int] = field(default_factory=list)
    """Candidates per row each selector call was handed (the all-gather's)."""


@contextlib.contextmanager
def merge_stand_ins(
    coop: CooperativeRanks,
    groups: list[SimulatedGroup],
    *,
    stand_in_selector: bool = True,
    plugin_getter: bool = True,
) -> Iterator[MergeCalls]:
    """What vLLM's real ``_merge_dcp_topk_global`` needs here: the DCP group
    (each rank's ``SimulatedGroup``, for the D-rank all-gather), and on CPU
    the CuteDSL selector (``stable_topk_stand_in``) and an input check
    without the CUDA half. The pack kernel is vLLM's own. ``plugin_getter``
    False leaves the module's ``get_dcp_group`` the D-wide group's (as
    without the patch's wrapper): a negative control."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.patches.worker.sparse_attn_indexer import (
        make_indexer_group_getter,
    )

    calls = MergeCalls()
    with contextlib.ExitStack() as stack:
        # The plugin's getter (the module's, as patched) around each rank's
        # simulated DCP group: the replica where the indexer call holds one.
        def dcp_group() -> SimulatedGroup:
            return groups[coop.local.rank]

        stack.enter_context(
            replaced(
                sai,
                "get_dcp_group",
                make_indexer_group_getter(dcp_group) if plugin_getter else dcp_group,
            )
        )
        if stand_in_selector:

            def selected(gathered: Any) -> None:
                calls.selector_calls.append(coop.local.rank)
                calls.gathered_widths.append(int(gathered.shape[1]))

            stack.enter_context(cutedsl_merge_stand_ins(selected))
        yield calls


def indexer_geometry(dcp: int, shard_count: int, rank: int, interleave: int) -> Any:
    """The indexer cache's geometry on ``rank`` (vLLM's own K is D)."""
    return GroupGeometry(
        INDEXER_LAYER,
        shard_count,
        dcp,
        rank,
        interleave_size=interleave,
        default_shard_count=dcp,
    )


def rank_selection(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    dcp: int,
    shard_count: int,
    interleave: int,
    block_size: int,
    topk: int,
    rank: int,
    row_start_pad: int = 0,
    replica: Any = None,
    direct_max_rows: int = 0,
) -> torch.Tensor:
    """One rank's selection as DeepSeek-V3.2's indexer call makes it: the
    local top-k of its shard's logits, then vLLM's (patched, where the plugin
    is registered) ``_merge_dcp_topk_global`` in the cache's shard world
    ``(K, r % K)`` with ``use_indexer_geometry`` active for a partial K (what
    ``patches.worker.deepseek_v32_attention`` passes and sets), and
    ``replica`` (a partial cache bound in its replica, rule A6) held. K = D
    is upstream's call (``(D, r)``, nothing set); K = 1 passes world 1.
    ``row_start_pad`` > 0: the prefill layout, logits behind that many
    leading columns of other rows and ``row_starts`` pointing past them.
    Where the merge takes vLLM 0.34's keywords they are passed as the op
    passes them (float32 logits, ``num_positions`` the row width,
    ``direct_max_rows`` as given: > 0 asks for the symmetric-memory path)."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.runtime.group_context import (
        use_indexer_geometry,
        use_replica_group,
    )

    geometry = indexer_geometry(dcp, shard_count, rank, interleave)
    world, shard = geometry.shard_world
    logits, local = shard_logits(
        scores,
        lengths,
        block_size=block_size,
        shard_count=shard_count,
        interleave=interleave,
        shard=shard,
    )
    selection = reference_topk(logits, local, topk)
    row_starts = None
    if row_start_pad:
        wide = torch.full(
            (logits.shape[0], logits.shape[1] + row_start_pad),
            float("-inf"),
            device=logits.device,
        )
        wide[:, row_start_pad:] = logits
        logits = wide
        row_starts = torch.full(
            (logits.shape[0],), row_start_pad, dtype=torch.int32, device=logits.device
        )
    keywords: dict[str, Any] = {}
    if selector_reads_rank_major():
        keywords = {
            "logits_dtype": torch.float32,
            "num_positions": scores.shape[1],
            "direct_max_rows": direct_max_rows,
        }
    with contextlib.ExitStack() as active:
        if geometry.is_partial:
            active.enter_context(use_indexer_geometry(geometry))
            if replica is not None:
                active.enter_context(use_replica_group(replica))
        sai._merge_dcp_topk_global(
            logits, selection, topk, shard, world, interleave, row_starts, **keywords
        )
    return selection


def select_on_ranks(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    dcp: int,
    shard_count: int,
    interleave: int,
    block_size: int,
    topk: int,
    row_start_pad: int = 0,
    stand_in_selector: bool = True,
    within_replica: bool = False,
    direct_max_rows: int = 0,
    plugin_getter: bool = True,
) -> tuple[list[torch.Tensor], MergeCalls]:
    """Every rank's ``rank_selection``, the ranks in cooperative threads (the
    merge's all-gather sees its peers), and what the merge stand-ins saw.
    ``within_replica``: a partial cache's merge holds its replica (rule A6),
    else it runs on the D-wide group (``partial_collectives: "dcp"``).
    ``plugin_getter``: as ``merge_stand_ins``."""
    from tests.support.simulated_collectives import SimulatedReplica

    coop = CooperativeRanks(dcp)
    groups = [SimulatedGroup(coop, dcp, r) for r in range(dcp)]
    partial = 1 < shard_count < dcp

    def replica_of(rank: int) -> Any:
        if not (within_replica and partial):
            return None
        return SimulatedReplica(coop, dcp, rank, shard_count)

    shims = cpu_shims() if scores.device.type == "cpu" else contextlib.nullcontext()
    with (
        shims,
        merge_stand_ins(
            coop,
            groups,
            stand_in_selector=stand_in_selector,
            plugin_getter=plugin_getter,
        ) as calls,
    ):
        selections = coop.run(
            lambda r: rank_selection(
                scores,
                lengths,
                dcp=dcp,
                shard_count=shard_count,
                interleave=interleave,
                block_size=block_size,
                topk=topk,
                rank=r,
                row_start_pad=row_start_pad,
                replica=replica_of(r),
                direct_max_rows=direct_max_rows,
            )
        )
    return selections, calls


def selection_lengths(
    dcp: int, interleave: int, block_size: int, width: int
) -> list[int]:
    """Row lengths worth checking: shorter than one interleave round over the
    D ranks (``D * I``), at and around block and round boundaries, one, and
    the whole width."""
    round_ = dcp * interleave
    wanted = {
        1,
        2,
        max(round_ - 1, 1),
        round_,
        round_ + 1,
        block_size,
        2 * block_size,
        block_size * dcp,
        width - 1,
        width,
    }
    return sorted(n for n in wanted if 1 <= n <= width)


def replica_selection_report(dcp: int, shard_count: int, interleave: int) -> dict:
    """One small selection over a K-shard indexer cache, summarised: whether a
    rank's merged selection selects an id twice, and which ranks equal the
    single-device top-k. Runs the same code patched and unpatched."""
    block_size, topk, width = 16, 16, 97
    lengths = torch.tensor(selection_lengths(dcp, interleave, block_size, width))
    scores = tied_scores(lengths.numel(), width, seed=11)
    selections, _ = select_on_ranks(
        scores,
        lengths,
        dcp=dcp,
        shard_count=shard_count,
        interleave=interleave,
        block_size=block_size,
        topk=topk,
    )
    want = selection_sets(reference_topk(scores, lengths, topk))
    return {
        "repeats": [has_repeated_ids(s) for s in selections],
        "matches": [selection_sets(s) == want for s in selections],
    }


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


@dataclass
class SparseRank:
    rank: int
    layers: dict[str, Any]
    topk_buffer: torch.Tensor
    cache: torch.Tensor


def indexer_call_arguments(
    logits: torch.Tensor,
    topk_buffer: torch.Tensor,
    topk: int,
    *,
    dcp: int,
    rank: int,
    interleave: int,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments ``DeepseekV32Attention._sparse_indexer_and_attn`` hands
    ``sparse_attn_indexer``, in its order and keywords, the DCP ones as the
    layer computes them (the DCP manager's rank, the config's D)."""
    args = (
        logits,  # q_c: the stand-in reads its logits here
        INDEXER_LAYER,  # self.indexer.k_cache.prefix
        torch.empty(0),  # kv_cache
        torch.empty(0),  # index_q_fp8
        None,
        None,  # index_k
        torch.empty(0),  # index_weights_out
        128,  # quant_block_size
        None,  # scale_fmt
        topk,
        128,  # head_dim
        4096,  # max_model_len
        8192,  # max_total_seq_len
        topk_buffer,
    )
    kwargs = {
        "skip_k_cache_insert": True,
        "use_pcp": False,
        "pcp_shard_decode_requests": False,
        "dense_mha_metadata_layer_name": "",
        "dcp_rank": rank,
        "dcp_world_size": dcp,
        "cp_kv_cache_interleave_size": interleave,
        "skip_topk_buffer_clear": True,
        "topk_backend": "auto",
    }
    return args, kwargs


def make_sparse_ranks(
    case: SparseCase,
    dcp: int,
    shard_count: int,
    interleave: int,
    coop: CooperativeRanks,
    vllm_config: Any,
    table: torch.Tensor,
) -> list[SparseRank]:
    """Every rank's layers, bound as the worker's builders bind them for the
    group's K (``layer_binding.bind_group_layers`` with the geometry resolved
    from a spec carrying K, in the rank's replica group where the config
    keeps partial collectives within it, as ``builder_init`` does; nothing
    for vLLM's own K = D), and its paged cache."""
    from vllm_dcp_geometry.runtime.group_context import use_replica_group
    from vllm_dcp_geometry.runtime.group_geometry import resolve_group_geometry
    from vllm_dcp_geometry.runtime.layer_binding import bind_group_layers
    from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group

    shape = case.shape
    spec = mla_spec(
        None if shard_count == dcp else shard_count,
        shape=Shape(block_size=shape.block_size, kv_lora_rank=VALUE_DIM),
    )
    within = partial_collectives(vllm_config.additional_config) == REPLICA
    replicas = [shard_count] if 1 < shard_count < dcp and within else []
    ranks = []
    for r in range(dcp):
        with (
            rank_process(vllm_config, dcp, r, coop) as group,
            replica_groups_of(group, replicas),
        ):
            topk_buffer = torch.full(
                (len(shape.queries), shape.topk), -1, dtype=torch.int32
            ).to(shape.device)
            impl = make_impl(shape.heads_per_rank, topk_buffer)
            manager = make_dcp_manager(vllm_config, shape.heads_per_rank, shape.device)
            layers = sparse_layers(impl, manager)
            context = forward_context_of(layers)
            for name in (LATENT_LAYER, INDEXER_LAYER):
                geometry = resolve_group_geometry(spec, [name], vllm_config)
                assert geometry is not None and geometry.shard_count == shard_count
                replica = (
                    operator_replica_group(geometry, vllm_config)
                    if geometry.is_partial
                    else None
                )
                with contextlib.ExitStack() as scope:
                    if replica is not None:
                        scope.enter_context(use_replica_group(replica))
                    bind_group_layers(context, [name], geometry, mla=True)
        cache = paged_cache(case, table, shard_count, interleave, r % shard_count)
        ranks.append(SparseRank(r, layers, topk_buffer, cache))
    return ranks


@dataclass
class RankOutput:
    selection: torch.Tensor
    out: torch.Tensor  # [tokens, h, 512]: this rank's heads
    kernel_lse: torch.Tensor  # the kernel's own LSE (before any combine)
    impl_world: int  # impl.dcp_world_size the layer saw


def _case_config(dcp: int, interleave: int, shape: SparseShape, collectives: str):
    """The case's DeepSeek-V3.2 config: a bf16 cache, the partial K's
    collectives as the operator's override gives them."""
    vllm_config = dsv32_config(
        dcp,
        interleave,
        heads_per_rank=shape.heads_per_rank,
        block_size=shape.block_size,
        cache_dtype="auto",
    )
    if collectives != REPLICA:
        vllm_config.additional_config = {
            "dcp_geometry": {"partial_collectives": collectives}
        }
    return vllm_config


def _unmask_combines(ranks: list[SparseRank]) -> None:
    """Every rank's replica-masked combine replaced by the combine it masks
    (a negative control)."""
    from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine

    for rank in ranks:
        manager = rank.layers[LATENT_LAYER].dcp_manager
        if isinstance(manager.combine, ReplicaMaskedCombine):
            manager.combine = manager.combine.combine


def _rank_forward(
    r: int,
    *,
    ranks: list[SparseRank],
    case: SparseCase,
    geometry: tuple[int, int, int],
    metadata: Any,
    indexer_call: Any,
) -> RankOutput:
    """Rank ``r``'s step: its shard's logits through the indexer call (and
    the merge), then ``DeepseekV32Attention._sparse_indexer_and_attn``'s DCP
    steps: the query all-gather where the impl's world is > 1, the bound
    impl's ``forward_mqa`` (shard-world top-k filter, the kernel over this
    rank's own cache), the layer's replica-masked combine."""
    dcp, shard_count, interleave = geometry
    shape = case.shape
    rank = ranks[r]
    logits, _ = shard_logits(
        case.scores,
        case.lengths,
        block_size=shape.block_size,
        shard_count=shard_count,
        interleave=interleave,
        shard=r % shard_count,
    )
    layer = rank.layers[LATENT_LAYER]
    # The layer hands its indexer its DCP manager's rank.
    manager_rank = layer.dcp_manager.group.rank_in_group
    args, kwargs = indexer_call_arguments(
        logits, rank.topk_buffer, shape.topk, dcp=dcp, rank=manager_rank,
        interleave=interleave,
    )  # fmt: skip
    indexer_call(*args, **kwargs)
    selection = rank.topk_buffer.clone()
    impl, manager = layer.impl, layer.dcp_manager
    impl.record_logical_topk_ready()
    impl.prepare_for_batch(metadata)
    h = shape.heads_per_rank
    q = case.q[:, r * h : (r + 1) * h].contiguous()
    if impl.dcp_world_size > 1:
        q = manager.query_gather(q)
    out, lse = impl.forward_mqa(q, rank.cache, metadata, layer)
    if impl.dcp_world_size > 1:
        assert lse is not None
        out = manager.combine(out, lse, seq_lens=None, query_start_loc=None)
    return RankOutput(selection, out, impl.kernel_lse, impl.dcp_world_size)


def _upstream_merge() -> Any:
    """vLLM's own ``_merge_dcp_topk_global`` in place of the plugin's (a
    negative control)."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.runtime.patching import original_of

    original = original_of(sai._merge_dcp_topk_global)
    return replaced(sai, "_merge_dcp_topk_global", original)


def _per_rank_forward_context(coop: CooperativeRanks, ranks: list[SparseRank]) -> Any:
    """vLLM's forward context, its layers each rank's own."""
    from vllm.forward_context import ForwardContext, override_forward_context

    layers = PerRankLayers(coop, [rank.layers for rank in ranks])
    context = ForwardContext(
        no_compile_layers=layers,  # type: ignore[arg-type]
        attn_metadata={},
        slot_mapping={},
    )
    return override_forward_context(context)


def run_sparse_case(
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    seed: int = 0,
    shape: SparseShape = CPU_SPARSE,
    mask_merge: bool = True,
    mask_combine: bool = True,
    vllm_config: Any = None,
    collectives: str = REPLICA,
    merge_in_replica: bool = True,
) -> dict[str, Any]:
    """One forward of D ranks over a K-shard sparse cache, every step vLLM's
    own code where it runs here (``_rank_forward``): the DeepSeek-V3.2
    indexer call wrapper around ``indexer_op_stand_in``, vLLM's
    ``_merge_dcp_topk_global`` (real pack kernel, D-rank all-gather; CPU:
    the selector stood in), then the layer's DCP steps.

    ``collectives``: a partial K within its replica (rule A6, the default:
    merge, query gather and combine over the K ranks) or on the D-wide group
    (``"dcp"``: duplicate replicas masked). ``mask_merge=False`` runs the
    merge unwrapped (vLLM's own), ``mask_combine=False`` the combine
    unmasked, ``merge_in_replica=False`` the merge's ``get_dcp_group``
    D-wide whatever the call holds: the negative controls.
    Returns per-rank results and the single-device run.
    """
    from vllm_dcp_geometry.patches.worker import deepseek_v32_attention

    if vllm_config is None:
        vllm_config = _case_config(dcp, interleave, shape, collectives)
    case = make_sparse_case(dcp, seed, shape)
    single = single_device(case, seed + 1)
    table = block_table(shape, shard_count, seed + 2)
    coop = CooperativeRanks(dcp)
    groups = [SimulatedGroup(coop, dcp, r) for r in range(dcp)]
    calls: dict[int, IndexerCall] = {}
    indexer_call = deepseek_v32_attention._make_sparse_attn_indexer(
        indexer_op_stand_in(lambda call: calls.__setitem__(coop.local.rank, call))
    )

    with contextlib.ExitStack() as stack:
        if shape.device == "cpu":
            stack.enter_context(cpu_shims())
        ranks = make_sparse_ranks(
            case, dcp, shard_count, interleave, coop, vllm_config, table
        )
        if not mask_combine:
            _unmask_combines(ranks)
        if not mask_merge:
            stack.enter_context(_upstream_merge())
        calls_seen = stack.enter_context(
            merge_stand_ins(
                coop,
                groups,
                stand_in_selector=shape.device == "cpu",
                plugin_getter=merge_in_replica,
            )
        )
        records = stack.enter_context(recording(coop))
        stack.enter_context(_per_rank_forward_context(coop, ranks))
        metadata = sparse_metadata(case, table, interleave)

        run = functools.partial(
            _rank_forward,
            ranks=ranks,
            case=case,
            geometry=(dcp, shard_count, interleave),
            metadata=metadata,
            indexer_call=indexer_call,
        )
        outputs = coop.run(run)
    return {
        "ranks": outputs,
        "single": single,
        "indexer_calls": calls,
        "selector_calls": list(calls_seen.selector_calls),
        "gathered_widths": list(calls_seen.gathered_widths),
        "combined_lse": {r: rec.get("combined_lse") for r, rec in records.items()},
    }


def evaluate_sparse_case(report: dict[str, Any], shard_count: int) -> dict[str, Any]:
    """Worst errors over the ranks: output against the single-device kernel
    and against float64, LSE (combined over all heads, or the kernel's own
    where the rank runs local) against float64; and whether every rank's
    selection is the single-device top-k."""
    single = report["single"]
    want = selection_sets(single["selection"])
    worst = {"out_single": 0.0, "out_f64": 0.0, "lse_f64": 0.0, "single_f64": 0.0}
    worst["single_f64"] = (
        (single["out"].double().cpu() - single["ref_out"]).abs().max().item()
    )
    selections_ok = []
    for r, result in enumerate(report["ranks"]):
        h = result.out.shape[1]
        heads = slice(r * h, (r + 1) * h)
        selections_ok.append(selection_sets(result.selection) == want)
        out = result.out.double().cpu()
        worst["out_single"] = max(
            worst["out_single"],
            (out - single["out"][:, heads].double().cpu()).abs().max().item(),
        )
        worst["out_f64"] = max(
            worst["out_f64"], (out - single["ref_out"][:, heads]).abs().max().item()
        )
        combined = report["combined_lse"].get(r)
        if result.impl_world > 1:
            # Combined over the heads of the collective's W ranks: the
            # replica's (DCP ranks q*K .. q*K + K - 1) or all D.
            assert combined is not None
            world = result.impl_world
            first = r // world * world
            lse = combined.double().cpu()
            ref = single["ref_lse"][:, first * h : (first + world) * h]
        else:
            lse, ref = result.kernel_lse.double().cpu(), single["ref_lse"][:, heads]
        worst["lse_f64"] = max(worst["lse_f64"], (lse - ref).abs().max().item())
    worst["selections_ok"] = selections_ok
    worst["replica_lse_offset"] = math.log(
        len(report["ranks"]) / shard_count
    )  # what an unmasked combine adds
    return worst
