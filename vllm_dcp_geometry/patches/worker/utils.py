# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.worker.utils``: admit every attention group at start-up.

What: wraps ``AttentionGroup.create_metadata_builders`` (Model Runner V1 and
V2, target and draft groups alike). Before any builder is made for a group
whose K differs from D (or is a K = D other than the spec's default), the
group goes through the one admission rule,
``attention_admission.admit_attention``, once per layer class of the group,
with its spec's kind, K, D, the K vLLM would read it with, the layer class,
the DCP world its impl was built for, its backend and the DCP modes (PCP,
MLA query replication, interleave, Kimi-K3's specialized decode). A refused
group raises ``DcpGeometryError`` naming the group, layer, layer class,
backend, K and D; ``vllm-dcp-geometry plan`` prints the same decision.
Groups with vLLM's default K = D, or D = 1, go straight to upstream, except
on a backend whose DCP path drops attention features a layer may use
(FLASH_ATTN: the mask_mods; FLASHINFER: sinks), where upstream is wrong
for such a layer.

Why: a backend the plugin has not taught a group's K reads every cache with
vLLM's own geometry (the global D for MLA and most backends); running it on a
cache with another K would be silently wrong.

Remove when: every vLLM attention backend takes a per-group shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract.attention_backends import DCP_DROPPED_FEATURES
from vllm_dcp_geometry.runtime.group_geometry import resolve_group_geometry
from vllm_dcp_geometry.runtime.patching import Patch, Wrap
from vllm_dcp_geometry.runtime.worker_admission import (
    admit_group,
    attention_kind,
    backend_label,
)


def admit_attention_group(group: Any, vllm_config: Any) -> None:
    """Raise if the admission rule refuses ``group`` (an ``AttentionGroup``).

    At D = 1 (read from the DCP process group, as upstream builders read it)
    nothing else is looked at.
    """
    from vllm.distributed import parallel_state

    if parallel_state.get_dcp_world_size_and_rank(True)[0] == 1:
        return
    geometry = resolve_group_geometry(
        group.kv_cache_spec,
        group.layer_names,
        vllm_config,
        index=group.kv_cache_group_id,
    )
    if geometry is None:
        return
    backend = group.backend
    name = backend.get_name()
    if not geometry.needs_admission and name not in DCP_DROPPED_FEATURES:
        return
    admit_group(
        geometry,
        kind=attention_kind(group.kv_cache_spec, backend),
        backend=backend_label(name, backend.get_builder_cls()),
        vllm_config=vllm_config,
        layer_names=group.layer_names,
    ).check()


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
        admit_attention_group(self, vllm_config)
        return original(
            self, vllm_config, device, kernel_block_size, num_metadata_builders
        )

    return create_metadata_builders


PATCH = Patch(
    upstream_module="vllm.v1.worker.utils",
    replaces=(
        Wrap(
            "AttentionGroup.create_metadata_builders",
            "self, vllm_config, device, kernel_block_size=, num_metadata_builders=",
            _make_create_metadata_builders,
        ),
    ),
    why=(
        "Only some attention backends are taught a group's DCP shard count; every "
        "group goes through one admission rule at start-up, which refuses the rest."
    ),
    remove_when="every attention backend takes a per-group DCP shard count",
    related="none upstream: backends take D from the process group",
)
