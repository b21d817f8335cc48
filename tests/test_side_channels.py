# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The side channels of ``runtime.group_context``: every one is made by the
one factory, holds its value only inside its ``with`` block (nested uses
restore the outer one, exceptions included, other threads see nothing) and
reads None outside."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.runtime import group_context
from vllm_dcp_geometry.runtime.group_context import (
    CHANNELS,
    current_group_geometry,
    pending_dcp_shard_counts,
    pending_shard_counts,
    side_channel,
    use_group_geometry,
    use_indexer_geometry,
)


def test_every_channel_end_is_named_as_its_table_entry() -> None:
    for channel in CHANNELS:
        for name in (channel.setter, channel.getter):
            end = getattr(group_context, name)
            assert (end.__name__, end.__qualname__) == (name, name)
            assert end.__doc__


def test_a_channel_holds_its_value_only_inside_and_nests() -> None:
    outer = GroupGeometry("outer", 2, 4, 1)
    inner = GroupGeometry("inner", 1, 4, 1)
    assert current_group_geometry() is None
    with use_group_geometry(outer) as given:
        assert given is outer
        assert current_group_geometry() is outer
        with pytest.raises(RuntimeError), use_group_geometry(inner):
            assert current_group_geometry() is inner
            raise RuntimeError("upstream failed")
        assert current_group_geometry() is outer
        seen: list[Any] = []
        thread = threading.Thread(target=lambda: seen.append(current_group_geometry()))
        thread.start()
        thread.join()
        assert seen == [None]
    assert current_group_geometry() is None


def test_the_channels_are_independent() -> None:
    setter, getter = side_channel("use_x", "current_x", setter_doc="s", getter_doc="g")
    with setter("x"):
        assert getter() == "x"
        assert current_group_geometry() is None
    assert getter() is None


def test_the_indexer_channel_refuses_a_geometry_that_is_not_partial() -> None:
    with (
        pytest.raises(ValueError, match="only a partial indexer merges"),
        use_indexer_geometry(GroupGeometry("indexer", 4, 4, 1)),
    ):
        pass
    assert group_context.current_indexer_geometry() is None


def test_shard_counts_are_copied_or_worked_out_when_read() -> None:
    counts = [2, 4]
    with pending_dcp_shard_counts(counts):
        counts.append(1)
        assert pending_shard_counts() == (2, 4)
    asked: list[int] = []

    def source() -> list[int] | None:
        asked.append(1)
        return None if len(asked) > 1 else [1, 4]

    with pending_dcp_shard_counts(source):
        assert asked == []
        assert pending_shard_counts() == (1, 4)
        assert pending_shard_counts() is None
    assert pending_shard_counts() is None
