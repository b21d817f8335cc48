# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Where every group's K is vLLM's own default and upstream is right, a
patched function takes upstream's path exactly: the same reads of config and
runner state, in the same order, the same writes, the same result or
exception. Where upstream is wrong although every K is its default (Model
Runner V2 drops a replicated sliding window's null masking at D > 1), the
patched path runs.

Each case runs the patched function and its original
(``patching.original_of``) on strict doubles: config and runner objects
wrapped so that every attribute read and write is recorded as a dotted path
and a missing attribute raises ``AttributeError``, as in vLLM's own unit
tests. Specs and KV-cache configs are real vLLM objects. About 5 s in all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1 import kv_cache_interface as k

from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.runtime.patching import ORIGINAL_ATTR, original_of

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

ATTN = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}


class Recorder:
    """A strict double over ``target``: logs ``("get"|"set", path)`` for each
    attribute access and wraps config-like values it hands out."""

    __slots__ = ("_Recorder__log", "_Recorder__path", "_Recorder__target")

    def __init__(self, target: Any, path: str, log: list[tuple[str, str]]) -> None:
        object.__setattr__(self, "_Recorder__target", target)
        object.__setattr__(self, "_Recorder__path", path)
        object.__setattr__(self, "_Recorder__log", log)

    def __getattr__(self, name: str) -> Any:
        path = f"{self.__path}.{name}"
        self.__log.append(("get", path))
        return record(getattr(self.__target, name), path, self.__log)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__log.append(("set", f"{self.__path}.{name}"))
        setattr(self.__target, name, value)


def record(value: Any, path: str, log: list[tuple[str, str]]) -> Any:
    """``value`` behind a ``Recorder`` if it is config or state (a namespace
    or one of vLLM's config classes), else ``value`` itself."""
    cls = type(value)
    is_config = cls.__module__.startswith("vllm.config") and cls.__name__.endswith(
        "Config"
    )
    if isinstance(value, SimpleNamespace) or is_config:
        return Recorder(value, path, log)
    return value


@dataclass
class Trace:
    accesses: list[tuple[str, str]]
    outcome: tuple[str, str]


Args = Callable[[], dict[str, Any]]
"""Makes fresh arguments, by parameter name (config and state get recorded)."""


def trace(function: Callable[..., Any], make_args: Args) -> Trace:
    """Run ``function`` on fresh doubles; its accesses and how it ended."""
    log: list[tuple[str, str]] = []
    args = [record(value, name, log) for name, value in make_args().items()]
    try:
        outcome = ("returned", repr(function(*args)))
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return Trace(log, outcome)


def extra_accesses(patched: Callable[..., Any], make_args: Args) -> list:
    """What ``patched`` (a wrapper) does in front of its original, after
    checking that the rest is the original's own, in order, with the same
    outcome."""
    original = original_of(patched)
    assert original is not patched, "not a wrapper: nothing to compare"
    want = trace(original, make_args)
    got = trace(patched, make_args)
    assert got.outcome == want.outcome
    extra = len(got.accesses) - len(want.accesses)
    assert extra >= 0 and got.accesses[extra:] == want.accesses, (
        got.accesses,
        want.accesses,
    )
    return got.accesses[:extra]


def assert_hands_back(patched: Callable[..., Any], make_args: Args) -> None:
    assert extra_accesses(patched, make_args) == []


def carrier(dcp: int, **kw: Any) -> SimpleNamespace:
    """The tests' vLLM config (real ParallelConfig and CacheConfig)."""
    return make_vllm_config(dcp, **kw)


def full(**kw: Any) -> k.FullAttentionSpec:
    return k.FullAttentionSpec(block_size=16, **ATTN, **kw)


def mamba() -> k.MambaSpec:
    return k.MambaSpec(
        block_size=64,
        shapes=((4, 16),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
    )


def kv_config(*specs: Any) -> k.KVCacheConfig:
    return k.KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            k.KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)
        ],
    )


# The double itself ----------------------------------------------------------------


def _leaky(original: Callable[..., Any]) -> Callable[..., Any]:
    """A deliberately wrong wrapper: reads the PCP size before handing over."""

    @functools.wraps(original)
    def resolve(kv_cache_config: Any, vllm_config: Any) -> Any:
        if vllm_config.parallel_config.prefill_context_parallel_size > 1:
            raise AssertionError("unreachable in these tests")
        return original(kv_cache_config, vllm_config)

    setattr(resolve, ORIGINAL_ATTR, original)
    return resolve


