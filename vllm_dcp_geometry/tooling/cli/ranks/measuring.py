# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a ``ranks`` worker measures of vLLM's own code: the bytes its
collectives move through the DCP and replica groups (``Traffic``) and the
LSEs its MLA attention hands on (``LseRecorder``).

``install_meters`` puts both in place once per worker process through the
patch framework: every upstream symbol is pinned to the parameters its
wrapper was written against (``METERED``, checked by ``verify_symbol``), and
each is replaced by ``wrap`` inside ``undo_on_error``, so a vLLM that changed
one of them leaves none wrapped and stops the worker with the symbol named.
The wrappers are never undone: a worker process exists for one measured run,
the same installation serves every group it runs, and a wrapper only passes
calls through while nothing is being measured (``Traffic.counted``,
``LseRecorder.recording``). No patch is applying, so nothing lands in the
plugin's ledger: what ``register()`` changed stays all it records.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.contract.collectives import collective_bytes
from vllm_dcp_geometry.runtime.patching import (
    UpstreamSymbol,
    undo_on_error,
    verify_symbol,
    wrap,
)

PARALLEL_STATE = "vllm.distributed.parallel_state"
TORCH_DISTRIBUTED = "torch.distributed"
DCP_OPS = "vllm.v1.attention.ops.dcp"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla"

COORDINATOR_OPS = ("all_gather", "reduce_scatter", "all_reduce")
"""``GroupCoordinator`` methods counted; the tensor is their ``input_``."""

DEVICE_GROUP_OPS = ("all_gather_into_tensor", "all_to_all_single")
"""``torch.distributed`` calls vLLM makes on a group's device group directly
(the context KV gather, the all-to-all combine); the rank's own tensor is
their second argument."""

METERED = (
    UpstreamSymbol(PARALLEL_STATE, "GroupCoordinator.all_gather", "self, input_, dim="),
    UpstreamSymbol(
        PARALLEL_STATE, "GroupCoordinator.reduce_scatter", "self, input_, dim="
    ),
    UpstreamSymbol(PARALLEL_STATE, "GroupCoordinator.all_reduce", "self, input_"),
    UpstreamSymbol(
        TORCH_DISTRIBUTED,
        "all_gather_into_tensor",
        "output_tensor, input_tensor, group=, async_op=",
    ),
    UpstreamSymbol(
        TORCH_DISTRIBUTED,
        "all_to_all_single",
        "output, input, output_split_sizes=, input_split_sizes=, group=, async_op=",
    ),
    UpstreamSymbol(
        DCP_OPS, "correct_attn_out", "out, lses, cp_rank, ctx, is_lse_base_on_e="
    ),
    UpstreamSymbol(
        MLA_ATTENTION,
        "merge_attn_states",
        "output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=, "
        "prefill_tokens_with_context=, output_scale=",
    ),
    UpstreamSymbol(
        TRITON_MLA,
        "TritonMLAImpl.forward_mqa",
        "self, q, kv_c_and_k_pe_cache, attn_metadata, layer",
    ),
)
"""Every upstream symbol the meters wrap, with the parameters their wrappers
were written against."""


