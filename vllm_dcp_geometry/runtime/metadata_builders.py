# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A backend's metadata builder taught its group's geometry.

``builder_init`` is the one constructor wrapper of every taught builder
(FlashAttention, FlashInfer, MLA): it resolves the group, admits it where K
is not vLLM's own, runs upstream's constructor (with the group's world active
where the backend derives its lengths from it), lets the backend finish a
partial builder and binds the group's layers. ``make_partial_group_build``
wraps ``build`` so a partial group's builder reads its own local lengths;
``group_world_getter`` makes a backend module's ``get_dcp_world_size_and_rank``
answer the group being built.

No vLLM import at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import GroupGeometry
from vllm_dcp_geometry.runtime.group_context import (
    current_group_geometry,
    use_group_geometry,
    use_replica_group,
)
from vllm_dcp_geometry.runtime.group_geometry import (
    BOUND_GEOMETRY_ATTR,
    resolve_group_geometry,
)
from vllm_dcp_geometry.runtime.layer_binding import bind_group_layers
from vllm_dcp_geometry.runtime.worker_admission import admit_builder

if TYPE_CHECKING:
    import torch

LOCAL_SEQ_LENS_BUFFER_ATTR = "_vllm_dcp_geometry_local_seq_lens"
"""A partial group's builder: persistent buffer of the group's local lengths."""


REPLICA_GROUP_ATTR = "_vllm_dcp_geometry_replica_group"
"""A builder of a partial group within its replica: the replica's
``GroupCoordinator``."""


FinishBuilder = Callable[[Any, GroupGeometry, Any, Any], None]
"""``(builder, geometry, vllm_config, device)``: a backend's own steps after
upstream constructed its builder for a K other than vLLM's own."""


@dataclasses.dataclass(frozen=True)
class BuilderTeaching:
    """How one backend's metadata builder is constructed for a group.

    ``construct_in_group(geometry)``: whether upstream's constructor runs with
    the group active (``use_group_geometry``), i.e. takes the group's world
    where it asks the DCP process group. ``finish``: the backend's own steps
    after upstream constructed it. ``admit_vllm_default``: admit vLLM's own
    K = D too (FlashAttention, whose DCP path drops features).
    ``replica_group(geometry, vllm_config)``: the replica ``GroupCoordinator``
    a partial group's collectives stay within (rule A6), or None (D-wide);
    with one, the group's layers are bound first, and the binding, the
    constructor and ``finish`` run in the group and its replica
    (``use_replica_group``).
    """

    mla: bool
    construct_in_group: Callable[[GroupGeometry], bool]
    finish: FinishBuilder | None = None
    admit_vllm_default: bool = False
    replica_group: Callable[[GroupGeometry, Any], Any] | None = None


def builder_init(
    teaching: BuilderTeaching,
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The ``__init__`` wrapper factory of a taught metadata builder.

    D == 1: upstream's constructor and nothing else. Otherwise the group is
    admitted before upstream runs wherever K is not vLLM's own (a refusal
    names group, layer, class, backend, K and D), the builder is marked with
    its geometry and the group's layers are bound. vLLM's own K = D runs
    upstream's constructor alone (FlashAttention then admits its features).
    """

    def make(original: Callable[..., None]) -> Callable[..., None]:
        def __init__(
            self: Any,
            kv_cache_spec: Any,
            layer_names: list[str],
            vllm_config: Any,
            device: Any,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            def construct() -> None:
                original(
                    self,
                    kv_cache_spec,
                    layer_names,
                    vllm_config,
                    device,
                    *args,
                    **kwargs,
                )

            def admit(geometry: GroupGeometry) -> None:
                admit_builder(self, geometry, kv_cache_spec, vllm_config, layer_names)

            geometry = resolve_group_geometry(kv_cache_spec, layer_names, vllm_config)
            if geometry is None:
                construct()
                return
            if not geometry.needs_admission:
                # vLLM's own K = D: upstream's builder, nothing to bind.
                construct()
                if teaching.admit_vllm_default:
                    admit(geometry)
                return
            admit(geometry)
            replica = None
            if teaching.replica_group is not None and geometry.is_partial:
                replica = teaching.replica_group(geometry, vllm_config)
            build = _BuilderConstruction(
                teaching, geometry, vllm_config, layer_names, device, construct
            )
            if replica is not None:
                build.within_replica(self, replica)
            else:
                build.on_dcp_group(self)

        return __init__

    return make


@dataclasses.dataclass(frozen=True)
class _BuilderConstruction:
    """One admitted builder's construction for a group whose K is not vLLM's
    own: upstream's constructor (``construct``) in the group's geometry, the
    backend's ``finish``, then the builder marked and the layers bound."""

    teaching: BuilderTeaching
    geometry: GroupGeometry
    vllm_config: Any
    layer_names: list[str]
    device: Any
    construct: Callable[[], None]

    def within_replica(self, builder: Any, replica: Any) -> None:
        """A partial group whose collectives stay within its replica (rule A6)."""
        geometry, teaching = self.geometry, self.teaching
        # The layers' replica managers must exist before upstream's
        # constructor hands the first one its KV-gather workspace.
        with use_replica_group(replica):
            bind_group_layers(
                self.vllm_config, self.layer_names, geometry, mla=teaching.mla
            )
            with use_group_geometry(geometry):
                self.construct()
            if teaching.finish is not None:
                teaching.finish(builder, geometry, self.vllm_config, self.device)
        setattr(builder, REPLICA_GROUP_ATTR, replica)
        setattr(builder, BOUND_GEOMETRY_ATTR, geometry)

    def on_dcp_group(self, builder: Any) -> None:
        """Any other admitted group: its collectives run over vLLM's D ranks."""
        geometry, teaching = self.geometry, self.teaching
        if teaching.construct_in_group(geometry):
            with use_group_geometry(geometry):
                self.construct()
        else:
            self.construct()
        if teaching.finish is not None:
            teaching.finish(builder, geometry, self.vllm_config, self.device)
        setattr(builder, BOUND_GEOMETRY_ATTR, geometry)
        bind_group_layers(
            self.vllm_config, self.layer_names, geometry, mla=teaching.mla
        )


