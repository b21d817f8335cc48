# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The per-cache DCP geometry contract, as pure functions.

This module is the single source of truth for how a KV-cache group lays out
token positions under decode context parallelism (DCP). It imports nothing from
vLLM, so it can be read, tested and used (the CLI, the benchmarks) on its own.

The rules are written out, numbered, with a worked table, in
``docs/contract.md``; each function here names the rule it applies
(``R1`` ... ``P1``). Symbols:

- ``D``: DCP world size, ``r`` in ``[0, D)`` a rank of the DCP group.
- ``K``: a group's token-position shard count; rank ``r`` stores shard
  ``s = r % K`` and is replica ``q = r // K`` of it (``D / K`` replicas).
- ``B``: physical block size (tokens per block on one rank); ``V = B * K`` the
  tokens one block-table column covers (the virtual block).
- ``I``: interleave size, tokens placed on one shard before the next.
- ``L``: the length a block table must address.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

PAD_SLOT_ID = -1
"""Slot written for a position another shard owns (vLLM's ``PAD_SLOT_ID``)."""


class DcpGeometryError(ValueError):
    """A KV-cache spec, layer or layout breaks the DCP geometry contract."""


class ShardCountMergeError(DcpGeometryError, AssertionError):
    """Specs of different K asked to share one KV-cache group. Also an
    ``AssertionError``: that is how vLLM's planner learns that two specs do
    not merge (``is_kv_cache_spec_uniform`` catches only it), so that it keeps
    them in different groups instead of failing start-up."""


