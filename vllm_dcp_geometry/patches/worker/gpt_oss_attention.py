# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.model_executor.models.gpt_oss``: gpt-oss's attention layer
keeps the KV head its QKV projection replicates under DCP.

What: wraps ``OAIAttention._build_attention`` (upstream's hook, called at the
end of ``__init__`` once ``qkv_proj`` exists). Where DCP is on and the layer's
``num_local_key_value_heads`` differs from the KV heads per rank its
``QKVParallelLinear`` holds (``qkv_proj.num_kv_heads``, which is at least 1:
KV heads are replicated once TP exceeds them), the layer takes the
projection's count, and ``kv_size`` (the width ``forward`` splits K and V
off the projection's output with) becomes that count times ``head_dim``;
then the upstream hook builds the ``Attention`` with it.

Why: DCP on a GQA model needs TP above its total KV heads (vLLM's config
check: gpt-oss's 8 KV heads allow DCP 2 from TP 16, DCP 4 from TP 32, DCP 8
from TP 64). ``OAIAttention`` divides instead (``8 // 16 == 0`` KV heads,
``kv_size`` 32 instead of 64), so vLLM 0.33.0 cannot build gpt-oss under DCP
at all ("integer modulo by zero" in ``Attention``).

Hand-back: with the counts equal (TP up to the KV heads), or at D = 1, the
upstream hook runs untouched; a TP above the KV heads at D = 1 fails as
upstream does (no DCP: not this plugin's to change).

Remove when: ``OAIAttention`` takes its KV heads per rank from its QKV
projection (as ``LlamaAttention`` does, ``max(1, heads // tp)``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.upstream_symbols import require_class_path

OAI_ATTENTION = "vllm.model_executor.models.gpt_oss.OAIAttention"


def _dcp_world_size() -> int:
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config().parallel_config.decode_context_parallel_size


def _make_build_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    def _build_attention(
        self: Any, config: Any, cache_config: Any, quant_config: Any, prefix: str
    ) -> Any:
        held = self.qkv_proj.num_kv_heads
        if self.num_local_key_value_heads != held and _dcp_world_size() > 1:
            self.num_local_key_value_heads = held
            self.kv_size = held * self.head_dim
        return original(self, config, cache_config, quant_config, prefix)

    return _build_attention


def apply(module: ModuleType) -> None:
    require_class_path(module, "OAIAttention", OAI_ATTENTION)


PATCH = Patch(
    upstream_module="vllm.model_executor.models.gpt_oss",
    replaces=(
        Wrap(
            "OAIAttention._build_attention",
            "self, config, cache_config, quant_config, prefix",
            _make_build_attention,
        ),
    ),
    relies_on=(
        # Relied on: __init__ sets qkv_proj, head_dim, num_local_key_value_heads
        # and kv_size before it calls the hook; forward splits with kv_size.
        Pin(
            "OAIAttention.__init__",
            "self, config, quant_config=, cache_config=, prefix=",
        ),
        Pin("OAIAttention.forward", "self, hidden_states, positions"),
    ),
    why=(
        "gpt-oss's attention divides its KV heads by TP (0 per rank once TP "
        "exceeds them, as DCP requires) where its QKV projection replicates one."
    ),
    remove_when="OAIAttention takes its KV heads per rank from its QKV projection",
    related="none found upstream: vLLM builds gpt-oss with TP up to its 8 KV heads",
    apply=apply,
)