def group_local_seq_lens(
    seq_lens: torch.Tensor, geometry: GroupGeometry
) -> torch.Tensor:
    """Per-request local sequence lengths of this rank for the group: the
    positions ``< seq_len`` whose owner shard is ``s`` (contract
    ``local_seq_len``), computed by vLLM's own helper given (K, s)."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    shard_count, shard = geometry.shard_world
    return get_dcp_local_seq_lens(
        seq_lens, shard_count, shard, geometry.interleave_size
    )


def attach_local_seq_lens_buffer(builder: Any, vllm_config: Any, device: Any) -> None:
    """Give a partial group's builder a persistent buffer for its local
    lengths, so FULL CUDA graphs replay the current values."""
    import torch

    setattr(
        builder,
        LOCAL_SEQ_LENS_BUFFER_ATTR,
        torch.zeros(
            vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device
        ),
    )


def with_group_local_seq_lens(
    builder: Any, common_attn_metadata: Any, geometry: GroupGeometry, **changes: Any
) -> Any:
    """A copy of the common metadata whose DCP local lengths are the group's,
    held in the builder's persistent buffer (rows past the batch read 0), with
    ``changes`` applied in the same copy.

    The runners compute one ``dcp_local_seq_lens`` per step with vLLM's
    global (D, r) for every group; a partial group's builder reads this copy.
    """
    buffer = getattr(builder, LOCAL_SEQ_LENS_BUFFER_ATTR)
    seq_lens = common_attn_metadata.seq_lens
    num_rows = seq_lens.shape[0]
    buffer[:num_rows].copy_(group_local_seq_lens(seq_lens, geometry))
    buffer[num_rows:].zero_()
    # Only PCP fills this bound, and PCP never runs a partial group; derive it
    # anyway where given (the local length is monotonic in the length).
    upper_bound = None
    seq_upper_bound = common_attn_metadata.seq_lens_cpu_upper_bound
    if (
        common_attn_metadata.dcp_local_seq_lens_cpu_upper_bound is not None
        and seq_upper_bound is not None
    ):
        upper_bound = group_local_seq_lens(seq_upper_bound, geometry)
    return dataclasses.replace(
        common_attn_metadata,
        dcp_local_seq_lens=buffer[:num_rows],
        dcp_local_seq_lens_cpu_upper_bound=upper_bound,
        **changes,
    )


def bound_partial_geometry(builder: Any) -> GroupGeometry | None:
    """The partial group (1 < K < D) a metadata builder was bound to at
    construction, or None (upstream's ``build`` then runs untouched)."""
    geometry = getattr(builder, BOUND_GEOMETRY_ATTR, None)
    if geometry is None or not geometry.is_partial:
        return None
    return geometry


def make_partial_group_build(
    original: Callable[..., Any],
    adjust: Callable[[Any, GroupGeometry], dict[str, Any]] | None = None,
    finish: Callable[[Any, Any], None] | None = None,
) -> Callable[..., Any]:
    """Wrap a metadata builder's ``build`` (FlashInfer, MLA) for partial
    groups; upstream's own where the builder's group is not partial.

    A partial group's build runs upstream's (within its replica group where
    it has one, ``REPLICA_GROUP_ATTR``) on a copy of the common metadata
    with the group's local lengths (``with_group_local_seq_lens``) and the
    fields ``adjust(common_attn_metadata, geometry)`` returns, with the group
    active (``use_group_geometry``) for the module helpers upstream calls
    inside; ``finish(metadata, common_attn_metadata)`` may then correct what
    upstream derived from the adjusted copy.
    """

    def build(
        self: Any,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> Any:
        geometry = bound_partial_geometry(self)
        if geometry is None:
            return original(self, common_prefix_len, common_attn_metadata, fast_build)
        replica = getattr(self, REPLICA_GROUP_ATTR, None)
        within = (
            contextlib.nullcontext() if replica is None else use_replica_group(replica)
        )
        with within:
            changes = {} if adjust is None else adjust(common_attn_metadata, geometry)
            group_metadata = with_group_local_seq_lens(
                self, common_attn_metadata, geometry, **changes
            )
            with use_group_geometry(geometry):
                metadata = original(self, common_prefix_len, group_metadata, fast_build)
        if finish is not None:
            finish(metadata, common_attn_metadata)
        return metadata

    return build


def group_world_getter(
    answers: Callable[[GroupGeometry], bool],
) -> Callable[[Callable[..., tuple[int, int]]], Callable[..., tuple[int, int]]]:
    """The wrapper factory of a backend module's ``get_dcp_world_size_and_rank``
    (as that module sees it): while a group for which ``answers(geometry)``
    holds is active (``use_group_geometry``), an enabled call answers the
    group's shard world ``(K, r % K)``; every other call is upstream's."""

    def make(
        original: Callable[..., tuple[int, int]],
    ) -> Callable[..., tuple[int, int]]:
        def get_dcp_world_size_and_rank(enabled: bool = True) -> tuple[int, int]:
            geometry = current_group_geometry()
            if geometry is None or not enabled or not answers(geometry):
                return original(enabled)
            return geometry.shard_world

        return get_dcp_world_size_and_rank

    return make