class TokenLayout(str, enum.Enum):
    """How a cache stores token positions under DCP, before any count is set."""

    SHARDED = "sharded"
    """Attention whose positions are spread over the DCP group (K = D unless
    a partial ``dcp_kv_shard_count`` says otherwise)."""

    REPLICATED = "replicated"
    """Attention whose every position is held by every rank (K = 1)."""

    RECURRENT = "recurrent"
    """Recurrent state indexed by global position; never token-sharded."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(-a // b)


def check_dcp_world_size(dcp_world_size: int) -> None:
    """Rule R1: the DCP world size is a positive integer."""
    if isinstance(dcp_world_size, bool) or not isinstance(dcp_world_size, int):
        raise DcpGeometryError(
            f"DCP world size must be an integer, got {dcp_world_size!r}"
        )
    if dcp_world_size < 1:
        raise DcpGeometryError(f"DCP world size must be >= 1, got {dcp_world_size}")


def check_shard_count_value(owner: str, dcp_kv_shard_count: int | None) -> None:
    """``dcp_kv_shard_count`` is None or a positive integer (checked without D)."""
    if dcp_kv_shard_count is None:
        return
    if isinstance(dcp_kv_shard_count, bool) or not isinstance(dcp_kv_shard_count, int):
        raise DcpGeometryError(
            f"{owner}: dcp_kv_shard_count must be an integer or None, "
            f"got {dcp_kv_shard_count!r}"
        )
    if dcp_kv_shard_count < 1:
        raise DcpGeometryError(
            f"{owner}: dcp_kv_shard_count must be >= 1, got {dcp_kv_shard_count}"
        )


def check_shard_count_divides(
    owner: str, shard_count: int, dcp_world_size: int, name: str = "dcp_kv_shard_count"
) -> None:
    """Rule R6: ``1 <= K <= D`` and ``D % K == 0`` - the one check every
    caller uses (specs, group geometries, operator overrides)."""
    k, d = shard_count, dcp_world_size
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d or d % k:
        raise DcpGeometryError(
            f"{owner}: {name} K={k!r} must divide the DCP world size D={d} "
            "(1 <= K <= D, D % K == 0)"
        )


def resolve_shard_count(
    *,
    owner: str,
    layout: TokenLayout,
    dcp_world_size: int,
    dcp_kv_shard_count: int | None = None,
) -> int:
    """Token-position shard count K of one layer's cache (rules R1-R6).

    ``owner`` names the spec or layer for error messages.
    """
    check_dcp_world_size(dcp_world_size)
    if dcp_world_size == 1:
        return 1
    if layout is TokenLayout.RECURRENT:
        if dcp_kv_shard_count not in (None, 1):
            raise DcpGeometryError(
                f"{owner}: recurrent state is indexed by global position and is "
                f"never token-sharded, but dcp_kv_shard_count="
                f"{dcp_kv_shard_count} was asked for (D={dcp_world_size})"
            )
        return 1
    if layout is TokenLayout.REPLICATED:
        if dcp_kv_shard_count not in (None, 1):
            raise DcpGeometryError(
                f"{owner}: a replicated cache (dcp_sharded=False) holds every "
                f"position on every rank, so it cannot be partially sharded: "
                f"dcp_kv_shard_count={dcp_kv_shard_count}, D={dcp_world_size}"
            )
        return 1
    if layout is not TokenLayout.SHARDED:
        raise DcpGeometryError(f"{owner}: unknown token layout {layout!r}")
    if dcp_kv_shard_count is None:
        return dcp_world_size
    check_shard_count_value(owner, dcp_kv_shard_count)
    check_shard_count_divides(owner, dcp_kv_shard_count, dcp_world_size)
    return dcp_kv_shard_count


def resolve_uniform_shard_count(owner: str, layer_counts: Mapping[str, int]) -> int:
    """Rule R7: the layers of one aggregate spec share a single K."""
    if not layer_counts:
        raise DcpGeometryError(f"{owner}: an aggregate spec without layers has no K")
    distinct = set(layer_counts.values())
    if len(distinct) != 1:
        by_count: dict[int, list[str]] = {}
        for name, count in layer_counts.items():
            by_count.setdefault(count, []).append(name)
        detail = "; ".join(
            f"K={count}: {', '.join(sorted(names))}"
            for count, names in sorted(by_count.items())
        )
        raise DcpGeometryError(
            f"{owner}: every layer of one KV-cache group must have the same "
            f"token-position shard count, got {detail}"
        )
    return distinct.pop()


@dataclass(frozen=True)
class GroupGeometry:
    """Where DCP rank ``r`` sits in one KV-cache group with ``K`` shards.

    Invariants: ``D >= 1``, ``1 <= K <= D``, ``D % K == 0``, ``0 <= r < D``,
    ``I >= 1``. Rank ``r`` stores shard ``s = r % K`` and is replica
    ``q = r // K`` of it. ``default_shard_count`` is the K vLLM 0.33.0 derives
    for the group's spec from its boolean ``dcp_sharded`` alone (D or 1), or
    None where nobody asked.
    """

    owner: str
    """The group (or layer), for error messages."""
    shard_count: int
    dcp_world_size: int
    dcp_rank: int
    interleave_size: int = 1
    default_shard_count: int | None = None

    def __post_init__(self) -> None:
        check_dcp_world_size(self.dcp_world_size)
        d, k, r = self.dcp_world_size, self.shard_count, self.dcp_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < d:
            raise DcpGeometryError(
                f"{self.owner}: DCP rank {r!r} is outside the group of size {d}"
            )
        check_shard_count_divides(self.owner, k, d, name="shard count")
        if self.interleave_size < 1:
            raise DcpGeometryError(
                f"{self.owner}: interleave size must be >= 1, got "
                f"{self.interleave_size}"
            )

    @property
    def shard(self) -> int:
        """``s = r % K``: the shard of the group's positions this rank stores."""
        return self.dcp_rank % self.shard_count

    @property
    def replica(self) -> int:
        """``q = r // K``: which of the ``D / K`` identical copies of ``s``."""
        return self.dcp_rank // self.shard_count

    @property
    def replica_dcp_ranks(self) -> range:
        """Rule A6: the DCP ranks ``q*K .. q*K + K - 1`` of this rank's
        replica, which hold shards ``0 .. K-1`` in order."""
        first = self.replica * self.shard_count
        return range(first, first + self.shard_count)

    @property
    def replica_count(self) -> int:
        """``D / K``: identical copies of every shard."""
        return self.dcp_world_size // self.shard_count

    @property
    def is_replicated(self) -> bool:
        """K = 1: every rank holds every position."""
        return self.shard_count == 1

    @property
    def is_partial(self) -> bool:
        """1 < K < D: positions spread over K of the D ranks, D/K replicas."""
        return 1 < self.shard_count < self.dcp_world_size

    @property
    def is_sharded(self) -> bool:
        """K = D: positions spread over every DCP rank (vLLM's own DCP)."""
        return self.shard_count == self.dcp_world_size

    @property
    def matches_default(self) -> bool:
        """K is what vLLM derives from the spec's ``dcp_sharded`` flag."""
        return self.shard_count == self.default_shard_count

    @property
    def needs_admission(self) -> bool:
        """Whether attention must be admitted for this K: every K < D, and a
        K = D that is not vLLM's default (a 'sharded' override on a layer
        vLLM built replicated, whose impl may run for fewer ranks)."""
        return not (self.is_sharded and self.matches_default)

    @property
    def shard_world(self) -> tuple[int, int]:
        """``(K, s)``: world size and rank of the group's token sharding."""
        return self.shard_count, self.shard

    def describe(self) -> str:
        return (
            f"{self.owner} (K={self.shard_count}, D={self.dcp_world_size}, "
            f"rank {self.dcp_rank}: shard {self.shard}, replica {self.replica})"
        )


def check_prefill_context_parallel(
    owner: str, shard_count: int, dcp_world_size: int, pcp_world_size: int
) -> None:
    """Rule P1 (its partial-K half; admission refuses K < D): PCP keeps
    upstream behaviour, which knows K in {1, D} only: a partial
    K (1 < K < D) together with prefill context parallelism > 1 is refused."""
    if pcp_world_size > 1 and 1 < shard_count < dcp_world_size:
        raise DcpGeometryError(
            f"{owner}: a partial DCP shard count K={shard_count} "
            f"(D={dcp_world_size}) cannot be combined with prefill context "
            f"parallelism (PCP={pcp_world_size}); use K=1 ('replicated') or "
            "K=D ('sharded'), or turn PCP off"
        )


