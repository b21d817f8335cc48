# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.utils``: refuse a partial DCP shard count for any
attention backend that cannot honour it, at start-up.

What: wraps ``AttentionGroup.create_metadata_builders`` (used by Model Runner
V1 and V2 alike). Before any builder is made for a group with 1 < K < D, the
backend's builder class must be one the plugin taught the group geometry
(``attention_geometry.register_partial_shard_builder``: FlashAttention and
FlashInfer); any other raises ``DcpGeometryError`` naming the group, its
layers, the backend, K and D. Groups with K in {1, D}, or D == 1, go straight
to upstream.

Why: every other builder and impl in vLLM 0.33.0 assumes the global D (local
lengths, combines, workspaces); running one on a K-sharded cache would be
silently wrong. Failing closed at start-up is the contract's rule.

Remove when: every vLLM attention backend takes a per-group shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry._patching import UpstreamSymbol, wrap
from vllm_dcp_geometry.attention_geometry import (
    builder_supports_partial_shards,
    partial_shard_refusal,
    resolve_group_geometry,
)

UPSTREAM_MODULE = "vllm.v1.worker.utils"
RUNS_IN = "worker"
WHY = (
    "Only the FlashAttention and FlashInfer builders are taught a partial DCP "
    "shard count; every other backend must refuse one at start-up."
)
REMOVE_WHEN = "every attention backend takes a per-group DCP shard count"
RELATED = "none upstream: backends take D from the process group"

_M = UPSTREAM_MODULE
PATCHED_SYMBOLS: tuple[UpstreamSymbol, ...] = (
    UpstreamSymbol(
        _M,
        "AttentionGroup.create_metadata_builders",
        "self, vllm_config, device, kernel_block_size=, num_metadata_builders=",
    ),
)


def check_backend_honours_shard_count(group: Any, vllm_config: Any) -> None:
    """Raise if ``group`` has a partial K its backend's builder cannot honour."""
    geometry = resolve_group_geometry(
        group.kv_cache_spec, group.layer_names, vllm_config
    )
    if geometry is None or not geometry.is_partial:
        return
    builder_cls = group.backend.get_builder_cls()
    if builder_supports_partial_shards(builder_cls):
        return
    raise partial_shard_refusal(
        geometry,
        f"KV-cache group {group.kv_cache_group_id}: attention backend "
        f"{group.backend.get_name()} ({builder_cls.__qualname__})",
        "Use K=1 ('replicated'), K=D ('sharded'), or the FLASH_ATTN / "
        "FLASHINFER backend for this group.",
    )


def _make_create_metadata_builders(
    original: Callable[..., Any],
) -> Callable[..., Any]:
    def create_metadata_builders(
        self: Any,
        vllm_config: Any,
        device: Any,
        kernel_block_size: int | None = None,
        num_metadata_builders: int = 1,
    ) -> Any:
        check_backend_honours_shard_count(self, vllm_config)
        return original(
            self, vllm_config, device, kernel_block_size, num_metadata_builders
        )

    return create_metadata_builders


def apply(module: ModuleType) -> None:
    wrap(
        module.AttentionGroup,
        "create_metadata_builders",
        _make_create_metadata_builders,
    )
