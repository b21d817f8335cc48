# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu.model_runner`` (Model Runner V2): operator
overrides of per-layer DCP geometry.

What: wraps only ``GPUModelRunner.get_kv_cache_spec``; the specs it collects
(after V2 marks DCP1 draft layers replicated) get the
``--additional-config '{"dcp_geometry": {"layers": {...}}}'`` overrides
applied (``vllm_dcp_geometry.overrides``), so an operator's override wins over
V2's draft default. Every other symbol of this module (block tables, KV-cache
initialisation) is another patch module's business.

Why: operators need per-layer shard counts without code changes, and the
workers' spec collection is the one place every worker sees its layers the
same way, before the engine core plans memory and groups.

Remove when: vLLM lets operators set a per-layer DCP shard count itself.
"""

from __future__ import annotations

from types import ModuleType

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.patches.worker.kv_cache_spec_overrides import (
    make_get_kv_cache_spec,
)

UPSTREAM_MODULE = "vllm.v1.worker.gpu.model_runner"
PROCESS = "worker"
WHY = "apply operator DCP geometry overrides where workers collect KV-cache specs"
REMOVE_WHEN = "vLLM supports per-layer DCP shard counts from its own config"

PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(UPSTREAM_MODULE, "GPUModelRunner.get_kv_cache_spec", "self"),
)


def apply(module: ModuleType) -> None:
    wrap(module.GPUModelRunner, "get_kv_cache_spec", make_get_kv_cache_spec)
