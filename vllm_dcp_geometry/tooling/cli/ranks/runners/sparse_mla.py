# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The runner of DeepSeek-V3.2's sparse MLA layer with its DSA indexer: its
two groups (the latent cache, ``DeepseekV32Attention``, and the indexer
cache, ``DeepseekV32IndexerCache``: one layer, one K) run together once per
worker, and report a row each.

The layer and both groups' builders are vLLM's own (``sparse_layer``), so
the plugin's builders bind the layer and its indexer cache for the group's
K: partial groups within their K-rank replica groups (rule A6) or on the
D-wide group, replicas masked. One decode step runs through the layer's own
``_sparse_indexer_and_attn`` (``sparse_step``); what vLLM's indexer op
computes before its merge is stood in for on every device, each rank's
logits being the run's scores at the positions its shard stores
(``sparse_indexer``). On a CPU the CuteDSL selector and FlashMLA's kernels
are stood in for too (``sparse_stand_ins``): the impl is vLLM's
``SparseMLACommonImpl`` with vLLM's Triton sparse MLA kernel in its kernel
hook, reading a cache of the run's dtype that holds exactly the values an
``fp8_ds_mla`` row represents, not the 656-byte format itself. On a GPU the
backend is FLASHMLA_SPARSE with its ``fp8_ds_mla`` cache, written by vLLM's
own KV-write op.

