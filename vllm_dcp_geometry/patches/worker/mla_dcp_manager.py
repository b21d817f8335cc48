# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.ops.dcp``: an MLA layer's DCP manager can be
remade for its group's replica (rule A6).

What: wraps ``MLADCPManager.__init__`` to keep the arguments the layer gave
it on the instance (``mla_geometry.MANAGER_ARGS_ATTR``; one attribute,
nothing else), and, as this module sees it, ``get_dcp_group``: while a
partial MLA group is bound within its replica
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

Hand-back: outside a replica binding ``get_dcp_group`` is upstream's; the
constructor runs upstream's after keeping its arguments.

Remove when: vLLM's MLA takes a per-group DCP shard count (with
``worker.mla_attention``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.mla_geometry import MANAGER_ARGS_ATTR, make_group_getter
from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, wrap

UPSTREAM_MODULE = "vllm.v1.attention.ops.dcp"
RUNS_IN = "worker"
WHY = (
    "An MLA layer's DCP manager takes its collective group from get_dcp_group() "
    "at model build; a partial group's replica needs one over its K ranks."
)
REMOVE_WHEN = "vLLM's MLA takes a per-group DCP shard count"
RELATED = "none upstream: MLADCPManager takes get_dcp_group() when the model is built"

_M = UPSTREAM_MODULE
REPLACES: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "MLADCPManager.__init__",
        "self, vllm_config, device, num_heads, query_head_dim, output_head_dim, "
        "query_dtype, output_dtype, padded_num_heads, is_lse_base_on_e, use_pcp",
    ),
    UpstreamSymbol(_M, "get_dcp_group", ""),
)
RELIES_ON: tuple[UpstreamSymbol, ...] = (
    # Relied on: the manager's collectives all go through ``self.group``.
    UpstreamSymbol(
        _M, "MLADCPManager.init_kv_gather", "self, workspace, max_gathered_tokens"
    ),
    UpstreamSymbol(_M, "cp_lse_ag_out_rs"),
    UpstreamSymbol(_M, "dcp_a2a_lse_reduce"),
)
ADDS: tuple[str, ...] = ()
REMOVE_WITH: tuple[str, ...] = ("worker.mla_attention",)
PATCHED_SYMBOLS = REPLACES + RELIES_ON


def _keep_arguments(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        setattr(self, MANAGER_ARGS_ATTR, (args, kwargs))
        original(self, *args, **kwargs)

    return __init__


def apply(module: ModuleType) -> None:
    wrap(module, "get_dcp_group", make_group_getter)
    wrap(module.MLADCPManager, "__init__", _keep_arguments)
