# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.benchmarks.forward.batch``: the forward benchmark's block
counts ask the spec.

What: replaces ``kv_block_size(spec, dcp_size)`` - an inline copy of
``block_size * (D if dcp_sharded else 1)`` that ``_num_blocks`` and
``build_batch`` use to size each request's synthetic block table - with
``B * K``; where K equals vLLM's value the original runs. Importers holding
it by name are rebound. (Named ``forward_batch`` because ``batch`` alone says
nothing; it runs in ``vllm bench``, where it stands in for the scheduler's
block allocation.)

Why: benchmarking a topology with a partial group would otherwise hand the
model runner too few blocks for that group.

Remove when: vLLM's forward benchmark reads a per-spec DCP shard count.
"""

from __future__ import annotations

from types import ModuleType

from vllm_dcp_geometry.runtime.geometry import make_virtual_block_size_resolver
from vllm_dcp_geometry.runtime.patching import (
    UpstreamSymbol,
    wrap_module_functions,
)

UPSTREAM_MODULE = "vllm.benchmarks.forward.batch"
RUNS_IN = "benchmark"
WHY = "the forward benchmark restates block_size * D from the boolean dcp_sharded"
REMOVE_WHEN = "vLLM's forward benchmark reads a per-spec DCP shard count"
RELATED = "none upstream: the benchmark restates the B * D rule inline"

REPLACES: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(UPSTREAM_MODULE, "kv_block_size", "spec, dcp_size"),
)
RELIES_ON: tuple[UpstreamSymbol, ...] = (
    # Relied on: it calls the module's kv_block_size.
    UpstreamSymbol(UPSTREAM_MODULE, "_num_blocks", "spec, computed, kv_len, dcp_size"),
)
ADDS: tuple[str, ...] = ()
REMOVE_WITH: tuple[str, ...] = ()
PATCHED_SYMBOLS = REPLACES + RELIES_ON


def apply(module: ModuleType) -> None:
    wrap_module_functions(module, {"kv_block_size": make_virtual_block_size_resolver})
