# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Where every group's K is vLLM's own default and upstream is right, a
patched function takes upstream's path exactly: the same reads of config and
runner state, in the same order, the same writes, the same result or
exception. Where upstream is wrong although every K is its default (Model
Runner V2 drops a replicated sliding window's null masking at D > 1), the
patched path runs.

Each case runs the patched function and its original
(``patching.original_of``) on strict doubles (``tests.support.hand_back``):
config and runner objects wrapped so that every attribute read and write is
recorded as a dotted path and a missing attribute raises ``AttributeError``,
as in vLLM's own unit tests. Specs and KV-cache configs are real vLLM
objects. Here the double itself and both model runners; the scheduler's block
sizes, vLLM's own unit-test doubles and every other wrapper are in
``test_hand_back_wrappers``. About 5 s in all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1 import kv_cache_interface as k

from tests.support.hand_back import (
    ATTN,
    DEFAULT_LAYOUTS,
    REPLICATED_LAYOUTS,
    Args,
    assert_hands_back,
    carrier,
    extra_accesses,
    full,
    kv_config,
    mamba,
    trace,
    v1_runner,
    v2_runner,
)
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
