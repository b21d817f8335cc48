# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's sparse MLA (DSA) over D simulated DCP ranks, on CPU or a GPU.

What it offers:

- the top-k **selection**: a float64 single-device reference
  (``reference_topk``, ties to the smaller id), each rank's indexer logits
  over the positions its shard stores (``shard_logits``, from the contract's
  rule L1), a torch stand-in for vLLM's CuteDSL stable top-k selector with
  its exact key contract (``stable_topk_stand_in``), the few stand-ins vLLM's
  real top-k merge ``_merge_dcp_topk_global`` needs on CPU
  (``merge_stand_ins``: the D-rank all-gather over ``CooperativeRanks``, the
  selector, its CUDA-only input check) and ``select_on_ranks``, one merged
  selection per rank as DeepSeek-V3.2's indexer call makes it;
- the sparse **attention**: vLLM's Triton sparse MLA kernel with its output
  store kept in the output's dtype (``sparse_attention``: generated at run
  time from the installed source into a temporary directory, only that store
  changed), a float64 reference (``reference_attention``), shells of
  vLLM's ``DeepseekV32Attention`` and ``DeepseekV32IndexerCache`` with a
  ``SparseMLACommonImpl`` whose kernel hook is that Triton kernel
  (``TritonSparseMLAImpl``: the top-k filter and conversion are upstream's
  ``forward_mqa``), bound by the library's own ``bind_group_layers``, and
  ``run_sparse_case``: one (D, K, I) forward over the ranks through the
  DeepSeek-V3.2 indexer call wrapper, vLLM's merge, the bound impl and the
  layer's real ``MLADCPManager`` (query all-gather, replica-masked combine),
  against the same kernel on one device and the float64 reference;
- the **builders**' set-up: a DeepSeek-V3.2 config directory (no weights)
  and a real ``VllmConfig`` of it (``dsv32_model_dir``, ``dsv32_config``),
  the indexer and ``fp8_ds_mla`` latent specs with K (``indexer_spec``,
  ``latent_spec``), one rank's process groups (``rank_process``), its layers
  in the forward context (``install_sparse_layers``) and a group's builder as
  the worker makes it (``build_group_builder``).

