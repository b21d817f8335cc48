# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Documentation made from the code, beside vLLM (nothing a server loads reads
it): docs/patches.md's patch table (``patch_table``) and its index by upstream
symbol (``patch_index``), which ``tools/update_docs.py`` writes, and the audit
of vLLM's attention layer classes (``layer_class_audit``)."""
