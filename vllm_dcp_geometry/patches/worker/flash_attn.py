# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.flash_attn``: per-group DCP attention.

What: wraps ``FlashAttentionMetadataBuilder.__init__``. The builder is built
per KV-cache group from the group's spec, so it resolves the group's K and,
where K differs from what vLLM derives from ``dcp_sharded``, runs the upstream
constructor with the module's ``get_dcp_world_size_and_rank`` answering the
group's shard world ``(K, s = r % K)``. Everything the builder derives from it
then follows the group: the per-request local context lengths
(``get_dcp_local_seq_lens(ctx, K, s, I)``, the contract's local sequence
length), the ``max_dcp_context_kv_len`` bound (``ceil(L / (K*I)) * I``), the
persistent buffers and the draft-update flag. The one upstream use of the
builder's world size that means "query heads gathered over the DCP group"
(the FA3 scheduler-metadata head count ``num_heads_q * dcp_world_size``) must
stay D, so a partial builder scales ``num_heads_q`` by D/K.

Where K < D the constructor first admits the group
(``attention_admission.admit_attention``; a refusal names group, backend, K
and D). It also binds the group's attention impls (created with the
model, before any spec existed): K = 1 runs plain local attention (no query
all-gather, no LSE combine); 1 < K < D runs within its K-rank replica
(rule A6, the default ``partial_collectives``): the builder is constructed
and the impls bound with the replica's ``GroupCoordinator`` held
(``replica_groups.operator_replica_group``), each impl takes ``(K, r % K)``
and runs every forward within the replica
(``impl_binding.bind_impl_within_replica``), and the module's
``get_dcp_group`` then answers the replica, so the query all-gather (K x H
heads, the workspace and scheduler plan sized for them) and the LSE combine
span the K ranks holding one copy of every position. With
``partial_collectives: "dcp"`` the D-rank all-gather and combine stay, with
duplicate replicas (``q = r // K != 0``) masked to LSE = -inf, so each shard
is counted once and the combined LSE that is merged with new-token attention
is exact (see ``impl_binding.mask_duplicate_replica_lse``); the scheduler
plan then counts the queries of all D ranks.

The global ``dcp_local_seq_lens`` of the runners (V1 ``gpu_model_runner``, V2
``gpu/cp_utils``/``gpu/attn_utils``) is left untouched: this builder never
reads it.

Why: vLLM 0.33.0 takes (D, r) or (1, 0) from the boolean ``dcp_sharded``, and
its impls take the global D; a partial group would read a K-sharded cache with
D-shard lengths, and a replicated target group would skip its cached context.

It also wraps ``FlashAttentionImpl._forward_with_dcp``, the DCP path every
K > 1 runs (vLLM's own K = D included), which hands its kernels no ``s_aux``:
for a layer with attention sinks, the module's ``flash_attn_varlen_func``
becomes (once) a ``SinkFoldingKernel``, which during that layer's call, on
that thread, folds the sinks into the new-token attention (the call whose
keys are the step's own) and passes the context attention over the rank's
shard through untouched, so the sinks enter the merged softmax exactly once
(rule A7). Folding needs only the
kernel's (out, LSE) contract, the one the path's merge already relies on,
where ``s_aux`` would also need the kernel's LSE to count the sink (which no
CPU check can show). A layer without sinks goes straight to upstream.

Where K > 1 the layers must still not use what the DCP path drops: the
R-SWA / multimodal-prefix mask_mods. Admission refuses them (for vLLM's own
K = D after the upstream constructor ran), naming layer, feature and backend;
K = 1 runs the single-device path, which keeps them.

Hand-back: D == 1, or K equal to vLLM's own per-spec choice, runs the upstream
constructor untouched (a replicated group still gets local impls; a K = D
group is then admitted for the features above); D == 1 never reaches the
DCP path.

Remove when: upstream FlashAttention takes a per-group shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.runtime.attention_sinks import sink_folding_kernel
from vllm_dcp_geometry.runtime.group_context import current_replica_group
from vllm_dcp_geometry.runtime.metadata_builders import (
    BuilderTeaching,
    builder_init,
    group_world_getter,
)
from vllm_dcp_geometry.runtime.mla_geometry import make_group_getter
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call


def _scale_gathered_heads(
    builder: Any, geometry: GroupGeometry, vllm_config: Any, device: Any
) -> None:
    if geometry.is_partial and current_replica_group() is None:
        # On the D-wide group the DCP context pass attends with the queries
        # of all D ranks; within its replica, with the K it was built with.
        builder.num_heads_q *= geometry.replica_count


BUILDER_TEACHING = BuilderTeaching(
    mla=False,
    construct_in_group=lambda geometry: not geometry.matches_default,
    finish=_scale_gathered_heads,
    # vLLM's own K = D: its DCP path still drops the mask_mods, which
    # admission refuses for the layers using them.
    admit_vllm_default=True,
    replica_group=operator_replica_group,
)


def _make_forward_with_dcp(
    original: Callable[..., Any], module: ModuleType
) -> Callable[..., Any]:
    def _forward_with_dcp(
        self: Any, query: Any, key: Any, *args: Any, **kw: Any
    ) -> Any:
        sinks = self.sinks
        if sinks is None:
            return original(self, query, key, *args, **kw)
        kernel = sink_folding_kernel(module, "flash_attn_varlen_func")
        with kernel.folding(key, sinks):
            return original(self, query, key, *args, **kw)

    return _forward_with_dcp


def apply(module: ModuleType) -> None:
    # The path must reach its kernels through the module global rebound above.
    require_global_call(
        module, "FlashAttentionImpl._forward_with_dcp", "flash_attn_varlen_func"
    )


PATCH = Patch(
    upstream_module="vllm.v1.attention.backends.flash_attn",
    replaces=(
        # The builder is constructed with the group active wherever K is not
        # vLLM's own, and then takes the group's shard world.
        Wrap(
            "get_dcp_world_size_and_rank",
            "enabled=",
            group_world_getter(lambda geometry: True),
        ),
        # Within a partial group's replica (its impls' forward, bound at
        # construction) the DCP path gathers and combines over the replica.
        Wrap("get_dcp_group", "", make_group_getter),
        Wrap(
            "FlashAttentionMetadataBuilder.__init__",
            "self, kv_cache_spec, layer_names, vllm_config, device",
            builder_init(BUILDER_TEACHING),
        ),
        # Attention sinks folded into the DCP path's new-token attention.
        Wrap(
            "FlashAttentionImpl._forward_with_dcp",
            "self, query, key, value, key_cache, value_cache, output, "
            "attn_metadata, q_descale=, k_descale=, v_descale=",
            _make_forward_with_dcp,
            with_module=True,
        ),
    ),
    relies_on=(
        # The single-device path keeps sinks and mask_mods (admission lets K = 1
        # layers that use them run; tests/test_attention_features pins it).
        Pin("FlashAttentionImpl.forward"),
        # Relied on: the builder reads its geometry and head count from these.
        Pin(
            "FlashAttentionMetadataBuilder.build",
            "self, common_prefix_len, common_attn_metadata, fast_build=",
        ),
        Pin(
            "FlashAttentionMetadataBuilder._get_scheduler_metadata",
            "self, *, aot_schedule, batch_size, cu_query_lens, max_query_len, "
            "seqlens, max_seq_len, causal, max_num_splits",
        ),
    ),
    # The replica groups a partial group's collectives stay within.
    remove_with=("worker.gpu_worker",),
    why=(
        "FlashAttention builders take DCP (D, r) from the boolean dcp_sharded and "
        "impls take the global D; partial and replicated groups need (K, r % K), "
        "local attention for K = 1 and, for 1 < K < D, collectives within the "
        "K-rank replica (or an exact masked LSE combine on the D-wide group); "
        "the DCP path runs its kernels without the layer's attention sinks."
    ),
    remove_when=(
        "upstream FlashAttention takes a per-group DCP shard count and passes "
        "sinks on its DCP path"
    ),
    related=(
        "vllm#48392 (dense drafts: the DCP query all-gather needs replicated KV heads)"
    ),
    apply=apply,
)
