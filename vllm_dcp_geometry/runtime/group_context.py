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
    Set by the FlashAttention, FlashInfer, MLA, sparse MLA and DSA indexer
    builder patches while a partial group whose collectives stay within its replica
    (rule A6) is bound and its upstream builder code runs
    (``FlashAttentionMetadataBuilder.__init__``,
    ``FlashInferMetadataBuilder.__init__`` and ``.build``,
    ``MLACommonMetadataBuilder.__init__`` and ``.build``,
    ``SparseMLACommonMetadataBuilder.__init__`` and its context planning,
    ``DeepseekV32IndexerMetadataBuilder.__init__``), by the layer binding
    while it makes the layer's replica ``MLADCPManager``, and by
    DeepSeek-V3.2's indexer call of a cache bound in its replica, and around
    every forward of an attention impl bound in its replica
    (``impl_binding.ReplicaForward``). Read by the FlashAttention,
    FlashInfer, MLA, sparse MLA, DCP ops and indexer modules'
    ``get_dcp_group``, which then answer the group's replica
    ``GroupCoordinator`` (K ranks), by
    ``build_mla_chunked_context_metadata`` (which then plans as for a
    sharded group of K), by the MLA layer binding, the indexer cache binding
    and the top-k merge. Why: upstream's MLA builders, DCP manager, top-k
    merge and FlashAttention's and FlashInfer's DCP paths take their
    collective group from ``get_dcp_group()``, which has no notion of a
    group's replica.

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
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.runtime.geometry import BlockTableLayout


@dataclass(frozen=True)
class SideChannel:
    """One side channel: the function that sets it and the one that reads it
    (as vLLM pairs ``set_forward_context`` and ``get_forward_context``), the
    patches that write and read it, and what the reader takes from it.

    Writer and reader patches must be removed together (their
    ``Patch.remove_with``; a ``self_fed`` writer with itself); a test checks
    that each writer calls ``setter`` and each reader ``getter``."""

    setter: str
    getter: str
    writers: tuple[str, ...]
    """Patch modules (under ``vllm_dcp_geometry.patches``) that set it."""
    readers: tuple[str, ...]
    """Patch modules that read it."""
    written_when: str
    read_for: str
    via: tuple[str, ...] = ()
    """``module.function`` of shared code (under ``vllm_dcp_geometry.runtime``)
    that sets or reads it on the patches' behalf (a patch calling one of them
    writes or reads it)."""
    self_fed: tuple[str, ...] = ()
    """Writers whose value only their own module's reader takes (no other
    reader is reached while they hold it), so they go with no other reader."""


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
        via=(
            "metadata_builders.builder_init",
            "metadata_builders.group_world_getter",
            "mla_geometry.make_group_getter",
        ),
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
        (
            "worker.flash_attn",
            "worker.flashinfer",
            "worker.mla_attention",
            "worker.sparse_mla_attention",
            "worker.mla_indexer",
            "worker.deepseek_v32_attention",
        ),
        (
            "worker.flash_attn",
            "worker.flashinfer",
            "worker.mla_attention",
            "worker.mla_dcp_manager",
            "worker.sparse_mla_attention",
            "worker.sparse_attn_indexer",
            "worker.deepseek_v32_attention",
        ),
        "the FlashAttention, FlashInfer, MLA, sparse MLA and DSA indexer "
        "builders of a partial group whose collectives stay within its replica, "
        "while it is bound and built; every forward of an attention impl bound "
        "in its replica; DeepSeek-V3.2's indexer call of such a cache",
        "FlashAttention's, FlashInfer's, MLA's, sparse MLA's, the DCP ops' and "
        "the indexer's "
        "`get_dcp_group` answer the replica group (K ranks), the context "
        "chunks are planned as for K sharded ranks, the layer binding gives "
        "the layer a replica DCP manager (an impl its replica forward), and "
        "the top-k merge gathers over the replica",
        via=(
            "metadata_builders.builder_init",
            "impl_binding.bind_impl_to_group",
            "mla_geometry.bind_mla_layer",
            "mla_geometry.make_group_getter",
        ),
        # FlashAttention's and FlashInfer's builders and DCP paths reach no
        # other module's get_dcp_group: their combines are handed the group
        # their own module's getter gave.
        self_fed=("worker.flash_attn", "worker.flashinfer"),
    ),
)
"""Every side channel: the README's side-channel table is made from these."""

LAYOUT_ATTR = "dcp_geometry_layout"
"""Set on a ``MultiGroupBlockTable`` to the layout it took from the channel, and
on Model Runner V1 to the layout its input batch was built with."""

TAKEN_SHARD_COUNTS_ATTR = "dcp_shard_counts"
"""Set on a ``BlockTables`` to the shard counts it took (None: upstream's)."""


_Value = TypeVar("_Value")
ChannelWriter = Callable[[_Value], AbstractContextManager[_Value]]
"""A channel's setter: holds the value it is given for the code run inside
its ``with`` block (and yields it)."""

