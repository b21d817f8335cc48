# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Drive vLLM's real worker block tables and slot-mapping kernels on CPU:
scenarios of requests and their block rows, Model Runner V1's
``MultiGroupBlockTable`` and ``may_reinitialize_input_batch``, Model Runner
V2's ``BlockTables`` and ``initialize_kv_cache`` on runner states without a
model, and ``enable_v2_on_cpu``. Imported in the patched test process and in
unpatched subprocesses alike, so nothing here calls a patched-only API unless
its caller passes patched-only arguments. The Triton kernels run under the
interpreter (``TRITON_INTERPRET=1`` set by ``tests/conftest.py`` or
``tests.support.processes``); the GPU check in ``tests/gpu`` calls the same
functions with CUDA tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_dcp_geometry.contract import cdiv

PAD = -1


def enable_v2_on_cpu() -> Callable[[], None]:
    """Let Model Runner V2's ``BlockTables`` build on CPU; returns the undo
    (the tooling's CPU set-up, ``simulate``'s in its CPU process)."""
    from vllm_dcp_geometry.tooling.cpu_stand_ins import enable_block_tables_on_cpu

    return enable_block_tables_on_cpu()


def v2_shard_counts(kv_config: Any, vllm_config: Any) -> list[int]:
    """Every group's K as the patched Model Runner V2 hands it to
    ``BlockTables`` (patched processes only)."""
    from vllm_dcp_geometry.runtime.geometry import group_shard_counts

    parallel = vllm_config.parallel_config
    return group_shard_counts(
        kv_config.kv_cache_groups,
        parallel.decode_context_parallel_size,
        pcp_world_size=parallel.prefill_context_parallel_size,
        interleave_size=parallel.cp_kv_cache_interleave_size,
    )


def kv_cache_config(specs: Sequence[tuple[str, Any]]) -> Any:
    """A ``KVCacheConfig`` with one group per ``(layer name, spec)``."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([name], spec) for name, spec in specs]
    return KVCacheConfig(
        num_blocks=1 << 20, kv_cache_tensors=[], kv_cache_groups=groups
    )


# Requests ---------------------------------------------------------------------------


@dataclass
class Scenario:
    """Requests of one batch and their block-table rows, per group."""

    seq_lens: list[int]
    rows: list[list[list[int]]]
    """``rows[group][request]``: the block ids the scheduler gave the request
    (identical on every DCP rank)."""
    first_positions: list[int]
    """First scheduled position of every request (0: full prefill)."""

    @property
    def num_tokens(self) -> int:
        return sum(
            s - f for s, f in zip(self.seq_lens, self.first_positions, strict=True)
        )


def make_scenario(
    seed: int,
    seq_lens: Sequence[int],
    virtual_block_sizes: Sequence[int],
    *,
    first_positions: Sequence[int] | None = None,
    pool_factor: int = 3,
) -> Scenario:
    """Random distinct block ids (never the null block 0): every request gets
    ``cdiv(seq_len, V)`` blocks in a group whose column covers V tokens."""
    rng = np.random.default_rng(seed)
    rows = []
    for virtual in virtual_block_sizes:
        need = [cdiv(s, virtual) for s in seq_lens]
        pool = rng.permutation(np.arange(1, pool_factor * sum(need) + 2))
        ids = pool[: sum(need)].tolist()
        group_rows, start = [], 0
        for n in need:
            group_rows.append(ids[start : start + n])
            start += n
        rows.append(group_rows)
    firsts = (
        list(first_positions) if first_positions is not None else [0] * len(seq_lens)
    )
    return Scenario([int(s) for s in seq_lens], rows, firsts)


def batch_inputs(
    scenario: Scenario, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``query_start_loc`` (int32) and ``positions`` (int64) of the batch."""
    lens = [
        s - f for s, f in zip(scenario.seq_lens, scenario.first_positions, strict=True)
    ]
    query_start_loc = torch.tensor(
        np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32
    )
    positions = torch.cat(
        [
            torch.arange(f, s, dtype=torch.int64)
            for s, f in zip(scenario.seq_lens, scenario.first_positions, strict=True)
        ]
    )
    return query_start_loc.to(device), positions.to(device)


