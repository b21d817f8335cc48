# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks`` runs, before any process starts: each group's shapes
(``shapes.Shape``), its batches, its backend, and which groups run on this machine
(``plan_groups``, one entry per group, or the reason it is not run).

Every group runs at its own shapes, what the operator's model runs: query
heads per TP rank (``Topology.heads_per_rank``), latent rank L and rope dim
R (``CacheGroup.kv_lora_rank`` and ``rope_dim``), the spec's dtype, the
group's block size and K, and the topology's interleave. A group whose
topology gives no ``query_heads`` or ``kv_lora_rank`` is not run (no shape
is made up for it), nor one whose latent row L + R vLLM's MLA metadata does
not admit (``MLACommonBackend.supports_head_size``: 320, 512 or 576). Only
where the operator asks (``--scale N``) are the query heads per rank divided
by N (rounded up, never below two: one head per rank takes another decode
kernel): they are what a worker's memory and time grow with; L and R stay,
since vLLM admits no smaller row than 320, and so do the dtype, block size,
K and interleave. The nope and value head dims are not in a topology: they
size only ``kv_b_proj``'s up-projection (absorbed into the latent query on
decode), never the cache or a collective, and are ``NOPE_DIM`` here.
Contexts are a few rounds over the group's K shards (a few times B * K
tokens). A full-attention or sliding-window group (FLASH_ATTN,
``runners.flash_attention``) runs at its head size and window instead of a
latent row.

Which runner runs a group, and the shapes it runs it at, are the runner's
(``runners``: one per layer class ``ranks`` builds). The runners plan with
``shapes``' ``Shape`` and batches, never with this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract.attention_backends import collectives_within_replica
from vllm_dcp_geometry.contract.collectives import REPLICA, collective_world_size
from vllm_dcp_geometry.tooling.cli.ranks.runners import runner_of, why_not_run
from vllm_dcp_geometry.tooling.cli.ranks.shapes import (
    BACKEND,
    RUN_BACKENDS,
    topology_shape,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

if TYPE_CHECKING:
    from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
        GroupCase,
        LayerRunner,
    )

NON_CAUSAL_DCP_REASON = (
    "not run on {backend}: a non-causal multi-token draft under DCP needs a "
    "backend with DSpark DCP support (FLASHINFER_MLA, CUDA); {backend}'s builder "
    "refuses it"
)


def layer_runner(group: CacheGroup) -> LayerRunner | None:
    """The runner of the group's layer class (None: ``ranks`` builds none)."""
    return runner_of(group)


def planned_world_size(
    k: int, dcp: int, partial_collectives: str, backend: str = BACKEND
) -> int:
    """What a group's collectives span with K shards, as ``plan`` says for
    the same input: rule A6 where ``partial_collectives`` is ``replica`` and
    the backend binds the replica group, else D-wide."""
    replica = partial_collectives == REPLICA and collectives_within_replica(backend)
    return collective_world_size(k, dcp, replica_collectives=replica)


def group_backend(group: CacheGroup, dcp: int, *, gpu: bool, named: str) -> str:
    """The backend a group runs on: ``named`` (``--attention-backend``), or
    for ``auto`` its runner's CPU backend on a CPU and on a GPU the backend
    vLLM 0.33.0 selects for the group on SM90 (``plan``'s)."""
    runner = layer_runner(group)
    if runner is not None and runner.fixed_backend:
        return runner.cpu_backend
    if named != "auto":
        return named
    if not gpu:
        return BACKEND if runner is None else runner.cpu_backend
    from vllm_dcp_geometry.tooling.cli.plan.attention import (
        default_attention_backend,
    )

    return default_attention_backend(group, dcp)


def backend_refused(
    group: CacheGroup, backend: str, dcp: int, *, gpu: bool
) -> str | None:
    """Why the group cannot run on ``backend`` here (None: it can): a
    backend ``ranks`` does not build, a compiled one without a GPU, or a
    non-causal multi-token draft under DCP on a backend whose builder
    refuses it (vLLM's ``supports_non_causal_multi_token_dcp``)."""
    from vllm_dcp_geometry.tooling.cli.plan.attention import (
        NON_CAUSAL_DCP_MLA_BACKENDS,
    )

    runner = layer_runner(group)
    backends = RUN_BACKENDS if runner is None else runner.backends
    if backend not in backends:
        return (
            f"not run: backend {backend} (ranks runs this layer class on "
            f"{', '.join(backends)})"
        )
    if backend not in backends[:1] and not gpu:
        return f"not run on this machine: {backend} needs CUDA"
    non_causal = group.spec_fields.get("non_causal_multi_token_decode", False)
    under_dcp = group.shard_count(dcp) > 1
    if non_causal and under_dcp and backend not in NON_CAUSAL_DCP_MLA_BACKENDS:
        return NON_CAUSAL_DCP_REASON.format(backend=backend)
    return None


