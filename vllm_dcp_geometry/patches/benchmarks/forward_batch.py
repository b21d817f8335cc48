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

from vllm_dcp_geometry.runtime.geometry import make_virtual_block_size_resolver
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap

PATCH = Patch(
    upstream_module="vllm.benchmarks.forward.batch",
    replaces=(
        Wrap(
            "kv_block_size",
            "spec, dcp_size",
            make_virtual_block_size_resolver,
            rebind_copies=True,
        ),
    ),
    relies_on=(
        # Relied on: it calls the module's kv_block_size.
        Pin("_num_blocks", "spec, computed, kv_len, dcp_size"),
    ),
    why="the forward benchmark restates block_size * D from the boolean dcp_sharded",
    remove_when="vLLM's forward benchmark reads a per-spec DCP shard count",
    related="none upstream: the benchmark restates the B * D rule inline",
)
