# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry replay``: drive vLLM's real KV-cache manager, no weights.

Builds the topology's scheduler-side ``KVCacheConfig`` from real specs, lets
vLLM resolve its scheduler and hash block sizes, and feeds one long request to
vLLM's ``KVCacheManager`` in chunked-prefill steps. After every step it checks:

- ownership: every non-null physical block sits in exactly one group's row at
  one column, and held + free pages account for the whole pool;
- width: no group's row is longer than its block-table width
  (``spec.max_num_blocks_per_req``);
- addressability: every computed position has a block at the column the
  worker maps it to, under the contract's geometry (``V = B * K`` for
  attention, the running state's column for recurrent groups);
- geometry: each manager allocates in units of the contract's ``V`` and the
  scheduler block size is the contract's LCM.

Run unpatched (a fresh process that never registers the plugin), the same
replay shows where vLLM 0.33.0 diverges from the contract.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.cli import _vllm
from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    cdiv,
    scheduler_block_size,
    virtual_block_size,
)
from vllm_dcp_geometry.geometry import default_shard_count
from vllm_dcp_geometry.topology import CacheGroup, Topology, TopologyError

MAX_REPORTED_VIOLATIONS = 50
CATEGORIES = ("ownership", "width", "addressability", "geometry", "pool")
REQUEST_ID = "replay-0"


@dataclass
class _Track:
    """What the replay knows and has seen of one group."""

    group: CacheGroup
    spec: Any
    shard_count: int
    """K under the contract: the worker's geometry for this group."""
    virtual_block_size: int
    width: int
    recurrent_align: bool
    num_speculative_blocks: int
    sliding_window: int | None
    manager: Any = None
    max_column_used: int = -1
    max_row_length: int = 0
    pages_held: int = 0
    first_unaddressable_position: int | None = None

    def first_position_beyond_width(self) -> int:
        if self.recurrent_align:
            # The running state after n tokens sits in column cdiv(n, B) - 1,
            # followed by the speculative columns.
            return (self.width - self.num_speculative_blocks) * self.group.block_size
        return self.width * self.virtual_block_size


@dataclass
class _Violations:
    counts: Counter = field(default_factory=Counter)
    items: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[tuple[str, str | None]] = field(default_factory=set)

    def add(
        self,
        category: str,
        message: str,
        *,
        step: int,
        group: str | None = None,
        position: int | None = None,
    ) -> None:
        self.counts[category] += 1
        # Report the first occurrence per category and group; count the rest.
        key = (category, group)
        if key in self._seen or len(self.items) >= MAX_REPORTED_VIOLATIONS:
            return
        self._seen.add(key)
        self.items.append(
            {
                "category": category,
                "group": group,
                "step": step,
                "position": position,
                "message": message,
            }
        )


