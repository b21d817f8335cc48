# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu_model_runner`` (Model Runner V1): operator
overrides of per-layer DCP geometry.

What: wraps only ``GPUModelRunner.get_kv_cache_spec``; the specs it collects
get the ``--additional-config '{"dcp_geometry": {"layers": {...}}}'``
overrides applied (``vllm_dcp_geometry.overrides``). Every other symbol of
this module (block tables, input batch) is another patch module's business.

Why: operators need per-layer shard counts without code changes, and the
workers' spec collection is the one place every worker sees its layers the
same way, before the engine core plans memory and groups.

Remove when: vLLM lets operators set a per-layer DCP shard count itself.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.overrides import apply_to_kv_cache_specs

UPSTREAM_MODULE = "vllm.v1.worker.gpu_model_runner"
PROCESS = "worker"
WHY = "apply operator DCP geometry overrides where workers collect KV-cache specs"
REMOVE_WHEN = "vLLM supports per-layer DCP shard counts from its own config"

PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(UPSTREAM_MODULE, "GPUModelRunner.get_kv_cache_spec", "self"),
)


def make_get_kv_cache_spec(
    original: Callable[[Any], dict[str, Any]],
) -> Callable[[Any], dict[str, Any]]:
    def get_kv_cache_spec(self: Any) -> dict[str, Any]:
        return apply_to_kv_cache_specs(original(self), self.vllm_config)

    return get_kv_cache_spec


def apply(module: ModuleType) -> None:
    wrap(module.GPUModelRunner, "get_kv_cache_spec", make_get_kv_cache_spec)
