# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.attention.backends.mla.flashmla_sparse``: a FLASHMLA_SPARSE
group's builder checks the query its collectives gather: none for K = 1, K
ranks' heads for a partial group within its replica.

What: wraps ``FlashMLASparseMetadataBuilder.__init__``. Upstream's
constructor runs with a view of the ``VllmConfig`` whose
``decode_context_parallel_size`` is the world the group's collectives span
(the builder keeps it, so its later reads agree): 1 for K = 1 (its base
constructor is the sparse builder patch's, which builds in the world
(1, 0)), K for a partial group within its K-rank replica (rule A6; the base
constructor builds in the replica, world K). A partial group on the D-wide
group (``partial_collectives: "dcp"``) gathers D ranks' heads and keeps the
real config.

Why: besides the DCP group, the constructor reads
``parallel_config.decode_context_parallel_size`` itself and raises for DCP
without the fp8 mixed-batch path or with a gathered head count (local heads
times the config's D) that pads to another kernel envelope. Those limits are
about the gathered query: a K = 1 group gathers none and a replica gathers
K ranks' heads, so under D they refuse what the group never does (DeepSeek-
V3.2 at TP8/DCP8 as two replicas of 4: 16 heads per rank pad to 64, so do
the replica's 64, D's 128 do not). Its own code reads the view nowhere else.

Per release: vLLM 0.33.0's constructor raises both limits for every cache
dtype (its impl also refuses a bf16 cache wherever it must return a decode
LSE). vLLM 0.34.0 raises them for fp8 caches
(``QUANTIZED_DS_MLA_CACHE_FORMATS``) only: its bf16 kernel returns the LSE
for every token and pads the gathered heads itself. So on 0.34 the view
decides an fp8 group's build as above and changes nothing for a bf16 group,
which builds at every K as at K = D.

Hand-back: D == 1, K = D and a partial group on the D-wide group run
upstream untouched with the real config.

Remove with: ``patches.worker.sparse_mla_attention`` (the base constructor it
relies on). Remove when: vLLM's sparse MLA takes a per-group DCP shard count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.runtime.group_geometry import resolve_group_geometry
from vllm_dcp_geometry.runtime.hand_back import config_with_dcp_size
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.replica_groups import operator_replica_group


def gathered_world(geometry: Any, vllm_config: Any) -> int | None:
    """The world a group's query is gathered over where it is not the
    config's D (None: D, upstream's): 1 for K = 1, K for a partial group
    within its replica."""
    if geometry.is_replicated:
        return 1
    if (
        geometry.is_partial
        and operator_replica_group(geometry, vllm_config) is not None
    ):
        return int(geometry.shard_count)
    return None


def _make_builder_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(
        self: Any,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: Any,
    ) -> None:
        geometry = resolve_group_geometry(kv_cache_spec, layer_names, vllm_config)
        world = None if geometry is None else gathered_world(geometry, vllm_config)
        if world is not None:
            vllm_config = config_with_dcp_size(vllm_config, world)
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
        "config's DCP size, for limits of the gathered query, which a "
        "replicated group never gathers and a replica gathers over K ranks."
    ),
    remove_when="vLLM's sparse MLA takes a per-group DCP shard count",
    related="none upstream: the builder reads the parallel config's DCP size",
)
