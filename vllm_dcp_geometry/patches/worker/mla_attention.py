# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.model_executor.layers.attention.mla_attention``: MLA reads
each group's cache with the group's shard count K.

What: wraps ``MLACommonMetadataBuilder.__init__`` and ``.build`` (every dense
MLA builder) and, as this module sees them, ``get_dcp_group`` and
``build_mla_chunked_context_metadata``. The constructor admits the group
(``attention_admission``; a refusal names group, backend, K and D) and binds
the group's MLA layers (``mla_geometry``):

- K = 1 (``local``): the upstream constructor runs with ``get_dcp_group``
  answering the group's world (1, 0), so the builder is vLLM's DCP1 builder
  (workspace N, no KV gather, full decode lengths, the DCP1 prefill-context
  path, backend workspaces sized for the rank's own heads, and DSpark's DCP
  backend check ``_validate_dspark_dcp_support`` skipped as at DCP = 1); the
  layers run plain local attention (bound through their layer class,
  ``layer_binding``).
- 1 < K < D (``dcp-partial``) within its replica (rule A6, the default):
  the group's layers are bound first (each gets a replica ``MLADCPManager``
  over the K ranks of its replica, made by ``worker.mla_dcp_manager``; its
  impl runs with ``(K, r % K)``), then the upstream constructor runs with
  ``get_dcp_group`` answering the replica's ``GroupCoordinator``
  (``replica_groups``, made by ``worker.gpu_worker``): vLLM's builder for K
  sharded ranks (workspace N + N/K, context chunks over K, decode bound over
  K). ``build`` runs in the replica with the group's local decode lengths
  (persistent per-builder buffer); nothing is masked. A partial group whose
  replica groups were not made is refused, naming the way out.
- 1 < K < D on the D-wide group (``partial_collectives: "dcp"``): the
  upstream constructor keeps D (the query all-gather, combine and context KV
  gather span the DCP group). ``build`` runs with the group's local decode
  lengths, its decode bound ``ceil(L / (K*I)) * I``, and context chunks
  planned over K shards; the layer's combine masks duplicate replicas; the
  decode kernels get ``(K, r % K)`` as their cp world.

vLLM 0.34.0: with ``dcp_comm_backend="a2a"`` the layer combines and
up-projects in one step (``MLADCPManager.v_up_proj_combine`` with a
``W_UV_dcp`` gathered over the D ranks at load), which matches neither a
replica's K-rank gather nor the replica mask; binding a partial group clears
both (``mla_geometry.drop_fused_up_projection``), so the layer combines as
above, then up-projects its own heads. ``forward_impl`` is pinned with its
0.34.0 parameters (``mqa_q_prepared=``) and ``process_weights_after_loading``
(the load-time gather) is relied on there. DCP query replication
(``W_UK_T_dcp_qrep``) brings all D ranks' heads to each rank; admission
refuses it below K = D, as on 0.33.0.

Why: vLLM 0.33.0's MLA takes D from the DCP group whatever the spec says, so
a replicated or partial MLA cache is read as if sharded over D: wrong
lengths, a wrong combine and a wrong context gather, silently.

A K = D that is not the spec's default (a 'sharded' override) is admitted
too, so a layer whose impl vLLM built for fewer ranks is refused.

Hand-back: D == 1 or K == D by default runs every wrapped function
upstream's way (``get_dcp_group``, the DSpark check and the planner check one
context variable).

