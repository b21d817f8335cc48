# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The patch modules, one per patched vLLM module, grouped by process.

- ``common``: modules every process loads (the KV-cache specs).
- ``engine_core``: the scheduler side (KV-cache managers, planning, hashing).
- ``worker``: model runners, block tables, attention metadata.
- ``benchmarks``: vLLM's benchmark tools (``vllm bench``).

No patch module imports another: what they share lives in
``vllm_dcp_geometry.runtime`` and ``vllm_dcp_geometry.contract``, the only
parts of the package a patch module may import (``tools/check_sources.py``).

Each patch module declares itself once, ``PATCH = Patch(...)``
(``vllm_dcp_geometry.runtime.patching``). ``PATCH_MODULES`` is the full list
``register()`` installs; the order is the order in which patches apply when
their upstream modules are already loaded. ``declarations`` reads them.
"""

import importlib
from collections.abc import Iterable

from vllm_dcp_geometry.runtime.patching import PATCH_PACKAGE, Patch

assert __name__ == PATCH_PACKAGE

PATCH_MODULES: tuple[str, ...] = (
    "vllm_dcp_geometry.patches.common.kv_cache_interface",
    "vllm_dcp_geometry.patches.worker.block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner",
    "vllm_dcp_geometry.patches.worker.gpu_block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner_v2",
    "vllm_dcp_geometry.patches.worker.gpu_warmup",
    "vllm_dcp_geometry.patches.worker.dflash_speculator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_utils",
    "vllm_dcp_geometry.patches.engine_core.single_type_kv_cache_manager",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_coordinator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_planning",
    "vllm_dcp_geometry.patches.engine_core.kv_connector_base",
    "vllm_dcp_geometry.patches.benchmarks.forward_batch",
    "vllm_dcp_geometry.patches.worker.utils",
    "vllm_dcp_geometry.patches.worker.flash_attn",
    "vllm_dcp_geometry.patches.worker.flashinfer",
    "vllm_dcp_geometry.patches.worker.gpt_oss_attention",
    "vllm_dcp_geometry.patches.worker.mla_dcp_manager",
    "vllm_dcp_geometry.patches.worker.mla_attention",
    "vllm_dcp_geometry.patches.worker.kimi_k3_mla",
    "vllm_dcp_geometry.patches.worker.flint_model",
    "vllm_dcp_geometry.patches.worker.sparse_mla_attention",
    "vllm_dcp_geometry.patches.worker.flashmla_sparse",
    "vllm_dcp_geometry.patches.worker.mla_indexer",
    "vllm_dcp_geometry.patches.worker.deepseek_v32_attention",
    "vllm_dcp_geometry.patches.worker.sparse_attn_indexer",
    "vllm_dcp_geometry.patches.worker.gpu_worker",
    "vllm_dcp_geometry.patches.worker.parallel_state",
)


def declarations(names: Iterable[str] = PATCH_MODULES) -> dict[str, Patch]:
    """The ``PATCH`` of every patch module in ``names`` (full module names),
    in that order; a module without one is refused by name."""
    found = {}
    for name in names:
        patch = getattr(importlib.import_module(name), "PATCH", None)
        if not isinstance(patch, Patch):
            raise TypeError(f"{name} declares no PATCH = Patch(...)")
        found[name] = patch
    return found
