# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.model_executor.layers.attention.mla_attention``: MLA refuses a
partial DCP shard count at start-up.

What: wraps ``MLACommonMetadataBuilder.__init__`` (the constructor of every
dense MLA builder). A group whose K satisfies 1 < K < D raises
``DcpGeometryError`` naming the group's layers, K and D before anything is
allocated. K = D (sharded) and K = 1 (replicated) run the upstream
constructor unchanged.

Why: MLA builders and impls take the global D everywhere: the chunked-prefill
workspace and its all-gather share are sized from D in ``__init__``, the
context chunks split rows over D ranks, and the local lengths and LSE combine
assume D shards. A K-sharded MLA cache would be read with a D-shard geometry,
which is silently wrong. (Sparse MLA and other builders are covered by the
generic start-up check in ``patches.worker.utils``.)

Remove when: MLA takes a per-group DCP shard count, or upstream rejects it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.attention_geometry import (
    partial_shard_refusal,
    resolve_group_geometry,
)

UPSTREAM_MODULE = "vllm.model_executor.layers.attention.mla_attention"
RUNS_IN = "worker"
WHY = (
    "MLA builders/impls size workspaces and split context over the global D; "
    "a partial shard count must be refused at start-up, not run wrongly."
)
REMOVE_WHEN = "MLA takes a per-group DCP shard count"
RELATED = "vllm#23734 (MLA DCP sizes its workspaces and combine from D)"

_M = UPSTREAM_MODULE
PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "MLACommonMetadataBuilder.__init__",
        "self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=, "
        "supports_dcp_with_varlen=",
    ),
)


def _make_builder_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(
        self: Any,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        geometry = resolve_group_geometry(kv_cache_spec, layer_names, vllm_config)
        if geometry is not None and geometry.is_partial:
            raise partial_shard_refusal(
                geometry,
                f"{type(self).__name__} (MLA)",
                "MLA sizes its workspaces and splits its context over the whole "
                "DCP group. Use K=1 ('replicated') or K=D ('sharded') for MLA "
                "layers.",
            )
        original(self, kv_cache_spec, layer_names, vllm_config, device, *args, **kwargs)

    return __init__


def apply(module: ModuleType) -> None:
    wrap(module.MLACommonMetadataBuilder, "__init__", _make_builder_init)
