# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.flashinfer``: per-group DCP attention.

What: wraps ``FlashInferMetadataBuilder.__init__``, ``.build`` and
``._get_prefill_wrapper``; ``get_dcp_world_size_and_rank`` and
``get_dcp_local_seq_lens`` as this module sees them answer the group that is
being built (outside our builder calls they are upstream's).

- K = 1 on a spec vLLM treats as sharded: the constructor runs with the
  group's world (1, 0), i.e. vLLM's own replicated builder.
- 1 < K < D: the builder keeps the D-rank world, because FlashInfer uses its
  ``dcp_world_size`` as "query heads gathered over the DCP group" when it plans
  (``num_qo_heads * dcp_world_size``). Only the local lengths follow the
  group: ``build`` runs with the group active, so its call of
  ``get_dcp_local_seq_lens(seq, D, r, I)`` answers ``(seq, K, s, I)``, and it
  is handed a ``CommonAttentionMetadata`` whose ``dcp_local_seq_lens`` (read by
  the trtllm-gen decode) are the group's, written into a persistent per-builder
  buffer so FULL CUDA graphs replay the current values. The prefill wrapper's
  own DCP combine is replica-masked like the impl's.

Where K < D the constructor first admits the group
(``attention_admission.admit_attention``). It binds the group's impls
(``impl_binding``): K = 1 runs
plain local attention; 1 < K < D masks duplicate replicas to LSE = -inf
before the D-rank combine, so the combined LSE is exact.

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
from vllm_dcp_geometry.runtime.group_context import current_group_geometry
from vllm_dcp_geometry.runtime.impl_binding import mask_combine
from vllm_dcp_geometry.runtime.metadata_builders import (
    BuilderTeaching,
    attach_local_seq_lens_buffer,
    bound_partial_geometry,
    builder_init,
    group_local_seq_lens,
    group_world_getter,
    make_partial_group_build,
)
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


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


BUILDER_TEACHING = BuilderTeaching(
    mla=False,
    # A partial builder keeps D: FlashInfer plans with num_qo_heads * its
    # dcp_world_size, the heads gathered over the DCP group.
    construct_in_group=lambda geometry: (
        geometry.is_replicated and not geometry.matches_default
    ),
    finish=_attach_buffer,
)


def _make_get_prefill_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_prefill_wrapper(self: Any, causal: bool = True) -> Any:
        wrapper = original(self, causal)
        geometry = bound_partial_geometry(self)
        if geometry is None:
            return wrapper
        # A partial builder keeps D, so upstream hands it its DCP prefill
        # wrapper; one without a combine to mask would count replicas twice.
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
        # Only a replicated group's builder is constructed in its world; a
        # partial one keeps D (build runs with the group active, see above).
        Wrap(
            "get_dcp_world_size_and_rank",
            "enabled=",
            group_world_getter(lambda geometry: geometry.is_replicated),
        ),
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
        # Relied on: the prefill wrapper keeps its combine in ``_dcp_combine``.
        Pin(
            "BatchDCPPrefillWrapper.__init__",
            "self, kv_layout, workspace_buffer=, dcp_a2a=, use_trtllm_context=",
        ),
    ),
    why=(
        "FlashInfer builders take DCP (D, r) from the boolean dcp_sharded, trtllm "
        "decode reads the global local sequence lengths and every combine spans "
        "the D ranks; partial and replicated groups need their own geometry."
    ),
    remove_when="upstream FlashInfer takes a per-group DCP shard count",
    related="none upstream: FlashInfer takes DCP from the boolean dcp_sharded",
)
