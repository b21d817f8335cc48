# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The attention backends vLLM 0.33.0 selects on a Hopper (SM90) GPU when the
operator names none: what ``plan`` reports for a topology's groups and what
the planning platform (``serve.planning_platform``) gives the layers it
builds. A GPU check (``tests/gpu``) holds them to vLLM's own selector.
"""

from __future__ import annotations

DEFAULT_ATTENTION_BACKENDS = {
    "mla": "FLASH_ATTN_MLA",
    "full_attention": "FLASH_ATTN",
    "sliding_window": "FLASH_ATTN",
}
"""What vLLM 0.33.0 picks first for a group's kind on a Hopper (SM90) GPU
(``vllm.platforms.cuda``'s backend priorities). ``--attention-backend NAME``
replaces it for the groups of NAME's kind (MLA backends for MLA groups)."""

NON_CAUSAL_DCP_MLA_BACKEND = "FLASHINFER_MLA"
"""What vLLM 0.33.0 picks on SM90 for an MLA layer with non-causal
multi-token decode (a DSpark draft) under DCP: its selector keeps only
builders with ``supports_non_causal_multi_token_dcp``, whatever the group's
K (the selector runs with the model, before any spec is known)."""