def _case(
    topology: Topology,
    group: CacheGroup,
    runner: LayerRunner | None,
    run_on: str | None,
    world: int | None,
    *,
    gpu: bool,
    scale: int,
    dtype: str | None,
) -> tuple[GroupCase | None, str | None]:
    """What the group runs at here, or (None and) why it is not run: what it
    is (``runners.why_not_run``), its backend, then its runner's shapes and
    whether it runs them here."""
    dcp = topology.decode_context_parallel_size
    reason = why_not_run(group, gpu=gpu, dcp=dcp)
    if reason is None and run_on is not None:
        reason = backend_refused(group, run_on, dcp, gpu=gpu)
    if reason is not None:
        return None, reason
    assert runner is not None, "why_not_run names every group with no runner"
    found = runner.plan(topology, group, scale, run_on or BACKEND, dtype)
    if isinstance(found, str):
        return None, found
    reason = runner.refuse_shape(found.shape, world or 1, gpu)
    return (None, reason) if reason else (found, None)


def _planned_group(
    topology: Topology,
    index: int,
    group: CacheGroup,
    *,
    gpu: bool,
    scale: int,
    partial_collectives: str,
    backend: str,
    dtype: str | None,
) -> dict[str, Any]:
    """One group's entry of the plan (``plan_groups``)."""
    from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
        OPTIONAL_PLAN_ENTRIES,
    )

    dcp = topology.decode_context_parallel_size
    k = group.shard_count(dcp) if group.is_attention else None
    runner = layer_runner(group) if group.is_attention else None
    run_on = (
        group_backend(group, dcp, gpu=gpu, named=backend)
        if group.is_attention and (group.kind == "mla" or runner is not None)
        else None
    )
    world = (
        None
        if k is None
        else planned_world_size(k, dcp, partial_collectives, run_on or BACKEND)
    )
    case, reason = _case(
        topology, group, runner, run_on, world, gpu=gpu, scale=scale, dtype=dtype
    )
    return {
        "index": index,
        "name": group.name,
        "kind": group.kind + (" (draft)" if group.draft else ""),
        "layer_class": group.layer_class,
        "runner": None if runner is None else runner.name,
        "backend": run_on,
        "non_causal": bool(
            group.spec_fields.get("non_causal_multi_token_decode", False)
        ),
        "block_size": group.block_size,
        "shard_count": k,
        "dcp_kv_shard_count": group.dcp_kv_shard_count,
        "dcp_sharded": group.dcp_sharded,
        "draft": group.draft,
        "interleave": topology.interleave_size,
        "collective_world_size": world,
        "topology_shape": topology_shape(topology, group)
        if group.kind == "mla"
        else None,
        "shape": None if case is None else case.shape.to_dict(),
        # What a runner adds for its workers (a DeepSeek-V3.2 layer's other
        # group and top-k); absent, the worker's defaults.
        **OPTIONAL_PLAN_ENTRIES,
        **({} if case is None else case.plan),
        "run": reason is None,
        "reason": reason,
    }


def plan_groups(
    topology: Topology,
    *,
    gpu: bool,
    scale: int,
    partial_collectives: str,
    backend: str = "auto",
    dtype: str | None = None,
) -> list[dict[str, Any]]:
    """Every group of the topology: what the workers run, on which backend
    (``group_backend``), at which shapes, or why not."""
    return [
        _planned_group(
            topology,
            index,
            group,
            gpu=gpu,
            scale=scale,
            partial_collectives=partial_collectives,
            backend=backend,
            dtype=dtype,
        )
        for index, group in enumerate(topology.groups)
    ]


def nothing_to_run(topology: Topology, groups: list[dict[str, Any]]) -> str:
    """The one line ``ranks`` refuses a topology with no group it can run:
    the groups, by why each cannot."""
    by_reason: dict[str, list[str]] = {}
    for g in groups:
        by_reason.setdefault(g["reason"], []).append(g["name"])
    why = "; ".join(
        f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()
    )
    return (
        f"ranks: no group of {topology.name} can run here "
        f"(D={topology.decode_context_parallel_size}): {why}"
    )
