# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.model_executor.layers.attention.sparse_mla_attention``: sparse
MLA builders follow their group's K.

What: wraps ``SparseMLACommonMetadataBuilder.__init__`` (the base of the
FLASHMLA_SPARSE, FLASHINFER_MLA_SPARSE and FLASH_ATTN_MLA_SPARSE_FA4
builders) with the one taught-builder constructor
(``metadata_builders.builder_init``), its ``_build_chunked_context_fields``,
and the module's ``get_dcp_group`` as this module sees it (outside our
builder calls it is upstream's). The module calls the MLA module's
``build_mla_chunked_context_metadata`` by name, which the MLA patch plans
over K shards while a partial group is active.

- K = 1: upstream's constructor runs with ``get_dcp_group`` answering a world
  of 1, i.e. vLLM's DCP1 sparse builder (an N-row workspace, no KV gather, a
  DCP1 chunk plan for the dense-MHA prefill); the layers' impls run local.
- 1 < K < D within its replica (rule A6, the default): as dense MLA, the
  group's layers are bound first (a replica ``MLADCPManager`` over the K
  ranks of the replica: the query gather and LSE combine of
  ``DeepseekV32Attention``), then upstream's constructor runs with
  ``get_dcp_group`` answering the replica: vLLM's sparse builder for K
  sharded ranks (workspace N + N/K, its dense-MHA prefill context planned
  over K, the KV gather over the replica); ``_build_chunked_context_fields``
  runs in the replica too. The builder is checked to hold world K and the
  replica manager.
- 1 < K < D on the D-wide group (``partial_collectives: "dcp"``): the
  builder keeps D (the query is gathered over the DCP group and combined by
  the layer's ``MLADCPManager``, duplicate replicas masked); the dense-MHA
  prefill's context is planned over K shards
  (``mla_geometry.group_context_chunk_kwargs``, the dense MLA rule).

Either way the workspace is checked, and sparse decode has no length to
localise: causality comes from the top-k, which the impl filters to the
rank's shard in the shard world ``(K, r % K)`` (``ShardWorldForwardMqa``).

Why: vLLM 0.33.0's sparse builders take D from the DCP group whatever the
spec says.

Hand-back: D == 1, or vLLM's own K = D, runs upstream untouched.

Remove when: vLLM's sparse MLA takes a per-group DCP shard count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    use_group_geometry,
    use_replica_group,
)
from vllm_dcp_geometry.runtime.metadata_builders import (
    REPLICA_GROUP_ATTR,
    BuilderTeaching,
    bound_partial_geometry,
    builder_init,
)
from vllm_dcp_geometry.runtime.mla_geometry import (
    CHUNK_PLANNER_PARAMETERS,
    check_context_workspace,
    check_replica_builder,
    make_group_getter,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap, original_of
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group
from vllm_dcp_geometry.runtime.upstream_symbols import UpstreamChangedError


def _make_context_fields(original: Callable[..., Any]) -> Callable[..., Any]:
    def _build_chunked_context_fields(
        self: Any,
        common_attn_metadata: Any,
        num_decodes: int,
        num_prefills: int,
        prefill_query_lens_cpu: Any,
    ) -> Any:
        geometry = bound_partial_geometry(self)
        replica = getattr(self, REPLICA_GROUP_ATTR, None)
        with contextlib.ExitStack() as active:
            if geometry is not None:
                active.enter_context(use_group_geometry(geometry))
            if replica is not None:
                active.enter_context(use_replica_group(replica))
            return original(
                self,
                common_attn_metadata,
                num_decodes,
                num_prefills,
                prefill_query_lens_cpu,
            )

    return _build_chunked_context_fields


def _check_partial_workspace(
    builder: Any, geometry: GroupGeometry, vllm_config: Any, device: Any
) -> None:
    if geometry.is_partial:
        check_replica_builder(builder, geometry, "sparse MLA")
        check_context_workspace(
            geometry,
            builder.chunked_prefill_workspace_size,
            builder.kv_cache_spec.block_size,
        )


BUILDER_TEACHING = BuilderTeaching(
    mla=True,
    construct_in_group=lambda geometry: geometry.is_replicated,
    finish=_check_partial_workspace,
    replica_group=operator_replica_group,
)


def _require_mla_chunk_planner(module: ModuleType) -> None:
    import vllm.model_executor.layers.attention.mla_attention as mla

    ours = mla.build_mla_chunked_context_metadata
    copy = module.build_mla_chunked_context_metadata
    if copy is not ours and copy is original_of(ours):
        raise UpstreamChangedError(
            f"{module.__name__}.build_mla_chunked_context_metadata still holds "
            f"{mla.__name__}'s original, not the MLA patch's wrapper: the MLA "
            "patch did not reach this copy (a plugin bug, not a vLLM change)"
        )
    if copy is not ours:
        raise UpstreamChangedError(
            f"{module.__name__}.build_mla_chunked_context_metadata is no longer "
            f"{mla.__name__}'s (which the MLA patch plans over K shards); "
            "review the plugin against this vLLM"
        )


PATCH = Patch(
    upstream_module="vllm.model_executor.layers.attention.sparse_mla_attention",
    replaces=(
        Wrap(
            "SparseMLACommonMetadataBuilder.__init__",
            "self, kv_cache_spec, layer_names, vllm_config, device",
            builder_init(BUILDER_TEACHING),
        ),
        Wrap(
            "SparseMLACommonMetadataBuilder._build_chunked_context_fields",
            "self, common_attn_metadata, num_decodes, num_prefills, "
            "prefill_query_lens_cpu",
            _make_context_fields,
        ),
        Wrap("get_dcp_group", "", make_group_getter),
    ),
    relies_on=(
        # Relied on: the module calls the MLA module's chunk planner by name,
        # which the MLA patch plans over K shards for the active partial group.
        Pin("build_mla_chunked_context_metadata", CHUNK_PLANNER_PARAMETERS),
        # Relied on: the impls filter the top-k with their own dcp_world_size and
        # dcp_rank, which the bound impl swaps to (K, r % K) during forward_mqa.
        Pin(
            "SparseMLACommonImpl.forward_mqa",
            "self, q, kv_c_and_k_pe_cache, attn_metadata, layer",
        ),
    ),
    remove_with=(
        "worker.flashmla_sparse",
        "worker.mla_attention",
        "worker.mla_dcp_manager",
        "worker.sparse_attn_indexer",
    ),
    why=(
        "Sparse MLA builders take D from the DCP group whatever the spec says; "
        "replicated sparse groups must build DCP1 metadata and partial ones plan "
        "their dense-MHA prefill context over K shards."
    ),
    remove_when="vLLM's sparse MLA takes a per-group DCP shard count",
    related="none upstream: sparse MLA builders read the DCP process group",
    apply=_require_mla_chunk_planner,
)
