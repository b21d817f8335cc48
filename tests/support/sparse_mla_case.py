# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One end-to-end sparse MLA case over D simulated ranks (``run_sparse_case``):
each rank's layers, cache and the indexer call's arguments, one forward
through the DeepSeek-V3.2 indexer call wrapper, vLLM's merge, the bound impl
and the layer's real ``MLADCPManager`` (query all-gather, replica-masked
combine), held to the same kernel on one device and the float64 reference
(``evaluate_sparse_case``). The case's inputs and the layers are in
``sparse_mla``, the selection's stand-ins in ``sparse_selection``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.mla import Shape, cpu_shims, mla_spec, replaced
from tests.support.mla_forward import recording
from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
    replica_groups_of,
)
from tests.support.sparse_mla import (
    CPU_SPARSE,
    INDEXER_LAYER,
    LATENT_LAYER,
    PerRankLayers,
    SparseCase,
    SparseShape,
    block_table,
    dsv32_config,
    forward_context_of,
    make_dcp_manager,
    make_impl,
    make_sparse_case,
    paged_cache,
    rank_process,
    single_device,
    sparse_layers,
    sparse_metadata,
)
from tests.support.sparse_selection import merge_stand_ins
from vllm_dcp_geometry.contract.collectives import REPLICA
from vllm_dcp_geometry.contract.overrides import partial_collectives
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    VALUE_DIM,
    IndexerCall,
    indexer_op_stand_in,
    selection_sets,
    shard_logits,
)


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
