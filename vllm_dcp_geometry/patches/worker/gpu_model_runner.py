# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu_model_runner``: Model Runner V1 asks the spec.

What: wraps ``GPUModelRunner.may_reinitialize_input_batch``. Under DCP it
builds the block-table layout of the KV-cache groups (shard count K, width
with the spec's token alignment, slot mode from ``uses_slot_mapping``; the
encoder-only groups upstream skips are skipped, so table index and group index
may differ) and hands it to the ``MultiGroupBlockTable`` the runner builds
through the ``group_context.pending_block_table_layout`` side channel.
Upstream gives every token-slot table the global D, which is right only for
a sharded group at its default K: where every table is one of those or
recurrent state (whose table maps no slots), decided from the specs alone
(``hand_back``), and at D = 1, it calls the original before reading anything
else; a spec that is not a vLLM ``KVCacheSpec`` (vLLM's own tests pass
doubles) follows upstream too. A replicated token-slot group at D > 1 is not
such a case. Model Runner V1 of vLLM 0.33.0 has no sliding-window null
masking at any D (Model Runner V2 has), so a replicated sliding-window group
here keeps exactly its D = 1 table.
It also wraps ``GPUModelRunner.get_kv_cache_spec``: the specs this worker
collects get the operator's ``--additional-config`` DCP geometry overrides
(``vllm_dcp_geometry.contract.overrides``), identically on every worker.

Why: vLLM 0.33.0 derives the slot mode and alignment from the cache kind and
lets every table use the global DCP size and rank; operators have no way to
set a layer's shard count.

Remove when: Model Runner V1 passes per-group geometry to its block tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.runtime.geometry import BlockTableLayout, input_batch_layout
from vllm_dcp_geometry.runtime.group_context import (
    LAYOUT_ATTR,
    pending_block_table_layout,
)
from vllm_dcp_geometry.runtime.hand_back import follows_vllm_default
from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.spec_overrides import make_get_kv_cache_spec


def check_input_batch_layout(block_table: Any, layout: BlockTableLayout) -> None:
    """Fail closed unless ``block_table`` (a ``MultiGroupBlockTable``) has
    ``layout``'s tables."""
    tables = list(block_table.block_tables)
    ok = getattr(block_table, LAYOUT_ATTR, None) == layout and len(tables) == len(
        layout.tables
    )
    if ok:
        ok = all(
            table.max_num_blocks_per_req == layout.tables[index].width
            and (table.dcp_world_size, table.dcp_rank)
            == layout.group_geometry(index).shard_world
            for index, table in enumerate(tables)
        )
    if not ok:
        raise DcpGeometryError(
            "Model Runner V1's input batch was not built with the per-group DCP "
            "block-table layout: vllm_dcp_geometry.patches.worker.block_table "
            "(this patch's partner, remove_with) should have taken it from "
            "pending_block_table_layout; refusing to run with the global DCP "
            "geometry"
        )


def upstream_tables_fit(kv_cache_config: Any) -> bool:
    """Whether upstream's tables are right at every D, from the specs alone:
    each non-encoder group is recurrent state (no slot mapping) or sharded
    attention whose K follows its flag (K = D, the D upstream gives it). A
    group whose spec is no ``KVCacheSpec`` (a test double) has no K either."""
    from vllm.v1.kv_cache_interface import (
        KVCacheSpec,
        KVCacheSpecKind,
        get_kv_cache_spec_kind,
    )

    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if not isinstance(spec, KVCacheSpec):
            continue
        kind = get_kv_cache_spec_kind(spec)
        if kind == KVCacheSpecKind.ENCODER_ONLY_ATTENTION:
            continue
        if not follows_vllm_default(spec):
            return False
        if kind != KVCacheSpecKind.MAMBA and not spec.dcp_sharded:
            return False
    return True


def _make_may_reinitialize_input_batch(
    original: Callable[[Any, Any], None],
) -> Callable[[Any, Any], None]:
    def may_reinitialize_input_batch(self: Any, kv_cache_config: Any) -> None:
        if upstream_tables_fit(kv_cache_config):
            original(self, kv_cache_config)
            return
        # Read through the config upstream passes to the specs' widths.
        dcp = self.vllm_config.parallel_config.decode_context_parallel_size
        if dcp == 1:
            original(self, kv_cache_config)
            return
        layout = input_batch_layout(
            kv_cache_config,
            self.vllm_config,
            max(self.max_model_len, self.max_encoder_len),
            dcp,
            self.dcp_rank,
        )
        if getattr(self, LAYOUT_ATTR, None) != layout:
            # Upstream rebuilds the InputBatch when its own inputs change; an
            # empty block-size list is how it forces that itself.
            self._init_block_sizes = []
        with pending_block_table_layout(layout):
            original(self, kv_cache_config)
        check_input_batch_layout(self.input_batch.block_table, layout)
        setattr(self, LAYOUT_ATTR, layout)

    return may_reinitialize_input_batch


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu_model_runner",
    # Model Runner V1: vLLM 0.34.0 removed it (not applicable there).
    releases=("0.33.0",),
    replaces=(
        Wrap(
            "GPUModelRunner.may_reinitialize_input_batch",
            "self, kv_cache_config",
            _make_may_reinitialize_input_batch,
        ),
        Wrap("GPUModelRunner.get_kv_cache_spec", "self", make_get_kv_cache_spec),
    ),
    remove_with=("worker.block_table",),
    why=(
        "Model Runner V1 gives every block table the global DCP size and picks slot "
        "mode and alignment from the cache kind, not from the spec."
    ),
    remove_when="Model Runner V1 passes per-group DCP geometry to its block tables",
    related="vllm#40996 (DCP with hybrid attention); none gives V1 tables a K",
)
