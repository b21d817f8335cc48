# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.block_table``: each cache group's table has its own K.

What: ``BlockTable.__init__`` takes an optional keyword ``dcp_geometry``
(``contract.GroupGeometry``: the group's K with the DCP world size D and rank
r) and then sets the instance attributes ``dcp_world_size = K`` and
``dcp_rank = r % K`` that ``ComputeSlotMappingKernel`` reads.
``MultiGroupBlockTable.__init__`` takes an optional keyword ``dcp_layout``
(``geometry.BlockTableLayout``, built from the groups' specs; Model Runner V1
hands it over through the ``group_context.pending_block_table_layout`` side
channel) and builds one table per group with the spec's K, width
(``spec.max_num_blocks_per_req`` and vLLM's ``get_block_table_width`` with
``spec.block_table_token_alignment``) and slot mode (``uses_slot_mapping``).

Why: vLLM 0.33.0 gives every table the global DCP size and rank, so a
replicated token-slot group (K = 1) gets a sharded slot mapping: (D-1)/D of
its tokens are never written and the rest land in wrong slots. A partial group
(1 < K < D) cannot be expressed at all. The table's alignment also comes from
the cache kind, not from the spec.

Remove when: vLLM's V1 block tables take the shard count per cache group.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.geometry import BlockTableLayout
from vllm_dcp_geometry.runtime.group_context import LAYOUT_ATTR, pending_layout
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap

# Wrappers ------------------------------------------------------------------------


def _make_block_table_init(
    original: Callable[..., None], module: ModuleType
) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(
        self: Any,
        *args: Any,
        dcp_geometry: GroupGeometry | None = None,
        **kwargs: Any,
    ) -> None:
        if dcp_geometry is None:
            original(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        mode = bound.arguments["slot_mapping_mode"]
        # Upstream registers its slot-mapping warmup with the global DCP size;
        # build without it and register the group's own geometry below.
        bound.arguments["slot_mapping_mode"] = module.SlotMappingMode.NONE
        original(*bound.args, **bound.kwargs)
        group = (self.dcp_world_size, self.dcp_rank)
        wanted = (dcp_geometry.dcp_world_size, dcp_geometry.dcp_rank)
        # (1, 0) is upstream's value when no DCP group exists (tests, tools).
        if group not in ((1, 0), wanted):
            raise DcpGeometryError(
                f"block table geometry names DCP rank {wanted[1]} of {wanted[0]}, "
                f"but this worker is rank {group[1]} of a DCP group of {group[0]}"
            )
        self.dcp_world_size, self.dcp_rank = dcp_geometry.shard_world
        self.slot_mapping_mode = mode
        if mode == module.SlotMappingMode.TOKEN_TO_KV_SLOT:
            module._COMPUTE_SLOT_MAPPING_KERNEL.register_warmup(
                kv_cache_block_size=self.block_size,
                total_cp_world_size=self.dcp_world_size,
                total_cp_rank=self.dcp_rank,
                cp_kv_cache_interleave_size=self.cp_kv_cache_interleave_size,
                block_table_stride=self.block_table.gpu.stride(0),
            )

    return __init__


def _check_layout_matches(
    layout: BlockTableLayout, block_sizes: list[int], max_num_blocks: list[int]
) -> None:
    if len(layout.tables) != len(block_sizes):
        raise DcpGeometryError(
            f"the DCP block-table layout has {len(layout.tables)} tables, but "
            f"the runner builds {len(block_sizes)}"
        )
    for table, block_size, num_blocks in zip(
        layout.tables, block_sizes, max_num_blocks, strict=True
    ):
        if (table.block_size, table.max_num_blocks_per_req) != (
            block_size,
            num_blocks,
        ):
            raise DcpGeometryError(
                f"{table.owner}: the runner asks for block size {block_size} and "
                f"{num_blocks} blocks per request, the spec gives "
                f"{table.block_size} and {table.max_num_blocks_per_req}"
            )


def _make_multi_group_init(
    original: Callable[..., None], module: ModuleType
) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(
        self: Any,
        *args: Any,
        dcp_layout: BlockTableLayout | None = None,
        **kwargs: Any,
    ) -> None:
        layout = dcp_layout if dcp_layout is not None else pending_layout()
        if layout is None:
            original(self, *args, **kwargs)
            return
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        _check_layout_matches(
            layout, list(arguments["block_sizes"]), list(arguments["max_num_blocks"])
        )
        # Upstream checks its arguments and sets up an empty container; the
        # tables themselves come from the layout (the caller's kind-based slot
        # modes and 128-token alignment are what the layout replaces).
        for name in ("block_sizes", "max_num_blocks", "slot_mapping_modes"):
            arguments[name] = []
        original(*bound.args, **bound.kwargs)
        mode = module.SlotMappingMode
        self.block_tables = [
            module.BlockTable(
                table.block_size,
                arguments["max_num_reqs"],
                table.width,
                arguments["max_num_batched_tokens"],
                arguments["pin_memory"],
                arguments["device"],
                arguments["cp_kv_cache_interleave_size"],
                slot_mapping_mode=(
                    mode.TOKEN_TO_KV_SLOT if table.uses_slot_mapping else mode.NONE
                ),
                dcp_geometry=layout.group_geometry(index),
            )
            for index, table in enumerate(layout.tables)
        ]
        setattr(self, LAYOUT_ATTR, layout)

    return __init__


PATCH = Patch(
    upstream_module="vllm.v1.worker.block_table",
    # Model Runner V1: vLLM 0.34.0 removed it (not applicable there).
    releases=("0.33.0",),
    replaces=(
        Wrap(
            "BlockTable.__init__",
            "self, block_size, max_num_reqs, max_num_blocks_per_req, "
            "max_num_batched_tokens, pin_memory, device, cp_kv_cache_interleave_size, "
            "slot_mapping_mode=",
            _make_block_table_init,
            with_module=True,
        ),
        Wrap(
            "MultiGroupBlockTable.__init__",
            "self, max_num_reqs, max_num_batched_tokens, pin_memory, device, "
            "block_sizes, max_num_blocks, cp_kv_cache_interleave_size=, "
            "slot_mapping_modes=",
            _make_multi_group_init,
            with_module=True,
        ),
    ),
    relies_on=(
        # Read, not replaced: the geometry feeds these.
        Pin(
            "get_block_table_width",
            "max_num_blocks, block_size, *, token_alignment=",
        ),
        Pin("_COMPUTE_SLOT_MAPPING_KERNEL"),
        Pin("SlotMappingMode"),
    ),
    remove_with=("worker.gpu_model_runner",),
    why=(
        "vLLM 0.33.0 V1 block tables use the global DCP size and rank for every "
        "cache group, so replicated groups get sharded slot mappings and partial "
        "groups cannot exist."
    ),
    remove_when="vLLM's V1 block tables take the DCP shard count per cache group",
    related="vllm#40996 (DCP with hybrid attention in Model Runner V1 block tables)",
)
