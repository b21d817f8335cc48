# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's sparse MLA layer with its DSA indexer on one ``ranks``
worker: its two groups (the latent cache and the indexer cache, one layer,
one K) run together once, and report a row each.

The layer is vLLM's ``vllm.models.deepseek_v32.attention.DeepseekV32Attention``
made by its own constructor (its indexer, its ``DeepseekV32IndexerCache``, its
impl and its ``MLADCPManager``) over a weightless DeepSeek-V3.2 config with the
group's ``fp8_ds_mla`` cache dtype, top-k and shapes; its ``kv_b_proj`` holds
the rank's slice of a random weight, absorbed by its own
``process_weights_after_loading``. Both groups' builders are made by
``AttentionGroup.create_metadata_builders`` as a ``vllm serve`` worker makes
them (FLASHMLA_SPARSE's for the latent cache, DEEPSEEK_V32_INDEXER's for the
indexer cache), so the plugin's builders bind the layer and its indexer cache
for the group's K: partial groups within their K-rank replica groups (rule
A6) or on the D-wide group, replicas masked.

One decode step runs through the layer's own ``_sparse_indexer_and_attn``
under vLLM's forward context (the metadata both builders built): its indexer
call (the module's ``sparse_attn_indexer``, the plugin's wrapper where it is
loaded) with the rank's indexer logits, vLLM's ``_merge_dcp_topk_global`` (the
Triton pack kernel, the all-gather over the DCP or replica
``GroupCoordinator``), then the query all-gather, the impl's ``forward_mqa``
(the top-k filtered to the rank's shard) and the combine, and the layer's
``W_UV`` up-projection. What vLLM's indexer op computes before its merge
(DeepGEMM's fp8 logits over the indexer cache) is stood in for on every
device (``sparse_rank_run.indexer_op_stand_in``, beneath the plugin's
wrapper, re-made by the wrapper's own factory): each rank's logits are the
run's scores at the positions its shard stores. On a CPU the CuteDSL selector
and FlashMLA's kernels are stood in for too (``sparse_stand_ins``): the impl is
vLLM's ``SparseMLACommonImpl`` with vLLM's Triton sparse MLA kernel in its
kernel hook, reading a cache of the run's dtype that holds exactly the values
an ``fp8_ds_mla`` row represents (``sparse_rank_run.fp8_ds_mla_values``), not
the 656-byte format itself. On a GPU the backend is FLASHMLA_SPARSE with its
``fp8_ds_mla`` cache, written by vLLM's own KV-write op.

Every rank is held to float64: its merged selection to the single-device
top-k with vLLM's tie order, its output (after ``W_UV``) and LSE to float64
sparse attention over that selection. The collectives are counted in order
(``CallTraffic``): the indexer call's (the top-k merge) and the attention's
(the query all-gather and the combine) apart, each row against its own
formula.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv
from vllm_dcp_geometry.runtime.patching import UpstreamSymbol, verify_symbol
from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call
from vllm_dcp_geometry.tooling.cli.ranks.cases import (
    Shape,
    sparse_decode_requests,
)
from vllm_dcp_geometry.tooling.cli.ranks.group import (
    TIMED_STEPS,
    Inputs,
    PlannedGroup,
    RankRun,
    Requests,
    ShardLayout,
    common_metadata,
    group_slots,
    up_projection_weight,
)
from vllm_dcp_geometry.tooling.cli.ranks.measuring import Collective, Traffic
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import vllm_config
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.mla_rank_run import magnitude, max_error
from vllm_dcp_geometry.tooling.sparse_rank_run import (
    FP8_DS_MLA_ROW_BYTES,
    IndexerCall,
    fp8_ds_mla_values,
    has_repeated_ids,
    indexer_op_stand_in,
    indexer_spec,
    latent_spec,
    reference_attention,
    reference_topk,
    selection_sets,
    shard_logits,
    tied_scores,
    write_dsv32_config,
)
from vllm_dcp_geometry.tooling.vllm_release import process_weights_after_loading

DSV32 = "vllm.models.deepseek_v32.attention"
MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"
PREFIX = "model.layers.0.self_attn"
LATENT_LAYER = f"{PREFIX}.attn"
"""Where ``DeepseekV32Attention`` registers itself."""
INDEXER_LAYER = f"{PREFIX}.indexer.k_cache"
"""Where its ``DeepseekV32IndexerCache`` registers itself."""

LATENT, INDEXER = "latent", "indexer"
"""The two rows a layer reports (``sparse_role``)."""

RELIED_ON = (
    UpstreamSymbol(
        DSV32,
        "DeepseekV32Attention.__init__",
        "self, vllm_config, config, prefix, topk_indices_buffer=, attn_backend=, "
        "index_group_builder=",
    ),
    UpstreamSymbol(
        DSV32,
        "DeepseekV32Attention._sparse_indexer_and_attn",
        "self, positions, q_c, q_nope, q_pe, index_q_fp8, index_k, "
        "index_weights_out, kv_c, k_pe, ql_nope, mqa_q, output",
    ),
    UpstreamSymbol(MLA_ATTENTION, "get_mla_prefill_backend", "vllm_config"),
)
"""What this runner drives or answers in vLLM, pinned: the layer's
constructor and the method that runs its indexer and sparse attention (which
calls the module's ``sparse_attn_indexer`` by name), and the MLA prefill
selector the constructor asks (answered with ``cpu_sdpa`` on a CPU)."""

_pair_results: dict[str, dict[str, Any]] = {}
"""The other row of a layer already run in this worker, by group name."""


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Run the DeepSeek-V3.2 layer of ``group`` (both of its groups, once per
    worker) on this rank; ``group``'s row."""
    if group.name in _pair_results:
        return _pair_results.pop(group.name)
    rows = run_layer(group, run)
    for name, row in rows.items():
        if name != group.name:
            _pair_results[name] = row
    return rows[group.name]


# Building --------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseSetUp:
    """One DeepSeek-V3.2 layer built on this rank: its layout, the float64
    ``kv_b_proj`` weight of all heads, the layer and both groups' builders,
    and the decode batch."""

    group: PlannedGroup
    topk: int
    layout: ShardLayout
    weight: Any
    config: Any
    layer: Any
    latent_builder: Any
    indexer_builder: Any
    requests: Requests
    width: int
    """Block-table entries per request."""
    num_blocks: int


def backend_class(device: str, dtype: str) -> type:
    """FLASHMLA_SPARSE; on a CPU the same backend (its builder, its name)
    handing out ``sparse_stand_ins.triton_sparse_impl_class`` as its impl (its
    Triton kernel as shipped, or with a float32 store for a float32 run)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    flashmla_sparse = AttentionBackendEnum["FLASHMLA_SPARSE"].get_class()
    if device != "cpu":
        return flashmla_sparse
    from vllm_dcp_geometry.tooling.sparse_stand_ins import triton_sparse_impl_class

    impl = triton_sparse_impl_class(fp32_store=dtype == "float32")

    class TritonImplOnCpu(flashmla_sparse):  # type: ignore[misc, valid-type]
        @staticmethod
        def get_impl_cls() -> type:
            return impl

    return TritonImplOnCpu


def sparse_config(group: PlannedGroup, run: RankRun) -> Any:
    """The run's ``VllmConfig`` for the layer: TP = DCP = D, a DeepSeek-V3.2
    model of D x h heads selecting the group's top-k, the group's block size,
    interleave and ``fp8_ds_mla`` cache dtype."""
    shape, topk = group.shape, group.indexer_topk
    assert topk is not None
    path = write_dsv32_config(
        run.world * shape.heads_per_rank,
        index_topk=topk,
        dtype=shape.dtype,
        max_position_embeddings=max(4096, shape.max_model_len),
        nope_dim=shape.nope_dim,
        v_head_dim=shape.v_head_dim,
    )
    config = vllm_config(
        path,
        run.world,
        group.interleave,
        group.block_size,
        shape,
        run.device,
        run.partial_collectives,
    )
    config.cache_config.cache_dtype = "fp8_ds_mla"
    return config


def build_layer(
    config: Any, weight: Any, rank: int, shape: Shape, device: str, topk: int
) -> Any:
    """The rank's ``DeepseekV32Attention`` by its own constructor (the
    run's backend; ``cpu_sdpa`` answering the MLA prefill selector on a
    CPU), with its TP slice of ``weight`` in ``kv_b_proj``, weights
    absorbed."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.models.deepseek_v32 import attention as dsv32
    from vllm.utils.torch_utils import set_default_torch_dtype

    for symbol in RELIED_ON:
        verify_symbol(symbol)
    require_global_call(
        dsv32, "DeepseekV32Attention._sparse_indexer_and_attn", "sparse_attn_indexer"
    )
    require_global_call(
        mla_attention, "MLAAttention.__init__", "get_mla_prefill_backend"
    )
    dtype = getattr(torch, shape.dtype)
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import (
                CPUSDPAMLAPrefillBackend,
            )

            stack.enter_context(
                replaced(
                    mla_attention,
                    "get_mla_prefill_backend",
                    lambda *a, **k: CPUSDPAMLAPrefillBackend,
                )
            )
        else:
            from vllm.v1.worker.workspace import (
                init_workspace_manager,
                is_workspace_manager_initialized,
            )

            # FlashMLA's sparse impl reserves its workspace when it is built.
            if not is_workspace_manager_initialized():
                init_workspace_manager(torch.device(device))
        stack.enter_context(set_current_vllm_config(config))
        stack.enter_context(set_default_torch_dtype(dtype))
        stack.enter_context(torch.device(device))
        buffer = torch.full((config.scheduler_config.max_num_seqs, topk), -1)
        layer = dsv32.DeepseekV32Attention(
            config,
            config.model_config.hf_config,
            PREFIX,
            topk_indices_buffer=buffer.to(torch.int32),
            attn_backend=backend_class(device, shape.dtype),
        )
    rows = shape.heads_per_rank * (shape.nope_dim + shape.v_head_dim)
    layer.kv_b_proj.weight.data.copy_(weight[rank * rows : (rank + 1) * rows])
    process_weights_after_loading(layer, dtype)
    if device == "cpu":
        # A one-layer index group converts nothing (``forward_mqa`` converts
        # per layer), and the CUDA event it records for its indexer raises
        # without a CUDA device.
        layer.impl.index_group = None
    return layer


def set_up_layer(group: PlannedGroup, run: RankRun) -> SparseSetUp:
    """The rank's layer and both groups' builders for ``group``'s layer
    (the layer in the forward context first, as in a worker, so the plugin's
    builders bind it and its indexer cache)."""
    import torch
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.worker.utils import AttentionGroup

    shape, topk, k = group.shape, group.indexer_topk, group.shard_count
    assert topk is not None
    shard = GroupGeometry(group.name, k, run.world, run.rank).shard
    weight = up_projection_weight(group, run)
    config = sparse_config(group, run)
    layer = build_layer(config, weight, run.rank, shape, run.device, topk)
    count = group.dcp_kv_shard_count if run.patched else None
    builders = []
    for backend, name, spec in (
        (
            layer.attn_backend,
            LATENT_LAYER,
            latent_spec(group.block_size, count, dcp_sharded=group.dcp_sharded),
        ),
        (
            DeepseekV32IndexerBackend,
            INDEXER_LAYER,
            indexer_spec(group.block_size, count, dcp_sharded=group.dcp_sharded),
        ),
    ):
        attn_group = AttentionGroup(backend, [name], spec, 0)
        attn_group.create_metadata_builders(config, torch.device(run.device))
        builders.append(attn_group.get_metadata_builder())
    requests = sparse_decode_requests(group.block_size, k, topk)
    width = cdiv(shape.max_model_len, group.block_size * k)
    return SparseSetUp(
        group=group,
        topk=topk,
        layout=ShardLayout(group.block_size, k, group.interleave, shard),
        weight=weight,
        config=config,
        layer=layer,
        latent_builder=builders[0],
        indexer_builder=builders[1],
        requests=requests,
        width=width,
        num_blocks=width * len(requests) + 1,
    )


# Inputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseInputs:
    """Float64 inputs of one decode step, identical on every rank (one
    seed): every position's latent row on the fp8_ds_mla grid, the absorbed
    queries of all D x h heads, the indexer's scores (many ties) and the
    block table (``base``: the requests, rows and latents as ``group``'s
    metadata and slot helpers read them)."""

    base: Inputs
    latents: list[Any]
    q: Any
    scores: Any

    @property
    def lengths(self) -> Any:
        import torch

        return torch.tensor([c + n for c, n in self.base.requests], dtype=torch.int32)


def make_sparse_inputs(set_up: SparseSetUp, run: RankRun) -> SparseInputs:
    import torch

    shape = set_up.group.shape
    gen = torch.Generator().manual_seed(run.seed + 31 * set_up.group.index + 6)
    dtype = getattr(torch, shape.dtype)
    row = shape.kv_lora_rank + shape.rope_dim
    latents = [
        fp8_ds_mla_values(
            torch.randn(c + n, row, generator=gen, dtype=torch.float64),
            shape.kv_lora_rank,
        )
        for c, n in set_up.requests
    ]
    tokens = sum(n for _, n in set_up.requests)
    q = torch.randn(
        tokens,
        run.world * shape.heads_per_rank,
        row,
        generator=gen,
        dtype=torch.float64,
    )
    q = q.to(dtype).double()
    width = max(c + n for c, n in set_up.requests)
    scores = tied_scores(tokens, width, run.seed + 31 * set_up.group.index + 7)
    blocks = torch.randperm(set_up.num_blocks, generator=gen)
    columns = set_up.width
    rows = [
        blocks[i * columns : (i + 1) * columns] for i in range(len(set_up.requests))
    ]
    kv_c = [latent[:, : shape.kv_lora_rank] for latent in latents]
    k_pe = [latent[:, shape.kv_lora_rank :] for latent in latents]
    base = Inputs(list(set_up.requests), kv_c, k_pe, q, rows)
    return SparseInputs(base, latents, q, scores)


def write_latent_cache(inputs: SparseInputs, set_up: SparseSetUp, run: RankRun) -> Any:
    """The rank's paged latent cache with its shard of every position at the
    contract's slots for the group's K. On a CPU: rows of the run's dtype
    holding the fp8_ds_mla values, every slot the shard does not own NaN (a
    wrong read shows); on a GPU: the 656-byte ``fp8_ds_mla`` rows, written by
    vLLM's KV-write op."""
    import torch

    shape, layout, device = set_up.group.shape, set_up.layout, run.device
    slots = group_slots(inputs.base, layout, lambda c, n: range(c + n))
    if device == "cpu":
        row = shape.kv_lora_rank + shape.rope_dim
        cache = torch.full(
            (set_up.num_blocks, layout.block_size, row),
            float("nan"),
            dtype=getattr(torch, shape.dtype),
        )
        flat = cache.view(-1, row)
        for latent, row_slots in zip(inputs.latents, slots, strict=True):
            where = torch.as_tensor(row_slots)
            mine = where >= 0
            flat[where[mine]] = latent[mine].to(cache.dtype)
        return cache
    import vllm._custom_ops as ops

    cache = torch.full(
        (set_up.num_blocks, layout.block_size, FP8_DS_MLA_ROW_BYTES),
        0xFF,
        dtype=torch.uint8,
        device=device,
    )
    for latent, row_slots in zip(inputs.latents, slots, strict=True):
        where = torch.as_tensor(row_slots, device=device)
        mine = where >= 0
        rows = latent.to(device, torch.bfloat16)[mine]
        ops.concat_and_cache_mla(
            rows[:, : shape.kv_lora_rank].contiguous(),
            rows[:, shape.kv_lora_rank :].contiguous(),
            cache,
            where[mine],
            "fp8_ds_mla",
            torch.ones((), device=device),
        )
    return cache


# The collectives of one layer call ------------------------------------------------


@dataclass
class CallTraffic:
    """The collectives of one layer call, counted in order in back-to-back
    ``Traffic.counted`` blocks (the meter counts one block at a time): the
    indexer call's (its top-k merge, part ``indexer``) and everything else
    the call runs before and after it (the attention's query all-gather and
    combine, part ``attention``); each collective lands in exactly one."""

    traffic: Traffic
    parts: dict[str, list[Collective]] = field(default_factory=dict)
    indexer_s: float | None = None
    _open: tuple[str, Any] | None = None

    def _start(self, name: str) -> None:
        counting = self.traffic.counted()
        counting.__enter__()
        self._open = (name, counting)

    def _stop(self) -> None:
        assert self._open is not None
        name, counting = self._open
        self._open = None
        counting.__exit__(None, None, None)
        self.parts.setdefault(name, []).extend(self.traffic.collectives)

    @contextlib.contextmanager
    def layer_call(self) -> Iterator[None]:
        self._start("attention")
        try:
            yield
        finally:
            self._stop()

    def around_indexer(self, op: Callable[..., Any]) -> Callable[..., Any]:
        def counted_indexer(*args: Any, **kwargs: Any) -> Any:
            self._stop()
            self._start("indexer")
            started = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.indexer_s = time.perf_counter() - started
                self._stop()
                self._start("attention")

        return counted_indexer

    def part(self, name: str) -> Traffic:
        """One part's collectives, as a ``Traffic`` (its totals and
        breakdowns)."""
        return Traffic(self.traffic.backend, collectives=list(self.parts.get(name, [])))


def plugin_wrappers_around(current: Any, stand_in: Callable[..., Any]) -> Any:
    """``current`` (a vLLM function, maybe wrapped by the plugin's patches)
    with what lies beneath its wrappers replaced by ``stand_in``: each
    installed wrapper re-made by its own factory (``FACTORY_ATTR``), in the
    same order. Unwrapped (unpatched vLLM): ``stand_in`` itself."""
    import importlib

    from vllm_dcp_geometry.runtime.patching import FACTORY_ATTR
    from vllm_dcp_geometry.runtime.upstream_symbols import ORIGINAL_ATTR, callable_of

    target = callable_of(current)
    factory_path = getattr(target, FACTORY_ATTR, None)
    if factory_path is None or not hasattr(target, ORIGINAL_ATTR):
        return stand_in
    module, _, name = factory_path.rpartition(".")
    factory = getattr(importlib.import_module(module), name)
    return factory(plugin_wrappers_around(getattr(target, ORIGINAL_ATTR), stand_in))


@contextlib.contextmanager
def indexer_op_stood_in(
    record: Callable[[IndexerCall], None],
    split: CallTraffic | None = None,
) -> Iterator[None]:
    """While the block runs: the name the layer calls its indexer by
    (``vllm.models.deepseek_v32.attention.sparse_attn_indexer``) is the
    plugin's wrappers (where loaded) around ``indexer_op_stand_in``, and, on
    a CPU, the merge's CuteDSL selector is stood in for; ``split`` counts the
    call's collectives apart."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.models.deepseek_v32 import attention as dsv32
    from vllm.platforms import current_platform

    from vllm_dcp_geometry.runtime.upstream_symbols import original_of

    current = dsv32.sparse_attn_indexer
    # What the layer's name resolves to beneath any wrapper is vLLM's op.
    innermost = current
    while original_of(innermost) is not innermost:
        innermost = original_of(innermost)
    if innermost is not original_of(sai.sparse_attn_indexer):
        raise RuntimeError(
            f"{dsv32.__name__}.sparse_attn_indexer is not vLLM's indexer op"
        )
    call = plugin_wrappers_around(current, indexer_op_stand_in(record))
    if split is not None:
        call = split.around_indexer(call)
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(dsv32, "sparse_attn_indexer", call))
        if current_platform.device_type == "cpu":
            from vllm_dcp_geometry.tooling.sparse_stand_ins import (
                cutedsl_merge_stand_ins,
            )

            stack.enter_context(cutedsl_merge_stand_ins())
        yield


# Running ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StepOutcome:
    """What one decode step of this rank left: its output, the LSEs the
    attention handed on, its selection, the indexer calls and the
    collectives by part."""

    output: Any
    seen: dict[str, Any]
    selection: Any
    calls: list[IndexerCall]
    split: CallTraffic | None
    indexer_metadata: Any


def prepare_step(
    inputs: SparseInputs, set_up: SparseSetUp, run: RankRun, cache: Any
) -> tuple[Callable[[], None], Any, Any]:
    """One decode step of the rank's layer, ready to run: both builders'
    metadata built (as the runner builds them before the model runs), the
    rank's indexer logits and queries on the device; the call, the output
    [tokens, h * V] it writes, and the indexer's metadata."""
    import torch
    from vllm.forward_context import set_forward_context

    group, layout, device = set_up.group, set_up.layout, run.device
    shape = group.shape
    dtype = getattr(torch, shape.dtype)
    new = group_slots(inputs.base, layout, lambda c, n: range(c, c + n))
    slots = torch.as_tensor([s for row in new for s in row], dtype=torch.int64)
    common = common_metadata(inputs.base, layout.interleave, run, slots)
    with contextlib.ExitStack() as stack:
        if device == "cpu":
            from vllm_dcp_geometry.tooling.sparse_stand_ins import (
                flashmla_scheduler_stand_in,
            )

            stack.enter_context(flashmla_scheduler_stand_in())
        latent_md = set_up.latent_builder.build(0, common)
    indexer_md = set_up.indexer_builder.build(0, common)
    logits, _ = shard_logits(
        inputs.scores,
        inputs.lengths,
        block_size=layout.block_size,
        shard_count=layout.shard_count,
        interleave=layout.interleave,
        shard=layout.shard,
    )
    h, rank = shape.heads_per_rank, run.rank
    q = inputs.q[:, rank * h : (rank + 1) * h].to(device, dtype)
    ql_nope = q[..., : shape.kv_lora_rank].contiguous()
    q_pe = q[..., shape.kv_lora_rank :].contiguous()
    tokens = q.shape[0]
    output = torch.zeros(tokens, h * shape.v_head_dim, dtype=dtype, device=device)
    layer = set_up.layer
    layer.kv_cache = cache
    layer.indexer.k_cache.kv_cache = torch.empty(0, device=device)
    on_device = slots.to(device)
    no_tensor = torch.empty(0, device=device)

    def step() -> None:
        layer.topk_indices_buffer.fill_(-1)
        with set_forward_context(
            {LATENT_LAYER: latent_md, INDEXER_LAYER: indexer_md},
            set_up.config,
            slot_mapping={LATENT_LAYER: on_device, INDEXER_LAYER: on_device},
        ):
            layer._sparse_indexer_and_attn(
                torch.arange(tokens, device=device),
                logits.to(device),  # q_c: the indexer op's stand-in reads it
                None,
                None,
                no_tensor,  # index_q_fp8
                None,
                no_tensor,  # index_weights_out
                None,
                None,
                ql_nope,
                q_pe,  # mqa_q: the roped query, unquantized (FlashMLA's)
                output,
            )

    return step, output, indexer_md


def _timed(run: RankRun, call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()`` with every rank starting together (a barrier on the world
    group, outside the timing; on CUDA synchronised around it); its result
    and seconds."""
    import torch
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    dist.barrier(group=parallel_state.get_world_group().cpu_group)
    cuda = run.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = call()
    if cuda:
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def run_step(
    inputs: SparseInputs, set_up: SparseSetUp, run: RankRun, cache: Any
) -> tuple[StepOutcome, float]:
    """One counted decode step of this rank's layer (both builders' ``build``
    and the layer's ``_sparse_indexer_and_attn``), and its seconds."""
    calls: list[IndexerCall] = []
    split = CallTraffic(run.meters.traffic)

    def counted_step() -> StepOutcome:
        step, output, indexer_md = prepare_step(inputs, set_up, run, cache)
        with (
            indexer_op_stood_in(calls.append, split),
            run.meters.lse.recording() as seen,
            split.layer_call(),
        ):
            step()
        selection = set_up.layer.topk_indices_buffer[: output.shape[0]].clone()
        return StepOutcome(output, dict(seen), selection, calls, split, indexer_md)

    return _timed(run, counted_step)


def step_seconds(
    inputs: SparseInputs,
    set_up: SparseSetUp,
    run: RankRun,
    cache: Any,
    counted_s: float,
) -> float:
    """Seconds of one decode step of this rank: the median of
    ``TIMED_STEPS``, the counted one (``counted_s``) and as many more, each
    timed as ``run_step`` times it (an interpreted sparse step takes seconds
    on a CPU: the counted one is not run again)."""

    def step() -> None:
        call, _, _ = prepare_step(inputs, set_up, run, cache)
        call()

    seconds = [counted_s]
    with indexer_op_stood_in(lambda call: None):
        for _ in range(TIMED_STEPS - 1):
            seconds.append(_timed(run, step)[1])
    return statistics.median(seconds)


# The reference ---------------------------------------------------------------------


def reference_step(inputs: SparseInputs, set_up: SparseSetUp) -> dict[str, Any]:
    """Float64 single-device: the top-k over every position with vLLM's tie
    order, sparse attention of all heads over it, and its up-projection by
    every head's ``W_UV`` (from the same weight); output [T, H * V], LSE
    [T, H]."""
    import torch

    shape = set_up.group.shape
    selection = reference_topk(inputs.scores, inputs.lengths, set_up.topk)
    tokens = inputs.q.shape[0]
    out, lse = reference_attention(
        inputs.q, inputs.latents, list(range(tokens)), selection, shape_scale(shape)
    )
    heads = inputs.q.shape[1]
    up = set_up.weight.view(heads, shape.nope_dim + shape.v_head_dim, -1)
    w_uv = up[:, shape.nope_dim :, :]  # [H, V, L]
    projected = torch.einsum("thl,hvl->thv", out, w_uv)
    return {"selection": selection, "out": projected.flatten(1), "lse": lse}


def shape_scale(shape: Shape) -> float:
    """DeepSeek-V3.2's softmax scale: ``(nope + rope) ** -0.5`` (no YaRN in
    the run's config)."""
    return float((shape.nope_dim + shape.rope_dim) ** -0.5)


def _traffic_fields(traffic: Traffic) -> dict[str, Any]:
    return {
        "decode_bytes": traffic.total,
        "decode_bytes_by_op": traffic.by_op,
        "decode_bytes_by_group": traffic.by_group,
        "decode_unmodeled_collectives": traffic.unmodeled,
        "decode_collective_calls": traffic.calls,
        "decode_collective_worlds": sorted(traffic.worlds),
    }


def _stand_ins(run: RankRun, shape: Shape) -> list[str]:
    """What ran in place of vLLM's own code on this rank, in words."""
    from vllm_dcp_geometry.tooling.sparse_stand_ins import DSA_CUTEDSL

    words = [
        "vllm.model_executor.layers.sparse_attn_indexer.sparse_attn_indexer's "
        "DeepGEMM logits and top-k (each rank's logits over its shard handed in; "
        "its local top-k merged by vLLM's _merge_dcp_topk_global)"
    ]
    if run.device == "cpu":
        kernel = (
            "vLLM's Triton sparse MLA kernel with its output store in float32 "
            "(generated at run time in a temporary directory)"
            if shape.dtype == "float32"
            else "vLLM's Triton sparse MLA kernel (xpu_mla_sparse, as shipped)"
        )
        words += [
            f"{DSA_CUTEDSL}.stable_topk_from_gathered_candidates_cutedsl "
            "(torch, its key contract)",
            "FlashMLASparseImpl's kernels: SparseMLACommonImpl with " + kernel,
            f"the fp8_ds_mla cache: {shape.dtype} rows holding exactly the values "
            "its 656-byte rows represent (fp8_ds_mla not run)",
            "vllm.v1.attention.backends.mla.flashmla_sparse.get_mla_metadata "
            "(an empty FlashMLASchedMeta, as FlashMLA's own)",
            "the impl's one-layer SparseMLAIndexGroup dropped (it records a CUDA "
            "event; forward_mqa converts the top-k per layer)",
        ]
    return words


def run_layer(group: PlannedGroup, run: RankRun) -> dict[str, dict[str, Any]]:
    """Build and run the DeepSeek-V3.2 layer of ``group`` on this rank; its
    two rows (the latent group's and the indexer group's), by group name."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    from vllm_dcp_geometry.contract import local_seq_len

    assert group.sparse_latent is not None and group.sparse_indexer is not None
    set_up = set_up_layer(group, run)
    inputs = make_sparse_inputs(set_up, run)
    cache = write_latent_cache(inputs, set_up, run)
    outcome, counted_s = run_step(inputs, set_up, run, cache)
    want = reference_step(inputs, set_up)
    shape, layout = group.shape, set_up.layout
    h, v = shape.heads_per_rank, shape.v_head_dim
    rank = run.rank
    layer = set_up.layer
    world = int(layer.impl.dcp_world_size)
    # The combine's LSE covers the heads of every rank its collectives span
    # (the replica's, or all D); a local layer's is the kernel's own.
    if world > 1:
        got_lse = outcome.seen.get("combined_lse")
        first = rank // world * world
        want_lse = want["lse"][:, first * h : (first + world) * h]
    else:
        got_lse = getattr(layer.impl, "kernel_lse", None)
        want_lse = want["lse"][:, rank * h : (rank + 1) * h]
    want_out = want["out"][:, rank * h * v : (rank + 1) * h * v]
    wanted = selection_sets(want["selection"])
    selection_ok = selection_sets(outcome.selection) == wanted
    assert outcome.split is not None
    attention = outcome.split.part("attention")
    indexer = outcome.split.part("indexer")
    step_s = step_seconds(inputs, set_up, run, cache, counted_s)
    tokens = int(outcome.output.shape[0])
    latent_class = type(layer)
    cache_class = type(layer.indexer.k_cache)
    assert cache_class is DeepseekV32IndexerCache or issubclass(
        cache_class, DeepseekV32IndexerCache
    )
    # The local lengths the indexer's builder gave its op, against the
    # contract's for the rank's shard.
    local = [
        local_seq_len(
            c + n,
            layout.block_size,
            layout.shard_count,
            layout.interleave,
            layout.shard,
        )
        for c, n in inputs.base.requests
    ]
    built = outcome.indexer_metadata.decode.seq_lens.flatten()[:tokens].tolist()
    calls = [
        {"dcp_rank": c.dcp_rank, "dcp_world_size": c.dcp_world_size}
        for c in outcome.calls
    ]
    common = {
        "decode_tokens": tokens,
        "topk": set_up.topk,
        "selection_ok": selection_ok,
        "selection_repeats": has_repeated_ids(outcome.selection),
        "stand_ins": _stand_ins(run, shape),
    }
    latent_row = {
        "name": group.sparse_latent,
        "sparse_role": LATENT,
        "layer_class_run": f"{latent_class.__module__}.{latent_class.__qualname__}",
        "impl_dcp_world_size": world,
        "decode_step_s": step_s,
        "decode_max_abs_error": max_error(outcome.output, want_out),
        "decode_max_lse_error": None
        if got_lse is None
        else max_error(got_lse, want_lse),
        "decode_output_magnitude": magnitude(want_out),
        "decode_lse_magnitude": magnitude(want_lse),
        **common,
        **_traffic_fields(attention),
    }
    merged = max(indexer.worlds, default=1)
    indexer_row = {
        "name": group.sparse_indexer,
        "sparse_role": INDEXER,
        "layer_class_run": f"{cache_class.__module__}.{cache_class.__qualname__}",
        "impl_dcp_world_size": merged,
        "decode_step_s": outcome.split.indexer_s,
        "indexer_calls": calls,
        "indexer_local_lengths": built,
        "contract_local_lengths": local,
        "local_lengths_ok": [int(n) for n in built] == local,
        **common,
        **_traffic_fields(indexer),
    }
    return {group.sparse_latent: latent_row, group.sparse_indexer: indexer_row}
