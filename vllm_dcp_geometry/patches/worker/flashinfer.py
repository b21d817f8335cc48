# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.flashinfer``: per-group DCP attention.

What: wraps ``FlashInferMetadataBuilder.__init__``, ``.build`` and
``._get_prefill_wrapper``; ``get_dcp_world_size_and_rank`` and
``get_dcp_local_seq_lens`` as this module sees them answer the group that is
being built (outside our builder calls they are upstream's).

- K = 1 on a spec vLLM treats as sharded: the constructor runs with the
  group's world (1, 0), i.e. vLLM's own replicated builder.
- 1 < K < D within its K-rank replica (rule A6, the default
  ``partial_collectives``): the builder is constructed, and the group's
  impls bound, with the replica's ``GroupCoordinator`` held
  (``replica_groups.operator_replica_group``), so the builder takes
  ``(K, r % K)`` and plans the K x H heads gathered over the replica
  (``num_qo_heads * dcp_world_size``), each impl takes ``(K, r % K)`` and runs
  every forward within the replica (``impl_binding.bind_impl_within_replica``),
  and the module's ``get_dcp_group`` then answers the replica: the query
  all-gathers and LSE combines of the decode path and of the DCP prefill
  wrapper span the K ranks holding one copy of every position; nothing is
  masked.
- 1 < K < D on the D-wide group (``partial_collectives: "dcp"``): the builder
  keeps the D-rank world, because FlashInfer uses its ``dcp_world_size`` as
  "query heads gathered over the DCP group" when it plans. The prefill
  wrapper's DCP combine is replica-masked like the impl's (duplicate
  replicas send LSE = -inf, so the combined LSE is exact).

Either way a partial group's ``build`` runs with the group active, so its
call of ``get_dcp_local_seq_lens`` answers the group's local lengths (within
the replica upstream's call is already ``(seq, K, s, I)``; on the D-wide group
the wrapper turns ``(seq, D, r, I)`` into it), and it is handed a
``CommonAttentionMetadata`` whose ``dcp_local_seq_lens`` (read by the
trtllm-gen decode) are the group's, written into a persistent per-builder
buffer so FULL CUDA graphs replay the current values.

Where K < D the constructor first admits the group
(``attention_admission.admit_attention``); K = 1 impls run plain local
attention (``impl_binding``).

The runners' global ``dcp_local_seq_lens`` are left untouched; a partial
group's builder replaces them in its own copy of the common metadata.

Why: vLLM 0.33.0 gives every group the global DCP geometry (one global local
sequence length, D-rank combines).

Hand-back: D == 1, or K equal to vLLM's own per-spec choice, runs upstream
unchanged (a replicated group still gets local impls).

Remove when: upstream FlashInfer takes a per-group DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    current_group_geometry,
    current_replica_group,
)
from vllm_dcp_geometry.runtime.impl_binding import mask_combine
from vllm_dcp_geometry.runtime.metadata_builders import (
    REPLICA_GROUP_ATTR,
    BuilderTeaching,
    attach_local_seq_lens_buffer,
    bound_partial_geometry,
    builder_init,
    group_local_seq_lens,
    group_world_getter,
    make_partial_group_build,
)
from vllm_dcp_geometry.runtime.mla_geometry import make_group_getter
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group


