# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The side channels: how a cache group's geometry reaches upstream code that
has no parameter for it.

The plugin wraps vLLM functions instead of copying them. Where upstream code
that needs a group's geometry is called from deep inside another upstream
function, with no argument to carry it, the wrapper of the outer function sets
a context variable for the duration of the upstream call and the wrapper of
the inner one reads it. Outside those calls every channel is empty and the
inner wrappers hand straight back to upstream. There are exactly three:

``use_group_geometry`` / ``current_group_geometry``
    Set by the attention metadata builder patches while a group's upstream
    builder code runs (``FlashAttentionMetadataBuilder.__init__``,
    ``FlashInferMetadataBuilder.__init__`` and ``.build``, and
    ``MLACommonMetadataBuilder.__init__`` and ``.build``). Read by the patched
    module-level helpers those builders call: ``get_dcp_world_size_and_rank``
    then answers the group's shard world ``(K, r % K)`` instead of vLLM's
    ``(D, r)``, FlashInfer's ``get_dcp_local_seq_lens`` the group's local
    lengths, the MLA module's ``get_dcp_group`` a world of 1 for a local
    (K = 1) group, and its ``build_mla_chunked_context_metadata`` plans a
    partial group's prefill context over K shards. Why: upstream builders
    take the DCP world from the process group, never from the spec they are
    built for.

``pending_block_table_layout`` / ``pending_layout``
    Set by Model Runner V1's ``may_reinitialize_input_batch``; read by
    ``MultiGroupBlockTable.__init__``, which upstream builds inside
    ``InputBatch.__init__`` with only the block sizes and widths. Why: the
    tables need each group's K, width and slot mode from its spec.

``pending_dcp_shard_counts`` / ``pending_shard_counts``
    Set by Model Runner V2's ``initialize_kv_cache``; read by
    ``BlockTables.__init__``, which upstream builds with one ``cp_size`` and a
    sharded/replicated bool per group. Why: a partial group needs its own K.

Each wrapper that sets a channel checks afterwards that the reader really
used it (the runners compare the tables they got with the layout), so a
channel that stops being read fails at start-up instead of silently falling
back to upstream's global geometry.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.geometry import BlockTableLayout

CHANNELS: tuple[tuple[str, str, str], ...] = (
    (
        "use_group_geometry",
        "attention metadata builders (FlashAttention, FlashInfer, MLA) while "
        "a group's upstream builder code runs",
        "the backends' `get_dcp_world_size_and_rank` (and FlashInfer's "
        "`get_dcp_local_seq_lens`) answer the group's `(K, r % K)`; MLA's "
        "`get_dcp_group` a world of 1 (K = 1) and its "
        "`build_mla_chunked_context_metadata` plans over K shards",
    ),
    (
        "pending_block_table_layout",
        "Model Runner V1 `may_reinitialize_input_batch`",
        "`MultiGroupBlockTable.__init__` (built inside `InputBatch`) takes each "
        "group's K, width and slot mode",
    ),
    (
        "pending_dcp_shard_counts",
        "Model Runner V2 `initialize_kv_cache`",
        "`BlockTables.__init__` takes each group's K",
    ),
)
"""(channel, set by, what reads it): the README's side-channel table."""


TAKEN_LAYOUT_ATTR = "dcp_geometry_layout"
"""Set on a ``MultiGroupBlockTable`` to the layout it took from the channel."""

TAKEN_SHARD_COUNTS_ATTR = "dcp_shard_counts"
"""Set on a ``BlockTables`` to the shard counts it took (None: upstream's)."""


_active_group: contextvars.ContextVar[GroupGeometry | None] = contextvars.ContextVar(
    "vllm_dcp_geometry_active_group", default=None
)
_pending_layout: contextvars.ContextVar[BlockTableLayout | None] = (
    contextvars.ContextVar("vllm_dcp_geometry_block_table_layout", default=None)
)
_pending_shard_counts: contextvars.ContextVar[tuple[int, ...] | None] = (
    contextvars.ContextVar("vllm_dcp_geometry_shard_counts", default=None)
)


@contextlib.contextmanager
def use_group_geometry(geometry: GroupGeometry) -> Iterator[GroupGeometry]:
    """Make ``geometry`` the group the patched backend helpers answer for,
    for the duration of one upstream builder call."""
    token = _active_group.set(geometry)
    try:
        yield geometry
    finally:
        _active_group.reset(token)


def current_group_geometry() -> GroupGeometry | None:
    """The group whose builder code is running, or None outside one."""
    return _active_group.get()


@contextlib.contextmanager
def pending_block_table_layout(layout: BlockTableLayout) -> Iterator[None]:
    """Hand ``layout`` to every ``MultiGroupBlockTable`` built inside."""
    token = _pending_layout.set(layout)
    try:
        yield
    finally:
        _pending_layout.reset(token)


def pending_layout() -> BlockTableLayout | None:
    """The layout a ``MultiGroupBlockTable`` being built should take."""
    return _pending_layout.get()


@contextlib.contextmanager
def pending_dcp_shard_counts(shard_counts: Sequence[int]) -> Iterator[None]:
    """Hand ``shard_counts`` (one K per group) to every ``BlockTables`` built
    inside."""
    token = _pending_shard_counts.set(tuple(shard_counts))
    try:
        yield
    finally:
        _pending_shard_counts.reset(token)


def pending_shard_counts() -> tuple[int, ...] | None:
    """The per-group K a ``BlockTables`` being built should take."""
    return _pending_shard_counts.get()