Every rank is held to float64: its merged selection to the single-device
top-k with vLLM's tie order, its output (after ``W_UV``) and LSE to float64
sparse attention over that selection. The collectives are counted in order
(``sparse_indexer.CallTraffic``): the indexer call's (the top-k merge) and
the attention's (the query all-gather and the combine) apart, each row
against its own formula (``sparse_cases.measure_sparse``).
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    LayerRunner,
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_cases import mla_shape_refused
from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_cases import (
    INDEXER_BACKEND,
    INDEXER_SPEC_VALUES,
    SPARSE_BACKEND,
    SPARSE_LATENT_SPEC_VALUES,
    measure_sparse,
    sparse_case,
    sparse_worker_bytes,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_layer import (
    SparseSetUp,
    set_up_layer,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_step import (
    SparseInputs,
    StepOutcome,
    make_sparse_inputs,
    reference_step,
    run_step,
    step_seconds,
    write_latent_cache,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.cli.ranks.traffic import Traffic
from vllm_dcp_geometry.tooling.mla_rank_run import magnitude, max_error
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    has_repeated_ids,
    selection_sets,
)

LATENT, INDEXER = "latent", "indexer"
"""The two rows a layer reports (``sparse_role``)."""
_pair_results: dict[str, dict[str, Any]] = {}
"""The other row of a layer already run in this worker, by group name."""


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Run the DeepSeek-V3.2 layer of ``group`` (both of its groups, once per
    worker) on this rank; ``group``'s row."""
    if group.name in _pair_results:
        return _pair_results.pop(group.name)
    rows = run_layer(group, run)
    for name, row in rows.items():
        if name != group.name:
            _pair_results[name] = row
    return rows[group.name]


def _traffic_fields(traffic: Traffic) -> dict[str, Any]:
    return {
        "decode_bytes": traffic.total,
        "decode_bytes_by_op": traffic.by_op,
        "decode_bytes_by_group": traffic.by_group,
        "decode_unmodeled_collectives": traffic.unmodeled,
        "decode_collective_calls": traffic.calls,
        "decode_collective_worlds": sorted(traffic.worlds),
    }


def _stand_ins(run: RankRun, shape: Shape) -> list[str]:
    """What ran in place of vLLM's own code on this rank, in words."""
    from vllm_dcp_geometry.tooling.sparse_stand_ins import DSA_CUTEDSL

    words = [
        "vllm.model_executor.layers.sparse_attn_indexer.sparse_attn_indexer's "
        "DeepGEMM logits and top-k (each rank's logits over its shard handed in; "
        "its local top-k merged by vLLM's _merge_dcp_topk_global)"
    ]
    if run.device == "cpu":
        kernel = (
            "vLLM's Triton sparse MLA kernel with its output store in float32 "
            "(generated at run time in a temporary directory)"
            if shape.dtype == "float32"
            else "vLLM's Triton sparse MLA kernel (xpu_mla_sparse, as shipped)"
        )
        words += [
            f"{DSA_CUTEDSL}.stable_topk_from_gathered_candidates_cutedsl "
            "(torch, its key contract)",
            "FlashMLASparseImpl's kernels: SparseMLACommonImpl with " + kernel,
            f"the fp8_ds_mla cache: {shape.dtype} rows holding exactly the values "
            "its 656-byte rows represent (fp8_ds_mla not run)",
            "vllm.v1.attention.backends.mla.flashmla_sparse.get_mla_metadata "
            "(an empty FlashMLASchedMeta, as FlashMLA's own)",
            "the impl's one-layer SparseMLAIndexGroup dropped (it records a CUDA "
            "event; forward_mqa converts the top-k per layer)",
        ]
    return words


def _latent_row(
    set_up: SparseSetUp,
    outcome: StepOutcome,
    want: dict[str, Any],
    run: RankRun,
    common: dict[str, Any],
) -> dict[str, Any]:
    """The latent group's row: the attention's output after ``W_UV`` and LSE
    against the reference, and its collectives (the query all-gather and
    the combine); its step time is the caller's to fill in."""
    shape, rank, layer = set_up.group.shape, run.rank, set_up.layer
    h, v = shape.heads_per_rank, shape.v_head_dim
    world = int(layer.impl.dcp_world_size)
    # The combine's LSE covers the heads of every rank its collectives span
    # (the replica's, or all D); a local layer's is the kernel's own.
    if world > 1:
        got_lse = outcome.seen.get("combined_lse")
        first = rank // world * world
        want_lse = want["lse"][:, first * h : (first + world) * h]
    else:
        got_lse = getattr(layer.impl, "kernel_lse", None)
        want_lse = want["lse"][:, rank * h : (rank + 1) * h]
    want_out = want["out"][:, rank * h * v : (rank + 1) * h * v]
    assert outcome.split is not None
    latent_class = type(layer)
    return {
        "name": set_up.group.sparse_latent,
        "sparse_role": LATENT,
        "layer_class_run": f"{latent_class.__module__}.{latent_class.__qualname__}",
        "impl_dcp_world_size": world,
        "decode_step_s": None,
        "decode_max_abs_error": max_error(outcome.output, want_out),
        "decode_max_lse_error": None
        if got_lse is None
        else max_error(got_lse, want_lse),
        "decode_output_magnitude": magnitude(want_out),
        "decode_lse_magnitude": magnitude(want_lse),
        **common,
        **_traffic_fields(outcome.split.part("attention")),
    }


def _indexer_row(
    set_up: SparseSetUp,
    inputs: SparseInputs,
    outcome: StepOutcome,
    common: dict[str, Any],
) -> dict[str, Any]:
    """The indexer group's row: the DCP world its op merged over, the local
    lengths its builder gave the op against the contract's, and its
    collectives (the top-k merge)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    from vllm_dcp_geometry.contract import local_seq_len

    layout = set_up.layout
    cache_class = type(set_up.layer.indexer.k_cache)
    assert cache_class is DeepseekV32IndexerCache or issubclass(
        cache_class, DeepseekV32IndexerCache
    )
    # The local lengths the indexer's builder gave its op, against the
    # contract's for the rank's shard.
    local = [
        local_seq_len(
            c + n,
            layout.block_size,
            layout.shard_count,
            layout.interleave,
            layout.shard,
        )
        for c, n in inputs.base.requests
    ]
    tokens = int(outcome.output.shape[0])
    built = outcome.indexer_metadata.decode.seq_lens.flatten()[:tokens].tolist()
    assert outcome.split is not None
    indexer = outcome.split.part("indexer")
    return {
        "name": set_up.group.sparse_indexer,
        "sparse_role": INDEXER,
        "layer_class_run": f"{cache_class.__module__}.{cache_class.__qualname__}",
        "impl_dcp_world_size": max(indexer.worlds, default=1),
        "decode_step_s": outcome.split.indexer_s,
        "indexer_calls": [
            {"dcp_rank": c.dcp_rank, "dcp_world_size": c.dcp_world_size}
            for c in outcome.calls
        ],
        "indexer_local_lengths": built,
        "contract_local_lengths": local,
        "local_lengths_ok": [int(n) for n in built] == local,
        **common,
        **_traffic_fields(indexer),
    }


def run_layer(group: PlannedGroup, run: RankRun) -> dict[str, dict[str, Any]]:
    """Build and run the DeepSeek-V3.2 layer of ``group`` on this rank; its
    two rows (the latent group's and the indexer group's), by group name."""
    assert group.sparse_latent is not None and group.sparse_indexer is not None
    set_up = set_up_layer(group, run)
    inputs = make_sparse_inputs(set_up, run)
    cache = write_latent_cache(inputs, set_up, run)
    outcome, counted_s = run_step(inputs, set_up, run, cache)
    want = reference_step(inputs, set_up)
    common = {
        "decode_tokens": int(outcome.output.shape[0]),
        "topk": set_up.topk,
        "selection_ok": selection_sets(outcome.selection)
        == selection_sets(want["selection"]),
        "selection_repeats": has_repeated_ids(outcome.selection),
        "stand_ins": _stand_ins(run, group.shape),
    }
    # The timed steps overwrite what the first one left (the kernel's LSE):
    # its row is read before they run.
    latent = _latent_row(set_up, outcome, want, run, common)
    latent["decode_step_s"] = step_seconds(inputs, set_up, run, cache, counted_s)
    return {
        group.sparse_latent: latent,
        group.sparse_indexer: _indexer_row(set_up, inputs, outcome, common),
    }


LATENT_RUNNER = LayerRunner(
    "sparse_mla",
    SPARSE_LATENT_SPEC_VALUES,
    plan=sparse_case,
    refuse_shape=mla_shape_refused,
    worker_bytes=sparse_worker_bytes,
    run_group=run_group,
    measure=measure_sparse,
    cpu_backend=SPARSE_BACKEND,
    cuda_backends=(),
)
"""The latent cache's runner: the layer, run once for both groups."""

INDEXER_RUNNER = LayerRunner(
    "sparse_indexer",
    INDEXER_SPEC_VALUES,
    plan=sparse_case,
    refuse_shape=mla_shape_refused,
    worker_bytes=sparse_worker_bytes,
    run_group=run_group,
    measure=measure_sparse,
    cpu_backend=INDEXER_BACKEND,
    cuda_backends=(),
    fixed_backend=True,
)
"""The indexer cache's runner: the same layer run, its row."""