def _make_local_seq_lens(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_dcp_local_seq_lens(
        seq_lens: Any,
        dcp_size: int = 1,
        dcp_rank: Any = None,
        cp_kv_cache_interleave_size: int = 1,
    ) -> Any:
        geometry = current_group_geometry()
        if (
            geometry is None
            or not geometry.is_partial
            or dcp_size != geometry.dcp_world_size
        ):
            return original(seq_lens, dcp_size, dcp_rank, cp_kv_cache_interleave_size)
        if (
            not isinstance(dcp_rank, int)
            or dcp_rank != geometry.dcp_rank
            or cp_kv_cache_interleave_size != geometry.interleave_size
        ):
            raise DcpGeometryError(
                f"{geometry.describe()}: FlashInfer asked for D-rank local lengths "
                f"(rank {dcp_rank!r}, interleave {cp_kv_cache_interleave_size}) "
                "that this group's geometry cannot answer"
            )
        return group_local_seq_lens(seq_lens, geometry)

    return get_dcp_local_seq_lens


def _attach_buffer(
    builder: Any, geometry: GroupGeometry, vllm_config: Any, device: Any
) -> None:
    if geometry.is_partial:
        attach_local_seq_lens_buffer(builder, vllm_config, device)


def _takes_shard_world(geometry: GroupGeometry) -> bool:
    # FlashInfer plans with num_qo_heads * its dcp_world_size, the heads
    # gathered over its collective group: a partial builder takes K only
    # within its replica, and keeps D on the D-wide group.
    return geometry.is_replicated or current_replica_group() is not None


BUILDER_TEACHING = BuilderTeaching(
    mla=False,
    construct_in_group=lambda geometry: (
        geometry.is_replicated and not geometry.matches_default
    ),
    finish=_attach_buffer,
    replica_group=operator_replica_group,
)


def _make_get_prefill_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_prefill_wrapper(self: Any, causal: bool = True) -> Any:
        wrapper = original(self, causal)
        geometry = bound_partial_geometry(self)
        if geometry is None or getattr(self, REPLICA_GROUP_ATTR, None) is not None:
            # Within its replica every shard has one holder: nothing to mask.
            return wrapper
        # A D-wide partial builder keeps D, so upstream hands it its DCP
        # prefill wrapper; one without a combine to mask would count replicas
        # twice.
        combine = getattr(wrapper, "_dcp_combine", None)
        if combine is None:
            raise DcpGeometryError(
                f"{geometry.describe()}: FlashInfer's prefill wrapper "
                f"{type(wrapper).__name__} has no DCP combine (_dcp_combine) to "
                "replica-mask; refusing to run the group's prefill unmasked"
            )
        wrapper._dcp_combine = mask_combine(combine, geometry.replica)
        return wrapper

    return _get_prefill_wrapper


PATCH = Patch(
    upstream_module="vllm.v1.attention.backends.flashinfer",
    replaces=(
        # A replicated group's builder, and a partial one's within its
        # replica, take the group's world; a D-wide partial one keeps D.
        Wrap(
            "get_dcp_world_size_and_rank",
            "enabled=",
            group_world_getter(_takes_shard_world),
        ),
        # Within a partial group's replica (its impls' forward, bound at
        # construction) the decode path and the DCP prefill wrapper gather
        # and combine over the replica.
        Wrap("get_dcp_group", "", make_group_getter),
        Wrap(
            "get_dcp_local_seq_lens",
            "seq_lens, dcp_size=, dcp_rank=, cp_kv_cache_interleave_size=",
            _make_local_seq_lens,
        ),
        Wrap(
            "FlashInferMetadataBuilder.__init__",
            "self, kv_cache_spec, layer_names, vllm_config, device",
            builder_init(BUILDER_TEACHING),
        ),
        Wrap(
            "FlashInferMetadataBuilder.build",
            "self, common_prefix_len, common_attn_metadata, fast_build=",
            make_partial_group_build,
        ),
        Wrap(
            "FlashInferMetadataBuilder._get_prefill_wrapper",
            "self, causal=",
            _make_get_prefill_wrapper,
        ),
    ),
    relies_on=(
        # Within a replica, every collective of the decode path and of the
        # DCP prefill wrapper asks this module's get_dcp_group at forward.
        Pin(
            "FlashInferImpl.forward",
            "self, layer, query, key, value, kv_cache, attn_metadata, output, "
            "output_scale=, output_block_scale=",
        ),
        Pin(
            "BatchDCPPrefillWrapper.run",
            "self, layer, prefill_query, kv_cache_tuple, key, value, out",
        ),
        # Relied on: the prefill wrapper keeps its combine in ``_dcp_combine``.
        Pin(
            "BatchDCPPrefillWrapper.__init__",
            "self, kv_layout, workspace_buffer=, dcp_a2a=, use_trtllm_context=",
        ),
    ),
    # The replica groups a partial group's collectives stay within.
    remove_with=("worker.gpu_worker",),
    why=(
        "FlashInfer builders take DCP (D, r) from the boolean dcp_sharded, trtllm "
        "decode reads the global local sequence lengths and every combine spans "
        "the D ranks; partial and replicated groups need their own geometry, "
        "partial ones their collectives within the K-rank replica."
    ),
    remove_when="upstream FlashInfer takes a per-group DCP shard count",
    related="none upstream: FlashInfer takes DCP from the boolean dcp_sharded",
)
