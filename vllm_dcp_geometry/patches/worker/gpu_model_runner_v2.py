# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.model_runner``: Model Runner V2 asks the spec.

What: wraps ``GPUModelRunner.initialize_kv_cache`` so the ``BlockTables`` it
builds receive every group's shard count K (``get_kv_cache_dcp_shard_count``)
through the ``group_context.pending_dcp_shard_counts`` side channel. Widths
already come from ``spec.max_num_blocks_per_req`` and the spec's alignment
upstream. The wrapper reads nothing before upstream starts (upstream's own
first steps and exceptions come first): the channel carries a function that
``BlockTables.__init__`` calls, and that answers None - upstream's own tables
- where they are right: at D = 1, and wherever every K follows the spec's
flag (``hand_back``) and no group is a replicated sliding window. Upstream
turns sliding-window null masking off for every group once D > 1, but a
replicated group's columns still cover contiguous tokens, so it must keep
its masking (vLLM's comment: the blocks below the window may have been freed
and reused, and a NaN there can reach the attention output).

Draft groups: upstream ``get_kv_cache_spec`` already marks the draft layers of
every ``DraftModelSpeculator`` whose ``dcp_size`` is 1 under a DCP target as
replicated, and in vLLM 0.33.0 every speculator with a draft KV cache is one
(only the DFlash family runs its draft at DCP 1), so they get K = 1 here.
It also wraps ``GPUModelRunner.get_kv_cache_spec``: the specs this worker
collects get the operator's ``--additional-config`` DCP geometry overrides
(``vllm_dcp_geometry.contract.overrides``); an override wins over the draft default.

Why: vLLM 0.33.0 hands ``BlockTables`` one ``cp_size`` plus a per-group bool,
which cannot express a partial K; operators have no way to set a layer's
shard count.

Remove when: Model Runner V2 passes per-group shard counts to its block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.geometry import group_shard_counts
from vllm_dcp_geometry.runtime.group_context import (
    TAKEN_SHARD_COUNTS_ATTR,
    pending_dcp_shard_counts,
)
from vllm_dcp_geometry.runtime.hand_back import groups_follow_vllm_default
from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.spec_overrides import make_get_kv_cache_spec


def replicated_sliding_window(groups: Any) -> bool:
    """Whether a group is a replicated sliding window, whose null masking
    upstream turns off under DCP (read as upstream reads it: the window from
    the group's first layer spec, ``dcp_sharded`` from the group's spec)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec, UniformTypeKVCacheSpecs

    for group in groups:
        spec = group.kv_cache_spec
        layer = spec.first_spec if isinstance(spec, UniformTypeKVCacheSpecs) else spec
        if (
            isinstance(layer, SlidingWindowSpec)
            and layer.num_retained_tokens > 0
            and not spec.dcp_sharded
        ):
            return True
    return False


def upstream_tables_fit(groups: Any) -> bool:
    """Whether upstream's ``BlockTables`` are right at every D, from the specs
    alone: every K follows its spec's flag and no replicated group loses its
    sliding-window masking."""
    return groups_follow_vllm_default(groups) and not replicated_sliding_window(groups)


class _ShardCounts:
    """Every group's K for the ``BlockTables`` upstream builds, worked out
    once, when first asked (None: upstream's own tables are right)."""

    def __init__(self, runner: Any, kv_cache_config: Any) -> None:
        self._runner = runner
        self._kv_cache_config = kv_cache_config
        self._known = False
        self._counts: tuple[int, ...] | None = None

    def __call__(self) -> tuple[int, ...] | None:
        if not self._known:
            self._counts = self._work_out()
            self._known = True
        return self._counts

    def _work_out(self) -> tuple[int, ...] | None:
        groups = self._kv_cache_config.kv_cache_groups
        if upstream_tables_fit(groups) or self._runner.dcp_size == 1:
            return None
        parallel = self._runner.vllm_config.parallel_config
        return tuple(
            group_shard_counts(
                groups,
                parallel.decode_context_parallel_size,
                pcp_world_size=parallel.prefill_context_parallel_size,
                interleave_size=parallel.cp_kv_cache_interleave_size,
            )
        )


def _make_initialize_kv_cache(original: Callable[..., None]) -> Callable[..., None]:
    def initialize_kv_cache(
        self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        counts = _ShardCounts(self, kv_cache_config)
        with pending_dcp_shard_counts(counts):
            original(self, kv_cache_config, *args, **kwargs)
        wanted = counts()
        if wanted is None:
            return
        taken = getattr(self.block_tables, TAKEN_SHARD_COUNTS_ATTR, None)
        if taken != wanted:
            raise DcpGeometryError(
                "Model Runner V2's block tables were not built with the "
                "per-group DCP shard counts: vllm_dcp_geometry.patches.worker."
                "gpu_block_table (this patch's partner, remove_with) should have "
                "taken them from pending_dcp_shard_counts; refusing to run with "
                "the global DCP geometry"
            )

    return initialize_kv_cache


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu.model_runner",
    replaces=(
        Wrap(
            "GPUModelRunner.initialize_kv_cache",
            {
                "0.33.0": "self, kv_cache_config, is_profiling=, "
                "kv_cache_allocation_context=",
                # 0.34.0's extensible KV cache: the wrapper forwards it unread.
                "0.34.0": "self, kv_cache_config, is_profiling=, "
                "kv_cache_allocation_context=, extensible=",
            },
            _make_initialize_kv_cache,
        ),
        Wrap("GPUModelRunner.get_kv_cache_spec", "self", make_get_kv_cache_spec),
    ),
    remove_with=("worker.gpu_block_table",),
    why=(
        "Model Runner V2 builds its block tables from one DCP size plus a "
        "sharded/replicated bool per group."
    ),
    remove_when="Model Runner V2 passes per-group DCP shard counts to BlockTables",
    related="vllm#56723 (per-group dcp_sharded in Model Runner V2)",
)