ChannelReader = Callable[[], _Value | None]
"""A channel's getter: what the innermost enclosing setter holds, or None
outside every one."""

ShardCountsSource = Callable[[], "Sequence[int] | None"]
"""Works out the per-group K when a ``BlockTables`` asks (None: upstream's)."""


def _as_given(value: Any) -> Any:
    return value


def side_channel(
    setter: str,
    getter: str,
    *,
    setter_doc: str,
    getter_doc: str,
    admit: Callable[[Any], Any] = _as_given,
    resolve: Callable[[Any], Any] = _as_given,
) -> tuple[ChannelWriter[Any], ChannelReader[Any]]:
    """The two ends of one side channel, named ``setter`` and ``getter``.

    The setter holds ``admit(value)`` in a context variable of its own for
    the duration of its ``with`` block, so nested uses restore the outer
    value on the way out (exceptions included) and threads and tasks never
    see each other's; ``admit`` may refuse the value. The getter answers
    ``resolve`` of the value held, or None outside every setter."""
    held: contextvars.ContextVar[Any] = contextvars.ContextVar(
        f"vllm_dcp_geometry_{setter}", default=None
    )

    @contextlib.contextmanager
    def write(value: Any) -> Iterator[Any]:
        token = held.set(admit(value))
        try:
            yield value
        finally:
            held.reset(token)

    def read() -> Any:
        value = held.get()
        return None if value is None else resolve(value)

    for end, name, doc in ((write, setter, setter_doc), (read, getter, getter_doc)):
        end.__name__ = end.__qualname__ = name
        end.__doc__ = doc
    return write, read


def _admit_partial_indexer(geometry: GroupGeometry) -> GroupGeometry:
    if not geometry.is_partial:
        raise ValueError(f"{geometry.describe()}: only a partial indexer merges")
    return geometry


def _admit_shard_counts(
    shard_counts: Sequence[int] | ShardCountsSource,
) -> tuple[int, ...] | ShardCountsSource:
    return shard_counts if callable(shard_counts) else tuple(shard_counts)


def _resolve_shard_counts(
    held: tuple[int, ...] | ShardCountsSource,
) -> tuple[int, ...] | None:
    if not callable(held):
        return held
    counts = held()
    return None if counts is None else tuple(counts)


use_group_geometry: ChannelWriter[GroupGeometry]
current_group_geometry: ChannelReader[GroupGeometry]
use_group_geometry, current_group_geometry = side_channel(
    "use_group_geometry",
    "current_group_geometry",
    setter_doc="Make ``geometry`` the group the patched backend helpers answer "
    "for, for the duration of one upstream builder call.",
    getter_doc="The group whose builder code is running, or None outside one.",
)

use_replica_group: ChannelWriter[Any]
current_replica_group: ChannelReader[Any]
use_replica_group, current_replica_group = side_channel(
    "use_replica_group",
    "current_replica_group",
    setter_doc="Make ``coordinator`` (a partial group's replica "
    "``GroupCoordinator``) the collective group the patched helpers "
    "answer, for the duration of one binding, upstream builder call or "
    "replica-bound forward.",
    getter_doc="The replica group of the partial group being built or run, or None.",
)

use_indexer_geometry: ChannelWriter[GroupGeometry]
current_indexer_geometry: ChannelReader[GroupGeometry]
use_indexer_geometry, current_indexer_geometry = side_channel(
    "use_indexer_geometry",
    "current_indexer_geometry",
    setter_doc="Make ``geometry`` (a partial indexer cache's; any other is "
    "refused) the one the top-k merge answers for, for the duration of one "
    "``sparse_attn_indexer`` call.",
    getter_doc="The partial indexer cache whose top-k is being merged, or None.",
    admit=_admit_partial_indexer,
)

pending_block_table_layout: ChannelWriter[BlockTableLayout]
pending_layout: ChannelReader[BlockTableLayout]
pending_block_table_layout, pending_layout = side_channel(
    "pending_block_table_layout",
    "pending_layout",
    setter_doc="Hand ``layout`` to every ``MultiGroupBlockTable`` built inside.",
    getter_doc="The layout a ``MultiGroupBlockTable`` being built should take.",
)

pending_dcp_shard_counts: ChannelWriter[Sequence[int] | ShardCountsSource]
pending_shard_counts: ChannelReader[tuple[int, ...]]
pending_dcp_shard_counts, pending_shard_counts = side_channel(
    "pending_dcp_shard_counts",
    "pending_shard_counts",
    setter_doc="Hand ``shard_counts`` (one K per group, or a function giving "
    "them) to every ``BlockTables`` built inside.",
    getter_doc="The per-group K a ``BlockTables`` being built should take (the "
    "function's answer where a function was handed over).",
    admit=_admit_shard_counts,
    resolve=_resolve_shard_counts,
)
