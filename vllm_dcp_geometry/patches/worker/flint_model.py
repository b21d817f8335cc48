# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.models.flint.model``: name Flint's attention wrapper on its
layer, so admission sees the class that reads the cache.

What: wraps ``FlintAttention.__init__``. Under DCP (D > 1) it names
``FlintAttention`` on the generic ``Attention`` it registers in the forward
context (``layer_classes.LAYER_CLASS_ATTR``). Admission then treats the
layer as Flint's: K = 1 runs (its fused low-latency decode gets world-1
FlashInfer metadata), 1 < K < D is refused at start-up.

Why: ``FlintAttention.forward_ll`` bypasses the impl for small pure-decode
batches and asserts ``decode.dcp_query_start_loc is None``, which every
FlashInfer builder in a DCP world > 1 sets: a partial group would start and
then fail at its first small decode. The wrapper itself is not in the
forward context, so without this name the layer would pass as vLLM's
generic ``Attention``.

Hand-back: D = 1 runs upstream's constructor and reads nothing more than the
DCP world size. Remove when: Flint's fast decode handles DCP metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract.layer_classes import FLINT_ATTENTION, LAYER_CLASS_ATTR
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.upstream_symbols import require_class_path


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        from vllm.distributed import parallel_state

        if parallel_state.get_dcp_world_size_and_rank(True)[0] > 1:
            setattr(self.attn, LAYER_CLASS_ATTR, FLINT_ATTENTION)

    return __init__


def _require_flint_attention(module: ModuleType) -> None:
    require_class_path(module, "FlintAttention", FLINT_ATTENTION)


PATCH = Patch(
    upstream_module="vllm.models.flint.model",
    replaces=(
        Wrap(
            "FlintAttention.__init__",
            "self, config, layer_idx, cache_config, quant_config, prefix=",
            _make_init,
        ),
    ),
    relies_on=(
        # Relied on: the fast path that reads the builder's DCP metadata.
        Pin(
            "FlintAttention.forward_ll",
            "self, positions, hidden_states, residual, input_layernorm",
        ),
    ),
    why=(
        "Flint's attention wrapper runs its own fast decode on the builder's "
        "metadata; admission must see its class, not the generic layer inside."
    ),
    remove_when="Flint's low-latency decode accepts DCP decode metadata",
    related="none upstream: forward_ll asserts dcp_query_start_loc is None",
    apply=_require_flint_attention,
)
