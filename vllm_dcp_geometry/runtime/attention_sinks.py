# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention sinks through a DCP attention path that runs its kernels without
them (rule A7).

A sink is one more logit per head, ``s``, in the softmax denominator and none
in the numerator: ``o = sum_j e^(x_j) v_j / (e^s + sum_j e^(x_j))``. A DCP
path splits the keys into parts (each rank's context shard, the new tokens)
and merges the parts' outputs by their LSEs, so the sink must enter exactly
one part: the attention over the new tokens, which every rank computes once
for its own query heads whatever the group's K. Folding it there is exact:
``lse' = logaddexp(lse, s)`` and ``o' = o * e^(lse - lse')`` is that part's
attention with the sink, and any LSE merge of it with the other parts
(``merge_attn_states``; the D-rank combine, replica-masked or not, never
sees it) is the whole attention with the sink.

No vLLM import at module level.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.runtime.upstream_symbols import UpstreamChangedError

if TYPE_CHECKING:
    import torch


def fold_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """Fold per-head ``sinks`` ``[H]`` into one attention part in place:
    ``out`` ``[T, H, d]`` becomes that part's output with the sinks, and the
    returned LSE ``[H, T]`` (FlashAttention's layout) includes them.

    A row that attended no key (a padded row: FlashAttention gives it an
    infinite LSE, which ``merge_attn_states`` weighs 0) is left as the kernel
    gave it; the new-token attention of a real token always sees itself.
    """
    import torch

    attended = torch.isfinite(lse)
    folded = torch.where(
        attended, torch.logaddexp(lse, sinks.to(lse.dtype)[:, None]), lse
    )
    scale = torch.where(attended, torch.exp(lse - folded), torch.ones_like(lse))
    out.mul_(scale.transpose(0, 1).unsqueeze(-1))
    return folded


class SinkFoldingKernel:
    """Stands in for a module's FlashAttention varlen kernel: within
    ``folding(new_keys, sinks)`` on the calling thread, a call whose keys are
    ``new_keys`` (the new-token attention of a DCP path) gets the sinks
    folded in; every other call (the context attention over a rank's shard,
    any call outside ``folding`` or on another thread: vLLM's micro-batch
    threads share the module) passes through unchanged."""

    def __init__(self, kernel: Callable[..., Any]) -> None:
        self.kernel = kernel
        self._fold = threading.local()

    @contextmanager
    def folding(self, new_keys: Any, sinks: torch.Tensor) -> Iterator[None]:
        """Fold ``sinks`` into this thread's calls on ``new_keys`` within;
        a DCP path that made no such call (its new-token attention no longer
        hands the kernel the keys it was given) is an upstream change."""
        saved = getattr(self._fold, "state", None)
        state = [new_keys, sinks, 0]
        self._fold.state = state
        try:
            yield
        finally:
            self._fold.state = saved
        if state[2] == 0:
            raise UpstreamChangedError(
                "FlashAttention's DCP path ran no attention over the step's own "
                "keys, into which attention sinks are folded"
            )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.kernel(*args, **kwargs)
        state = getattr(self._fold, "state", None)
        if state is None:
            return result
        new_keys, sinks, _ = state
        keys = kwargs["k"] if "k" in kwargs else args[1] if len(args) > 1 else None
        if keys is not new_keys:
            return result
        state[2] += 1
        if kwargs.get("return_softmax_lse") is not True:
            raise UpstreamChangedError(
                "FlashAttention's DCP path no longer asks its new-token "
                "attention for the LSE, which folding attention sinks needs"
            )
        out, lse = result
        if kwargs.get("out") is not None and out is not kwargs["out"]:
            raise UpstreamChangedError(
                "FlashAttention's kernel no longer writes its output into out=, "
                "where folding attention sinks rescales it"
            )
        return out, fold_sinks(out, lse, sinks)


_INSTALL_LOCK = threading.Lock()


def sink_folding_kernel(module: ModuleType, name: str) -> SinkFoldingKernel:
    """The ``SinkFoldingKernel`` around ``module.<name>``, installed there the
    first time a layer with sinks needs it (a model without sinks never
    changes the module); once installed, no lock is taken."""
    kernel = getattr(module, name)
    if isinstance(kernel, SinkFoldingKernel):
        return kernel
    with _INSTALL_LOCK:
        kernel = getattr(module, name)
        if not isinstance(kernel, SinkFoldingKernel):
            kernel = SinkFoldingKernel(kernel)
            setattr(module, name, kernel)
        return kernel
