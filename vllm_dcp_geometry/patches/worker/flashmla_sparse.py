# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.mla.flashmla_sparse``: a replicated
FLASHMLA_SPARSE group builds vLLM's DCP1 builder.

What: wraps ``FlashMLASparseMetadataBuilder.__init__``. For a group with
K = 1 upstream's constructor runs with a view of the ``VllmConfig`` whose
``decode_context_parallel_size`` is 1 (the builder keeps it, so its later
reads agree); its base constructor is the sparse builder patch's, which
builds in the world (1, 0). Every other group runs upstream's constructor
with the real config.

Why: besides the DCP group, the constructor reads
``parallel_config.decode_context_parallel_size`` itself and raises for DCP
without the fp8 mixed-batch path or with a gathered head count that pads to
another kernel envelope. Those limits are about the D-gathered query; a
K = 1 group gathers none, so under them a replicated group would be refused
for what it never does.

Hand-back: D == 1 and every K > 1 run upstream untouched (partial groups keep
the query gather, so FlashMLA's DCP limits stay theirs).

Remove with: ``patches.worker.sparse_mla_attention`` (the base constructor it
relies on). Remove when: vLLM's sparse MLA takes a per-group DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.group_geometry import resolve_group_geometry
from vllm_dcp_geometry.runtime.hand_back import config_with_dcp_size
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap


def _make_builder_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(
        self: Any,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: Any,
    ) -> None:
        geometry = resolve_group_geometry(kv_cache_spec, layer_names, vllm_config)
        if geometry is not None and geometry.is_replicated:
            vllm_config = config_with_dcp_size(vllm_config, 1)
        original(self, kv_cache_spec, layer_names, vllm_config, device)

    return __init__


PATCH = Patch(
    upstream_module="vllm.v1.attention.backends.mla.flashmla_sparse",
    replaces=(
        Wrap(
            "FlashMLASparseMetadataBuilder.__init__",
            "self, kv_cache_spec, layer_names, vllm_config, device",
            _make_builder_init,
        ),
    ),
    relies_on=(
        # Relied on: the mixed-batch path filters the top-k with the impl's own
        # dcp_world_size and dcp_rank (bound per group).
        Pin(
            "FlashMLASparseImpl._forward_fp8_kv_mixed_batch",
            "self, q, kv_c_and_k_pe_cache, topk_indices, attn_metadata, "
            "kernel_metadata=",
        ),
    ),
    remove_with=("worker.sparse_mla_attention",),
    why=(
        "FlashMLA's sparse builder refuses DCP configurations on the parallel "
        "config's DCP size, for limits of the gathered query a replicated group "
        "never gathers."
    ),
    remove_when="vLLM's sparse MLA takes a per-group DCP shard count",
    related="none upstream: the builder reads the parallel config's DCP size",
)
