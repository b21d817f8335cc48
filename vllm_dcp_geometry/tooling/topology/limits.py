# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a topology and the command line may ask for: value ranges bounded by
what vLLM can represent, and the error bad input gets.

Every upper bound is a named constant derived from a limit of vLLM 0.33.0 or
of the machine, and every refusal names it, so a user sees which limit a value
broke and what the allowed range is.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError

INT32_MAX = 2**31 - 1
"""The largest value of vLLM's int32 tensors."""

MAX_MODEL_LEN = INT32_MAX
"""vLLM's input batch counts a request's tokens in int32 (``InputBatch``'s
``num_tokens_no_spec`` and ``num_computed_tokens_cpu``)."""

MAX_POOL_PAGES = 2**31
"""Block tables hold int32 block ids: a KV pool has at most ``2**31`` pages
(ids ``0 .. 2**31 - 1``), the null page included."""

MAX_POOL_SLOTS = 2**31
"""Model Runner V2's ``_compute_slot_mappings_kernel`` multiplies an int32 block
id by the block size in int32, so every slot ``block_id * B + offset`` of the
pool stays below ``2**31``: ``pages * B <= 2**31``."""

LARGEST_DEVICE_MEMORY_BYTES = 288 * 10**9
"""Memory of the largest accelerator vLLM 0.33.0 runs on (288 GB: NVIDIA B300,
AMD Instinct MI355X). A rank's block tables, and the KV cache one max-length
request needs on a rank, must fit in it."""

MAX_TOPOLOGY_FILE_BYTES = 16 * 2**20
"""Topology files are small tables; a larger file is not one."""

REPLAY_MAX_TOKENS = 2**27
"""``replay`` builds its request from a Python list of token ids (8 bytes a
token): 2**27 tokens is 1 GiB of host memory."""

REPLAY_MAX_POOL_PAGES = 2**24
"""vLLM's ``BlockPool`` makes one Python ``KVCacheBlock`` per page (about 136
bytes and 5 us each): 2**24 pages is about 2.3 GiB and 80 s to build."""

REPLAY_MAX_CHECKED_COLUMNS = 2**31
"""``replay`` re-reads every group's block-table row after each step (about
85 ns a column): steps times the summed table widths stays below 2**31 so a
replay ends within a few minutes."""


class TopologyError(DcpGeometryError):
    """A topology file, profile or command-line value is malformed, out of
    range, or asks for a layout the contract or vLLM forbids."""


_short = reprlib.Repr()
_short.maxstring = 60
_short.maxlong = 40
_short.maxother = 60
_short.maxlist = 6
_short.maxdict = 6


def show(value: Any) -> str:
    """A short, one-line ``repr`` of a user's value for an error message."""
    return _short.repr(value)


@dataclass(frozen=True)
class IntRange:
    """An allowed integer range; ``limit`` names what bounds it."""

    low: int
    high: int
    limit: str

    def describe(self) -> str:
        return f"an integer in [{self.low}, {self.high}] ({self.limit})"

    def check(self, value: Any, what: str) -> int:
        """``value`` if it is an int (not a bool) in range, else raise
        ``TopologyError`` naming ``what`` and the range."""
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not self.low <= value <= self.high
        ):
            raise TopologyError(f"{what} must be {self.describe()}, got {show(value)}")
        return value


INT32_LIMIT = "vLLM holds it in int32"

POSITIVE_INT32 = IntRange(1, INT32_MAX, INT32_LIMIT)
NON_NEGATIVE_INT32 = IntRange(0, INT32_MAX, INT32_LIMIT)
MODEL_LEN_RANGE = IntRange(
    1, MAX_MODEL_LEN, "MAX_MODEL_LEN: vLLM counts a request's tokens in int32"
)
REPLAY_TOKENS_RANGE = IntRange(
    1,
    REPLAY_MAX_TOKENS,
    "REPLAY_MAX_TOKENS: the replay holds the request's token ids in memory",
)
REPLAY_POOL_PAGES_RANGE = IntRange(
    2,
    REPLAY_MAX_POOL_PAGES,
    "the null page plus one; REPLAY_MAX_POOL_PAGES: one host object per page",
)
