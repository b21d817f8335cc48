# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.distributed.parallel_state``: the replica process groups of
partial MLA groups are destroyed with vLLM's model-parallel groups (rule A6).

What: wraps ``destroy_model_parallel``. Before upstream's (which destroys the
TP, DCP, PCP, PP, DP and EP groups), ``replica_groups.destroy_replica_groups``
destroys every replica ``GroupCoordinator`` this process made
(``GroupCoordinator.destroy``: its device communicator, then its device and
CPU process groups) and forgets it, so a re-initialisation (sleep/wake,
elastic scaling, an engine rebuilt in one process) makes fresh groups and can
reach none of the old ones. The copies other vLLM modules took with
``from vllm.distributed import destroy_model_parallel`` (the executors'
shutdown) are pointed at the wrapper.

Why: vLLM 0.33.0's teardown knows only its own groups; a replica group left
alive across a re-initialisation holds its communicators (NCCL resources on
GPUs) until the process exits.

Hand-back: where no replica group was made (D = 1, no partial override, or
``partial_collectives: "dcp"``) nothing is done before upstream's function.

Remove when: vLLM's MLA takes a per-group DCP shard count (with
``worker.gpu_worker``, which makes the groups).
"""

from __future__ import annotations

from collections.abc import Callable

from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.replica_groups import destroy_replica_groups


def _make_destroy_model_parallel(original: Callable[[], None]) -> Callable[[], None]:
    def destroy_model_parallel() -> None:
        destroy_replica_groups()
        original()

    return destroy_model_parallel


PATCH = Patch(
    upstream_module="vllm.distributed.parallel_state",
    replaces=(
        Wrap(
            "destroy_model_parallel",
            "",
            _make_destroy_model_parallel,
            rebind_copies=True,
        ),
    ),
    remove_with=("worker.gpu_worker",),
    why=(
        "vLLM's teardown destroys only its own groups; the replica groups of "
        "partial MLA groups must go with them, not live on holding communicators."
    ),
    remove_when="vLLM's MLA takes a per-group DCP shard count",
    related="none upstream: vLLM knows K in {1, D} only",
)
