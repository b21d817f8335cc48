# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Every side channel between patches (``group_context.CHANNELS``) has both
ends: its setter and getter exist, every writer patch sets it and every reader
reads it (itself, or through the shared runtime code it names), and writers
and readers are removed together. Each check is shown to catch a channel with
an end missing."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import textwrap
import types
from typing import Any

import pytest

from vllm_dcp_geometry.patches import declarations

pytestmark = pytest.mark.patches(
    "worker.gpu_model_runner", "worker.gpu_model_runner_v2"
)

PREFIX = "vllm_dcp_geometry.patches."
RUNTIME = "vllm_dcp_geometry.runtime"


def _names_used(module: types.ModuleType) -> set[str]:
    import ast

    tree = ast.parse(inspect.getsource(module))
    return {
        node.id if isinstance(node, ast.Name) else node.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.Attribute))
    }


def _shared_source(path: str) -> str:
    """The source of a shared ``module.function`` under ``runtime``, with the
    module's own classes and functions it names (one level: the helpers it
    hands its steps to)."""
    import ast

    module_name, _, function = path.rpartition(".")
    shared = importlib.import_module(f"{RUNTIME}.{module_name}")
    source = inspect.getsource(getattr(shared, function))
    sources = [source]
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Name) and node.id != function:
            helper = getattr(shared, node.id, None)
            if (
                inspect.isfunction(helper) or inspect.isclass(helper)
            ) and helper.__module__ == shared.__name__:
                sources.append(inspect.getsource(helper))
    return "\n".join(sources)


def channel_problems(channels: Any) -> list[str]:
    """Each channel has both ends: its setter and getter exist in
    ``group_context``, every writer patch calls the setter, every reader
    the getter, and writers and readers are each other's partners."""
    from vllm_dcp_geometry.runtime import group_context

    problems = []
    for channel in channels:
        for fn in (channel.setter, channel.getter):
            if not callable(getattr(group_context, fn, None)):
                problems.append(f"{channel.setter}: no function {fn}")
        for role, patches, fn in (
            ("writer", channel.writers, channel.setter),
            ("reader", channel.readers, channel.getter),
        ):
            # Shared functions that use ``fn`` on a patch's behalf.
            via = {
                path.rpartition(".")[2]
                for path in channel.via
                if fn in _shared_source(path)
            }
            for name in patches:
                patch = importlib.import_module(PREFIX + name)
                used = _names_used(patch)
                if fn not in used and not via & used:
                    problems.append(f"{channel.setter}: {role} {name} never uses {fn}")
        for path in channel.via:
            source = _shared_source(path)
            if channel.setter not in source and channel.getter not in source:
                problems.append(
                    f"{channel.setter}: {path} uses neither {channel.setter} nor "
                    f"{channel.getter}"
                )
        for writer in sorted(set(channel.self_fed) - set(channel.readers)):
            problems.append(
                f"{channel.setter}: {writer} is self-fed but does not read it"
            )
        for writer in set(channel.writers) - set(channel.self_fed):
            for reader in set(channel.readers) - set(channel.writers):
                partners = declarations()[PREFIX + writer].remove_with
                if reader not in partners:
                    problems.append(
                        f"{channel.setter}: {writer} is not removed with {reader}"
                    )
    return problems


def test_every_side_channel_has_both_ends() -> None:
    from vllm_dcp_geometry.runtime.group_context import CHANNELS

    assert len(CHANNELS) == 5
    assert channel_problems(CHANNELS) == []


def test_the_channel_check_catches_a_missing_end() -> None:
    from vllm_dcp_geometry.runtime.group_context import CHANNELS, SideChannel

    v1 = CHANNELS[1]
    broken = (
        SideChannel(v1.setter, v1.getter, v1.writers, ("worker.utils",), "", ""),
        SideChannel(v1.setter, "no_such_getter", v1.writers, v1.readers, "", ""),
    )
    assert channel_problems(broken) == [
        "pending_block_table_layout: reader worker.utils never uses pending_layout",
        "pending_block_table_layout: worker.gpu_model_runner is not removed with "
        "worker.utils",
        "pending_block_table_layout: no function no_such_getter",
        "pending_block_table_layout: reader worker.block_table never uses "
        "no_such_getter",
    ]


def test_the_channel_check_follows_shared_code_into_its_helpers() -> None:
    """``builder_init`` hands the channels' use to its module's
    ``_BuilderConstruction``: followed there, the MLA indexer (which calls
    only ``builder_init``) writes the replica channel. (Pointed at shared
    code that touches neither end, the check fails: below.)"""
    from vllm_dcp_geometry.runtime import metadata_builders
    from vllm_dcp_geometry.runtime.group_context import CHANNELS

    replica = CHANNELS[-1]
    assert replica.setter == "use_replica_group"
    assert "use_replica_group" not in inspect.getsource(metadata_builders.builder_init)
    assert "worker.mla_indexer" in replica.writers
    assert channel_problems((replica,)) == []


def test_the_channel_check_catches_a_shared_writer_that_does_not_write() -> None:
    from vllm_dcp_geometry.runtime.group_context import CHANNELS, SideChannel

    builders = CHANNELS[0]
    wrong_via = SideChannel(
        builders.setter,
        builders.getter,
        ("worker.flashinfer",),
        ("worker.flashinfer",),
        "",
        "",
        via=("metadata_builders.bound_partial_geometry",),
    )
    assert channel_problems((wrong_via,)) == [
        "use_group_geometry: writer worker.flashinfer never uses use_group_geometry",
        "use_group_geometry: metadata_builders.bound_partial_geometry uses neither "
        "use_group_geometry nor current_group_geometry",
    ]
    no_via = dataclasses.replace(builders, via=())
    assert (
        "use_group_geometry: writer worker.flash_attn never uses use_group_geometry"
        in channel_problems((no_via,))
    )


def test_a_self_fed_writer_goes_with_no_other_reader_and_must_read() -> None:
    """FlashAttention and FlashInfer hold the replica only for their own
    module's getter, so they are not removed with the MLA readers; a writer declared self-fed that
    does not read, or a self-fed declaration dropped, is caught."""
    import dataclasses

    from vllm_dcp_geometry.runtime.group_context import CHANNELS

    replica = CHANNELS[-1]
    assert replica.self_fed == ("worker.flash_attn", "worker.flashinfer")
    not_self_fed = dataclasses.replace(replica, self_fed=())
    assert (
        "use_replica_group: worker.flash_attn is not removed with "
        "worker.mla_dcp_manager"
    ) in channel_problems((not_self_fed,))
    not_reading = dataclasses.replace(
        replica, self_fed=("worker.mla_indexer",), readers=replica.readers
    )
    assert channel_problems((not_reading,))[0] == (
        "use_replica_group: worker.mla_indexer is self-fed but does not read it"
    )
