# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How start-up would group a topology file's layers: vLLM's own planner.

A topology file states its groups; vLLM's engine core makes its own from the
layers' specs (``get_global_kv_cache_groups``, with the plugin's patches), and
may refuse the mix, split a group, merge two or pad a page. ``plan``,
``replay`` and ``simulate`` run that planner on the specs the topology
builds, so a layout start-up refuses is refused (exit 2, vLLM's message), and
a grouping that differs from the file's is named in the output, with what the
command priced or ran on it.

A topology is a model vLLM's registry does not know, so it declares no
grouping of its own (``SupportsKVCacheGrouping``): vLLM's default grouping is
the one start-up runs for it, with the hybrid manager on, as ``vllm serve``
leaves it. The KV-cache layout is resolved from the layouts the groups'
backends declare, as the engine core resolves it; a backend whose class cannot
be imported on this machine is named in ``layout_unread``.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.common.noise import vllm_notes_held_back
from vllm_dcp_geometry.tooling.topology import MODEL_SOURCE, Topology, TopologyError

DIFFERENCES_SHOWN = 3


def _model_order(name: str) -> list[Any]:
    # Start-up sees layers in module order; a file's group order is not that.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _layer_specs(topology: Topology) -> dict[str, Any]:
    specs = {}
    for group in topology.groups:
        spec = vllm_objects.build_spec(group, topology, patched=True)
        specs.update(dict.fromkeys(group.layers, spec))
    return {name: specs[name] for name in sorted(specs, key=_model_order)}


def _declared_layouts(backend_names: set[str]) -> tuple[list[str], list[str]]:
    """The layouts the named backends all support (vLLM's rule), and the
    backends whose declaration could not be read here."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    classes, unread = [], []
    for name in sorted(backend_names):
        try:
            classes.append(AttentionBackendEnum[name].get_class())
        # Some backends' modules touch CUDA on import (no driver here): the
        # declaration is then unread, and named so.
        except Exception:
            unread.append(name)
    return [layout.name for layout in get_supported_kv_cache_layouts(classes)], unread


def _start_up_config(topology: Topology) -> Any:
    from vllm.config import DeviceConfig, VllmConfig

    parallel, cache = vllm_objects.layout_configs(topology)
    config = VllmConfig(
        parallel_config=parallel,
        cache_config=cache,
        device_config=DeviceConfig(device="cpu"),
    )
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    config.model_config = SimpleNamespace(supports_kv_cache_grouping=False)
    return config


def _group_summary(group: Any) -> dict[str, Any]:
    spec = group.kv_cache_spec
    members = getattr(spec, "kv_cache_specs", None)
    one = next(iter(members.values())) if members else spec
    return {
        "spec": type(one).__name__,
        "block_size": one.block_size,
        "page_size_bytes": spec.page_size_bytes,
        "layers": list(group.layer_names),
    }


def _is_indexer_cache(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import SparseCacheRole

    return getattr(spec, "cache_role", None) == SparseCacheRole.INDEXER


def _differences(
    topology: Topology, groups: list[Any], specs: dict[str, Any]
) -> list[str]:
    """How start-up's groups differ from the file's. The file lists a DSA
    indexer cache as a group of its own beside its latent cache; start-up
    may hold both in one group."""
    found = []
    owner = {name: index for index, g in enumerate(groups) for name in g.layer_names}
    listed: dict[int, list[str]] = {}
    for group in topology.groups:
        owners = sorted({owner[name] for name in group.layers})
        if len(owners) > 1:
            found.append(
                f"group {group.name!r} ({len(group.layers)} layers) is split "
                f"over {len(owners)} of start-up's groups"
            )
        if not _is_indexer_cache(specs[group.layers[0]]):
            for index in owners:
                listed.setdefault(index, []).append(group.name)
    for index, names in sorted(listed.items()):
        if len(names) > 1:
            found.append(
                f"start-up's group {index} holds the layers of groups "
                f"{', '.join(repr(n) for n in names)}"
            )
    for group in groups:
        members = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            planned = members.get(name, group.kv_cache_spec)
            if planned != specs[name]:
                found.append(
                    f"layer {name!r}: start-up gives it {planned}, the topology "
                    f"{specs[name]}"
                )
                break
    return found


def start_up_grouping(topology: Topology, backend_names: set[str]) -> dict[str, Any]:
    """vLLM's planner's groups for a topology file's layers and how they differ
    from the file's, or (``refusal``) vLLM's message where start-up refuses
    them. A topology built from the model is vLLM's grouping already."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    if topology.source == MODEL_SOURCE:
        return {"checked": False, "reason": "the groups are vLLM's planner's"}
    specs = _layer_specs(topology)
    # Backend classes, the config and the planner are read, not run: their
    # notes (no ``vllm._C`` here, padding layers added) are start-up's log,
    # and what the planner did is in ``groups``.
    with vllm_notes_held_back():
        config = _start_up_config(topology)
        layouts, unread = _declared_layouts(backend_names)
    try:
        with vllm_notes_held_back():
            layout = resolve_kv_cache_layout(config, [layouts], specs.values())
            groups = list(get_global_kv_cache_groups(config, [dict(specs)]))
    # Whatever vLLM's planner raises, start-up raises: its own refusals
    # (ValueError, AssertionError, NotImplementedError) and its failures on a
    # mix it does not foresee (a StopIteration over an empty group).
    except Exception as exc:
        message = " ".join(str(exc).split()) or "no message"
        refuses = "refuses"
        if not isinstance(exc, (ValueError, AssertionError, NotImplementedError)):
            message, refuses = f"{type(exc).__name__}: {message}", "fails on"
        return {
            "checked": True,
            "matches": False,
            "refusal": f"topology {topology.name!r}: vLLM's KV-cache planner "
            f"{refuses} these layers, as start-up would ({message})",
            "layout_unread": unread,
        }
    differences = _differences(topology, groups, specs)
    return {
        "checked": True,
        "matches": not differences,
        "refusal": None,
        "kv_cache_layout": layout.name,
        "layout_unread": unread,
        "differences": differences,
        "groups": [_group_summary(g) for g in groups],
    }


def checked_start_up_grouping(topology: Topology) -> dict[str, Any]:
    """``start_up_grouping`` for a command that runs vLLM's KV-cache manager
    on the topology's groups (no backends chosen: vLLM's default layout
    preference); a layout start-up refuses is a ``TopologyError``."""
    grouping = start_up_grouping(topology, set())
    if grouping.get("refusal"):
        raise TopologyError(grouping["refusal"])
    return grouping


def grouping_lines(
    grouping: dict[str, Any] | None, listed_groups: int, used_as: str
) -> list[str]:
    """The planner check in a command's text: the refusal, the match, or a
    WARNING naming how start-up groups otherwise (``used_as``: what the
    command did with the file's groups)."""
    if not grouping or not grouping["checked"]:
        return []
    if grouping["refusal"]:
        return [f"refused: {grouping['refusal']}"]
    if grouping["matches"]:
        return [
            f"start-up groups these layers as the topology does (vLLM's planner, "
            f"layout {grouping['kv_cache_layout']})"
        ]
    differences = grouping["differences"]
    more = len(differences) - DIFFERENCES_SHOWN
    return [
        f"WARNING: start-up groups these layers differently: vLLM's planner makes "
        f"{len(grouping['groups'])} groups of the topology's {listed_groups}; "
        f"{used_as}:",
        *(f"  {d}" for d in differences[:DIFFERENCES_SHOWN]),
        *([f"  ... and {more} more (--json: start_up_grouping)"] if more > 0 else []),
    ]


def with_grouping_notice(
    report: dict[str, Any],
    text: str,
    grouping: dict[str, Any] | None,
    listed_groups: int,
    used_as: str,
) -> str:
    """Store the planner check in ``report``; a grouping that is not the
    file's leads ``text`` with its WARNING."""
    if grouping is None:
        return text
    report["start_up_grouping"] = grouping
    if not grouping.get("differences"):
        return text
    return "\n".join([*grouping_lines(grouping, listed_groups, used_as), text])


def start_up_pool(
    topology: Topology, backend_names: set[str], available_memory: int
) -> tuple[Any, Any]:
    """The scheduler's ``KVCacheConfig`` start-up makes for ``available_memory``
    bytes of KV per rank: vLLM's planner's groups (padding included), its
    pool size (``get_kv_cache_config_from_groups``), each group's spec as the
    scheduler holds it (``generate_scheduler_kv_cache_config``); and the
    ``VllmConfig`` it was made with. Start-up's refusal is a ``TopologyError``."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import (
        get_global_kv_cache_groups,
        get_kv_cache_config_from_groups,
    )
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    specs = _layer_specs(topology)
    with vllm_notes_held_back():
        config = _start_up_config(topology)
        config.model_config.max_model_len = topology.max_model_len
        layouts, _ = _declared_layouts(backend_names)
        try:
            resolve_kv_cache_layout(config, [layouts], specs.values())
            groups = list(get_global_kv_cache_groups(config, [dict(specs)]))
            worker = get_kv_cache_config_from_groups(config, groups, available_memory)
        except (ValueError, AssertionError, NotImplementedError) as exc:
            raise TopologyError(
                f"topology {topology.name!r}: vLLM's KV-cache planner refuses "
                f"these layers, as start-up would ({' '.join(str(exc).split())})"
            ) from exc
    return generate_scheduler_kv_cache_config([worker]), config
