# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.model_runner``: Model Runner V2 asks the spec.

What: wraps ``GPUModelRunner.initialize_kv_cache`` so the ``BlockTables`` it
builds receive every group's shard count K (``get_kv_cache_dcp_shard_count``)
through the ``group_context.pending_dcp_shard_counts`` side channel. Widths
already come from ``spec.max_num_blocks_per_req`` and the spec's alignment
upstream. Upstream's per-group ``dcp_sharded`` bool is right wherever K follows
the spec's flag, so there (``hand_back``) and at D = 1 it calls the original,
before reading anything.

Draft groups: upstream ``get_kv_cache_spec`` already marks the draft layers of
every ``DraftModelSpeculator`` whose ``dcp_size`` is 1 under a DCP target as
replicated, and in vLLM 0.33.0 every speculator with a draft KV cache is one
(only the DFlash family runs its draft at DCP 1), so they get K = 1 here.
It also wraps ``GPUModelRunner.get_kv_cache_spec``: the specs this worker
collects get the operator's ``--additional-config`` DCP geometry overrides
(``vllm_dcp_geometry.overrides``); an override wins over the draft default.

Why: vLLM 0.33.0 hands ``BlockTables`` one ``cp_size`` plus a per-group bool,
which cannot express a partial K; operators have no way to set a layer's
shard count.

Remove when: Model Runner V2 passes per-group shard counts to its block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.geometry import group_shard_counts
from vllm_dcp_geometry.group_context import (
    TAKEN_SHARD_COUNTS_ATTR,
    pending_dcp_shard_counts,
)
from vllm_dcp_geometry.hand_back import groups_follow_vllm_default
from vllm_dcp_geometry.overrides import make_get_kv_cache_spec

UPSTREAM_MODULE = "vllm.v1.worker.gpu.model_runner"
RUNS_IN = "worker"
WHY = (
    "Model Runner V2 builds its block tables from one DCP size plus a "
    "sharded/replicated bool per group."
)
REMOVE_WHEN = "Model Runner V2 passes per-group DCP shard counts to BlockTables"
RELATED = "vllm#56723 (per-group dcp_sharded in Model Runner V2)"

_M = UPSTREAM_MODULE
PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "GPUModelRunner.initialize_kv_cache",
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    ),
    UpstreamSymbol(_M, "GPUModelRunner.get_kv_cache_spec", "self"),
)


def _make_initialize_kv_cache(original: Callable[..., None]) -> Callable[..., None]:
    def initialize_kv_cache(
        self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        if (
            groups_follow_vllm_default(kv_cache_config.kv_cache_groups)
            or self.dcp_size == 1
        ):
            original(self, kv_cache_config, *args, **kwargs)
            return
        parallel = self.vllm_config.parallel_config
        counts = group_shard_counts(
            kv_cache_config.kv_cache_groups,
            parallel.decode_context_parallel_size,
            pcp_world_size=parallel.prefill_context_parallel_size,
            interleave_size=parallel.cp_kv_cache_interleave_size,
        )
        with pending_dcp_shard_counts(counts):
            original(self, kv_cache_config, *args, **kwargs)
        taken = getattr(self.block_tables, TAKEN_SHARD_COUNTS_ATTR, None)
        if taken != tuple(counts):
            raise DcpGeometryError(
                "Model Runner V2's block tables were not built with the "
                "per-group DCP shard counts; refusing to run with the global "
                "DCP geometry"
            )

    return initialize_kv_cache


def apply(module: ModuleType) -> None:
    runner = module.GPUModelRunner
    wrap(runner, "initialize_kv_cache", _make_initialize_kv_cache)
    wrap(runner, "get_kv_cache_spec", make_get_kv_cache_spec)