Remove when: vLLM's MLA takes a per-group DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    current_group_geometry,
    current_replica_group,
)
from vllm_dcp_geometry.runtime.metadata_builders import (
    BuilderTeaching,
    attach_local_seq_lens_buffer,
    builder_init,
    make_partial_group_build,
)
from vllm_dcp_geometry.runtime.mla_geometry import (
    CHUNK_PLANNER_PARAMETERS,
    check_context_workspace,
    check_replica_builder,
    decode_max_seq_len,
    group_context_chunk_kwargs,
    make_group_getter,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group


def _make_validate_dspark(original: Callable[..., None]) -> Callable[..., None]:
    def _validate_dspark_dcp_support(self: Any, supports_dcp_with_varlen: bool) -> None:
        geometry = current_group_geometry()
        if geometry is not None and geometry.is_replicated:
            # A replicated draft group runs without DCP, as at DCP = 1, where
            # vLLM lets every backend run DSpark.
            return
        original(self, supports_dcp_with_varlen)

    return _validate_dspark_dcp_support


def _make_chunk_planner(original: Callable[..., Any]) -> Callable[..., Any]:
    def build_mla_chunked_context_metadata(**kwargs: Any) -> Any:
        geometry = current_group_geometry()
        if geometry is None or not geometry.is_partial:
            return original(**kwargs)
        return original(**group_context_chunk_kwargs(kwargs, geometry))

    return build_mla_chunked_context_metadata


def _finish_partial_builder(
    builder: Any, geometry: GroupGeometry, vllm_config: Any, device: Any
) -> None:
    if not geometry.is_partial:
        return
    check_replica_builder(builder, geometry, "MLA")
    check_context_workspace(
        geometry, builder.chunked_prefill_workspace_size, builder.page_size
    )
    attach_local_seq_lens_buffer(builder, vllm_config, device)


BUILDER_TEACHING = BuilderTeaching(
    mla=True,
    # K = 1 builds vLLM's DCP1 builder (workspace, chunk plan, no KV gather);
    # a partial builder within its replica is vLLM's builder for K sharded
    # ranks; on the D-wide group it keeps D for the query gather and combine.
    construct_in_group=lambda geometry: geometry.is_replicated,
    finish=_finish_partial_builder,
    replica_group=operator_replica_group,
)


def _decode_bound(common_attn_metadata: Any, geometry: GroupGeometry) -> dict[str, Any]:
    if current_replica_group() is not None:
        # Built in its replica's world, upstream bounds over K itself.
        return {}
    return {
        "max_seq_len": decode_max_seq_len(common_attn_metadata.max_seq_len, geometry)
    }


def _batch_bound_without_decodes(metadata: Any, common_attn_metadata: Any) -> None:
    if not metadata.num_decodes:
        # Without decodes upstream reports the batch's own bound.
        metadata.max_seq_len = common_attn_metadata.max_seq_len


FORWARD_IMPL_PARAMETERS = (
    "self, q, k_c_normed, k_pe, kv_cache, attn_metadata, output, output_scale=, "
    "output_block_scale=, quant_group_size=, quant_scale_ue8m0=, quant_col_major=, "
    "quant_tma_aligned=, q_dcp_replicated="
)

PATCH = Patch(
    upstream_module="vllm.model_executor.layers.attention.mla_attention",
    replaces=(
        Wrap(
            "MLACommonMetadataBuilder.__init__",
            "self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=, "
            "supports_dcp_with_varlen=",
            builder_init(BUILDER_TEACHING),
        ),
        Wrap(
            "MLACommonMetadataBuilder.build",
            "self, common_prefix_len, common_attn_metadata, fast_build=",
            make_partial_group_build,
            factory_args=(_decode_bound, _batch_bound_without_decodes),
        ),
        Wrap("get_dcp_group", "", make_group_getter),
        Wrap(
            "MLACommonMetadataBuilder._validate_dspark_dcp_support",
            "self, supports_dcp_with_varlen",
            _make_validate_dspark,
        ),
        # Copies taken before the plugin registered (sparse MLA's) must call
        # the K-aware planner too, as they do when imported after it.
        Wrap(
            "build_mla_chunked_context_metadata",
            CHUNK_PLANNER_PARAMETERS,
            _make_chunk_planner,
            rebind_copies=True,
        ),
    ),
    relies_on=(
        # Relied on: the layer reads impl.dcp_world_size, dcp_manager.combine and
        # impl.forward_mqa; the context path splits its workspace by the impl's
        # D and reorganises K shards from the gather. On 0.34.0 it combines
        # through dcp_manager.v_up_proj_combine instead wherever W_UV_dcp is
        # set, which the binding clears for a partial group.
        Pin(
            "MLAAttention.forward_impl",
            {
                "0.33.0": FORWARD_IMPL_PARAMETERS,
                "0.34.0": FORWARD_IMPL_PARAMETERS + ", mqa_q_prepared=",
            },
        ),
        # Relied on (0.34.0): W_UV_dcp is gathered at load only where the
        # layer's manager has a v_up_proj_combine, so a reload after the
        # binding cleared both gathers nothing.
        Pin("MLAAttention.process_weights_after_loading", {"0.34.0": "self"}),
        Pin(
            "MLACommonBaseImpl._context_parallel_compute_prefill_context",
            "self, q, kv_c_and_k_pe_cache, attn_metadata, k_scale, dcp_world_size, "
            "fused_mla_kv_concat_fn=",
        ),
        Pin(
            "reorg_kvcache",
            "allgatered_kv_c_normed, allgatered_k_pe, padded_local_chunk_seq_lens_lst, "
            "local_context_lens_allranks, local_starts, sum_seq_len, max_seq_len, toks",
        ),
        Pin("MLADCPManager.init_kv_gather", "self, workspace, max_gathered_tokens"),
    ),
    remove_with=(
        "worker.kimi_k3_mla",
        "worker.sparse_mla_attention",
        "worker.mla_dcp_manager",
        "worker.gpu_worker",
        "worker.sparse_attn_indexer",
    ),
    why=(
        "MLA builders, impls and layers take D from the DCP group whatever the "
        "spec says; replicated MLA groups must run locally and partial ones read "
        "K shards and combine exactly."
    ),
    remove_when="vLLM's MLA takes a per-group DCP shard count",
    related="vllm#23734 (MLA DCP sizes its workspaces and combine from D)",
)
