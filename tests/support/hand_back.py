# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Strict doubles for the hand-back checks (``test_hand_back*``): config and
runner objects wrapped so that every attribute read and write is recorded as
a dotted path and a missing attribute raises ``AttributeError``, as in vLLM's
own unit tests; a patched function's accesses against its original's
(``extra_accesses``, ``assert_hands_back``); real vLLM specs and KV-cache
configs, the runner state each runner's patched functions read, and the
layouts every K of which is vLLM's default."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1 import kv_cache_interface as k

from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.runtime.patching import original_of

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
