# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""MLA attention under a KV-cache group's DCP geometry.

vLLM 0.33.0's MLA takes the DCP world from the process group everywhere: the
builder (``MLACommonMetadataBuilder``: workspace N + N/D, context chunks over
D ranks, decode lengths from the runner's global ``dcp_local_seq_lens``), the
impl (``MLACommonImpl.dcp_world_size`` from the parallel config) and the layer
(``MLAAttention.forward_impl``: query all-gather and LSE combine over D, the
layer's ``MLADCPManager``). This module holds what the MLA patch binds so a
group with K shards reads its cache with K:

- K = 1 (``local``): the builder is constructed in the world (1, 0) - full
  lengths, workspace N, no KV gather, the DCP1 prefill-context path - and the
  impls run plain local attention (no query all-gather, no combine).
- 1 < K < D (``dcp-partial``) within its replica (rule A6, the default):
  builder, impls and layers run as a sharded group of world K on the
  replica's ``GroupCoordinator`` (``replica_groups``): the builder is
  constructed with ``get_dcp_group`` answering the replica (workspace
  N + N/K, context chunks over K, decode bound over K), every layer gets a
  replica ``MLADCPManager`` (query all-gather, combine and context KV gather
  over K ranks, made by vLLM's own constructor with the layer's own
  arguments) and its impl runs with ``(K, r % K)``; nothing is masked.
- 1 < K < D on the D-wide DCP group (``partial_collectives: "dcp"``):
  builder and impls keep the D-wide query all-gather, combine and context KV
  all-gather, but decode reads the group's local lengths (``(K, r % K)``),
  the context chunks are planned over K shards within a row budget the
  D-wide gather fits, duplicate replicas (``r // K != 0``) weigh 0 in the
  combine, and kernels that take ``cp_world_size``/``cp_rank`` get
  ``(K, r % K)``.

vLLM 0.34.0: with ``dcp_comm_backend="a2a"`` (and no PCP) the layer's
``MLADCPManager`` carries ``v_up_proj_combine`` and the layer (vLLM's
``MLAAttention``, Kimi-K3's) a ``W_UV_dcp`` all-gathered over the D-rank DCP
group at weight load; the layer then combines and up-projects in one step
that neither follows a replica's K ranks nor the replica mask. Binding a
partial group clears both (``drop_fused_up_projection``), so the layer takes
``combine`` + ``_v_up_proj`` - the replica manager's or the masked one. On
0.33.0 neither exists and nothing is touched; K = 1 never combines and
K = D is never bound.

vLLM is imported inside the functions that need it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry, cdiv
from vllm_dcp_geometry.runtime.group_context import (
    current_group_geometry,
    current_replica_group,
    use_replica_group,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR, check_rebind
from vllm_dcp_geometry.runtime.impl_binding import make_impl_local, mask_combine


class ShardWorldGroup:
    """What an MLA builder reads of the DCP ``GroupCoordinator`` while a local
    group's builder is constructed: ``world_size`` 1 and ``rank_in_group`` 0.
    Anything else an upstream change might read raises instead of answering
    for the whole DCP group."""

    def __init__(self, geometry: GroupGeometry) -> None:
        if not geometry.is_replicated:
            raise DcpGeometryError(
                f"{geometry.describe()}: only a local (K=1) MLA group is built "
                "outside the DCP group"
            )
        self._geometry = geometry
        self.world_size, self.rank_in_group = geometry.shard_world

    def __getattr__(self, name: str) -> Any:
        raise DcpGeometryError(
            f"{self._geometry.describe()}: the MLA builder of a local group read "
            f"the DCP group's {name!r}, which this plugin does not answer for it"
        )


def make_group_getter(original: Callable[[], Any]) -> Callable[[], Any]:
    """Wrapper factory for a module's ``get_dcp_group`` (MLA's, the DCP
    ops', FlashAttention's, FlashInfer's): the partial group's replica
    ``GroupCoordinator`` while one is bound, built or run within its
    replica (``group_context.use_replica_group``), a world of 1
    (``ShardWorldGroup``) while a replicated group's builder is being built
    (``group_context.use_group_geometry``), upstream's group otherwise."""

    def get_dcp_group() -> Any:
        replica = current_replica_group()
        if replica is not None:
            return replica
        geometry = current_group_geometry()
        if geometry is None or not geometry.is_replicated:
            return original()
        return ShardWorldGroup(geometry)

    return get_dcp_group


class ShardWorldForwardMqa:
    """An MLA impl's ``forward_mqa`` bound to its group.

    While the decode kernel call runs, the impl's ``dcp_world_size`` and
    ``dcp_rank`` read the group's shard world ``(K, r % K)``: FLASH_ATTN_MLA
    passes them as ``cp_world_size``/``cp_rank`` and FLASHINFER_MLA as
    ``cp_world``/``cp_rank`` (the kernels' causal position map), the others
    only test them against 1. A local group asks for no LSE (nothing combines
    it; FLASHINFER_MLA's ragged multi-token decode cannot return one). The
    layer around it still sees the impl's own values: K for a partial group
    within its replica, D for one on the D-wide group (its all-gather and
    combine span the DCP group), 1 for a local one.
    """

    def __init__(
        self, impl: Any, forward_mqa: Callable[..., Any], geometry: GroupGeometry
    ) -> None:
        self.impl = impl
        self.forward_mqa = forward_mqa
        self.geometry = geometry

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self.impl
        saved = impl.dcp_world_size, impl.dcp_rank, impl.need_to_return_lse_for_decode
        impl.dcp_world_size, impl.dcp_rank = self.geometry.shard_world
        if self.geometry.is_replicated:
            impl.need_to_return_lse_for_decode = False
        try:
            return self.forward_mqa(*args, **kwargs)
        finally:
            (
                impl.dcp_world_size,
                impl.dcp_rank,
                impl.need_to_return_lse_for_decode,
            ) = saved


MANAGER_ARGS_ATTR = "_vllm_dcp_geometry_init_args"
"""Set on every ``MLADCPManager`` (by ``worker.mla_dcp_manager``) to the
``(args, kwargs)`` its layer constructed it with."""


def register_replica_warmups(
    init: Callable[..., None], manager: Any, args: Any, kwargs: Any
) -> None:
    """Register, as ``MLADCPManager(*args, **kwargs)`` (``init``: upstream's
    constructor) registers D's, the JIT warm-up of the LSE-combine kernel for
    every replica group made on this worker: the layer's own dtype, heads and
    head size with a config seen with DCP size K, so a replica's K-rank
    combine compiles at start-up, not on its first decode step. The layer's
    manager is made while the model is built, where vLLM's runners collect
    warm-ups (the replica managers come later, outside that window in Model
    Runner V1); the replica groups exist by then (``Worker.init_device``).
    Nothing is read where no replica group was made, nor for a replica
    manager itself (its layer's manager registered its K)."""
    from vllm_dcp_geometry.runtime.replica_groups import made_replica_groups

    shard_counts = sorted(made_replica_groups())
    if not shard_counts or current_replica_group() is not None:
        return
    import inspect

    from vllm.v1.attention.ops import dcp

    from vllm_dcp_geometry.runtime.hand_back import config_with_dcp_size

    given = inspect.signature(init).bind(manager, *args, **kwargs).arguments
    vllm_config = given["vllm_config"]
    parallel_config = vllm_config.parallel_config
    if (
        not vllm_config.kernel_config.enable_jit_warmup
        or parallel_config.dcp_comm_backend == "a2a"
    ):
        return  # upstream registers nothing here either
    for shard_count in shard_counts:
        if not 1 < shard_count < parallel_config.decode_context_parallel_size:
            continue
        dcp._CORRECT_ATTN_CP_OUT_KERNEL.register_warmup(
            config_with_dcp_size(vllm_config, shard_count),
            output_dtype=given["output_dtype"],
            num_heads=given["num_heads"],
            head_dim=given["output_head_dim"],
            is_base_e=given["is_lse_base_on_e"],
        )


def replica_manager(manager: Any, replica: Any, what: str) -> Any:
    """A layer's ``MLADCPManager`` for its replica group: vLLM's own
    constructor with the arguments the layer gave ``manager``, while
    ``get_dcp_group`` answers ``replica``, so its query gather, combine and
    KV gather (and any symmetric-memory workspace vLLM picks) span the K
    ranks of the replica."""
    recorded = getattr(manager, MANAGER_ARGS_ATTR, None)
    if recorded is None:
        raise DcpGeometryError(
            f"{what}: its MLADCPManager was made without "
            "vllm_dcp_geometry.patches.worker.mla_dcp_manager applied, so it "
            "cannot be remade for the group's replica"
        )
    args, kwargs = recorded
    with use_replica_group(replica):
        twin = type(manager)(*args, **kwargs)
    if twin.group is not replica:
        raise DcpGeometryError(
            f"{what}: the replica MLADCPManager took {twin.group!r}, not the "
            "replica group (vLLM's DCP ops no longer ask get_dcp_group)"
        )
    return twin


def drop_fused_up_projection(layer: Any, manager: Any) -> None:
    """A bound partial MLA layer (1 < K < D) combines, then up-projects
    its own heads.

    vLLM 0.34.0's a2a combine-and-up-project pairs the gathered heads with
    ``layer.W_UV_dcp``, the ``W_UV`` of all D ranks in DCP rank order: within
    a replica the query gather yields K*H heads (a batch-size error from 8
    rows, another rank's heads on replicas q >= 1 below), and on the D-wide
    group it skips the replica mask. Invariant after this: the layer holds no
    gathered ``W_UV`` (freed) and ``manager`` - the one it combines with - no
    ``v_up_proj_combine``, so ``forward_impl`` / ``_attention`` take
    ``combine`` + ``_v_up_proj``, and a weight reload (its
    ``process_weights_after_loading`` gathers only where the manager has one)
    does not gather it again. Only attributes that exist are set: nothing
    is added on 0.33.0."""
    if getattr(layer, "W_UV_dcp", None) is not None:
        layer.W_UV_dcp = None
    if getattr(manager, "v_up_proj_combine", None) is not None:
        manager.v_up_proj_combine = None


def bind_mla_layer(layer: Any, geometry: GroupGeometry, layer_name: str) -> None:
    """Give an MLA layer's impl (built with the model) its group's geometry;
    idempotent for the same geometry, an error for another. A partial group
    bound within its replica (``group_context.current_replica_group``) gets
    a replica DCP manager and runs with the replica's world; otherwise its
    D-wide combine is replica-masked. Either way a partial layer drops
    vLLM 0.34.0's fused a2a up-projection (``drop_fused_up_projection``):
    it combines with that manager, then up-projects its own heads."""
    impl = layer.impl
    what = f"the MLA attention impl of layer {layer_name}"
    if check_rebind(impl, geometry, what):
        return
    if geometry.is_replicated:
        make_impl_local(impl)
    else:
        manager = getattr(layer, "dcp_manager", None)
        if impl.dcp_world_size != geometry.dcp_world_size or manager is None:
            raise DcpGeometryError(
                f"{geometry.describe()}: {what} runs with a DCP world size of "
                f"{impl.dcp_world_size}, not the group's D"
            )
        replica = current_replica_group()
        if replica is not None:
            layer.dcp_manager = replica_manager(manager, replica, what)
            impl.dcp_world_size, impl.dcp_rank = geometry.shard_world
            impl.total_cp_world_size, impl.total_cp_rank = geometry.shard_world
        else:
            manager.combine = mask_combine(manager.combine, geometry.replica)
        if geometry.is_partial:
            drop_fused_up_projection(layer, layer.dcp_manager)
    impl.forward_mqa = ShardWorldForwardMqa(impl, impl.forward_mqa, geometry)
    setattr(impl, BOUND_GEOMETRY_ATTR, geometry)


def check_replica_builder(builder: Any, geometry: GroupGeometry, what: str) -> None:
    """A partial group's builder made within its replica took the replica's
    world (K) and its layer's replica manager; an error naming the group
    where an upstream change stopped asking ``get_dcp_group``."""
    replica = current_replica_group()
    if replica is None:
        return
    manager = builder.dcp_manager
    if (
        builder.dcp_world_size != geometry.shard_count
        or manager is None
        or manager.group is not replica
    ):
        raise DcpGeometryError(
            f"{geometry.describe()}: the {what} builder took a DCP world of "
            f"{builder.dcp_world_size} and a manager over "
            f"{getattr(manager, 'group', None)!r}, not its replica's "
            "(vLLM's builder no longer asks get_dcp_group)"
        )


# Chunked-prefill context of a partial group ------------------------------------

CHUNK_PLANNER_PARAMETERS = (
    "*, context_lens_cpu, prefill_query_start_loc_cpu, chunked_prefill_workspace, "
    "chunked_prefill_workspace_size, block_size, align_chunk_to_block, device, "
    "dcp_world_size, dcp_local_block_size, dcp_virtual_block_size, dcp_manager=, "
    "align_indptr="
)
"""The parameters of vLLM's ``build_mla_chunked_context_metadata`` that
``group_context_chunk_kwargs`` rewrites (pinned by the patches calling it).
"""


def context_row_budget(workspace_rows: int, geometry: GroupGeometry) -> int:
    """Context rows (all K shards together) one chunk may hold.

    Within its replica the group is a sharded group of K: N rows. On the
    D-wide group the layer's ``MLADCPManager`` all-gathers every rank's local
    rows over the D-rank DCP group into the N-row half of the N + N/D
    workspace, so a rank may gather at most N/D local rows per chunk; K
    shards of N/D rows each make N*K/D context rows.
    """
    if current_replica_group() is not None:
        return workspace_rows
    d = geometry.dcp_world_size
    if workspace_rows % d:
        raise DcpGeometryError(
            f"{geometry.describe()}: the MLA context workspace of {workspace_rows} "
            f"rows is not a multiple of D={d}"
        )
    return workspace_rows // d * geometry.shard_count


def check_context_workspace(
    geometry: GroupGeometry, workspace_rows: int, page_size: int
) -> None:
    """A partial group's context chunks must hold at least one aligned step
    (``lcm(B, I*K)`` rows), or vLLM's planner could not split a context."""
    alignment = math.lcm(page_size, geometry.interleave_size * geometry.shard_count)
    budget = context_row_budget(workspace_rows, geometry)
    if budget < alignment:
        raise DcpGeometryError(
            f"{geometry.describe()}: the MLA chunked-prefill workspace holds "
            f"{budget} context rows per chunk for this K, fewer than one aligned "
            f"step of {alignment}; raise max_model_len or max_num_seqs, or use "
            "K=1 or K=D"
        )


def group_context_chunk_kwargs(
    kwargs: dict[str, Any], geometry: GroupGeometry
) -> dict[str, Any]:
    """The arguments of ``build_mla_chunked_context_metadata`` for a partial
    group. Within its replica: the builder's own (checked to be K's). On the
    D-wide group, from the builder's D-wide ones: chunks planned over K shards
    (local lengths ``(K, s)``, alignment ``lcm(B, I*K)``, a row budget of N/D
    local rows per rank). The reorganisation after the D-wide gather then
    reads DCP ranks 0..K-1 - replica 0 of every shard - each shard once."""
    d, k, i = geometry.dcp_world_size, geometry.shard_count, geometry.interleave_size
    seen = (
        kwargs["dcp_world_size"],
        kwargs["dcp_local_block_size"],
        kwargs["dcp_virtual_block_size"],
    )
    if current_replica_group() is not None:
        # Built in its replica's world: upstream's plan for K sharded ranks.
        if seen != (k, i, i * k):
            raise DcpGeometryError(
                f"{geometry.describe()}: the MLA builder of a group within its "
                f"replica planned its context with (world, I, I*world)={seen}, "
                f"not the replica's (K={k}, I={i})"
            )
        return kwargs
    if seen != (d, i, i * d):
        raise DcpGeometryError(
            f"{geometry.describe()}: the MLA builder planned its context with "
            f"(D, I, I*D)={seen}, not the group's DCP world (D={d}, I={i})"
        )
    return {
        **kwargs,
        "dcp_world_size": k,
        "dcp_virtual_block_size": i * k,
        "chunked_prefill_workspace_size": context_row_budget(
            kwargs["chunked_prefill_workspace_size"], geometry
        ),
    }


# Decode of a partial group -------------------------------------------------------


def decode_max_seq_len(max_seq_len: int, geometry: GroupGeometry) -> int:
    """The ``max_seq_len`` to hand the MLA builder so that its D-rank decode
    bound ``ceil(L' / (D*I)) * I`` comes out as the group's
    ``ceil(L / (K*I)) * I``: ``L' = ceil(L / (K*I)) * D*I``."""
    i = geometry.interleave_size
    rounds = cdiv(max_seq_len, geometry.shard_count * i)
    return rounds * geometry.dcp_world_size * i