def test_the_double_catches_a_wrapper_that_reads_extra() -> None:
    from vllm.v1.core import kv_cache_utils

    leaky = _leaky(original_of(kv_cache_utils.resolve_kv_cache_block_sizes))

    def args() -> dict[str, Any]:
        return {"kv_cache_config": kv_config(full()), "vllm_config": carrier(1)}

    with pytest.raises(AssertionError):
        assert_hands_back(leaky, args)
    assert extra_accesses(leaky, args) == [
        ("get", "vllm_config.parallel_config"),
        ("get", "vllm_config.parallel_config.prefill_context_parallel_size"),
    ]

    # vLLM's own tests use doubles without such attributes: upstream runs,
    # the leaky wrapper raises.
    def bare() -> dict[str, Any]:
        config = carrier(1)
        config.parallel_config = SimpleNamespace(decode_context_parallel_size=1)
        return {"kv_cache_config": kv_config(full()), "vllm_config": config}

    # (What upstream returns differs by release: 0.34.0 resolves the spec's
    # own block size.)
    assert trace(original_of(leaky), bare).outcome[0] == "returned"
    assert trace(leaky, bare).outcome[0] == "AttributeError"


# Model Runner V1 and V2: runner doubles ----------------------------------------


def v1_runner(config: SimpleNamespace, max_model_len: int = 4096) -> SimpleNamespace:
    """The state ``GPUModelRunner.may_reinitialize_input_batch`` reads (the
    placeholder geometry ``__init__`` leaves), with no model."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.v1.worker.block_table import SlotMappingMode

    return SimpleNamespace(
        vllm_config=config,
        parallel_config=config.parallel_config,
        cache_config=config.cache_config,
        model_config=SimpleNamespace(get_vocab_size=lambda: 64),
        max_model_len=max_model_len,
        max_encoder_len=0,
        _init_block_sizes=[16],
        _init_max_num_blocks=[max_model_len // 16],
        _init_slot_mapping_modes=[SlotMappingMode.TOKEN_TO_KV_SLOT],
        cp_kv_cache_interleave_size=1,
        jit_warmup_registry=JitWarmupRegistry(config),
        max_num_reqs=2,
        max_num_tokens=32,
        device=torch.device("cpu"),
        num_spec_tokens=0,
        input_batch=SimpleNamespace(
            logitsprocs=None, logitsprocs_need_output_token_ids=False
        ),
        is_pooling_model=False,
    )


def v2_runner(config: SimpleNamespace) -> SimpleNamespace:
    """What ``initialize_kv_cache`` reads before it builds attention backends;
    like vLLM's own doubles it lacks the rest (``dcp_size`` included, which
    upstream reads only when it builds the block tables)."""
    return SimpleNamespace(
        vllm_config=config,
        parallel_config=config.parallel_config,
        max_model_len=4096,
        is_encoder_decoder=False,
        speculator=None,
    )


ENCODER = k.EncoderOnlyAttentionSpec(block_size=16, **ATTN)

DEFAULT_LAYOUTS = {
    "sharded": (full(),),
    "sharded+mamba": (full(), mamba()),
    "sharded+mamba+encoder": (full(), mamba(), ENCODER),
    "mla+sharded": (
        k.MLAAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16
        ),
        full(),
    ),
}
REPLICATED_LAYOUTS = {
    "replicated": (full(dcp_sharded=False),),
    "sharded+replicated+mamba": (full(), full(dcp_sharded=False), mamba()),
}


@pytest.mark.vllm_releases("0.33.0")  # Model Runner V1: gone in 0.34.0
@pytest.mark.parametrize("dcp", [1, 4])
@pytest.mark.parametrize("layout", sorted(DEFAULT_LAYOUTS))
def test_v1_input_batch_hands_back(layout: str, dcp: int) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    specs = DEFAULT_LAYOUTS[layout]
    assert_hands_back(
        GPUModelRunner.may_reinitialize_input_batch,
        lambda: {"self": v1_runner(carrier(dcp)), "kv_cache_config": kv_config(*specs)},
    )


@pytest.mark.vllm_releases("0.33.0")  # Model Runner V1: gone in 0.34.0
@pytest.mark.parametrize("layout", sorted(REPLICATED_LAYOUTS))
def test_v1_reads_only_d_for_a_replicated_group(layout: str) -> None:
    """Upstream V1 gives every token-slot table the global D, wrong for a
    replicated group at D > 1: the wrapper must learn D, and reads nothing
    else before handing back at D = 1."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    specs = REPLICATED_LAYOUTS[layout]
    assert extra_accesses(
        GPUModelRunner.may_reinitialize_input_batch,
        lambda: {"self": v1_runner(carrier(1)), "kv_cache_config": kv_config(*specs)},
    ) == [
        ("get", "self.vllm_config"),
        ("get", "self.vllm_config.parallel_config"),
        ("get", "self.vllm_config.parallel_config.decode_context_parallel_size"),
    ]


