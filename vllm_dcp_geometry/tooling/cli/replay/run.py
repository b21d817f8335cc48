# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The replay: one long request fed to vLLM's real ``KVCacheManager``.

Builds the topology's scheduler-side ``KVCacheConfig`` from real specs, lets
vLLM resolve its scheduler and hash block sizes, and feeds one long request to
vLLM's ``KVCacheManager`` (``vllm_objects.build_kv_cache_manager``) in
chunked-prefill steps, checking every step (``checks``). ``compare_replays``
says where an unpatched replay differs from a patched one.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_dcp_geometry.contract import scheduler_block_size
from vllm_dcp_geometry.runtime.geometry import default_shard_count
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.common.runs import check_replay_inputs, progress_bar
from vllm_dcp_geometry.tooling.cli.common.violations import Violations
from vllm_dcp_geometry.tooling.cli.replay.checks import (
    CATEGORIES,
    ITEMS,
    REQUEST_ID,
    Track,
    check_step,
    make_tracks,
)
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError


def _check_manager_geometry(
    setup: vllm_objects.ManagerSetup, tracks: list[Track], violations: Violations
) -> None:
    """vLLM's scheduler block size is the contract's LCM of ``V = B * K`` and
    each manager allocates in units of its group's ``V``."""
    expected_sched = scheduler_block_size(t.virtual_block_size for t in tracks)
    if setup.scheduler_block_size != expected_sched:
        violations.add(
            "geometry",
            f"vLLM's scheduler block size is {setup.scheduler_block_size:,}, the "
            f"contract's LCM of B*K is {expected_sched:,}",
            step=0,
        )
    single_type_managers = setup.manager.coordinator.single_type_managers
    for track, single in zip(tracks, single_type_managers, strict=True):
        track.manager = single
        if single.block_size != track.virtual_block_size:
            violations.add(
                "geometry",
                f"the manager allocates in units of {single.block_size} tokens; "
                f"the contract's V = B*K = {track.virtual_block_size}",
                step=0,
                group=track.group.name,
            )


