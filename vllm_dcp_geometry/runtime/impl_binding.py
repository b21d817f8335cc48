# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""An attention impl bound to its group's geometry (rules A2, A3).

Impls are built with the model, before any KV-cache spec is known, so they
take vLLM's global D; binding gives each its group's K. K = 1 runs plain local
attention; 1 < K < D runs within its K-rank replica where the group's backend
binds one (rule A6: the impl takes ``(K, r % K)`` and every forward runs with
its module's ``get_dcp_group`` answering the replica), and otherwise keeps the
D-rank query all-gather and combine with duplicate replicas weighted 0
(LSE -inf), which makes the combine exact.

No vLLM import at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    current_replica_group,
    use_replica_group,
)
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR, check_rebind

if TYPE_CHECKING:
    import torch


def make_impl_local(impl: Any) -> None:
    """Rule A2: run a replicated group's impl as plain local attention (no
    DCP pass).

    ``need_to_return_lse_for_decode`` is left as is: the runner's start-up
    check reads it for every target layer, and it only matters on DCP paths.
    With prefill context parallelism the impl's context path spans the PCP
    ranks too; the admission rule refuses K < D there, and so does this.
    """
    if impl.dcp_world_size == 1:
        return
    if impl.pcp_world_size > 1:
        raise DcpGeometryError(
            f"an attention impl of a replicated group (K=1) runs with prefill "
            f"context parallelism (PCP={impl.pcp_world_size}), which cannot be "
            "made local; use K=D ('sharded') or turn PCP off"
        )
    impl.dcp_world_size = 1
    impl.dcp_rank = 0
    impl.total_cp_world_size = 1
    impl.total_cp_rank = 0


def mask_duplicate_replica_lse(lse: torch.Tensor, replica: int) -> torch.Tensor:
    """Rule A3: the LSE to hand to a D-rank combine from replica ``q`` of a
    partial group.

    Each shard is held by D/K identical replicas; counting all of them scales
    the combined softmax denominator by D/K (LSE + ln(D/K)). Only replica 0
    takes part: the others send -inf, which the combine turns into weight 0
    and an output of exactly 0, so neither NaN nor a duplicate survives.
    """
    import torch

    if replica == 0:
        return lse
    return torch.full_like(lse, float("-inf"))


class ReplicaMaskedCombine:
    """Wraps a DCP combine whose first two arguments are the partial output
    and its LSE (``cp_lse_ag_out_rs`` / ``dcp_a2a_lse_reduce`` as impls hold
    them, ``MLADCPManager.combine``) so duplicate replicas weigh 0."""

    def __init__(self, combine: Callable[..., Any], replica: int) -> None:
        if isinstance(combine, ReplicaMaskedCombine):
            raise DcpGeometryError("a DCP combine is already replica-masked")
        self.combine = combine
        self.replica = replica

    def __call__(
        self, cp_attn_out: Any, cp_attn_lse: Any, *args: Any, **kw: Any
    ) -> Any:
        lse = mask_duplicate_replica_lse(cp_attn_lse, self.replica)
        return self.combine(cp_attn_out, lse, *args, **kw)

    def __repr__(self) -> str:
        return f"ReplicaMaskedCombine({self.combine!r}, replica={self.replica})"


def mask_combine(combine: Callable[..., Any], replica: int) -> Callable[..., Any]:
    """``combine`` replica-masked for ``replica`` (idempotent)."""
    if isinstance(combine, ReplicaMaskedCombine):
        if combine.replica != replica:
            raise DcpGeometryError(
                f"a DCP combine masked for replica {combine.replica} cannot be "
                f"reused by replica {replica}"
            )
        return combine
    return ReplicaMaskedCombine(combine, replica)


class ReplicaForward:
    """An impl's ``forward`` bound to its partial group's replica (rule A6):
    each call runs upstream's with ``group_context.use_replica_group``
    holding the replica's ``GroupCoordinator``, so the backend module's
    ``get_dcp_group`` (wrapped by its patch with
    ``mla_geometry.make_group_getter``) gathers queries and combines outputs
    over the K ranks of the replica, not the D ranks of the DCP group."""

    def __init__(self, forward: Callable[..., Any], replica: Any) -> None:
        self.forward = forward
        self.replica = replica

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with use_replica_group(self.replica):
            return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ReplicaForward({self.forward!r}, replica={self.replica!r})"


def bind_impl_within_replica(impl: Any, geometry: GroupGeometry, replica: Any) -> None:
    """Rule A6 for an impl of a partial group: it runs as a sharded group of
    K on the replica's ``GroupCoordinator`` (``(K, r % K)`` for its DCP and
    total CP world, every forward within the replica); nothing is masked,
    since each shard has exactly one holder in the replica. The replica's
    world must be the group's shard world."""
    if (replica.world_size, replica.rank_in_group) != geometry.shard_world:
        raise DcpGeometryError(
            f"{geometry.describe()}: its replica group has world "
            f"{replica.world_size} and rank {replica.rank_in_group}, not the "
            f"group's (K, r % K)={geometry.shard_world}"
        )
    impl.dcp_world_size, impl.dcp_rank = geometry.shard_world
    impl.total_cp_world_size, impl.total_cp_rank = geometry.shard_world
    impl.forward = ReplicaForward(impl.forward, replica)


def bind_impl_to_group(impl: Any, geometry: GroupGeometry, layer_name: str) -> None:
    """Give an attention impl (built with the model, before any spec was
    known) its group's geometry; idempotent.

    K = D: untouched. K = 1: plain local attention. 1 < K < D: bound within
    its replica where the group is being bound in one
    (``group_context.current_replica_group``: its builder's teaching binds
    the replica), otherwise the impl keeps the D-rank query all-gather and
    combine, and its ``dcp_combine`` is replica-masked so the D-rank combine
    counts every shard once.
    """
    what = f"the attention impl of layer {layer_name}"
    if check_rebind(impl, geometry, what):
        return
    if geometry.is_replicated:
        make_impl_local(impl)
    elif geometry.is_partial:
        if impl.dcp_world_size != geometry.dcp_world_size:
            raise DcpGeometryError(
                f"{geometry.describe()}: {what} runs with a DCP world size of "
                f"{impl.dcp_world_size}, not the group's D"
            )
        replica = current_replica_group()
        if replica is not None:
            bind_impl_within_replica(impl, geometry, replica)
        else:
            impl.dcp_combine = mask_combine(impl.dcp_combine, geometry.replica)
    setattr(impl, BOUND_GEOMETRY_ATTR, geometry)
