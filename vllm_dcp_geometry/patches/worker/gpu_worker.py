# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.gpu_worker``: every worker makes the replica process
groups of partial MLA, FlashAttention and FlashInfer groups once its
distributed state exists (rule A6).

What: wraps ``Worker.init_device``. After upstream's (which initialises
vLLM's distributed state), ``replica_groups.make_replica_groups`` makes the
replica groups of every partial K the operator's overrides name, unless
``partial_collectives`` is ``"dcp"``. Every worker of the world runs
``init_device`` and derives the same shard counts from the same
configuration, so the groups are made in lockstep, before the memory profile
(whose CUDA-graph pass already builds the attention metadata builders) and
before the KV cache exists.
Both model runners start here. Elastic expert parallelism (stateless process
groups) is refused with a partial K within replicas, naming the way out.

Why: vLLM 0.33.0 makes only the D-wide DCP group; a partial group on it
moves D-rank traffic and attends every rank's query heads over its shard,
with D/K replicas weighted 0.

Hand-back: at D = 1, and at D > 1 with no partial override, nothing is made
after upstream's method (the override section is read, as the spec patch
reads it on every worker).

Graph capture, custom all-reduce, a2a: vLLM's ``graph_capture`` enters the
TP, PP and DP groups' capture contexts only, not the DCP group's, and the
MLA, FlashAttention and FlashInfer DCP paths (all-gather / reduce-scatter, or
all-to-all) use no
all-reduce; the replica groups are vLLM ``GroupCoordinator``s with the DCP
group's backend and device communicator, so they are captured exactly as the
DCP group's collectives are, and nothing more than a new group is needed.

Remove when: vLLM's MLA, FlashAttention and FlashInfer take a per-group DCP
shard count (with ``worker.mla_attention``, ``worker.flash_attn`` and
``worker.flashinfer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.replica_groups import make_replica_groups


def _make_init_device(original: Callable[..., None]) -> Callable[..., None]:
    def init_device(self: Any) -> None:
        original(self)
        make_replica_groups(self.vllm_config)

    return init_device


PATCH = Patch(
    upstream_module="vllm.v1.worker.gpu_worker",
    replaces=(Wrap("Worker.init_device", "self", _make_init_device),),
    remove_with=(
        "worker.flash_attn",
        "worker.flashinfer",
        "worker.mla_attention",
        "worker.parallel_state",
    ),
    why=(
        "vLLM makes only the D-wide DCP group; partial MLA, FlashAttention "
        "and FlashInfer groups collective within "
        "their K-rank replicas, whose process groups every worker makes in lockstep."
    ),
    remove_when=(
        "vLLM's MLA, FlashAttention and FlashInfer take a per-group DCP shard count"
    ),
    related="none upstream: vLLM knows K in {1, D} only",
)
