# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The side channels: how a cache group's geometry reaches upstream code that
has no parameter for it.

The plugin wraps vLLM functions instead of copying them. Where upstream code
that needs a group's geometry is called from deep inside another upstream
function, with no argument to carry it, the wrapper of the outer function sets
a context variable for the duration of the upstream call and the wrapper of
the inner one reads it. Outside those calls every channel is empty and the
inner wrappers hand straight back to upstream. There are exactly five:

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

``use_replica_group`` / ``current_replica_group``
    Set by the MLA builder patch while a partial group whose collectives stay
    within its replica (rule A6) is bound and its upstream builder code runs
    (``MLACommonMetadataBuilder.__init__`` and ``.build``), and by the layer
    binding while it makes the layer's replica ``MLADCPManager``. Read by the
    MLA module's and the DCP ops module's ``get_dcp_group``, which then
    answer the group's replica ``GroupCoordinator`` (K ranks), by
    ``build_mla_chunked_context_metadata`` (which then plans as for a
    sharded group of K) and by the MLA layer binding. Why: upstream's MLA
    builder and DCP manager take their collective group from
    ``get_dcp_group()``, which has no notion of a group's replica.

``pending_block_table_layout`` / ``pending_layout``
    Set by Model Runner V1's ``may_reinitialize_input_batch``; read by
    ``MultiGroupBlockTable.__init__``, which upstream builds inside
    ``InputBatch.__init__`` with only the block sizes and widths. Why: the
    tables need each group's K, width and slot mode from its spec.

``pending_dcp_shard_counts`` / ``pending_shard_counts``
    Set by Model Runner V2's ``initialize_kv_cache``; read by
    ``BlockTables.__init__``, which upstream builds with one ``cp_size`` and a
    sharded/replicated bool per group. Why: a partial group needs its own K,
    and a replicated sliding-window group its null masking. The runner sets
    a function the reader calls, so that it reads nothing before upstream's
    own first steps (and exceptions); None from it means upstream's tables.

``use_indexer_geometry`` / ``current_indexer_geometry``
    Set by the DeepSeek-V3.2 attention patch around one
    ``sparse_attn_indexer`` call of a sparse layer whose indexer cache is
    partial (1 < K < D); read by ``_merge_dcp_topk_global``, which the
    indexer op calls inside with the shard world ``(K, r % K)`` but which
    all-gathers over all D ranks: duplicate replicas (``r // K != 0``) then
    send no candidates, so each shard's top-k is counted once. Why: the
    merge takes a rank and world size, not the replica.

Each wrapper that sets a channel checks afterwards that the reader really
used it (the runners compare the tables they got with the layout), so a
channel that stops being read fails at start-up instead of silently falling
back to upstream's global geometry.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.runtime.geometry import BlockTableLayout


@dataclass(frozen=True)
class SideChannel:
    """One side channel: the function that sets it and the one that reads it
    (as vLLM pairs ``set_forward_context`` and ``get_forward_context``), the
    patches that write and read it, and what the reader takes from it.

    Writer and reader patches must be removed together (their
    ``REMOVE_WITH``); a test checks that each writer calls ``setter`` and each
    reader ``getter``."""

    setter: str
    getter: str
    writers: tuple[str, ...]
    """Patch modules (under ``vllm_dcp_geometry.patches``) that set it."""
    readers: tuple[str, ...]
    """Patch modules that read it."""
    written_when: str
    read_for: str
    via: tuple[str, ...] = ()
    """``module.function`` of shared code that sets or reads it on the
    patches' behalf (a patch calling one of them writes or reads it)."""


_BUILDERS = (
    "worker.flash_attn",
    "worker.flashinfer",
    "worker.mla_attention",
    "worker.sparse_mla_attention",
)
CHANNELS: tuple[SideChannel, ...] = (
    SideChannel(
        "use_group_geometry",
        "current_group_geometry",
        _BUILDERS,
        _BUILDERS,
        "attention metadata builders (FlashAttention, FlashInfer, MLA) while "
        "a group's upstream builder code runs",
        "the backends' `get_dcp_world_size_and_rank` (and FlashInfer's "
        "`get_dcp_local_seq_lens`) answer the group's `(K, r % K)`; MLA's "
        "`get_dcp_group` a world of 1 (K = 1), its DSpark check runs as at "
        "DCP 1, and its `build_mla_chunked_context_metadata` plans over K shards",
        via=("metadata_builders.builder_init", "mla_geometry.make_group_getter"),
    ),
    SideChannel(
        "pending_block_table_layout",
        "pending_layout",
        ("worker.gpu_model_runner",),
        ("worker.block_table",),
        "Model Runner V1 `may_reinitialize_input_batch`",
        "`MultiGroupBlockTable.__init__` (built inside `InputBatch`) takes each "
        "group's K, width and slot mode",
    ),
    SideChannel(
        "pending_dcp_shard_counts",
        "pending_shard_counts",
        ("worker.gpu_model_runner_v2",),
        ("worker.gpu_block_table",),
        "Model Runner V2 `initialize_kv_cache`",
        "`BlockTables.__init__` takes each group's K",
    ),
    SideChannel(
        "use_indexer_geometry",
        "current_indexer_geometry",
        ("worker.deepseek_v32_attention",),
        ("worker.sparse_attn_indexer",),
        "DeepSeek-V3.2's `sparse_attn_indexer` call of a sparse layer whose "
        "indexer cache is partial",
        "`_merge_dcp_topk_global` (all-gathering over D) drops duplicate "
        "replicas' candidates",
    ),
    SideChannel(
        "use_replica_group",
        "current_replica_group",
        ("worker.mla_attention",),
        (
            "worker.mla_attention",
            "worker.mla_dcp_manager",
            "worker.sparse_mla_attention",
        ),
        "the MLA builder of a partial group whose collectives stay within its "
        "replica, while it is bound and built",
        "MLA's and the DCP ops' `get_dcp_group` answer the replica group (K "
        "ranks), the context chunks are planned as for K sharded ranks, and the "
        "layer binding gives the layer a replica DCP manager",
        via=("mla_geometry.bind_mla_layer", "mla_geometry.make_group_getter"),
    ),
)
"""Every side channel: the README's side-channel table is made from these."""

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
ShardCountsSource = Callable[[], "Sequence[int] | None"]
"""Works out the per-group K when a ``BlockTables`` asks (None: upstream's)."""

_pending_shard_counts: contextvars.ContextVar[
    tuple[int, ...] | ShardCountsSource | None
] = contextvars.ContextVar("vllm_dcp_geometry_shard_counts", default=None)


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


_active_replica: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "vllm_dcp_geometry_active_replica_group", default=None
)