# Collective traffic -------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes this rank sent plus received through the DCP group and the
    replica groups, by collective, while ``counted`` runs; the model of one
    call is ``collectives.collective_bytes``. A collective made inside a
    counted one (a coordinator's own device-group call) is not counted
    again."""

    counting: bool = False
    total: int = 0
    calls: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    worlds: set[int] = field(default_factory=set)
    _inside: threading.local = field(default_factory=threading.local, repr=False)

    def add(self, op: str, world: int, tensor: Any) -> None:
        depth: int = getattr(self._inside, "depth", 0)
        if not self.counting or depth > 0:
            return
        moved = collective_bytes(op, world, tensor.numel() * tensor.element_size())
        self.by_op[op] = self.by_op.get(op, 0) + moved
        self.total += moved
        self.calls += 1
        self.worlds.add(world)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1

    def reset(self) -> None:
        self.total = self.calls = 0
        self.by_op = {}
        self.worlds = set()

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """Count from zero while the block runs."""
        self.reset()
        self.counting = True
        try:
            yield
        finally:
            self.counting = False


def _counted_groups() -> list[Any]:
    """The DCP ``GroupCoordinator`` and this rank's replica groups."""
    from vllm.distributed import parallel_state

    from vllm_dcp_geometry.runtime.replica_groups import made_replica_groups

    groups = [parallel_state._DCP, *made_replica_groups().values()]
    return [g for g in groups if g is not None]


def _count_coordinator_call(
    original: Callable[..., Any], traffic: Traffic, op: str
) -> Callable[..., Any]:
    def counted(self: Any, input_: Any, *args: Any, **kwargs: Any) -> Any:
        if any(self is g for g in _counted_groups()):
            traffic.add(op, self.world_size, input_)
        with traffic.inside():
            return original(self, input_, *args, **kwargs)

    return counted


def _count_device_group_call(
    original: Callable[..., Any], traffic: Traffic, op: str
) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        for owner in _counted_groups():
            if group is owner.device_group:
                traffic.add(op, owner.world_size, args[1])
        with traffic.inside():
            return original(*args, **kwargs)

    return counted


# The LSEs the attention hands on --------------------------------------------------


@dataclass
class LseRecorder:
    """The LSEs of one forward while ``recording`` runs: the decode kernel's
    own (``local_lse``, from ``forward_mqa``), the DCP combine's
    (``combined_lse``, from ``correct_attn_out``) and the prefill context's
    (``context_lse``, from ``merge_attn_states``)."""

    seen: dict[str, Any] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, Any]]:
        self.seen = {}
        try:
            yield self.seen
        finally:
            self.seen = None


def _record_combined_lse(
    original: Callable[..., Any], recorder: LseRecorder
) -> Callable[..., Any]:
    def correct_attn_out(*args: Any, **kwargs: Any) -> Any:
        out, lse = original(*args, **kwargs)
        if recorder.seen is not None:
            recorder.seen["combined_lse"] = lse.clone()
        return out, lse

    return correct_attn_out


def _record_context_lse(
    original: Callable[..., Any], recorder: LseRecorder
) -> Callable[..., Any]:
    def merge_attn_states(*args: Any, **kwargs: Any) -> Any:
        if recorder.seen is not None:
            recorder.seen["context_lse"] = kwargs["prefix_lse"].clone()
        return original(*args, **kwargs)

    return merge_attn_states


def _record_local_lse(
    original: Callable[..., Any], recorder: LseRecorder
) -> Callable[..., Any]:
    def forward_mqa(self: Any, *args: Any, **kwargs: Any) -> Any:
        out, lse = original(self, *args, **kwargs)
        if recorder.seen is not None:
            recorder.seen["local_lse"] = lse
        return out, lse

    return forward_mqa


# Installing them -----------------------------------------------------------------


@dataclass(frozen=True)
class Meters:
    """This process's meters, installed by ``install_meters``."""

    traffic: Traffic
    lse: LseRecorder


@functools.cache
def install_meters() -> Meters:
    """Wrap every symbol of ``METERED`` (pinned, all or nothing), once per
    process; the meters they report to. Call it before any MLA builder or
    layer exists: a builder binds the KV gather function when it is made,
    and a bound impl keeps the ``forward_mqa`` it found."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.backends.mla import triton_mla
    from vllm.v1.attention.ops import dcp

    meters = Meters(Traffic(), LseRecorder())
    with undo_on_error():
        for symbol in METERED:
            verify_symbol(symbol)
        coordinator = parallel_state.GroupCoordinator
        for op in COORDINATOR_OPS:
            wrap(coordinator, op, _count_coordinator_call, meters.traffic, op)
        for op in DEVICE_GROUP_OPS:
            wrap(dist, op, _count_device_group_call, meters.traffic, op)
        wrap(dcp, "correct_attn_out", _record_combined_lse, meters.lse)
        wrap(mla_attention, "merge_attn_states", _record_context_lse, meters.lse)
        wrap(triton_mla.TritonMLAImpl, "forward_mqa", _record_local_lse, meters.lse)
    return meters
