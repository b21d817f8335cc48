# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The patch modules, one per patched vLLM module, grouped by process.

- ``common``: modules every process loads (the KV-cache specs).
- ``engine_core``: the scheduler side (KV-cache managers, planning, hashing).
- ``worker``: model runners, block tables, attention metadata.

``PATCH_MODULES`` is the full list ``register()`` installs; the order is the
order in which patches apply when their upstream modules are already loaded.
"""

PATCH_MODULES: tuple[str, ...] = (
    "vllm_dcp_geometry.patches.common.kv_cache_interface",
    "vllm_dcp_geometry.patches.worker.block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner",
    "vllm_dcp_geometry.patches.worker.gpu_block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner_v2",
    "vllm_dcp_geometry.patches.worker.dflash_speculator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_utils",
    "vllm_dcp_geometry.patches.engine_core.single_type_kv_cache_manager",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_coordinator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_planning",
    "vllm_dcp_geometry.patches.engine_core.kv_connector_base",
    "vllm_dcp_geometry.patches.engine_core.forward_batch",
    "vllm_dcp_geometry.patches.worker.utils",
    "vllm_dcp_geometry.patches.worker.flash_attn",
    "vllm_dcp_geometry.patches.worker.flashinfer",
    "vllm_dcp_geometry.patches.worker.mla_attention",
)


def patch_table_markdown() -> str:
    """The README's table of patched vLLM symbols, generated from the modules."""
    import importlib

    rows = [
        "| process | vLLM module | symbols | why | remove when |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in PATCH_MODULES:
        patch = importlib.import_module(name)
        symbols = ", ".join(f"`{s.qualname}`" for s in patch.PATCHED_SYMBOLS)
        rows.append(
            f"| {patch.PROCESS} | `{patch.UPSTREAM_MODULE}` | {symbols} | "
            f"{patch.WHY} | {patch.REMOVE_WHEN} |"
        )
    return "\n".join(rows)