@pytest.mark.parametrize("dcp", [1, 4])
@pytest.mark.parametrize("layout", sorted({**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}))
def test_v2_initialize_kv_cache_hands_back(layout: str, dcp: int) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    specs = {**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}[layout]
    patched = GPUModelRunner.initialize_kv_cache
    assert_hands_back(
        patched,
        lambda: {"self": v2_runner(carrier(dcp)), "kv_cache_config": kv_config(*specs)},
    )
    # The double ends where upstream needs more state than it has: the
    # comparison covered everything up to there.
    outcome = trace(
        patched,
        lambda: {"self": v2_runner(carrier(dcp)), "kv_cache_config": kv_config(*specs)},
    ).outcome
    assert outcome[0] == "AttributeError" and "jit_warmup_registry" in outcome[1]


def v2_runner_to_tables(config: SimpleNamespace) -> Any:
    """A V2 runner double that lasts through ``BlockTables``
    (``tests.support.worker``): upstream stops when it reads ``pcp_manager``."""
    from tests.support import worker

    return worker.v2_runner_state(
        config,
        dcp_rank=config.parallel_config.decode_context_parallel_size - 1,
        max_model_len=4096,
        max_num_reqs=2,
        max_num_tokens=32,
    )


def inserted_accesses(patched: Callable[..., Any], make_args: Args) -> list:
    """What ``patched`` reads beyond its original, anywhere: the original's
    accesses must all be there, in order, with the same outcome."""
    original = original_of(patched)
    want = trace(original, make_args)
    got = trace(patched, make_args)
    assert got.outcome == want.outcome
    extra, matched = [], 0
    for access in got.accesses:
        if matched < len(want.accesses) and access == want.accesses[matched]:
            matched += 1
        else:
            extra.append(access)
    assert matched == len(want.accesses), (got.accesses, want.accesses)
    return extra


WINDOW = k.SlidingWindowSpec(
    block_size=16, sliding_window=64, dcp_sharded=False, **ATTN
)
WRONG_UPSTREAM_LAYOUTS = {
    "replicated-window": (WINDOW,),
    "sharded+replicated+mamba+window": (
        full(),
        full(dcp_sharded=False),
        mamba(),
        WINDOW,
    ),
}


@pytest.fixture
def v2_tables_only(v2_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Model Runner V2 builds no attention groups (no layers registered)."""
    import vllm.v1.worker.gpu.model_runner as model_runner

    from tests.support import worker

    monkeypatch.setattr(model_runner, "init_attn_backend", worker.no_attention_backends)


def _v2_trace_args(specs: tuple[Any, ...], dcp: int) -> Args:
    return lambda: {
        "self": v2_runner_to_tables(carrier(dcp)),
        "kv_cache_config": kv_config(*specs),
    }


@pytest.mark.parametrize("dcp", [1, 4])
@pytest.mark.parametrize("layout", sorted({**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}))
def test_v2_hands_back_through_the_block_tables(
    v2_tables_only: None, layout: str, dcp: int
) -> None:
    """Upstream is right: its path exactly, up to and including the
    ``BlockTables`` it builds, which take no shard counts."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    specs = {**DEFAULT_LAYOUTS, **REPLICATED_LAYOUTS}[layout]
    args = _v2_trace_args(specs, dcp)
    assert inserted_accesses(GPUModelRunner.initialize_kv_cache, args) == []
    got = trace(GPUModelRunner.initialize_kv_cache, args)
    assert got.outcome[0] == "TablesBuilt"
    assert ("set", "self.block_tables") in got.accesses


@pytest.mark.parametrize("layout", sorted(WRONG_UPSTREAM_LAYOUTS))
def test_v2_patched_path_runs_where_upstream_is_wrong(
    v2_tables_only: None, layout: str
) -> None:
    """A replicated sliding window at D > 1: every K is the default, but
    upstream would drop its masking, so the tables take the shard counts. The
    wrapper still reads nothing before upstream starts; it learns D, the PCP
    size and the interleave when upstream builds the tables."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from tests.support import worker

    specs = WRONG_UPSTREAM_LAYOUTS[layout]
    parallel = "self.vllm_config.parallel_config"
    assert inserted_accesses(
        GPUModelRunner.initialize_kv_cache, _v2_trace_args(specs, 4)
    ) == [
        ("get", "self.dcp_size"),
        ("get", "self.vllm_config"),
        ("get", parallel),
        ("get", f"{parallel}.decode_context_parallel_size"),
        ("get", f"{parallel}.prefill_context_parallel_size"),
        ("get", f"{parallel}.cp_kv_cache_interleave_size"),
    ]
    runner = v2_runner_to_tables(carrier(4))
    worker.run_v2_initialize_kv_cache(
        GPUModelRunner.initialize_kv_cache, runner, kv_config(*specs)
    )
    assert runner.block_tables.dcp_shard_counts == tuple(
        4 if s is specs[0] and s.dcp_sharded else 1 for s in specs
    )
    assert runner.block_tables.has_sliding_window_groups
    # At D = 1 upstream masks by itself: the wrapper reads D, nothing else.
    assert inserted_accesses(
        GPUModelRunner.initialize_kv_cache, _v2_trace_args(specs, 1)
    ) == [("get", "self.dcp_size")]


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
