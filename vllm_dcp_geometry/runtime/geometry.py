# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What vLLM's KV-cache specs and groups say under DCP, asked through the contract.

The vLLM-facing half of the contract: every patch module, the CLI and the
benchmarks ask these functions (never each other) for a spec's shard count K,
the K vLLM 0.33.0 would derive from its boolean ``dcp_sharded``, a group's
display name, the K of every group, and the block-table layout of a worker.
The rules themselves stay in ``vllm_dcp_geometry.contract``; this module only
reads vLLM objects. vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    GroupGeometry,
    check_dcp_world_size,
    check_interleave,
    check_prefill_context_parallel,
    virtual_block_size,
)

SHARD_COUNT_FIELD_NAME = "dcp_kv_shard_count"
"""The attention-spec field that carries an explicit (partial) K."""


# Specs ---------------------------------------------------------------------------


def explicit_shard_count(spec: Any) -> int | None:
    """The explicit shard count a spec carries (None: follow ``dcp_sharded``)."""
    return getattr(spec, SHARD_COUNT_FIELD_NAME, None)


def get_kv_cache_dcp_shard_count(
    spec: Any, dcp_world_size: int, *, owner: str | None = None
) -> int:
    """Token-position shard count K of ``spec`` under DCP world size D.

    Delegates to ``spec.dcp_shard_count``, so a spec class answers itself.
    ``owner`` (a layer or group name) prefixes error messages.
    """
    check_dcp_world_size(dcp_world_size)
    if dcp_world_size == 1:
        return 1
    try:
        return int(spec.dcp_shard_count(dcp_world_size))
    except DcpGeometryError as exc:
        if owner is None or owner in str(exc):
            raise
        raise DcpGeometryError(f"{owner}: {exc}") from exc


def default_shard_count(spec: Any, dcp_world_size: int) -> int:
    """The K vLLM 0.33.0 implies from the boolean ``dcp_sharded`` alone."""
    return dcp_world_size if spec.dcp_sharded else 1


def shard_count_unless_default(
    spec: Any, dcp_world_size: int, *, owner: str | None = None
) -> int | None:
    """The spec's K where it differs from what vLLM derives from its flag;
    None where it is vLLM's own (a wrapper then calls the original)."""
    k = get_kv_cache_dcp_shard_count(spec, dcp_world_size, owner=owner)
    return None if k == default_shard_count(spec, dcp_world_size) else k


# Groups --------------------------------------------------------------------------


def kv_cache_group_name(
    layer_names: Sequence[str] = (), index: int | None = None
) -> str:
    """The one display name of a KV-cache group in messages, e.g.
    ``KV-cache group 3 (model.layers.3.attn, model.layers.7.attn)``."""
    label = "KV-cache group" if index is None else f"KV-cache group {index}"
    names = list(layer_names)
    if not names:
        return label
    shown = ", ".join(names[:3])
    more = f", ... ({len(names)} layers)" if len(names) > 3 else ""
    return f"{label} ({shown}{more})"


def group_shard_counts(
    groups: Sequence[Any],
    dcp_world_size: int,
    *,
    pcp_world_size: int = 1,
    interleave_size: int | None = None,
) -> list[int]:
    """K of every ``KVCacheGroupSpec``, in group order.

    Each K is validated by its spec; a partial K with PCP > 1 is refused; with
    ``interleave_size`` given, groups that map tokens to slots must satisfy
    the contract's interleave rule.
    """
    counts = []
    for index, group in enumerate(groups):
        owner = kv_cache_group_name(getattr(group, "layer_names", ()), index)
        spec = group.kv_cache_spec
        k = get_kv_cache_dcp_shard_count(spec, dcp_world_size, owner=owner)
        check_prefill_context_parallel(owner, k, dcp_world_size, pcp_world_size)
        if interleave_size is not None and spec.uses_slot_mapping:
            try:
                check_interleave(spec.block_size, k, interleave_size)
            except DcpGeometryError as exc:
                raise DcpGeometryError(f"{owner}: {exc}") from exc
        counts.append(k)
    return counts


def make_virtual_block_size_resolver(
    original: Callable[[Any, int], int],
) -> Callable[[Any, int], int]:
    """Wrap a ``(spec, D) -> B * (D if dcp_sharded else 1)`` copy of vLLM's
    rule so it answers ``V = B * K``; the original runs where K is vLLM's own."""

    def resolve_dcp_kv_block_size(spec: Any, dcp_world_size: int) -> int:
        k = shard_count_unless_default(spec, dcp_world_size)
        if k is None:
            return original(spec, dcp_world_size)
        return virtual_block_size(spec.block_size, k)

    return resolve_dcp_kv_block_size


# Worker block tables -------------------------------------------------------------

BLOCK_TABLE_ENTRY_BYTES = 4
"""vLLM's block tables hold int32 block ids."""


BLOCK_TABLE_WIDTH_HOMES: dict[str, str] = {
    "0.33.0": "vllm.v1.worker.block_table",
    "0.34.0": "vllm.v1.kv_cache_interface",
}
"""Where each known vLLM release defines ``get_block_table_width``: 0.34.0
moved it out of Model Runner V1's ``block_table`` module when it removed that
runner."""