@contextlib.contextmanager
def use_replica_group(coordinator: Any) -> Iterator[Any]:
    """Make ``coordinator`` (a partial group's replica ``GroupCoordinator``)
    the collective group the patched MLA helpers answer, for the duration of
    one binding or upstream builder call."""
    token = _active_replica.set(coordinator)
    try:
        yield coordinator
    finally:
        _active_replica.reset(token)


def current_replica_group() -> Any:
    """The replica group of the partial MLA group being built, or None."""
    return _active_replica.get()


_active_indexer: contextvars.ContextVar[GroupGeometry | None] = contextvars.ContextVar(
    "vllm_dcp_geometry_active_indexer", default=None
)


@contextlib.contextmanager
def use_indexer_geometry(geometry: GroupGeometry) -> Iterator[GroupGeometry]:
    """Make ``geometry`` (a partial indexer cache's) the one the top-k merge
    answers for, for the duration of one ``sparse_attn_indexer`` call."""
    if not geometry.is_partial:
        raise ValueError(f"{geometry.describe()}: only a partial indexer merges")
    token = _active_indexer.set(geometry)
    try:
        yield geometry
    finally:
        _active_indexer.reset(token)


def current_indexer_geometry() -> GroupGeometry | None:
    """The partial indexer cache whose top-k is being merged, or None."""
    return _active_indexer.get()


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
def pending_dcp_shard_counts(
    shard_counts: Sequence[int] | ShardCountsSource,
) -> Iterator[None]:
    """Hand ``shard_counts`` (one K per group, or a function giving them) to
    every ``BlockTables`` built inside."""
    value = shard_counts if callable(shard_counts) else tuple(shard_counts)
    token = _pending_shard_counts.set(value)
    try:
        yield
    finally:
        _pending_shard_counts.reset(token)


def pending_shard_counts() -> tuple[int, ...] | None:
    """The per-group K a ``BlockTables`` being built should take."""
    value = _pending_shard_counts.get()
    if callable(value):
        counts = value()
        return None if counts is None else tuple(counts)
    return value
