# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's top-k selection over simulated ranks: the stand-ins vLLM's
real top-k merge ``_merge_dcp_topk_global`` needs in one process
(``merge_stand_ins``: the D-rank all-gather over ``CooperativeRanks``, the
selector, its CUDA-only input check), the indexer geometry of a rank, and
``select_on_ranks``, one merged selection per rank as DeepSeek-V3.2's indexer
call makes it. The float64 references live in
``vllm_dcp_geometry.tooling.sparse_rank_run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tests.support.mla import cpu_shims, replaced
from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
)
from tests.support.sparse_mla import INDEXER_LAYER
from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    has_repeated_ids,
    reference_topk,
    selection_sets,
    shard_logits,
    tied_scores,
)
from vllm_dcp_geometry.tooling.sparse_stand_ins import (
    cutedsl_merge_stand_ins,
    selector_reads_rank_major,
)

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