# Model Runner V1 ------------------------------------------------------------------


def build_v1_tables(
    block_sizes: Sequence[int],
    max_num_blocks: Sequence[int],
    token_slots: Sequence[bool],
    interleave: int,
    *,
    max_num_reqs: int,
    max_num_batched_tokens: int,
    device: torch.device | str = "cpu",
    **patched_kwargs: Any,
) -> Any:
    """A real ``MultiGroupBlockTable``; ``patched_kwargs`` (``dcp_layout``) only
    in a patched process."""
    from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode

    modes = [
        SlotMappingMode.TOKEN_TO_KV_SLOT if on else SlotMappingMode.NONE
        for on in token_slots
    ]
    return MultiGroupBlockTable(
        max_num_reqs,
        max_num_batched_tokens,
        False,
        torch.device(device),
        list(block_sizes),
        list(max_num_blocks),
        interleave,
        modes,
        **patched_kwargs,
    )


def run_v1(block_table: Any, scenario: Scenario) -> dict[str, Any]:
    """Fill the rows, commit, compute the slot mapping; return every table's
    rows and slot-mapping buffer (None where the table maps no slots)."""
    from vllm.v1.worker.block_table import SlotMappingMode

    num_reqs = len(scenario.seq_lens)
    # The interpreter stores through raw pointers: never let it overrun.
    assert scenario.num_tokens <= block_table.block_tables[0].max_num_batched_tokens
    block_table.clear()
    for req in range(num_reqs):
        block_table.add_row(tuple(rows[req] for rows in scenario.rows), req)
    block_table.commit_block_table(num_reqs)
    device = block_table.block_tables[0].block_table.gpu.device
    query_start_loc, positions = batch_inputs(scenario, device)
    for table in block_table.block_tables:
        table.slot_mapping.gpu.fill_(-7)  # not a value the kernel writes
    block_table.compute_slot_mapping(num_reqs, query_start_loc, positions)
    out: dict[str, Any] = {"tables": [], "slots": []}
    for table in block_table.block_tables:
        out["tables"].append(table.block_table.gpu[:num_reqs].cpu().numpy())
        if table.slot_mapping_mode == SlotMappingMode.NONE:
            out["slots"].append(None)
        else:
            out["slots"].append(table.slot_mapping.gpu.cpu().numpy())
    return out


class RunnerState(SimpleNamespace):
    """The state ``GPUModelRunner.may_reinitialize_input_batch`` reads, without
    a model: enough to run the real method (and our wrapper) on CPU."""