Importable without the plugin, so the unpatched baseline runs the very same
code in a fresh process.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import tempfile
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.mla import (
    CooperativeRanks,
    Shape,
    SimulatedGroup,
    cpu_shims,
    mla_spec,
    process_groups,
    recording,
    replaced,
    replica_groups_of,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import (
    GroupGeometry,
    cdiv,
    local_seq_len,
    reference_slot_mapping,
)
from vllm_dcp_geometry.contract.collectives import REPLICA
from vllm_dcp_geometry.contract.overrides import partial_collectives
from vllm_dcp_geometry.tooling.mla_rank_run import write_deepseek_config

LATENT_DIM = 576
"""``kv_lora_rank + rope``: the one head size of the sparse kernels."""
VALUE_DIM = 512
ROPE_DIM = 64
SCALE = LATENT_DIM**-0.5
PREFIX = "model.layers.0.self_attn"
LATENT_LAYER = f"{PREFIX}.attn"
"""Where ``DeepseekV32Attention`` (an ``MLAAttention``) registers itself."""
INDEXER_LAYER = f"{PREFIX}.indexer.k_cache"
"""Where its indexer's ``DeepseekV32IndexerCache`` registers itself."""
FP32_TOLERANCE = 1e-5


# Geometry -----------------------------------------------------------------------


def shard_positions(
    length: int, block_size: int, shard_count: int, interleave: int, shard: int
) -> torch.Tensor:
    """The positions ``< length`` that ``shard`` stores, in its local order
    (rule L1 over an identity block table: the slot is the local index)."""
    columns = max(cdiv(length, block_size * shard_count), 1)
    slots = reference_slot_mapping(
        range(length),
        range(columns),
        block_size=block_size,
        shard_count=shard_count,
        interleave_size=interleave,
        shard=shard,
    )
    slots_t = torch.as_tensor(slots)
    owned = torch.nonzero(slots_t >= 0).flatten()
    order = torch.argsort(slots_t[owned])
    assert torch.equal(slots_t[owned][order], torch.arange(owned.numel()))
    return owned[order]


# Selection ----------------------------------------------------------------------


def reference_topk(
    scores: torch.Tensor, lengths: torch.Tensor, topk: int
) -> torch.Tensor:
    """Float64 top-k of each row's first ``lengths[t]`` scores, ties to the
    smaller index, ``-1`` padding: ``[rows, topk]`` int32 (on ``scores``'s
    device)."""
    rows, width = scores.shape
    values = scores.detach().double().cpu()
    lengths_cpu = lengths.detach().cpu().long()
    columns = torch.arange(width)
    values = torch.where(columns[None, :] < lengths_cpu[:, None], values, float("-inf"))
    # A stable sort keeps equal scores in index order: ties to the smaller id.
    order = torch.sort(-values, dim=1, stable=True).indices
    out = torch.full((rows, topk), -1, dtype=torch.int64)
    take = min(topk, width)
    out[:, :take] = order[:, :take]
    valid = torch.arange(topk)[None, :] < lengths_cpu.clamp(max=topk)[:, None]
    out = torch.where(valid, out, -1)
    return out.to(torch.int32).to(scores.device).contiguous()


def selection_sets(selection: torch.Tensor) -> list[list[int]]:
    """Each row's selected ids, sorted, padding dropped (the real selector's
    output order is unspecified)."""
    return [sorted(x for x in row if x >= 0) for row in selection.tolist()]


def has_repeated_ids(selection: torch.Tensor) -> bool:
    """Whether any row selects the same id twice."""
    for row in selection.tolist():
        ids = [x for x in row if x >= 0]
        if len(ids) != len(set(ids)):
            return True
    return False


def tied_scores(rows: int, width: int, seed: int) -> torch.Tensor:
    """Coarse random scores (many ties). ``+ 0.0`` turns -0.0 into +0.0: the
    selector's key orders -0.0 below +0.0, a float comparison does not."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width, generator=gen) * 2).round() / 2 + 0.0


def stable_keys(gathered: torch.Tensor) -> torch.Tensor:
    """vLLM's CuteDSL selector key of every ``(score, id)`` candidate, minus
    2**63 so that it orders as int64: ``(bits ^ (sign ? 0xFFFFFFFF :
    0x80000000)) << 32 | ~uint32(id)``, and 0 for ``id < 0``."""
    score = gathered[..., 0].contiguous()
    ids = gathered[..., 1].to(torch.int64)  # exact: ids < 2**24 travel in fp32
    bits = score.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = (bits & 0x80000000) != 0
    score_key = torch.where(negative, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    id_key = (~ids) & 0xFFFFFFFF
    key = ((score_key - 2**31) << 32) | id_key
    return torch.where(ids < 0, torch.full_like(key, -(2**63)), key)


def stable_topk_stand_in(
    gathered: torch.Tensor, topk: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Stand-in for ``stable_topk_from_gathered_candidates_cutedsl`` (CUDA
    only) with its contract: per row the ``topk`` largest keys
    (``stable_keys``), written as ``int32(~low32(key))`` (key 0 gives -1).
    The real kernel writes them in an unspecified order; this one in key
    order."""
    assert gathered.dim() == 3 and gathered.shape[2] == 2
    assert gathered.dtype == torch.float32
    top = stable_keys(gathered).topk(topk, dim=1, sorted=True).values
    low = (top + 2**63) & 0xFFFFFFFF
    ids = (~low) & 0xFFFFFFFF
    ids = torch.where(ids >= 2**31, ids - 2**32, ids).to(torch.int32)
    if out is None:
        return ids
    out.copy_(ids)
    return out


def check_merge_inputs(
    logits: torch.Tensor, topk_indices: torch.Tensor, k: int
) -> None:
    """The device-independent half of vLLM's ``_assert_cutedsl_dcp_merge_supported``
    (CUDA, CuteDSL and ``k`` in {512, 1024, 2048} aside)."""
    if logits.dtype != torch.float32 or topk_indices.dtype != torch.int32:
        raise RuntimeError("the DCP top-k merge takes fp32 logits, int32 indices")


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

    from vllm_dcp_geometry.runtime.mla_geometry import make_group_getter

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
                make_group_getter(dcp_group) if plugin_getter else dcp_group,
            )
        )
        if stand_in_selector:
            from vllm.model_executor.kernels.attention.dsa import (
                dcp_indexer_cutedsl as cutedsl,
            )

            def selector(gathered: Any, topk: int, out: Any = None) -> Any:
                calls.selector_calls.append(coop.local.rank)
                calls.gathered_widths.append(int(gathered.shape[1]))
                return stable_topk_stand_in(gathered, topk, out=out)

            stack.enter_context(
                replaced(
                    cutedsl, "stable_topk_from_gathered_candidates_cutedsl", selector
                )
            )
            stack.enter_context(
                replaced(sai, "_assert_cutedsl_dcp_merge_supported", check_merge_inputs)
            )
        yield calls


