# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.model_runner``: Model Runner V2 asks the spec.

What: wraps ``GPUModelRunner.initialize_kv_cache`` so the ``BlockTables`` it
builds receive every group's shard count K (``get_kv_cache_dcp_shard_count``;
see ``patches.worker.gpu_block_table``). Widths already come from
``spec.max_num_blocks_per_req`` and the spec's alignment upstream. At D = 1 it
calls the original.

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
from vllm_dcp_geometry.contract import DcpGeometryError, check_interleave
from vllm_dcp_geometry.overrides import make_get_kv_cache_spec
from vllm_dcp_geometry.patches.worker.block_table import (
    check_prefill_context_parallel,
)
from vllm_dcp_geometry.patches.worker.gpu_block_table import (
    SHARD_COUNTS_ATTR,
    pending_dcp_shard_counts,
)
from vllm_dcp_geometry.patches.worker.gpu_model_runner import group_owner

UPSTREAM_MODULE = "vllm.v1.worker.gpu.model_runner"
PROCESS = "worker"
WHY = (
    "Model Runner V2 builds its block tables from one DCP size plus a "
    "sharded/replicated bool per group."
)
REMOVE_WHEN = "Model Runner V2 passes per-group DCP shard counts to BlockTables"

_M = UPSTREAM_MODULE
PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "GPUModelRunner.initialize_kv_cache",
        "self, kv_cache_config, is_profiling=, kv_cache_allocation_context=",
    ),
    UpstreamSymbol(_M, "GPUModelRunner.get_kv_cache_spec", "self"),
)


def group_shard_counts(kv_cache_config: Any, vllm_config: Any) -> list[int]:
    """K of every KV-cache group, in group order, checked against the
    interleave and PCP rules."""
    from vllm.v1.kv_cache_interface import get_kv_cache_dcp_shard_count  # type: ignore[attr-defined]

    parallel_config = vllm_config.parallel_config
    dcp = parallel_config.decode_context_parallel_size
    interleave = parallel_config.cp_kv_cache_interleave_size
    owners_and_counts = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        owner = group_owner(index, list(group.layer_names))
        spec = group.kv_cache_spec
        k = get_kv_cache_dcp_shard_count(spec, dcp, owner=owner)
        if spec.uses_slot_mapping:
            try:
                check_interleave(spec.block_size, k, interleave)
            except DcpGeometryError as exc:
                raise DcpGeometryError(f"{owner}: {exc}") from exc
        owners_and_counts.append((owner, k))
    check_prefill_context_parallel(vllm_config, owners_and_counts)
    return [k for _, k in owners_and_counts]


def _make_initialize_kv_cache(original: Callable[..., None]) -> Callable[..., None]:
    def initialize_kv_cache(
        self: Any, kv_cache_config: Any, *args: Any, **kwargs: Any
    ) -> None:
        if self.dcp_size == 1:
            original(self, kv_cache_config, *args, **kwargs)
            return
        counts = group_shard_counts(kv_cache_config, self.vllm_config)
        with pending_dcp_shard_counts(counts):
            original(self, kv_cache_config, *args, **kwargs)
        if getattr(self.block_tables, SHARD_COUNTS_ATTR, None) != tuple(counts):
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
