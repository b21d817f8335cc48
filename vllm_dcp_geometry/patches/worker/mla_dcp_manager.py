# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.ops.dcp``: an MLA layer's DCP manager can be
remade for its group's replica (rule A6).

What: wraps ``MLADCPManager.__init__`` to keep the arguments the layer gave
it on the instance (``mla_geometry.MANAGER_ARGS_ATTR``; one attribute) and
to register, beside upstream's D-keyed JIT warm-up of the LSE-combine kernel,
the K-keyed one of every replica group made
(``mla_geometry.register_replica_warmups``); and, as this module sees it,
``get_dcp_group``: while a partial MLA group is bound within its replica
(``group_context.use_replica_group``) it answers the replica's
``GroupCoordinator``. ``mla_geometry.replica_manager`` then constructs the
layer's replica manager with vLLM's own constructor and the layer's own
arguments, so the query all-gather, the LSE combine (all-gather /
reduce-scatter, or the all-to-all of ``dcp_comm_backend="a2a"``) and the
context KV gather, with whatever symmetric-memory workspace vLLM selects for
a group, run over the K ranks of the replica.

Why: the manager takes its group from ``get_dcp_group()`` when the model is
built, before any KV-cache spec exists, and every MLA layer class (vLLM's
``MLAAttention``, Kimi-K3's) builds it with its own arguments.

vLLM 0.34.0: under ``dcp_comm_backend="a2a"`` a manager (the replica's
too) also gets ``v_up_proj_combine`` (``_init_combine``), which the binding
of a partial layer clears again: the up-projection it applies holds all D
ranks' heads.

Hand-back: outside a replica binding ``get_dcp_group`` is upstream's; the
constructor runs upstream's after keeping its arguments, and registers
nothing more where no replica group was made.

Remove when: vLLM's MLA takes a per-group DCP shard count (with
``worker.mla_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.mla_geometry import (
    MANAGER_ARGS_ATTR,
    make_group_getter,
    register_replica_warmups,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


def _keep_arguments(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        setattr(self, MANAGER_ARGS_ATTR, (args, kwargs))
        original(self, *args, **kwargs)
        register_replica_warmups(original, self, args, kwargs)

    return __init__


PATCH = Patch(
    upstream_module="vllm.v1.attention.ops.dcp",
    replaces=(
        Wrap(
            "MLADCPManager.__init__",
            "self, vllm_config, device, num_heads, query_head_dim, output_head_dim, "
            "query_dtype, output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp",
            _keep_arguments,
        ),
        Wrap("get_dcp_group", "", make_group_getter),
    ),
    relies_on=(
        # Relied on: the manager's collectives all go through ``self.group``.
        Pin("MLADCPManager.init_kv_gather", "self, workspace, max_gathered_tokens"),
        Pin("cp_lse_ag_out_rs"),
        Pin("dcp_a2a_lse_reduce"),
        # Relied on (0.34.0): v_up_proj_combine is set here alone, and a
        # partial layer's binding clears it (mla_geometry.
        # drop_fused_up_projection).
        Pin(
            "MLADCPManager._init_combine",
            {"0.34.0": "self, num_heads, head_dim, dtype, is_lse_base_on_e, use_pcp"},
        ),
        # Relied on: the replica warm-ups register with vLLM's own kernel.
        Pin("_CORRECT_ATTN_CP_OUT_KERNEL"),
        Pin(
            "CorrectAttnCPOutKernel.get_warmup_keys",
            "self, vllm_config, *, output_dtype=, num_heads=, head_dim=, is_base_e=",
        ),
    ),
    remove_with=(
        "worker.mla_attention",
        "worker.deepseek_v32_attention",
        "worker.mla_indexer",
        "worker.sparse_mla_attention",
    ),
    why=(
        "An MLA layer's DCP manager takes its collective group from get_dcp_group() "
        "at model build; a partial group's replica needs one over its K ranks."
    ),
    remove_when="vLLM's MLA takes a per-group DCP shard count",
    related=(
        "none upstream: MLADCPManager takes get_dcp_group() when the model is built"
    ),
)