def check_replay_inputs(topology: Topology, tokens: int, step_tokens: int) -> None:
    """Reject a replay vLLM could never schedule, before building anything."""
    for label, value in (("tokens", tokens), ("step tokens", step_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TopologyError(f"replay {label} must be a positive integer")
    if tokens > topology.max_model_len:
        raise TopologyError(
            f"replay of {tokens:,} tokens exceeds max_model_len="
            f"{topology.max_model_len:,}; raise --max-model-len or lower --tokens"
        )
    if topology.mamba_cache_mode == "align":
        for group in topology.groups:
            if group.kind == "mamba" and step_tokens % group.block_size:
                raise TopologyError(
                    f"group {group.name!r}: in Mamba align mode prefill chunks "
                    f"end on recurrent block boundaries, so --step-tokens "
                    f"({step_tokens}) must be a multiple of B={group.block_size}"
                )


def _make_tracks(
    topology: Topology, specs: list[Any], config: Any, violations: _Violations
) -> list[_Track]:
    dcp = topology.decode_context_parallel_size
    patched = _vllm.is_vllm_patched()
    tracks = []
    for group, spec in zip(topology.groups, specs, strict=True):
        k = group.shard_count(dcp)
        if patched and spec.dcp_shard_count(dcp) != k:
            violations.add(
                "geometry",
                f"spec reports K={spec.dcp_shard_count(dcp)}, the contract K={k}",
                step=0,
                group=group.name,
            )
        recurrent = group.kind == "mamba"
        tracks.append(
            _Track(
                group=group,
                spec=spec,
                shard_count=k,
                virtual_block_size=virtual_block_size(group.block_size, k),
                width=spec.max_num_blocks_per_req(config, topology.max_model_len),
                recurrent_align=recurrent and topology.mamba_cache_mode == "align",
                num_speculative_blocks=(
                    spec.num_speculative_blocks if recurrent else 0
                ),
                sliding_window=getattr(spec, "sliding_window", None),
            )
        )
    return tracks


def _check_addressable(
    track: _Track, ids: Any, nonnull: Any, num_tokens: int, step: int, v: _Violations
) -> None:
    name = track.group.name

    def fail(position: int, message: str, category: str = "addressability") -> None:
        if (
            track.first_unaddressable_position is None
            or position < track.first_unaddressable_position
        ):
            track.first_unaddressable_position = position
        v.add(category, message, step=step, group=name, position=position)

    if track.group.kind == "mamba":
        if not track.recurrent_align:
            if ids.size == 0 or not nonnull[0]:
                fail(num_tokens - 1, "no block holds the running recurrent state")
            return
        column = cdiv(num_tokens, track.group.block_size) - 1
        if column + 1 + track.num_speculative_blocks > track.width:
            fail(
                track.first_position_beyond_width(),
                f"after {num_tokens:,} tokens the running state needs column "
                f"{column} plus {track.num_speculative_blocks} speculative "
                f"columns, but the table has {track.width} columns",
                "width",
            )
        if ids.size <= column or not nonnull[column]:
            fail(
                num_tokens - 1,
                f"after {num_tokens:,} tokens the running state's column {column} "
                f"has no block (row length {ids.size})",
            )
        return

    virtual = track.virtual_block_size
    need = cdiv(num_tokens, virtual)
    first_column = 0
    if track.sliding_window is not None:
        first_column = max(0, num_tokens - track.sliding_window) // virtual
    if need > track.width:
        fail(
            track.first_position_beyond_width(),
            f"position {track.first_position_beyond_width():,} maps to column "
            f"{track.width} (V = B*K = {virtual}), beyond the table's "
            f"{track.width} columns",
            "width",
        )
    if ids.size < need:
        column = max(ids.size, first_column)
        fail(
            column * virtual,
            f"position {column * virtual:,} maps to column {column} (V = B*K = "
            f"{virtual}) but the manager allocated only {ids.size} columns for "
            f"{num_tokens:,} tokens (it allocates in units of "
            f"{track.manager.block_size} tokens)",
        )
        return
    missing = (~nonnull[first_column:need]).nonzero()[0]
    if missing.size:
        column = first_column + int(missing[0])
        fail(
            column * virtual,
            f"position {column * virtual:,} maps to column {column}, which holds "
            "the null block",
        )


def _check_step(
    tracks: list[_Track],
    block_pool: Any,
    num_tokens: int,
    step: int,
    usable_pages: int,
    v: _Violations,
) -> int:
    """All per-step checks; returns the number of pages in use."""
    import numpy as np

    null_id = block_pool.null_block.block_id
    held = []
    for track in tracks:
        row = track.manager.req_to_blocks.get(REQUEST_ID, ())
        ids = np.fromiter((b.block_id for b in row), dtype=np.int64, count=len(row))
        nonnull = ids != null_id
        used = nonnull.nonzero()[0]
        if used.size:
            track.max_column_used = max(track.max_column_used, int(used[-1]))
        track.max_row_length = max(track.max_row_length, ids.size)
        track.pages_held = int(used.size)
        if ids.size > track.width:
            v.add(
                "width",
                f"the manager's row has {ids.size} columns but the block table "
                f"is {track.width} wide (spec.max_num_blocks_per_req)",
                step=step,
                group=track.group.name,
            )
        _check_addressable(track, ids, nonnull, num_tokens, step, v)
        held.append(ids[nonnull])
    all_held = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
    unique, counts = np.unique(all_held, return_counts=True)
    shared = unique[counts > 1]
    if shared.size:
        block_id = int(shared[0])
        owners = [
            f"{t.group.name}[{c}]"
            for t in tracks
            for c, b in enumerate(t.manager.req_to_blocks.get(REQUEST_ID, ()))
            if b.block_id == block_id
        ]
        v.add(
            "ownership",
            f"{shared.size} physical block(s) have more than one owner, e.g. "
            f"block {block_id} at {', '.join(owners)}",
            step=step,
        )
    free = block_pool.get_num_free_blocks()
    if unique.size + free != usable_pages:
        v.add(
            "ownership",
            f"{unique.size:,} pages held + {free:,} free != {usable_pages:,} usable "
            "pages: a page is both held and free, or leaked",
            step=step,
        )
    return int(unique.size)


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
    patched = _vllm.is_vllm_patched()
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.request import Request

    dcp = topology.decode_context_parallel_size
    config = _vllm.sizing_config(topology)
    specs = [_vllm.build_spec(g, topology, patched=patched) for g in topology.groups]
    violations = _Violations()
    tracks = _make_tracks(topology, specs, config, violations)

    pages_per_request = sum(_vllm.pages_per_request(s, config) for s in specs)
    # vLLM's pool reserves one page as the null block.
    pool_pages = num_pages if num_pages is not None else pages_per_request + 1
    if pool_pages < 2:
        raise TopologyError(f"--num-pages must be at least 2, got {pool_pages}")
    kv_cache_config = _vllm.build_kv_cache_config(topology, specs, pool_pages)
    try:
        sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, config)
    except (ValueError, AssertionError) as exc:
        raise TopologyError(f"vLLM cannot resolve block sizes: {exc}") from exc
    expected_sched = scheduler_block_size(t.virtual_block_size for t in tracks)
    if sched_block != expected_sched:
        violations.add(
            "geometry",
            f"vLLM's scheduler block size is {sched_block:,}, the contract's LCM "
            f"of B*K is {expected_sched:,}",
            step=0,
        )
    try:
        manager = KVCacheManager(
            kv_cache_config,
            max_model_len=topology.max_model_len,
            scheduler_block_size=sched_block,
            hash_block_size=hash_block,
            enable_caching=False,
            dcp_world_size=dcp,
            pcp_world_size=1,
        )
    except (ValueError, AssertionError) as exc:
        raise TopologyError(
            f"vLLM's KVCacheManager rejects this layout: {exc}"
        ) from exc
    for track, single in zip(
        tracks, manager.coordinator.single_type_managers, strict=True
    ):
        track.manager = single
        if single.block_size != track.virtual_block_size:
            violations.add(
                "geometry",
                f"the manager allocates in units of {single.block_size} tokens; "
                f"the contract's V = B*K = {track.virtual_block_size}",
                step=0,
                group=track.group.name,
            )

    request = Request(
        REQUEST_ID, [0] * tokens, SamplingParams(max_tokens=1), pooling_params=None
    )
    usable = pool_pages - 1
    from tqdm import tqdm

    bar = tqdm(
        total=tokens,
        unit="tok",
        unit_scale=True,
        desc=f"replay {'patched' if patched else 'unpatched'}",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    computed = steps = peak = 0
    started = time.perf_counter()
    with bar:
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
            in_use = _check_step(
                tracks, manager.block_pool, computed, steps, usable, violations
            )
            peak = max(peak, in_use)
            bar.update(chunk)
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
        "free_pages": manager.block_pool.get_num_free_blocks(),
        "peak_pages_in_use": peak,
        "scheduler_block_size": sched_block,
        "hash_block_size": hash_block,
        "ownership_violations": counts["ownership"],
        "violation_counts": counts,
        "violations": violations.items,
        "ok": not any(counts.values()) and computed == tokens,
        "elapsed_s": round(elapsed, 3),
        "groups": [
            {
                "name": t.group.name,
                "kind": t.group.kind,
                "draft": t.group.draft,
                "shard_count": t.shard_count,
                "upstream_shard_count": default_shard_count(t.spec, dcp),
                "block_size": t.group.block_size,
                "virtual_block_size": t.virtual_block_size,
                "manager_block_size": t.manager.block_size,
                "block_table_width": t.width,
                "max_column_used": t.max_column_used,
                "max_row_length": t.max_row_length,
                "pages_held": t.pages_held,
                "first_unaddressable_position": t.first_unaddressable_position,
            }
            for t in tracks
        ],
    }


# Baseline -------------------------------------------------------------------------

UNPATCHED_FLAG = "--unpatched-baseline"

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


def run_unpatched_baseline(
    topology: Topology, *, tokens: int, step_tokens: int, num_pages: int | None
) -> dict[str, Any]:
    """The same replay on vLLM 0.33.0 as installed, in a fresh interpreter
    that never registers the plugin."""
    with tempfile.TemporaryDirectory(prefix="vllm-dcp-geometry-") as tmp:
        path = os.path.join(tmp, "topology.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(topology.to_dict(), fh)
        argv = [
            sys.executable,
            "-m",
            "vllm_dcp_geometry",
            "replay",
            "--topology",
            path,
            "--tokens",
            str(tokens),
            "--step-tokens",
            str(step_tokens),
            "--json",
            "--no-progress",
            UNPATCHED_FLAG,
        ]
        if num_pages is not None:
            argv += ["--num-pages", str(num_pages)]
        env = dict(os.environ)
        # vLLM would load the plugin through its entry point if anything in the
        # child called load_general_plugins(); an empty filter forbids it.
        env["VLLM_PLUGINS"] = ""
        env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        result = subprocess.run(
            argv, capture_output=True, text=True, env=env, check=False
        )
    if result.returncode not in (0, 1):
        raise DcpGeometryError(
            "the unpatched baseline replay failed:\n" + result.stderr[-4000:]
        )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if not lines:
        raise DcpGeometryError(
            "the unpatched baseline printed nothing:\n" + result.stderr[-4000:]
        )
    baseline = json.loads(lines[-1])
    baseline["source"] = topology.source
    return baseline


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


# Text output ----------------------------------------------------------------------


def format_replay(report: dict[str, Any]) -> str:
    from vllm_dcp_geometry.cli.plan import render_table

    mode = report["mode"]
    version = report.get("vllm_version") or ""
    lines = [
        f"replay {report['topology']} on {mode} vLLM {version}".rstrip(),
        f"  {report['tokens_replayed']:,} of {report['tokens']:,} tokens in "
        f"{report['step_tokens']:,}-token steps: {report['allocation_steps']:,} "
        f"allocation steps in {report['elapsed_s']:.2f} s",
        f"  pool: {report['num_pages']:,} pages ({report['pages_per_request']:,} "
        "per max-length request by vLLM's rule, + the null page); "
        f"{report['free_pages']:,} free at the end; peak "
        f"{report['peak_pages_in_use']:,} in use",
        f"  scheduler block size {report['scheduler_block_size']:,}, hash block "
        f"size {report['hash_block_size']:,}",
        "",
    ]
    headers = [
        "group",
        "kind",
        "K",
        "V=B*K",
        "manager unit",
        "width",
        "max column",
        "pages held",
        "first unaddressable",
    ]
    rows = []
    for g in report["groups"]:
        first = g["first_unaddressable_position"]
        rows.append(
            [
                g["name"],
                g["kind"] + (" (draft)" if g["draft"] else ""),
                str(g["shard_count"]),
                f"{g['virtual_block_size']:,}",
                f"{g['manager_block_size']:,}",
                f"{g['block_table_width']:,}",
                f"{g['max_column_used']:,}",
                f"{g['pages_held']:,}",
                "-" if first is None else f"{first:,}",
            ]
        )
    lines.append(render_table(headers, rows, right=set(range(2, len(headers)))))
    lines.append("")
    counts = report["violation_counts"]
    lines.append("violations: " + ", ".join(f"{c} {counts[c]:,}" for c in CATEGORIES))
    for item in report["violations"]:
        where = f" [{item['group']}]" if item["group"] else ""
        lines.append(
            f"  step {item['step']}{where} {item['category']}: {item['message']}"
        )
    lines.append("OK" if report["ok"] else "FAILED")
    return "\n".join(lines)


def format_baseline(baseline: dict[str, Any], diffs: list[dict[str, Any]]) -> str:
    lines = ["", "baseline: the same replay on unpatched vLLM (fresh process)"]
    if not diffs and baseline["ok"]:
        lines.append(
            "  no divergence: unpatched vLLM allocates and addresses this "
            "topology the same way"
        )
        return "\n".join(lines)
    for d in diffs:
        where = f"[{d['group']}] " if d["group"] else ""
        lines.append(
            f"  {where}{d['field']}: patched {d['patched']}, unpatched {d['unpatched']}"
        )
    for item in baseline["violations"]:
        where = f" [{item['group']}]" if item["group"] else ""
        pos = "" if item["position"] is None else f" at position {item['position']:,}"
        lines.append(
            f"  unpatched fails{where}{pos} (step {item['step']}): {item['message']}"
        )
    return "\n".join(lines)
