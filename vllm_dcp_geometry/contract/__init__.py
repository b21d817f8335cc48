# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The DCP geometry contract: pure Python, no vLLM import, no torch.

``rules`` holds the token-position rules (shard counts, widths, local
lengths, the reference slot mapping) that ``docs/contract.md`` writes out;
``attention_admission`` how a group's attention may run them (from the
backends the plugin taught, ``attention_backends``),
``collectives`` which ranks its collectives span and what they move, and
``layer_classes`` the attention layer classes the plugin was taught. The
runtime inside vLLM and the tooling beside it both read these; nothing here
reads them back.

The rules' names are re-exported here: ``from vllm_dcp_geometry.contract
import GroupGeometry``.
"""

from vllm_dcp_geometry.contract.rules import (
    PAD_SLOT_ID,
    DcpGeometryError,
    GroupGeometry,
    ShardCountMergeError,
    TokenLayout,
    attention_block_table_width,
    cdiv,
    check_dcp_world_size,
    check_interleave,
    check_prefill_context_parallel,
    check_shard_count_divides,
    check_shard_count_value,
    full_attention_pages_per_request,
    local_seq_len,
    recurrent_align_block_table_width,
    reference_slot_mapping,
    resolve_shard_count,
    resolve_uniform_shard_count,
    scheduler_block_size,
    virtual_block_size,
)

__all__ = [
    "PAD_SLOT_ID",
    "DcpGeometryError",
    "GroupGeometry",
    "ShardCountMergeError",
    "TokenLayout",
    "attention_block_table_width",
    "cdiv",
    "check_dcp_world_size",
    "check_interleave",
    "check_prefill_context_parallel",
    "check_shard_count_divides",
    "check_shard_count_value",
    "full_attention_pages_per_request",
    "local_seq_len",
    "recurrent_align_block_table_width",
    "reference_slot_mapping",
    "resolve_shard_count",
    "resolve_uniform_shard_count",
    "scheduler_block_size",
    "virtual_block_size",
]
