# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a ``ranks`` worker measures of vLLM's own code, installed once: the
bytes its collectives move (``traffic.Traffic``) and the LSEs its MLA
attention hands on (``LseRecorder``: the decode kernel's, the DCP combine's,
the prefill context's).

``install_meters`` puts the wrappers in place once per worker process through the
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
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.patching import (
    UpstreamSymbol,
    undo_on_error,
    verify_symbol,
    wrap,
)
from vllm_dcp_geometry.tooling.cli.ranks.traffic import (
    FLIGHT_RECORDER_ENTRIES,
    FLIGHT_RECORDER_ENV,
    PYNCCL_METERED,
    PYNCCL_OPS,
    Traffic,
    count_pynccl_call,
)

DCP_OPS = "vllm.v1.attention.ops.dcp"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
TRITON_MLA = "vllm.v1.attention.backends.mla.triton_mla"

MERGE_PARAMS = (
    "output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse=, "
    "prefill_tokens_with_context=, output_scale="
)
"""The parameters of vLLM's ``merge_attn_states`` the context-LSE meter reads
(``prefix_lse``, by keyword or third)."""

METERED = (
    UpstreamSymbol(
        DCP_OPS, "correct_attn_out", "out, lses, cp_rank, ctx, is_lse_base_on_e="
    ),
    UpstreamSymbol(MLA_ATTENTION, "merge_attn_states", MERGE_PARAMS),
    UpstreamSymbol(
        TRITON_MLA,
        "TritonMLAImpl.forward_mqa",
        "self, q, kv_c_and_k_pe_cache, attn_metadata, layer",
    ),
)
"""Every upstream symbol the LSE meters wrap, with the parameters their
wrappers were written against."""


def enable_flight_recorder() -> None:
    """Have torch record every collective of this process's process groups;
    call it before the first group exists (the recorder is sized then)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "ranks: the flight recorder must be sized before the first process "
            "group exists"
        )
    os.environ[FLIGHT_RECORDER_ENV] = str(FLIGHT_RECORDER_ENTRIES)


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
            # MLA hands it by keyword, FlashAttention's DCP path by position.
            prefix_lse = kwargs["prefix_lse"] if "prefix_lse" in kwargs else args[2]
            recorder.seen["context_lse"] = prefix_lse.clone()
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


def record_context_lse_in(module: ModuleType, lse: LseRecorder) -> None:
    """Also record the prefix LSE ``module`` hands its own imported
    ``merge_attn_states`` (a layer class that merges its prefill context
    itself, as Kimi-K3's does; FlashAttention's DCP path, whose prefix is the
    combined context), once per process; the name is pinned to the same
    parameters as ``mla_attention``'s."""
    verify_symbol(UpstreamSymbol(module.__name__, "merge_attn_states", MERGE_PARAMS))
    wrap(module, "merge_attn_states", _record_context_lse, lse)


def record_local_lse_of(impl_class: type, lse: LseRecorder) -> None:
    """Also record the LSE the decode of ``impl_class`` (another backend's
    impl than TRITON_MLA's) hands on, at the class that defines its
    ``forward_mqa``; call it before a builder binds an impl (a bound impl
    keeps the method it found)."""
    owner = next((c for c in impl_class.__mro__ if "forward_mqa" in vars(c)), None)
    if owner is None:
        raise RuntimeError(f"ranks: {impl_class.__qualname__} has no forward_mqa")
    verify_symbol(UpstreamSymbol(owner.__module__, f"{owner.__qualname__}.forward_mqa"))
    wrap(owner, "forward_mqa", _record_local_lse, lse)


# Installing them -----------------------------------------------------------------


@dataclass(frozen=True)
class Meters:
    """This process's meters, installed by ``install_meters``."""

    traffic: Traffic
    lse: LseRecorder


@functools.cache
def install_meters(backend: str = "gloo") -> Meters:
    """Wrap every symbol of ``METERED`` and ``PYNCCL_METERED`` (pinned, all
    or nothing) and every method of ``PYNCCL_OPS``, once per process; the
    meters they report to. Call it after ``enable_flight_recorder`` and
    before any MLA builder or layer exists: a bound impl keeps the
    ``forward_mqa`` it found."""
    from vllm.distributed.device_communicators import pynccl
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.backends.mla import triton_mla
    from vllm.v1.attention.ops import dcp

    if int(os.environ.get(FLIGHT_RECORDER_ENV, "0")) <= 0:
        raise RuntimeError(
            "ranks: torch's flight recorder is off (enable_flight_recorder "
            "before the process groups): no collective would be counted"
        )
    meters = Meters(Traffic(backend), LseRecorder())
    with undo_on_error():
        for symbol in (*METERED, *PYNCCL_METERED):
            verify_symbol(symbol)
        for method in PYNCCL_OPS:
            wrap(
                pynccl.PyNcclCommunicator,
                method,
                count_pynccl_call,
                meters.traffic,
                method,
            )
        wrap(dcp, "correct_attn_out", _record_combined_lse, meters.lse)
        wrap(mla_attention, "merge_attn_states", _record_context_lse, meters.lse)
        wrap(triton_mla.TritonMLAImpl, "forward_mqa", _record_local_lse, meters.lse)
    return meters