def shard_logits(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    *,
    block_size: int,
    shard_count: int,
    interleave: int,
    shard: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One shard's indexer logits ``[rows, local positions]`` in local order
    (``-inf`` past each row's local length) and the local lengths: what the
    indexer scores on a rank holding ``shard`` of a K-shard indexer cache."""
    width = scores.shape[1]
    positions = shard_positions(width, block_size, shard_count, interleave, shard)
    logits = scores[:, positions.to(scores.device)].float().clone()
    local = torch.tensor(
        [
            local_seq_len(int(n), block_size, shard_count, interleave, shard)
            for n in lengths.tolist()
        ],
        dtype=torch.int32,
    )
    beyond = torch.arange(positions.numel())[None, :] >= local[:, None]
    logits[beyond.to(logits.device)] = float("-inf")
    return logits.contiguous(), local.to(scores.device)


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
) -> torch.Tensor:
    """One rank's selection as DeepSeek-V3.2's indexer call makes it: the
    local top-k of its shard's logits, then vLLM's (patched, where the plugin
    is registered) ``_merge_dcp_topk_global`` in the cache's shard world
    ``(K, r % K)`` with ``use_indexer_geometry`` active for a partial K (what
    ``patches.worker.deepseek_v32_attention`` passes and sets). K = D is
    upstream's call (``(D, r)``, nothing set); K = 1 passes world 1.
    ``row_start_pad`` > 0: the prefill layout, logits behind that many
    leading columns of other rows and ``row_starts`` pointing past them."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.runtime.group_context import use_indexer_geometry

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
    active = (
        use_indexer_geometry(geometry)
        if geometry.is_partial
        else contextlib.nullcontext()
    )
    with active:
        sai._merge_dcp_topk_global(
            logits, selection, topk, shard, world, interleave, row_starts
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
) -> tuple[list[torch.Tensor], MergeCalls]:
    """Every rank's ``rank_selection``, the ranks in cooperative threads (the
    merge's all-gather sees its peers), and what the merge stand-ins saw."""
    coop = CooperativeRanks(dcp)
    groups = [SimulatedGroup(coop, dcp, r) for r in range(dcp)]
    shims = cpu_shims() if scores.device.type == "cpu" else contextlib.nullcontext()
    with (
        shims,
        merge_stand_ins(coop, groups, stand_in_selector=stand_in_selector) as calls,
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

STORE = "acc.to(tl.bfloat16)"
"""The output store of vLLM's Triton sparse MLA kernel (rounds to bf16)."""
FP32_STORE = "acc.to(out_ptr.dtype.element_ty)"


@functools.cache
def fp32_store_kernel_module() -> types.ModuleType:
    """vLLM's ``xpu_mla_sparse`` ops module regenerated from the installed
    source with one change, the output store keeping the output buffer's
    dtype (``STORE`` -> ``FP32_STORE``). Written to a temporary directory
    (Triton reads kernel sources from a file), never into the repository."""
    import vllm.v1.attention.ops.xpu_mla_sparse as upstream

    source = inspect.getsource(upstream)
    assert source.count(STORE) == 1, "vLLM's sparse MLA kernel store changed"
    path = Path(tempfile.mkdtemp(prefix="vllm_dcp_geometry_sparse_")) / (
        "fp32_store_mla_sparse.py"
    )
    path.write_text(source.replace(STORE, FP32_STORE))
    spec = importlib.util.spec_from_file_location("fp32_store_mla_sparse", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sparse_attention(
    q: torch.Tensor,
    kv_rows: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    *,
    fp32_store: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``triton_bf16_mla_sparse_interface`` (``q [T, H, 576]``,
    ``kv_rows [N, 576]``, ``indices [T, topk]``; ``-1`` and ``>= N`` read
    nothing): output ``[T, H, 512]`` and natural-log LSE ``[T, H]``. With
    ``fp32_store`` the output is stored in ``q``'s dtype
    (``fp32_store_kernel_module``), else as shipped (bf16-rounded)."""
    if fp32_store:
        interface = fp32_store_kernel_module().triton_bf16_mla_sparse_interface
    else:
        import vllm.v1.attention.ops.xpu_mla_sparse as upstream

        interface = upstream.triton_bf16_mla_sparse_interface
    out, _, lse = interface(
        q.contiguous(),
        kv_rows.reshape(-1, 1, kv_rows.shape[-1]),
        indices.reshape(indices.shape[0], 1, -1).contiguous(),
        scale,
    )
    return out, lse


def reference_attention(
    q: torch.Tensor,
    latents: list[torch.Tensor],
    requests: list[int],
    selection: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 sparse MLA: token ``t`` of request ``requests[t]`` attends to
    the latent rows its ``selection`` names (request positions, ``-1``
    padding); output ``[T, H, 512]`` and LSE ``[T, H]``."""
    outs, lses = [], []
    for t, request in enumerate(requests):
        ids = selection[t][selection[t] >= 0].long().cpu()
        kv = latents[request][ids].double().cpu()
        logits = torch.einsum("hd,kd->hk", q[t].double().cpu(), kv) * scale
        outs.append(logits.softmax(-1) @ kv[:, :VALUE_DIM])
        lses.append(logits.logsumexp(-1))
    return torch.stack(outs), torch.stack(lses)


# Layers -------------------------------------------------------------------------


def layer_shell(cls: type) -> Any:
    """An instance of vLLM layer class ``cls`` without its constructor (a
    real model builds it on a GPU): what the plugin binds reads only the
    attributes the caller sets on it."""
    from torch import nn

    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    return layer


def triton_sparse_impl_class() -> type:
    """``TritonSparseMLAImpl``: vLLM's ``SparseMLACommonImpl`` with its kernel
    hook ``_forward_mqa_kernel`` running the Triton sparse kernel
    (``sparse_attention``). Everything before the hook - the top-k filter to
    the rank's shard (``triton_filter_and_convert_dcp_index`` with the impl's
    own ``dcp_world_size`` / ``dcp_rank``) or, at world 1, the plain
    conversion - is upstream's ``forward_mqa``."""
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl,
    )
    from vllm.v1.attention.backends.mla.sparse_utils import flat_kv_row_view

    class TritonSparseMLAImpl(SparseMLACommonImpl):  # type: ignore[type-arg]
        can_return_lse_for_decode = True
        # Convert per layer at world 1 (no index group here).
        group_conversion_decode_only = True
        kernel_lse: torch.Tensor | None = None

        def _forward_mqa_kernel(
            self,
            q: Any,
            kv_cache: torch.Tensor,
            topk_indices: torch.Tensor,
            valid_counts: torch.Tensor,
            *,
            layer: Any,
            block_size: int,
            is_decode: bool,
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            if isinstance(q, tuple):
                q = torch.cat(q, dim=-1)
            rows, _ = flat_kv_row_view(kv_cache, block_size)
            out, lse = sparse_attention(q, rows, topk_indices, self.softmax_scale)
            self.kernel_lse = lse
            return out, lse if self.need_to_return_lse_for_decode else None

    return TritonSparseMLAImpl


@functools.cache
def _impl_class() -> type:
    return triton_sparse_impl_class()


def make_impl(num_heads: int, topk_buffer: torch.Tensor) -> Any:
    """A ``TritonSparseMLAImpl`` as vLLM makes every impl: ``__new__`` takes
    the DCP world and rank from the current config and DCP group."""
    cls = _impl_class()
    impl = cls.__new__(cls)
    impl.num_heads = num_heads
    impl.softmax_scale = SCALE
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


def dsv32_model_dir(
    num_heads: int, index_topk: int = 64, max_position_embeddings: int = 4096
) -> Path:
    """A DeepSeek-V3.2 config directory (no weights): one layer, DeepSeek's
    latent sizes (512 + 64), ``num_heads`` query heads."""
    return write_deepseek_config(
        num_heads,
        kv_lora_rank=VALUE_DIM,
        nope_dim=128,
        rope_dim=ROPE_DIM,
        v_head_dim=128,
        dtype="bfloat16",
        max_position_embeddings=max_position_embeddings,
        q_lora_rank=64,
        architecture="DeepseekV32ForCausalLM",
        model_type="deepseek_v32",
        extra={"index_topk": index_topk, "index_n_heads": 4, "index_head_dim": 128},
        prefix="vllm_dcp_geometry_dsv32_",
    )


@functools.cache
def _cached_model_dir(num_heads: int, index_topk: int) -> Path:
    return dsv32_model_dir(num_heads, index_topk)


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


def indexer_spec(block_size: int, shard_count: int | None) -> Any:
    """The indexer cache's spec as ``DeepseekV32IndexerCache.get_kv_cache_spec``
    builds it (128 fp8 values and one fp32 scale per token), with K where
    given (the plugin's spec field)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    extra = {} if shard_count is None else {"dcp_kv_shard_count": shard_count}
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=128 + 128 // 128 * 4,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
        **extra,
    )


def latent_spec(block_size: int, shard_count: int | None) -> Any:
    """The sparse latent cache's spec in vLLM's ``fp8_ds_mla`` format (656
    bytes per token), with K where given."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    extra = {} if shard_count is None else {"dcp_kv_shard_count": shard_count}
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=LATENT_DIM,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        state_content_bytes=656,
        **extra,
    )


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


@dataclass
class IndexerCall:
    """What the stand-in of vLLM's indexer op was called with."""

    dcp_rank: int
    dcp_world_size: int
    interleave: int
    indexer_geometry: Any


def indexer_op_stand_in(records: dict[int, IndexerCall], coop: CooperativeRanks):
    """Stand-in for vLLM's ``sparse_attn_indexer`` op (DeepGEMM logits and
    top-k are CUDA-only), bound to its real signature: ``hidden_states``
    carries this rank's indexer logits over its local positions (``-inf``
    past the local length); it writes their local top-k into
    ``topk_indices_buffer`` and merges it with vLLM's
    ``_merge_dcp_topk_global`` and the DCP rank and world it was handed, as
    the op does."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai

    from vllm_dcp_geometry.runtime.group_context import current_indexer_geometry

    signature = inspect.signature(sai.sparse_attn_indexer)

    def sparse_attn_indexer(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        logits = a["hidden_states"]
        topk = a["topk_tokens"]
        buffer = a["topk_indices_buffer"]
        records[coop.local.rank] = IndexerCall(
            a["dcp_rank"],
            a["dcp_world_size"],
            a["cp_kv_cache_interleave_size"],
            current_indexer_geometry(),
        )
        local = torch.isfinite(logits).sum(dim=1)
        rows = buffer[: logits.shape[0], :topk]
        rows.copy_(reference_topk(logits, local, topk))
        sai._merge_dcp_topk_global(
            logits,
            rows,
            topk,
            a["dcp_rank"],
            a["dcp_world_size"],
            a["cp_kv_cache_interleave_size"],
        )
        return buffer

    return sparse_attn_indexer


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
    own code where it runs here: the DeepSeek-V3.2 indexer call wrapper
    (``patches.worker.deepseek_v32_attention``'s factory around
    ``indexer_op_stand_in``) -> vLLM's ``_merge_dcp_topk_global`` (real pack
    kernel, D-rank all-gather; CPU: the selector stood in) -> the layer's
    steps of ``DeepseekV32Attention._sparse_indexer_and_attn``: query
    all-gather where the impl's world is > 1, the bound impl's
    ``forward_mqa`` (shard-world top-k filter, the kernel over this rank's
    own cache), the layer's replica-masked combine.

    ``collectives``: a partial K within its replica (rule A6, the default:
    merge, query gather and combine over the K ranks) or on the D-wide group
    (``"dcp"``: duplicate replicas masked). ``mask_merge=False`` runs the
    merge unwrapped (vLLM's own), ``mask_combine=False`` the combine
    unmasked, ``merge_in_replica=False`` the merge's ``get_dcp_group``
    D-wide whatever the call holds: the negative controls.
    Returns per-rank results and the single-device run.
    """
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_dcp_geometry.patches.worker import deepseek_v32_attention
    from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine
    from vllm_dcp_geometry.runtime.patching import original_of

    if vllm_config is None:
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
    case = make_sparse_case(dcp, seed, shape)
    single = single_device(case, seed + 1)
    table = block_table(shape, shard_count, seed + 2)
    coop = CooperativeRanks(dcp)
    groups = [SimulatedGroup(coop, dcp, r) for r in range(dcp)]
    calls: dict[int, IndexerCall] = {}
    indexer_call = deepseek_v32_attention._make_sparse_attn_indexer(
        indexer_op_stand_in(calls, coop)
    )
    h = shape.heads_per_rank

    with contextlib.ExitStack() as stack:
        if shape.device == "cpu":
            stack.enter_context(cpu_shims())
        ranks = make_sparse_ranks(
            case, dcp, shard_count, interleave, coop, vllm_config, table
        )
        if not mask_combine:
            for rank in ranks:
                manager = rank.layers[LATENT_LAYER].dcp_manager
                if isinstance(manager.combine, ReplicaMaskedCombine):
                    manager.combine = manager.combine.combine
        if not mask_merge:
            stack.enter_context(
                replaced(
                    sai,
                    "_merge_dcp_topk_global",
                    original_of(sai._merge_dcp_topk_global),
                )
            )
        calls_seen = stack.enter_context(
            merge_stand_ins(
                coop,
                groups,
                stand_in_selector=shape.device == "cpu",
                plugin_getter=merge_in_replica,
            )
        )
        records = stack.enter_context(recording(coop))
        context = ForwardContext(
            no_compile_layers=PerRankLayers(coop, [rank.layers for rank in ranks]),  # type: ignore[arg-type]
            attn_metadata={},
            slot_mapping={},
        )
        stack.enter_context(override_forward_context(context))
        metadata = sparse_metadata(case, table, interleave)

        def run(r: int) -> RankOutput:
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
            # DeepseekV32Attention._sparse_indexer_and_attn, its DCP steps:
            layer = rank.layers[LATENT_LAYER]
            impl, manager = layer.impl, layer.dcp_manager
            impl.record_logical_topk_ready()
            impl.prepare_for_batch(metadata)
            q = case.q[:, r * h : (r + 1) * h].contiguous()
            if impl.dcp_world_size > 1:
                q = manager.query_gather(q)
            out, lse = impl.forward_mqa(q, rank.cache, metadata, layer)
            if impl.dcp_world_size > 1:
                assert lse is not None
                out = manager.combine(out, lse, seq_lens=None, query_start_loc=None)
            return RankOutput(selection, out, impl.kernel_lse, impl.dcp_world_size)

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