@cache
def upstream_get_block_table_width() -> Callable[..., int]:
    """vLLM's ``get_block_table_width`` from its home on the installed release.

    A known release is asked at its recorded home only, so a symbol that went
    missing there raises instead of being found somewhere else. A release the
    plugin does not know (the version override) is asked at each known home,
    newest first; where none has it, that raises too.
    """
    import importlib

    from vllm_dcp_geometry._version import installed_vllm_version

    installed = installed_vllm_version()
    known = BLOCK_TABLE_WIDTH_HOMES.get(installed or "")
    homes = [known] if known else list(reversed(BLOCK_TABLE_WIDTH_HOMES.values()))
    for home in homes:
        try:
            module = importlib.import_module(home)
        except ModuleNotFoundError:
            continue
        if hasattr(module, "get_block_table_width"):
            return module.get_block_table_width  # type: ignore[no-any-return]
    raise ImportError(
        f"vLLM {installed} defines no get_block_table_width in "
        f"{' or '.join(homes)}; vllm-dcp-geometry cannot size block tables on it"
    )


def runner_table_width(spec: Any, max_num_blocks: int) -> int:
    """Rule W3: columns of a worker's block table for ``spec``: ``max_num_blocks``
    (``spec.max_num_blocks_per_req``) aligned by vLLM's own
    ``get_block_table_width`` to ``spec.block_table_token_alignment``, as
    every model runner sizes its tables."""
    get_block_table_width = upstream_get_block_table_width()
    return get_block_table_width(
        max_num_blocks,
        spec.block_size,
        token_alignment=spec.block_table_token_alignment,
    )


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
    interleave_size: int
    tables: tuple[TableGeometry, ...]

    def group_geometry(self, index: int) -> GroupGeometry:
        table = self.tables[index]
        return GroupGeometry(
            owner=table.owner,
            shard_count=table.shard_count,
            dcp_world_size=self.dcp_world_size,
            dcp_rank=self.dcp_rank,
            interleave_size=self.interleave_size,
        )


def is_recurrent_state(spec: Any) -> bool:
    """Whether a spec (or any layer of an aggregate spec) is Mamba-like state,
    whose table holds state indices rather than token slots."""
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    if isinstance(spec, UniformTypeKVCacheSpecs):
        return any(
            isinstance(layer, MambaSpec) for layer in spec.kv_cache_specs.values()
        )
    return isinstance(spec, MambaSpec)


def table_geometry(
    spec: Any, vllm_config: Any, max_len: int, dcp_world_size: int, *, owner: str
) -> TableGeometry:
    """The block-table geometry the contract gives ``spec``'s group.

    Width: ``spec.max_num_blocks_per_req`` aligned by vLLM's own
    ``get_block_table_width`` to ``spec.block_table_token_alignment``. Slot
    mode: ``spec.uses_slot_mapping``; recurrent state never takes one, since
    its table holds state indices (Model Runner V1's own rule, kept).
    """
    shard_count = get_kv_cache_dcp_shard_count(spec, dcp_world_size, owner=owner)
    max_num_blocks = spec.max_num_blocks_per_req(vllm_config, max_len)
    return TableGeometry(
        owner=owner,
        block_size=spec.block_size,
        shard_count=shard_count,
        max_num_blocks_per_req=max_num_blocks,
        width=runner_table_width(spec, max_num_blocks),
        uses_slot_mapping=bool(spec.uses_slot_mapping) and not is_recurrent_state(spec),
    )


def block_table_layout(
    specs: Sequence[tuple[str, Any]],
    vllm_config: Any,
    max_len: int,
    dcp_world_size: int,
    dcp_rank: int,
) -> BlockTableLayout:
    """The layout of the tables for ``specs`` (``(owner, spec)`` in table order)
    on DCP rank ``dcp_rank`` of ``dcp_world_size``: K, width and slot mode of
    each, checked against the interleave and PCP rules."""
    parallel = vllm_config.parallel_config
    interleave = parallel.cp_kv_cache_interleave_size
    pcp = parallel.prefill_context_parallel_size
    tables = tuple(
        table_geometry(spec, vllm_config, max_len, dcp_world_size, owner=owner)
        for owner, spec in specs
    )
    layout = BlockTableLayout(dcp_world_size, dcp_rank, interleave, tables)
    for index, table in enumerate(tables):
        layout.group_geometry(index)
        if table.uses_slot_mapping:
            try:
                check_interleave(table.block_size, table.shard_count, interleave)
            except DcpGeometryError as exc:
                raise DcpGeometryError(f"{table.owner}: {exc}") from exc
        check_prefill_context_parallel(
            table.owner, table.shard_count, dcp_world_size, pcp
        )
    return layout


def input_batch_layout(
    kv_cache_config: Any,
    vllm_config: Any,
    max_len: int,
    dcp_world_size: int,
    dcp_rank: int,
) -> BlockTableLayout:
    """The layout of Model Runner V1's tables: one per KV-cache group except
    encoder-only groups, in group order (as ``may_reinitialize_input_batch``
    builds them, so table index and group index may differ)."""
    from vllm.v1.kv_cache_interface import KVCacheSpecKind, get_kv_cache_spec_kind

    specs = [
        (kv_cache_group_name(group.layer_names, index), group.kv_cache_spec)
        for index, group in enumerate(kv_cache_config.kv_cache_groups)
        if get_kv_cache_spec_kind(group.kv_cache_spec)
        != KVCacheSpecKind.ENCODER_ONLY_ATTENTION
    ]
    return block_table_layout(specs, vllm_config, max_len, dcp_world_size, dcp_rank)
