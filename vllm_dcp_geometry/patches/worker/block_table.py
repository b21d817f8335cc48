# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.block_table``: each cache group's table has its own K.

What: ``BlockTable.__init__`` takes an optional keyword ``dcp_geometry``
(``ShardGeometry``: the group's shard count K with the DCP world size D and
rank r) and then sets the instance attributes ``dcp_world_size = K`` and
``dcp_rank = r % K`` that ``ComputeSlotMappingKernel`` reads.
``MultiGroupBlockTable.__init__`` takes an optional keyword ``dcp_layout``
(``BlockTableLayout``, built from the groups' specs by
``block_table_layout``; Model Runner V1 hands it over through
``pending_block_table_layout``) and builds one table per group with the spec's
K, width (``spec.max_num_blocks_per_req`` and vLLM's ``get_block_table_width``
with ``spec.block_table_token_alignment``) and slot mode (``uses_slot_mapping``).

Why: vLLM 0.33.0 gives every table the global DCP size and rank, so a
replicated token-slot group (K = 1) gets a sharded slot mapping: (D-1)/D of
its tokens are never written and the rest land in wrong slots. A partial group
(1 < K < D) cannot be expressed at all. The table's alignment also comes from
the cache kind, not from the spec.

Remove when: vLLM's V1 block tables take the shard count per cache group.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    check_dcp_world_size,
    check_interleave,
    shard_position,
)

UPSTREAM_MODULE = "vllm.v1.worker.block_table"
PROCESS = "worker"
WHY = (
    "vLLM 0.33.0 V1 block tables use the global DCP size and rank for every "
    "cache group, so replicated groups get sharded slot mappings and partial "
    "groups cannot exist."
)
REMOVE_WHEN = "vLLM's V1 block tables take the DCP shard count per cache group"

_M = UPSTREAM_MODULE
PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "BlockTable.__init__",
        "self, block_size, max_num_reqs, max_num_blocks_per_req, "
        "max_num_batched_tokens, pin_memory, device, cp_kv_cache_interleave_size, "
        "slot_mapping_mode=",
    ),
    UpstreamSymbol(
        _M,
        "MultiGroupBlockTable.__init__",
        "self, max_num_reqs, max_num_batched_tokens, pin_memory, device, "
        "block_sizes, max_num_blocks, cp_kv_cache_interleave_size=, "
        "slot_mapping_modes=",
    ),
    # Read, not replaced: the geometry feeds these.
    UpstreamSymbol(
        _M, "get_block_table_width", "max_num_blocks, block_size, *, token_alignment="
    ),
    UpstreamSymbol(_M, "_COMPUTE_SLOT_MAPPING_KERNEL"),
    UpstreamSymbol(_M, "SlotMappingMode"),
)


@dataclass(frozen=True)
class ShardGeometry:
    """Where one DCP rank sits in one cache group: K shards, rank r of D.

    The rank stores shard ``r % K``; K divides D.
    """

    shard_count: int
    dcp_world_size: int
    dcp_rank: int

    def __post_init__(self) -> None:
        shard_position(self.dcp_rank, self.shard_count, self.dcp_world_size)

    @property
    def shard(self) -> int:
        return self.dcp_rank % self.shard_count


@dataclass(frozen=True)
class TableGeometry:
    """One worker block table, as its cache group's spec lays it out."""

    owner: str
    """The group, for error messages."""
    block_size: int
    shard_count: int
    """K: token-position shards of the group."""
    max_num_blocks_per_req: int
    """The spec's own width, ``spec.max_num_blocks_per_req``."""
    width: int
    """Columns of the table: the width after the spec's token alignment."""
    uses_slot_mapping: bool
    """Whether the runner maps tokens to KV slots for this group."""


@dataclass(frozen=True)
class BlockTableLayout:
    """Every block table of one worker, in table order, with its DCP place."""

    dcp_world_size: int
    dcp_rank: int
    tables: tuple[TableGeometry, ...]

    def shard_geometry(self, index: int) -> ShardGeometry:
        return ShardGeometry(
            self.tables[index].shard_count, self.dcp_world_size, self.dcp_rank
        )


_pending_layout: contextvars.ContextVar[BlockTableLayout | None] = (
    contextvars.ContextVar("vllm_dcp_geometry_block_table_layout", default=None)
)


@contextlib.contextmanager
def pending_block_table_layout(layout: BlockTableLayout) -> Iterator[None]:
    """Hand ``layout`` to every ``MultiGroupBlockTable`` built inside.

    Model Runner V1 builds its tables deep inside ``InputBatch``, which has no
    parameter for it.
    """
    token = _pending_layout.set(layout)
    try:
        yield
    finally:
        _pending_layout.reset(token)


def _is_recurrent_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return any(
            isinstance(layer, MambaSpec) for layer in spec.kv_cache_specs.values()
        )
    return isinstance(spec, MambaSpec)