def _replay_steps(
    setup: vllm_objects.ManagerSetup,
    tracks: list[Track],
    violations: Violations,
    *,
    tokens: int,
    step_tokens: int,
    bar: Any,
) -> tuple[int, int, int]:
    """Feed the request to the manager chunk by chunk, checking every step;
    (tokens replayed, allocation steps, peak pages in use)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    manager = setup.manager
    usable = setup.num_pages - 1
    request = Request(
        REQUEST_ID, [0] * tokens, SamplingParams(max_tokens=1), pooling_params=None
    )
    computed = steps = peak = 0
    while computed < tokens:
        chunk = min(step_tokens, tokens - computed)
        manager.new_step_starts()
        new_blocks = manager.allocate_slots(request, chunk)
        if new_blocks is None:
            violations.add(
                "pool",
                f"no pages for tokens [{computed:,}, {computed + chunk:,}): "
                f"{manager.block_pool.get_num_free_blocks():,} of "
                f"{usable:,} pages free",
                step=steps + 1,
                position=computed,
            )
            break
        steps += 1
        for group_blocks, track in zip(new_blocks.blocks, tracks, strict=True):
            for block in group_blocks:
                if not block.is_null and block.ref_cnt != 1:
                    violations.add(
                        "ownership",
                        f"new block {block.block_id} has ref_cnt "
                        f"{block.ref_cnt}, not 1",
                        step=steps,
                        group=track.group.name,
                    )
        computed += chunk
        request.num_computed_tokens = computed
        in_use = check_step(
            tracks, manager.block_pool, computed, steps, usable, violations
        )
        peak = max(peak, in_use)
        bar.update(chunk)
    return computed, steps, peak


def run_replay(
    topology: Topology,
    *,
    tokens: int,
    step_tokens: int,
    num_pages: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Replay one request of ``tokens`` tokens in ``step_tokens`` steps.

    Uses whatever vLLM this process has: patched after ``register()``, else
    upstream's. Returns a JSON-ready report.
    """
    check_replay_inputs(topology, tokens, step_tokens)
    patched = vllm_objects.is_vllm_patched()
    config = vllm_objects.sizing_config(topology, max_num_batched_tokens=step_tokens)
    specs = [
        vllm_objects.build_spec(g, topology, patched=patched) for g in topology.groups
    ]
    violations = Violations(ITEMS)
    tracks = make_tracks(topology, specs, config, violations)

    pages_per_request = sum(vllm_objects.pages_per_request(s, config) for s in specs)
    # vLLM's pool reserves one page as the null block.
    pool_pages = num_pages if num_pages is not None else pages_per_request + 1
    if pool_pages < 2:
        raise TopologyError(f"--num-pages must be at least 2, got {pool_pages}")
    setup = vllm_objects.build_kv_cache_manager(
        topology, specs, config, pool_pages, enable_caching=False
    )
    _check_manager_geometry(setup, tracks, violations)
    bar = progress_bar(
        tokens, f"replay {'patched' if patched else 'unpatched'}", progress
    )
    started = time.perf_counter()
    with bar:
        computed, steps, peak = _replay_steps(
            setup, tracks, violations, tokens=tokens, step_tokens=step_tokens, bar=bar
        )
    elapsed = time.perf_counter() - started
    counts = {c: violations.counts.get(c, 0) for c in CATEGORIES}
    return {
        "command": "replay",
        "mode": "patched" if patched else "unpatched",
        "topology": topology.name,
        "source": topology.source,
        "tokens": tokens,
        "tokens_replayed": computed,
        "step_tokens": step_tokens,
        "allocation_steps": steps,
        "num_pages": pool_pages,
        "pages_per_request": pages_per_request,
        "free_pages": setup.manager.block_pool.get_num_free_blocks(),
        "peak_pages_in_use": peak,
        "scheduler_block_size": setup.scheduler_block_size,
        "hash_block_size": setup.hash_block_size,
        "ownership_violations": counts["ownership"],
        "violation_counts": counts,
        "violations": violations.items,
        "ok": not any(counts.values()) and computed == tokens,
        "elapsed_s": round(elapsed, 3),
        "groups": [
            _group_report(t, topology.decode_context_parallel_size) for t in tracks
        ],
    }


def _group_report(track: Track, dcp: int) -> dict[str, Any]:
    return {
        "name": track.group.name,
        "kind": track.group.kind,
        "draft": track.group.draft,
        "shard_count": track.shard_count,
        "upstream_shard_count": default_shard_count(track.spec, dcp),
        "block_size": track.group.block_size,
        "virtual_block_size": track.virtual_block_size,
        "manager_block_size": track.manager.block_size,
        "block_table_width": track.width,
        "max_column_used": track.max_column_used,
        "max_row_length": track.max_row_length,
        "pages_held": track.pages_held,
        "first_unaddressable_position": track.first_unaddressable_position,
    }


# Baseline -------------------------------------------------------------------------

_COMPARED_GROUP_FIELDS = (
    "manager_block_size",
    "block_table_width",
    "max_column_used",
    "max_row_length",
    "pages_held",
    "first_unaddressable_position",
)
_COMPARED_FIELDS = (
    "tokens_replayed",
    "allocation_steps",
    "num_pages",
    "pages_per_request",
    "free_pages",
    "peak_pages_in_use",
    "scheduler_block_size",
    "hash_block_size",
)


def compare_replays(patched: dict[str, Any], baseline: dict[str, Any]) -> list[dict]:
    """Where the unpatched replay differs from the patched one."""
    diffs: list[dict[str, Any]] = []
    for key in _COMPARED_FIELDS:
        if patched.get(key) != baseline.get(key):
            diffs.append(
                {
                    "group": None,
                    "field": key,
                    "patched": patched.get(key),
                    "unpatched": baseline.get(key),
                }
            )
    for ours, theirs in zip(patched["groups"], baseline["groups"], strict=True):
        for key in _COMPARED_GROUP_FIELDS:
            if ours.get(key) != theirs.get(key):
                diffs.append(
                    {
                        "group": ours["name"],
                        "field": key,
                        "patched": ours.get(key),
                        "unpatched": theirs.get(key),
                    }
                )
    return diffs
