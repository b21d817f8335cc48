# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu_worker``: every worker makes the replica process
groups of partial MLA groups at KV-cache initialisation (rule A6).

What: wraps ``Worker.initialize_from_config``. Where the KV-cache config
holds a partial MLA group (an MLA spec with an explicit
``dcp_kv_shard_count``) and the operator has not set
``partial_collectives: "dcp"``, ``replica_groups.make_replica_groups`` makes
the replica groups of the config's partial shard counts before upstream's
(which builds the attention backends, whose MLA builders then take their
replica). Both model
runners initialise through this method, and every worker of the world calls
it with the same groups (vLLM projects the global groups onto each worker,
keeping every group's spec), so the groups are made in lockstep.

Why: vLLM 0.33.0 makes only the D-wide DCP group; a partial group on it
moves D-rank traffic and attends every rank's query heads over its shard,
with D/K replicas weighted 0.

Hand-back: with no partial MLA spec in the config (every DCP1 config, every
group at vLLM's own K) upstream's method runs alone; only the specs are read
(not the worker's config).

Graph capture, custom all-reduce, a2a: vLLM's ``graph_capture`` enters the
TP, PP and DP groups' capture contexts only, not the DCP group's, and the
MLA DCP paths (all-gather / reduce-scatter, or all-to-all) use no
all-reduce; the replica groups are vLLM ``GroupCoordinator``s with the DCP
group's backend and device communicator, so they are captured exactly as the
DCP group's collectives are, and nothing more than a new group is needed.

Remove when: vLLM's MLA takes a per-group DCP shard count (with
``worker.mla_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.replica_groups import make_replica_groups, partial_shard_counts

UPSTREAM_MODULE = "vllm.v1.worker.gpu_worker"
RUNS_IN = "worker"
WHY = (
    "vLLM makes only the D-wide DCP group; partial MLA groups collective within "
    "their K-rank replicas, whose process groups every worker makes in lockstep."
)
REMOVE_WHEN = "vLLM's MLA takes a per-group DCP shard count"
RELATED = "none upstream: vLLM knows K in {1, D} only"

_M = UPSTREAM_MODULE
REPLACES: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(_M, "Worker.initialize_from_config", "self, kv_cache_config"),
)
RELIES_ON: tuple[UpstreamSymbol, ...] = ()
ADDS: tuple[str, ...] = ()
REMOVE_WITH: tuple[str, ...] = ("worker.mla_attention",)
PATCHED_SYMBOLS = REPLACES + RELIES_ON


def _make_initialize_from_config(
    original: Callable[..., None],
) -> Callable[..., None]:
    def initialize_from_config(self: Any, kv_cache_config: Any) -> None:
        specs = (group.kv_cache_spec for group in kv_cache_config.kv_cache_groups)
        if partial_shard_counts(specs):
            make_replica_groups(self.vllm_config, kv_cache_config)
        original(self, kv_cache_config)

    return initialize_from_config


def apply(module: ModuleType) -> None:
    wrap(module.Worker, "initialize_from_config", _make_initialize_from_config)