def table_geometry(
    spec: Any,
    vllm_config: Any,
    max_len: int,
    dcp_world_size: int,
    *,
    owner: str,
) -> TableGeometry:
    """The block-table geometry the contract gives ``spec``'s group.

    Width: ``spec.max_num_blocks_per_req`` aligned by vLLM's own
    ``get_block_table_width`` to ``spec.block_table_token_alignment``. Slot
    mode: ``spec.uses_slot_mapping``; recurrent state never takes one, since
    its table holds state indices (V1's own rule, kept).
    """
    from vllm.v1.kv_cache_interface import get_kv_cache_dcp_shard_count  # type: ignore[attr-defined]
    from vllm.v1.worker.block_table import get_block_table_width

    shard_count = get_kv_cache_dcp_shard_count(spec, dcp_world_size, owner=owner)
    uses_slot_mapping = bool(spec.uses_slot_mapping) and not _is_recurrent_state(spec)
    max_num_blocks = spec.max_num_blocks_per_req(vllm_config, max_len)
    width = get_block_table_width(
        max_num_blocks,
        spec.block_size,
        token_alignment=spec.block_table_token_alignment,
    )
    return TableGeometry(
        owner=owner,
        block_size=spec.block_size,
        shard_count=shard_count,
        max_num_blocks_per_req=max_num_blocks,
        width=width,
        uses_slot_mapping=uses_slot_mapping,
    )


def check_prefill_context_parallel(
    vllm_config: Any, owners_and_counts: Sequence[tuple[str, int]]
) -> None:
    """PCP keeps upstream geometry only: K must be 1 or D when PCP > 1."""
    parallel_config = vllm_config.parallel_config
    pcp = parallel_config.prefill_context_parallel_size
    dcp = parallel_config.decode_context_parallel_size
    if pcp <= 1:
        return
    for owner, k in owners_and_counts:
        if k not in (1, dcp):
            raise DcpGeometryError(
                f"{owner}: a partial DCP shard count K={k} (D={dcp}) cannot be "
                f"combined with prefill context parallelism (PCP={pcp}); use K=1 "
                f"or K=D, or turn PCP off"
            )


def block_table_layout(
    specs: Sequence[tuple[str, Any]],
    vllm_config: Any,
    max_len: int,
    dcp_world_size: int,
    dcp_rank: int,
    cp_kv_cache_interleave_size: int,
) -> BlockTableLayout:
    """The layout of the tables for ``specs`` (``(owner, spec)`` in table order)
    on DCP rank ``dcp_rank`` of ``dcp_world_size``."""
    check_dcp_world_size(dcp_world_size)
    tables = tuple(
        table_geometry(spec, vllm_config, max_len, dcp_world_size, owner=owner)
        for owner, spec in specs
    )
    for table in tables:
        shard_position(dcp_rank, table.shard_count, dcp_world_size)
        if table.uses_slot_mapping:
            try:
                check_interleave(
                    table.block_size, table.shard_count, cp_kv_cache_interleave_size
                )
            except DcpGeometryError as exc:
                raise DcpGeometryError(f"{table.owner}: {exc}") from exc
    check_prefill_context_parallel(
        vllm_config, [(t.owner, t.shard_count) for t in tables]
    )
    return BlockTableLayout(dcp_world_size, dcp_rank, tables)


# Wrappers ------------------------------------------------------------------------

_upstream: ModuleType | None = None


def _module() -> ModuleType:
    if _upstream is None:
        raise RuntimeError(f"{UPSTREAM_MODULE} is not patched yet")
    return _upstream


def _make_block_table_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(
        self: Any,
        *args: Any,
        dcp_geometry: ShardGeometry | None = None,
        **kwargs: Any,
    ) -> None:
        if dcp_geometry is None:
            original(self, *args, **kwargs)
            return
        module = _module()
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
        self.dcp_world_size = dcp_geometry.shard_count
        self.dcp_rank = dcp_geometry.shard
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


def _make_multi_group_init(original: Callable[..., None]) -> Callable[..., None]:
    signature = inspect.signature(original)

    def __init__(
        self: Any,
        *args: Any,
        dcp_layout: BlockTableLayout | None = None,
        **kwargs: Any,
    ) -> None:
        layout = dcp_layout if dcp_layout is not None else _pending_layout.get()
        if layout is None:
            original(self, *args, **kwargs)
            return
        module = _module()
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
                dcp_geometry=layout.shard_geometry(index),
            )
            for index, table in enumerate(layout.tables)
        ]
        self.dcp_geometry_layout = layout

    return __init__


def apply(module: ModuleType) -> None:
    global _upstream
    _upstream = module
    wrap(module.BlockTable, "__init__", _make_block_table_init)
    wrap(module.MultiGroupBlockTable, "__init__", _make_multi_group_init)