def virtual_block_size(block_size: int, shard_count: int) -> int:
    """``V = B * K``: tokens one block-table column covers (rules W1, S1)."""
    return block_size * shard_count


def attention_block_table_width(max_len: int, block_size: int, shard_count: int) -> int:
    """Rule W1: columns an attention group needs to address ``max_len``
    tokens, ``cdiv(L, B * K)``."""
    return cdiv(max_len, virtual_block_size(block_size, shard_count))


def recurrent_align_block_table_width(
    max_len: int, block_size: int, num_speculative_blocks: int
) -> int:
    """Rule W2: columns of a recurrent group in align mode: rows are position-indexed
    over the whole sequence, ``cdiv(L, B) + num_speculative_blocks``."""
    return cdiv(max_len, block_size) + num_speculative_blocks


def full_attention_pages_per_request(
    max_len: int, block_size: int, shard_count: int
) -> int:
    """Rule M1: pages one rank reserves for a full-attention request,
    ``cdiv(cdiv(L, K), B)``."""
    return cdiv(cdiv(max_len, shard_count), block_size)


def scheduler_block_size(virtual_block_sizes: Iterable[int]) -> int:
    """Rule S1: the LCM over groups of ``V = B * K``, the unit every group's blocks
    tile evenly (prefix-cache hashing and scheduler block size)."""
    sizes = list(virtual_block_sizes)
    if not sizes:
        raise DcpGeometryError("no KV-cache groups to size a scheduler block for")
    return math.lcm(*sizes)


def check_interleave(block_size: int, shard_count: int, interleave_size: int) -> None:
    """Rule L2: the interleave ``I`` must be positive and divide ``B`` when K > 1, so a
    virtual block holds whole interleave runs of every shard."""
    if interleave_size < 1:
        raise DcpGeometryError(f"interleave size must be >= 1, got {interleave_size}")
    if shard_count > 1 and block_size % interleave_size != 0:
        raise DcpGeometryError(
            f"block size B={block_size} must be divisible by the interleave size "
            f"I={interleave_size} when a group is sharded (K={shard_count})"
        )


def local_seq_len(
    seq_len: int,
    block_size: int,
    shard_count: int,
    interleave_size: int,
    shard: int,
) -> int:
    """Rule A1: positions ``< seq_len`` that shard ``shard`` stores."""
    check_interleave(block_size, shard_count, interleave_size)
    if not 0 <= shard < shard_count:
        raise DcpGeometryError(f"shard {shard} is outside [0, {shard_count})")
    if shard_count == 1:
        return seq_len
    # With I | B, the owner of p is (p // I) % K: whole rounds of K runs first.
    run = interleave_size * shard_count
    full_rounds, rest = divmod(seq_len, run)
    tail = min(max(rest - shard * interleave_size, 0), interleave_size)
    return full_rounds * interleave_size + tail


def reference_slot_mapping(
    positions: npt.ArrayLike,
    block_table_row: npt.ArrayLike,
    *,
    block_size: int,
    shard_count: int,
    interleave_size: int,
    shard: int,
) -> np.ndarray:
    """Rule L1: slot of every position on the rank storing ``shard``, or
    ``PAD_SLOT_ID``; over the K shards of one replica it gives every position
    exactly one slot (rule L3, which ``replay``, ``simulate`` and the tests
    check on vLLM's real tables and kernels).

    ``vb = p // V``, ``o = p % V``; owner ``(o // I) % K``; local offset
    ``(o // (I*K)) * I + o % I``; slot ``row[vb] * B + local`` where the owner
    is ``shard``. K = 1 maps every position locally.
    """
    import numpy as np

    check_interleave(block_size, shard_count, interleave_size)
    if not 0 <= shard < shard_count:
        raise DcpGeometryError(f"shard {shard} is outside [0, {shard_count})")
    pos = np.asarray(positions, dtype=np.int64)
    row = np.asarray(block_table_row, dtype=np.int64)
    virtual = virtual_block_size(block_size, shard_count)
    column = pos // virtual
    if pos.size and int(column.max()) >= row.size:
        raise DcpGeometryError(
            f"position {int(pos.max())} needs block-table column "
            f"{int(column.max())}, but the row has {row.size} columns"
        )
    offset = pos % virtual
    owner = (offset // interleave_size) % shard_count
    local = (offset // (interleave_size * shard_count)) * interleave_size + (
        offset % interleave_size
    )
    slots = row[column] * block_size + local
    return np.where(owner == shard, slots, PAD_SLOT_ID).astype(np.int64)