def v1_runner_input_batch(
    kv_cache_config: Any,
    vllm_config: Any,
    *,
    max_model_len: int,
    dcp_rank: int,
    max_num_reqs: int,
    max_num_tokens: int,
    device: torch.device | str = "cpu",
) -> Any:
    """Run the real ``GPUModelRunner.may_reinitialize_input_batch`` (patched or
    not) from its placeholder state and return the runner state."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
    from vllm.v1.worker.block_table import SlotMappingMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = RunnerState(
        vllm_config=vllm_config,
        parallel_config=vllm_config.parallel_config,
        cache_config=vllm_config.cache_config,
        model_config=SimpleNamespace(get_vocab_size=lambda: 64),
        max_model_len=max_model_len,
        max_encoder_len=0,
        dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
        dcp_rank=dcp_rank,
        # The placeholder geometry __init__ leaves before the KV cache is known.
        _init_block_sizes=[16],
        _init_max_num_blocks=[cdiv(max_model_len, 16)],
        _init_slot_mapping_modes=[SlotMappingMode.TOKEN_TO_KV_SLOT],
        cp_kv_cache_interleave_size=vllm_config.parallel_config.cp_kv_cache_interleave_size,
        jit_warmup_registry=JitWarmupRegistry(vllm_config),
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        device=torch.device(device),
        num_spec_tokens=0,
        input_batch=SimpleNamespace(
            logitsprocs=None, logitsprocs_need_output_token_ids=False
        ),
        is_pooling_model=False,
    )
    GPUModelRunner.may_reinitialize_input_batch(runner, kv_cache_config)
    return runner


# Model Runner V2 ------------------------------------------------------------------


def v2_table_args(
    kv_cache_config: Any, vllm_config: Any, max_len: int
) -> dict[str, Any]:
    """The per-group arguments Model Runner V2's ``initialize_kv_cache`` gives
    ``BlockTables``, from the same spec methods it calls (one restatement of
    upstream's loop, shared with ``simulate``)."""
    from vllm_dcp_geometry.tooling.cli.simulate.workers_v2 import upstream_v2_table_args

    return upstream_v2_table_args(kv_cache_config, vllm_config, max_len)


class TablesBuilt(Exception):
    """Ends a run of Model Runner V2's ``initialize_kv_cache`` right after it
    built its ``BlockTables`` (its next step reads ``pcp_manager``)."""


class V2RunnerState(SimpleNamespace):
    """What Model Runner V2's ``initialize_kv_cache`` reads up to and
    including building its ``BlockTables``, without a model."""

    @property
    def pcp_manager(self) -> Any:
        raise TablesBuilt


class _NoAttentionCgSupport:
    def narrow(self, *args: Any) -> _NoAttentionCgSupport:
        return self


def no_attention_backends(*args: Any, **kwargs: Any) -> tuple[list, Any, list]:
    """``init_attn_backend`` for a KV-cache config without attention layers
    registered: no attention groups (the tables do not depend on them)."""
    return [], _NoAttentionCgSupport(), []


def v2_runner_state(
    vllm_config: Any,
    *,
    dcp_rank: int,
    max_model_len: int,
    max_num_reqs: int,
    max_num_tokens: int,
    device: torch.device | str = "cpu",
) -> V2RunnerState:
    """A rank's runner state for ``v2_runner_block_tables``."""
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    parallel = vllm_config.parallel_config
    return V2RunnerState(
        vllm_config=vllm_config,
        parallel_config=parallel,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        speculator=None,
        jit_warmup_registry=JitWarmupRegistry(vllm_config),
        model_state=SimpleNamespace(
            get_additional_cg_support=lambda: (), num_new_sampled_tokens_per_step=1
        ),
        req_states=None,
        input_buffers=SimpleNamespace(query_start_loc=None),
        vocab_size=64,
        batch_sharder=None,
        max_num_reqs=max_num_reqs,
        max_num_tokens=max_num_tokens,
        device=torch.device(device),
        dcp_size=parallel.decode_context_parallel_size,
        dcp_rank=dcp_rank,
        cp_interleave=1,
    )


def run_v2_initialize_kv_cache(
    initialize_kv_cache: Callable[..., Any], runner: Any, kv_cache_config: Any
) -> None:
    """Run ``initialize_kv_cache`` (the real method, patched or not, or its
    original) on ``runner`` until it has built its ``BlockTables``, with
    ``init_attn_backend`` building no attention groups."""
    import vllm.v1.worker.gpu.model_runner as model_runner

    saved = model_runner.init_attn_backend
    model_runner.init_attn_backend = no_attention_backends
    try:
        initialize_kv_cache(runner, kv_cache_config)
    except TablesBuilt:
        return
    finally:
        model_runner.init_attn_backend = saved
    raise AssertionError("initialize_kv_cache returned before reading pcp_manager")


def v2_runner_block_tables(kv_cache_config: Any, vllm_config: Any, **state: Any) -> Any:
    """The ``BlockTables`` the real ``GPUModelRunner.initialize_kv_cache``
    (patched or not) builds on a rank (``state``: ``v2_runner_state``'s)."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    runner = v2_runner_state(vllm_config, **state)
    run_v2_initialize_kv_cache(
        GPUModelRunner.initialize_kv_cache, runner, kv_cache_config
    )
    return runner.block_tables


def build_v2_tables(
    table_args: dict[str, Any],
    *,
    cp_size: int,
    cp_rank: int,
    cp_interleave: int,
    max_num_reqs: int,
    max_num_batched_tokens: int,
    device: torch.device | str = "cpu",
    **patched_kwargs: Any,
) -> Any:
    """A real ``BlockTables``; ``patched_kwargs`` (``dcp_shard_counts``) only in
    a patched process."""
    from vllm.v1.worker.gpu.block_table import BlockTables

    return BlockTables(
        block_sizes=list(table_args["block_sizes"]),
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_blocks_per_group=list(table_args["max_num_blocks_per_group"]),
        device=torch.device(device),
        cp_size=cp_size,
        cp_rank=cp_rank,
        cp_interleave=cp_interleave,
        slot_mapping_enabled=list(table_args["slot_mapping_enabled"]),
        dcp_sharded=list(table_args["dcp_sharded"]),
        sliding_window_reach=list(table_args["sliding_window_reach"]),
        **patched_kwargs,
    )


def run_v2(
    block_tables: Any,
    scenario: Scenario,
    req_states: Sequence[int],
    *,
    rows_from: Any = None,
) -> dict[str, Any]:
    """Write request ``i``'s rows at state index ``req_states[i]``, gather and
    compute the slot mappings; return per-group gathered rows and slots.

    ``rows_from``: another rank's ``BlockTables`` already holding the same rows
    (the scheduler gives every rank the same block ids); its rows are copied
    instead of written again, which the interpreter makes slow, and nothing
    is gathered.
    """
    num_reqs = len(scenario.seq_lens)
    assert scenario.num_tokens <= block_tables.max_num_batched_tokens
    if rows_from is None:
        for req, state in enumerate(req_states):
            block_tables.append_block_ids(
                state, tuple(rows[req] for rows in scenario.rows), overwrite=True
            )
        block_tables.apply_staged_writes()
    else:
        for mine, theirs in zip(
            block_tables.block_tables, rows_from.block_tables, strict=True
        ):
            mine.gpu.copy_(theirs.gpu)
        block_tables.num_blocks.np[:] = rows_from.num_blocks.np
        block_tables.num_blocks.copy_to_uva()
    device = block_tables.slot_mappings.device
    idx_mapping = torch.tensor(list(req_states), dtype=torch.int32, device=device)
    query_start_loc, positions = batch_inputs(scenario, device)
    tables = None
    if rows_from is None:
        gathered = block_tables.gather_block_tables(idx_mapping, num_reqs)
        tables = [t[:num_reqs].cpu().numpy() for t in gathered]
    block_tables.slot_mappings.fill_(-7)
    slots = block_tables.compute_slot_mappings(
        idx_mapping, query_start_loc, positions, block_tables.slot_mappings.shape[1]
    )
    return {"tables": tables, "slots": [s.cpu().numpy() for s in slots]}


def gather_with_window(
    block_tables: Any, scenario: Scenario, req_states: Sequence[int]
) -> list[np.ndarray]:
    """Gathered rows with sliding-window null masking for the batch's first
    scheduled positions."""
    device = block_tables.slot_mappings.device
    idx_mapping = torch.tensor(list(req_states), dtype=torch.int32, device=device)
    computed = torch.zeros(block_tables.max_num_reqs, dtype=torch.int32, device=device)
    for req, state in enumerate(req_states):
        computed[state] = scenario.first_positions[req]
    gathered = block_tables.gather_block_tables(
        idx_mapping, len(req_states), num_computed_tokens=computed
    )
    return [t.cpu().numpy() for t in gathered]


def jsonable(result: dict[str, Any]) -> dict[str, Any]:
    """Arrays to lists, for the subprocess's JSON line."""
    return {
        key: None
        if value is None
        else [None if a is None else np.asarray(a).tolist() for a in value]
        for key, value in result.items()
    }
