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
)
