# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Where every K is vLLM's default, the rest of the patched functions take
upstream's path exactly (``test_hand_back`` has the double itself and both
model runners): against the doubles vLLM's own unit tests use, the
scheduler's block sizes (and the exception upstream raises), every other
wrapper that reads config before handing over, and the KV-cache grouping
reading only its override section.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support.hand_back import (
    DEFAULT_LAYOUTS,
    ENCODER,
    REPLICATED_LAYOUTS,
    Args,
    assert_hands_back,
    carrier,
    extra_accesses,
    full,
    kv_config,
    trace,
    v1_runner,
)

pytestmark = pytest.mark.patches(
    "common.kv_cache_interface",
    "worker.gpu_model_runner",
    "worker.gpu_block_table",
    "worker.gpu_model_runner_v2",
    "engine_core.kv_cache_utils",
    "engine_core.kv_cache_planning",
    "engine_core.kv_connector_base",
    "worker.utils",
    "worker.flash_attn",
    "worker.flashinfer",
    "worker.mla_attention",
)

# vLLM's own unit tests: doubles of their own -----------------------------------


@pytest.mark.vllm_releases("0.33.0")  # Model Runner V1: gone in 0.34.0
def test_v1_hands_back_a_spec_double(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``test_input_batch_reinitialized_after_late_interleave_adjustment``
    passes a spec that is no ``KVCacheSpec`` and a config without a parallel
    section: upstream reads none of it, nor may the wrapper."""
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.v1.kv_cache_interface import KVCacheSpecKind

    monkeypatch.setattr(
        gpu_model_runner,
        "get_kv_cache_spec_kind",
        lambda _: KVCacheSpecKind.FULL_ATTENTION,
    )

    def args() -> dict[str, Any]:
        runner = v1_runner(carrier(4))
        del runner.vllm_config.parallel_config
        runner.vllm_config.reasoning_config = None
        spec = SimpleNamespace(block_size=16, max_num_blocks_per_req=lambda *_: 4)
        return {
            "self": runner,
            "kv_cache_config": SimpleNamespace(
                kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)]
            ),
        }

    patched = gpu_model_runner.GPUModelRunner.may_reinitialize_input_batch
    # The specs decide (the double records the KV-cache config too); nothing
    # of the runner or its config is read before upstream.
    assert extra_accesses(patched, args) == [("get", "kv_cache_config.kv_cache_groups")]
    assert trace(patched, args).outcome == ("returned", "None")


def test_v2_reads_nothing_before_upstream(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``test_v2_runner_snapshots_late_interleave_adjustment``: upstream
    takes the interleave, then raises from its second step on a config with no
    groups; the wrapper must not read the config first."""
    import vllm.v1.worker.gpu.model_runner as model_runner

    class StopInitialization(Exception):
        pass

    def stop(value: Any) -> Any:
        raise StopInitialization

    monkeypatch.setattr(model_runner, "deepcopy", stop)

    def args() -> dict[str, Any]:
        runner = SimpleNamespace(
            parallel_config=SimpleNamespace(cp_kv_cache_interleave_size=16),
            cp_interleave=1,
        )
        return {"self": runner, "kv_cache_config": SimpleNamespace()}

    patched = model_runner.GPUModelRunner.initialize_kv_cache
    assert_hands_back(patched, args)
    assert trace(patched, args).outcome[0] == "StopInitialization"


# The scheduler's block sizes ----------------------------------------------------


@pytest.mark.parametrize("dcp", [1, 4])
@pytest.mark.parametrize("layout", sorted({**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}))
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_resolve_kv_cache_block_sizes_hands_back(
    layout: str, dcp: int, prefix_caching: bool
) -> None:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    specs = {**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}[layout]
    specs = tuple(s for s in specs if s is not ENCODER)
    assert_hands_back(
        resolve_kv_cache_block_sizes,
        lambda: {
            "kv_cache_config": kv_config(*specs),
            "vllm_config": carrier(
                dcp, enable_prefix_caching=prefix_caching, cache_block_size=16
            ),
        },
    )


def test_resolve_kv_cache_block_sizes_raises_what_upstream_raises() -> None:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    def args() -> dict[str, Any]:
        config = carrier(4, enable_prefix_caching=True, cache_block_size=16)
        config.cache_config.prefix_match_unit = 48
        return {"kv_cache_config": kv_config(full()), "vllm_config": config}

    assert_hands_back(resolve_kv_cache_block_sizes, args)
    assert trace(resolve_kv_cache_block_sizes, args).outcome[0] == "ValueError"


# Every other wrapper that reads config before handing over ------------------------

MLA = k.MLAAttentionSpec(
    block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
)


def _builder_args(builder: type, spec: Any, dcp: int) -> Args:
    return lambda: {
        "self": object.__new__(builder),
        "kv_cache_spec": spec,
        "layer_names": ["layer.0"],
        "vllm_config": carrier(dcp),
        "device": torch.device("cpu"),
    }


def _other_wrappers() -> dict[str, tuple[Callable[..., Any], Args]]:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadataBuilder
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder
    from vllm.v1.core import kv_cache_planning, kv_cache_utils
    from vllm.v1.worker.utils import AttentionGroup

    return {
        "resolve_dcp_kv_block_size": (
            kv_cache_utils.resolve_dcp_kv_block_size,
            lambda: {"spec": full(), "dcp_world_size": 4},
        ),
        "_layer_tp_replicas": (
            kv_cache_planning._layer_tp_replicas,
            lambda: {"spec": full(dcp_sharded=False), "tp_size": 8, "dcp_size": 4},
        ),
        "AttentionSpec.max_num_blocks_per_req[sharded]": (
            k.AttentionSpec.max_num_blocks_per_req,
            lambda: {"self": full(), "vllm_config": carrier(4), "max_len": 4096},
        ),
        "AttentionSpec.max_num_blocks_per_req[replicated]": (
            k.AttentionSpec.max_num_blocks_per_req,
            lambda: {
                "self": full(dcp_sharded=False),
                "vllm_config": carrier(4),
                "max_len": 4096,
            },
        ),
        "FullAttentionSpec.max_memory_usage_bytes": (
            k.FullAttentionSpec.max_memory_usage_bytes,
            lambda: {"self": full(), "vllm_config": carrier(4)},
        ),
        "KVConnectorBase_V1.__init__": (
            KVConnectorBase_V1.__init__,
            lambda: {
                "self": SimpleNamespace(),
                "vllm_config": carrier(4),
                "role": KVConnectorRole.SCHEDULER,
                "kv_cache_config": kv_config(full()),
            },
        ),
        "AttentionGroup.create_metadata_builders": (
            AttentionGroup.create_metadata_builders,
            lambda: {
                "self": SimpleNamespace(
                    kv_cache_spec=full(), layer_names=["layer.0"], kv_cache_group_id=0
                ),
                "vllm_config": carrier(1),
                "device": torch.device("cpu"),
            },
        ),
        "FlashAttentionMetadataBuilder.__init__": (
            FlashAttentionMetadataBuilder.__init__,
            _builder_args(FlashAttentionMetadataBuilder, full(), 1),
        ),
        "FlashInferMetadataBuilder.__init__": (
            FlashInferMetadataBuilder.__init__,
            _builder_args(FlashInferMetadataBuilder, full(), 1),
        ),
        "MLACommonMetadataBuilder.__init__": (
            MLACommonMetadataBuilder.__init__,
            _builder_args(MLACommonMetadataBuilder, MLA, 1),
        ),
    }


OTHER_WRAPPERS = [
    "resolve_dcp_kv_block_size",
    "_layer_tp_replicas",
    "AttentionSpec.max_num_blocks_per_req[sharded]",
    "AttentionSpec.max_num_blocks_per_req[replicated]",
    "FullAttentionSpec.max_memory_usage_bytes",
    "KVConnectorBase_V1.__init__",
    "AttentionGroup.create_metadata_builders",
    "FlashAttentionMetadataBuilder.__init__",
    "FlashInferMetadataBuilder.__init__",
    "MLACommonMetadataBuilder.__init__",
]


@pytest.mark.parametrize("name", OTHER_WRAPPERS)
def test_other_wrappers_hand_back(name: str) -> None:
    patched, args = _other_wrappers()[name]
    assert_hands_back(patched, args)


def test_kv_cache_grouping_reads_only_the_override_section() -> None:
    """The engine core's override check must read the plugin's own config
    section to know there is none; that is the only access it adds."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    assert extra_accesses(
        get_global_kv_cache_groups,
        lambda: {"vllm_config": carrier(4), "kv_cache_specs": [{"layer.0": full()}]},
    ) == [("get", "vllm_config.additional_config")]
