# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM's real MLA attention over D simulated DCP ranks on CPU, and the float64
single-device reference it is held to: the harness's sizes (``Shape``, ``CPU``)
and batches, the cooperative ranks and ``SimulatedGroup`` standing in for the
DCP/TP process groups (only the collectives are simulated), stand-ins for the
three ``vllm._C`` cache ops a CPU build lacks (checked against the contract in
``test_mla_stand_ins``), each rank's real ``MLAAttention`` layer, TRITON_MLA
impl, ``cpu_sdpa`` prefill backend and builder made by
``AttentionGroup.create_metadata_builders``, one forward over the ranks in
cooperative threads (one runs at a time; they hand over only inside a
collective, so the real query all-gather, LSE combine and context KV
all-gather see their peers), and ``run_case``: one (D, K, I) case evaluated
against the reference. Importable without the plugin, so the unpatched
baseline runs the very same code in a fresh process.

vLLM 0.34.0: every rank's model is loaded before any builder is made, as a
worker does, so the weights 0.34.0 all-gathers over the DCP ranks at load
(``W_UV_dcp`` for the a2a up-projection, ``W_UK_T_dcp_qrep``) hold every
rank's (``gathers_at_load``, ``complete_load_gathers``) before the plugin's
binding sees the layers; its ``process_weights_after_loading`` takes no
dtype (``process_weights``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced as replaced
from vllm_dcp_geometry.tooling.custom_op_stand_ins import STAND_IN_OPS
from vllm_dcp_geometry.tooling.mla_rank_run import (
    build_mla_layer,
    max_error,
    mla_reference,
    write_deepseek_config,
)

# Re-exported: the stand-ins, by name, for the tests and ``cpu_stand_ins``.
from vllm_dcp_geometry.tooling.custom_op_stand_ins import (  # isort: skip
    concat_and_cache_mla as concat_and_cache_mla,
    cp_gather_cache as cp_gather_cache,
    gather_and_maybe_dequant_cache as gather_and_maybe_dequant_cache,
)


@dataclass(frozen=True)
class Shape:
    """Model, cache and batch sizes of one harness run."""

    block_size: int = 16
    heads_per_rank: int = 2
    kv_lora_rank: int = 256
    rope_dim: int = 64  # MLA admits head sizes (L + R) of 320, 512 and 576 only
    nope_dim: int = 16
    v_head_dim: int = 16
    max_model_len: int = 64
    max_num_seqs: int = 8
    num_blocks: int = 96
    # (context length, query length), decodes first as the runner reorders
    # them: decodes over long and short contexts (some shards empty),
    # chunked-prefill continuations, a block-aligned prefix-cache hit and a
    # prefill without context. The prefill contexts need several context
    # chunks at D = 8 (workspace of 512 rows).
    requests: tuple[tuple[int, int], ...] = (
        (36, 1),
        (4, 1),
        (62, 1),
        (45, 6),
        (32, 9),
        (57, 5),
        (0, 5),
        (50, 3),
    )
    num_decodes: int = 3
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def scale(self) -> float:
        return float((self.nope_dim + self.rope_dim) ** -0.5)

    @property
    def head_size(self) -> int:
        """The latent cache entry: ``kv_lora_rank + rope_dim``."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def decode_rows(self) -> int:
        return sum(n for _, n in self.requests[: self.num_decodes])


CPU = Shape()
LAYER = "model.layers.0.self_attn.attn"


# Collectives --------------------------------------------------------------------


class CooperativeRanks:
    """Runs one function per rank in threads that take turns: a thread gives
    up its turn only while it waits for its peers inside ``exchange``, so
    vLLM's Triton interpreter never runs in two threads at once."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.turn = threading.Lock()
        self.barrier = threading.Barrier(world_size, timeout=300)
        self.slots: list[Any] = [None] * world_size
        self.local = threading.local()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.turn.release()
        self.barrier.wait()
        with self.turn:
            everything = list(self.slots)
        self.barrier.wait()
        self.turn.acquire()
        return everything

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            self.local.rank = rank
            self.turn.acquire()
            try:
                results[rank] = fn(rank)
            except BaseException as exc:
                errors.append(exc)
                self.barrier.abort()
            finally:
                self.turn.release()

        threads = [
            threading.Thread(target=body, args=(r,)) for r in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        if real or errors:
            raise (real or errors)[0]
        return results


class SimulatedGroup:
    """What vLLM reads of a ``GroupCoordinator`` here, over ``CooperativeRanks``."""

    def __init__(self, ranks: CooperativeRanks | None, world_size: int, rank: int):
        self.coop = ranks
        self.world_size = world_size
        self.rank_in_group = rank
        self.rank = rank
        self.ranks = list(range(world_size))
        self.device_group = self

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        assert self.coop is not None, "collective outside a simulated forward"
        return self.coop.exchange(self.rank_in_group, tensor.clone())

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        total = torch.stack(self._exchange(tensor)).sum(dim=0)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor)).sum(dim=0)

    def all_gather_into_tensor(self, out: torch.Tensor, local: torch.Tensor) -> None:
        out.copy_(torch.cat(self._exchange(local), dim=0))


class SimulatedReplica(SimulatedGroup):
    """A partial group's replica group (rule A6) of DCP rank ``dcp_rank``:
    the K ranks ``q*K .. q*K + K - 1``. Every DCP rank takes part in each
    exchange (they all run the same collectives at once); a rank keeps its
    replica's tensors."""

    def __init__(
        self,
        ranks: CooperativeRanks | None,
        dcp_world: int,
        dcp_rank: int,
        shard_count: int,
    ) -> None:
        geometry = GroupGeometry("replica", shard_count, dcp_world, dcp_rank)
        super().__init__(ranks, shard_count, geometry.shard)
        self.dcp_rank = dcp_rank
        self.ranks = list(geometry.replica_dcp_ranks)

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        assert self.coop is not None, "collective outside a simulated forward"
        everything = self.coop.exchange(self.dcp_rank, tensor.clone())
        return [everything[r] for r in self.ranks]


@contextmanager
def replica_groups_of(
    dcp: SimulatedGroup, shard_counts: Sequence[int], make: Any = None
) -> Iterator[None]:
    """The plugin's replica groups of this DCP rank (``make(k)``, by default
    ``SimulatedReplica``s), made for ``dcp``, while its builders are made
    (what ``create_replica_groups`` makes at KV-cache initialisation in a
    real worker)."""
    from vllm_dcp_geometry.runtime import replica_groups

    def replica(k: int) -> SimulatedGroup:
        group = (
            SimulatedReplica(dcp.coop, dcp.world_size, dcp.rank_in_group, k)
            if make is None
            else make(k)
        )
        setattr(group, replica_groups.MADE_FOR_ATTR, dcp)
        return group

    made = replica_groups._REPLICA_GROUPS
    saved = dict(made)
    made.update({k: replica(k) for k in shard_counts})
    try:
        yield
    finally:
        made.clear()
        made.update(saved)


class _Done:
    def wait(self) -> None:
        pass


def all_to_all_single(
    out: Any, local: Any, group: Any = None, async_op: bool = False, **_: Any
) -> Any:
    """Stand-in for ``torch.distributed.all_to_all_single`` (the MLA combine
    with ``dcp_comm_backend="a2a"``) over a ``SimulatedGroup``: chunk ``j`` of
    every rank's input lands, in rank order, in rank ``j``'s output."""
    assert isinstance(group, SimulatedGroup), group
    sent = group._exchange(local)
    me = group.rank_in_group
    out.copy_(torch.cat([s.chunk(group.world_size)[me] for s in sent]))
    return _Done() if async_op else None


def all_gather_into_tensor(out: Any, local: Any, group: Any = None, **_: Any) -> None:
    """Stand-in for ``torch.distributed.all_gather_into_tensor`` (the MLA
    context KV gather) over a ``SimulatedGroup``."""
    assert isinstance(group, SimulatedGroup), group
    group.all_gather_into_tensor(out, local)


# Stand-ins for vllm._C cache ops (see test_mla_stand_ins): the library's
# (``vllm_dcp_geometry.tooling.cpu_stand_ins``), which ``vllm-dcp-geometry ranks`` uses too.


# CPU set-up ----------------------------------------------------------------------


@contextmanager
def simulated_collectives() -> Iterator[None]:
    """The MLA context KV gather (captured when a builder is made, so hold
    this around ``make_ranks`` too) and the all-to-all combine over a
    ``SimulatedGroup``."""
    with (
        replaced(torch.distributed, "all_gather_into_tensor", all_gather_into_tensor),
        replaced(torch.distributed, "all_to_all_single", all_to_all_single),
    ):
        yield


@contextmanager
def cpu_stand_ins() -> Iterator[None]:
    """The ``vllm._C`` cache ops a CPU build lacks, stood in for."""
    import vllm._custom_ops as ops

    this = sys.modules[__name__]
    with contextlib.ExitStack() as stack:
        for name in STAND_IN_OPS:
            stack.enter_context(replaced(ops, name, getattr(this, name)))
        yield


@contextmanager
def cpu_shims() -> Iterator[None]:
    """What a CPU process lacks for this path, stood in for while a case runs:
    a device type and SM count for the unspecified platform, no pinned host
    memory in the MLA builder, and the ``constexprs`` attribute vLLM's kernel
    launcher reads from Triton's interpreter (see ``tests.support.attention``)."""
    from triton.runtime import interpreter
    from vllm.platforms import current_platform

    from tests.support.attention import _interpreted_constexprs
    from vllm_dcp_geometry.tooling.cpu_stand_ins import (
        MLA_ATTENTION_MODULE,
        disable_pinned_memory,
    )

    def compute_units(*_: Any) -> int:
        return 4

    function = interpreter.InterpretedFunction
    shim = (
        None if hasattr(function, "constexprs") else property(_interpreted_constexprs)
    )
    if shim is not None:
        function.constexprs = shim  # type: ignore[attr-defined]
    restore_pinned_memory = disable_pinned_memory((MLA_ATTENTION_MODULE,))
    try:
        with (
            replaced(current_platform, "device_type", "cpu"),
            replaced(current_platform, "num_compute_units", compute_units),
            cpu_stand_ins(),
            simulated_collectives(),
        ):
            yield
    finally:
        restore_pinned_memory()
        if shim is not None:
            del function.constexprs  # type: ignore[attr-defined]


# Model and batch ------------------------------------------------------------------


def model_dir(dcp: int, shape: Shape = CPU) -> Path:
    return write_deepseek_config(
        dcp * shape.heads_per_rank,
        kv_lora_rank=shape.kv_lora_rank,
        nope_dim=shape.nope_dim,
        rope_dim=shape.rope_dim,
        v_head_dim=shape.v_head_dim,
        dtype=str(shape.dtype).removeprefix("torch."),
        max_position_embeddings=4096,
    )


@dataclass
class Batch:
    """Float64 inputs for every position of every request, all D*h heads."""

    shape: Shape
    kv_c: list[torch.Tensor]  # per request [seq_len, kv_lora_rank]
    k_pe: list[torch.Tensor]  # per request [seq_len, rope_dim]
    q: torch.Tensor  # [num_tokens, D*h, nope_dim + rope_dim]
    kv_b_weight: torch.Tensor  # [D*h*(nope_dim + v_head_dim), kv_lora_rank]
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.q.shape[0]


def make_batch(dcp: int, shard_count: int, seed: int, shape: Shape = CPU) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    heads = dcp * shape.heads_per_rank

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    kv_c = [rand(c + n, shape.kv_lora_rank) for c, n in shape.requests]
    k_pe = [rand(c + n, shape.rope_dim) for c, n in shape.requests]
    q = rand(sum(n for _, n in shape.requests), heads, shape.nope_dim + shape.rope_dim)
    weight = rand(heads * (shape.nope_dim + shape.v_head_dim), shape.kv_lora_rank)
    weight *= shape.kv_lora_rank**-0.5
    blocks = torch.randperm(shape.num_blocks, generator=gen)
    width = cdiv(shape.max_model_len, shape.block_size * shard_count)
    rows = [blocks[i * width : (i + 1) * width] for i in range(len(shape.requests))]
    return Batch(shape, kv_c, k_pe, q, weight, rows)


def reference(batch: Batch) -> dict[str, torch.Tensor]:
    """Float64 single-device MLA: per token the output [H*V], the LSE over
    everything it sees [H], and the LSE over its request's context [H]
    (``vllm_dcp_geometry.tooling.mla_rank_run.mla_reference``)."""
    shape = batch.shape
    return mla_reference(
        batch.kv_c,
        batch.k_pe,
        batch.q,
        batch.kv_b_weight,
        shape.requests,
        nope_dim=shape.nope_dim,
        v_head_dim=shape.v_head_dim,
        scale=shape.scale,
    )


# Ranks ----------------------------------------------------------------------------


@contextmanager
def process_groups(
    dcp: SimulatedGroup, tp: SimulatedGroup | None = None
) -> Iterator[None]:
    """vLLM's DCP and TP groups as the given stand-ins (none exist here)."""
    from vllm.distributed import parallel_state

    saved = parallel_state._DCP, parallel_state._TP
    parallel_state._DCP, parallel_state._TP = dcp, tp  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel_state._DCP, parallel_state._TP = saved


def mla_model_config(
    path: Path,
    dcp: int,
    interleave: int,
    shape: Shape = CPU,
    comm_backend: str = "ag_rs",
    partial_collectives: str | None = None,
) -> Any:
    """The shared test config for the MLA model at ``path`` in ``shape``;
    ``partial_collectives`` sets the plugin's ``dcp_geometry`` key."""
    additional = (
        None
        if partial_collectives is None
        else {"dcp_geometry": {"partial_collectives": partial_collectives}}
    )
    return make_vllm_config(
        dcp,
        interleave=interleave,
        tp=dcp,
        model_dir=path,
        dtype=shape.dtype,
        max_model_len=shape.max_model_len,
        cache_block_size=shape.block_size,
        max_num_seqs=shape.max_num_seqs,
        dcp_comm_backend=comm_backend,
        additional_config=additional,
    )


def mla_spec(
    shard_count: int | None, replicated: bool = False, shape: Shape = CPU
) -> Any:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    # Unpatched vLLM (the baselines) has no dcp_kv_shard_count field.
    extra: dict[str, Any] = {}
    if shard_count is not None:
        extra["dcp_kv_shard_count"] = shard_count
    if replicated:
        extra["dcp_sharded"] = False
    return MLAAttentionSpec(
        block_size=shape.block_size,
        num_kv_heads=1,
        head_size=shape.head_size,
        dtype=shape.dtype,
        **extra,
    )


@dataclass
class Rank:
    rank: int
    interleave: int
    layer: Any
    builder: Any
    kv_cache: torch.Tensor


def process_weights(layer: Any, dtype: torch.dtype) -> None:
    """``layer.process_weights_after_loading``: vLLM 0.33.0's takes the
    activation dtype, 0.34.0's reads the layer's own ``act_dtype``."""
    import inspect

    if len(inspect.signature(layer.process_weights_after_loading).parameters):
        layer.process_weights_after_loading(dtype)
    else:
        layer.process_weights_after_loading()


def make_layer(vllm_config: Any, batch: Batch, rank: int, backend: Any) -> Any:
    # The library's builder post-processes the weights as the installed
    # release takes them (tooling.vllm_release.process_weights_after_loading).
    shape = batch.shape
    return build_mla_layer(
        vllm_config,
        shape,
        kv_b_weight=batch.kv_b_weight,
        rank=rank,
        backend=backend,
        dtype=shape.dtype,
        device=shape.device,
        layer_name=LAYER,
    )


@contextmanager
def gathers_at_load(group: SimulatedGroup) -> Iterator[None]:
    """While one rank's layers are built (ranks are built one after the
    other), the DCP group's ``all_gather`` - vLLM 0.34.0's gathers of
    ``W_UV_dcp`` / ``W_UK_T_dcp_qrep`` at weight load - returns this rank's
    tensor D times, the right shape; ``complete_load_gathers`` then writes
    every rank's tensors in."""

    def all_gather(tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([tensor] * group.world_size, dim=dim)

    with replaced(group, "all_gather", all_gather):
        yield


LOAD_GATHERS = {"W_UV_dcp": "W_UV", "W_UK_T_dcp_qrep": "W_UK_T"}
"""vLLM 0.34.0's weights all-gathered over the DCP ranks at load (dim 0)."""


def complete_load_gathers(layers_by_rank: Sequence[Sequence[Any]]) -> None:
    """What the load-time all-gathers give every rank of a D-rank world
    (``layers_by_rank[r]``: rank r's layers, the same kinds in the same
    order): each rank's weights in DCP rank order. Nothing on 0.33.0."""
    for same in zip(*layers_by_rank, strict=True):
        for gathered, local in LOAD_GATHERS.items():
            if getattr(same[0], gathered, None) is None:
                continue
            value = torch.cat([getattr(layer, local).detach() for layer in same])
            for layer in same:
                getattr(layer, gathered).data.copy_(value)


def write_cache(batch: Batch, shard_count: int, interleave: int, shard: int) -> Any:
    """The rank's paged cache holding its shard of every request, written by
    vLLM's KV-write op (stood in for on CPU) at the contract's slots - what
    the plugin's block tables give the runner."""
    import vllm._custom_ops as ops

    shape = batch.shape
    cache = torch.zeros(
        shape.num_blocks,
        shape.block_size,
        shape.head_size,
        dtype=shape.dtype,
        device=shape.device,
    )
    for i, (context, new) in enumerate(shape.requests):
        slots = reference_slot_mapping(
            range(context + new),
            batch.rows[i],
            block_size=shape.block_size,
            shard_count=shard_count,
            interleave_size=interleave,
            shard=shard,
        )
        ops.concat_and_cache_mla(
            batch.kv_c[i].to(shape.device, shape.dtype),
            batch.k_pe[i].to(shape.device, shape.dtype),
            cache,
            torch.as_tensor(slots, device=shape.device),
            "auto",
            torch.ones((), device=shape.device),
        )
    return cache


def make_ranks(
    batch: Batch,
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    spec: Any,
    backend_name: str = "TRITON_MLA",
    coop: CooperativeRanks | None = None,
    only: Sequence[int] | None = None,
    configure: Callable[[Any], None] | None = None,
    comm_backend: str = "ag_rs",
    partial_collectives: str | None = None,
    replicas_made: bool = True,
    make_replica: Callable[[int], SimulatedGroup] | None = None,
) -> list[Rank]:
    """One rank per DCP rank (or the ranks in ``only``), built as a worker
    builds them (the builder through ``AttentionGroup.create_metadata_builders``).
    ``configure`` may adjust each rank's ``VllmConfig`` before the builder.
    A partial K gets simulated replica groups unless ``partial_collectives``
    is ``"dcp"`` (or ``replicas_made`` is False: none, or the caller's);
    ``make_replica(k)`` makes them instead of ``SimulatedReplica``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.worker.utils import AttentionGroup

    shape = batch.shape
    backend = AttentionBackendEnum[backend_name].get_class()
    path = model_dir(dcp, shape)
    ranks = []
    replicas = [shard_count] if 1 < shard_count < dcp else []
    if partial_collectives == "dcp" or not replicas_made:
        replicas = []
    # The model (weights loaded) on every rank first, as workers load it
    # before their KV caches and builders exist.
    loaded = []
    for r in range(dcp) if only is None else only:
        groups = SimulatedGroup(coop, dcp, r), SimulatedGroup(coop, dcp, r)
        with (
            process_groups(*groups),
            replica_groups_of(groups[0], replicas, make_replica),
            gathers_at_load(groups[0]),
        ):
            vllm_config = mla_model_config(
                path, dcp, interleave, shape, comm_backend, partial_collectives
            )
            layer = make_layer(vllm_config, batch, r, backend)
            if configure is not None:
                configure(vllm_config)
        context = vllm_config.compilation_config.static_forward_context
        loaded.append((r, groups, vllm_config, [layer, context[LAYER]]))
    if only is None:
        complete_load_gathers([layers for *_, layers in loaded])
    for r, groups, vllm_config, (layer, _) in loaded:
        with (
            process_groups(*groups),
            replica_groups_of(groups[0], replicas, make_replica),
        ):
            attn_group = AttentionGroup(backend, [LAYER], spec, 0)
            attn_group.create_metadata_builders(vllm_config, torch.device(shape.device))
        cache = write_cache(batch, shard_count, interleave, r % shard_count)
        builder = attn_group.get_metadata_builder()
        ranks.append(Rank(r, interleave, layer, builder, cache))
    return ranks


def common_metadata(batch: Batch, dcp: int, rank: int, interleave: int) -> Any:
    """The runner's ``CommonAttentionMetadata``: its ``dcp_local_seq_lens`` are
    vLLM's global (D, r) ones, as both model runners compute them."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    shape = batch.shape
    seq_cpu = torch.tensor([c + n for c, n in shape.requests], dtype=torch.int32)
    query = torch.tensor([n for _, n in shape.requests], dtype=torch.int32)
    starts_cpu = torch.zeros(len(shape.requests) + 1, dtype=torch.int32)
    starts_cpu[1:] = query.cumsum(0)
    seq, starts = seq_cpu.to(shape.device), starts_cpu.to(shape.device)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts_cpu,
        seq_lens=seq,
        num_reqs=len(shape.requests),
        num_actual_tokens=batch.num_tokens,
        max_query_len=int(query.max()),
        max_seq_len=int(seq_cpu.max()),
        block_table_tensor=torch.stack(batch.rows).to(shape.device, torch.int32),
        slot_mapping=torch.zeros(
            batch.num_tokens, dtype=torch.int64, device=seq.device
        ),
        dcp_local_seq_lens=get_dcp_local_seq_lens(seq, dcp, rank, interleave),
        seq_lens_cpu_upper_bound=seq_cpu,
    )


# One forward --------------------------------------------------------------------


@dataclass
class RankResult:
    out: torch.Tensor  # [tokens, h * V], this rank's heads
    decode_lse: torch.Tensor | None  # [decode tokens, heads]: combined, or local
    decode_lse_ranks: range  # whose heads it covers: the combine's, else own
    context_lse: torch.Tensor | None  # [h, prefill tokens] merged with new tokens
    metadata: Any


@contextmanager
def recording(
    coop: CooperativeRanks, merge_owner: Any = None
) -> Iterator[dict[int, dict[str, Any]]]:
    """Record, per rank, the LSEs its attention hands on: the DCP combine's
    and the prefill context's (``merge_attn_states`` as ``merge_owner``, by
    default vLLM's MLA module, imported it)."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.ops import dcp

    records: dict[int, dict[str, Any]] = {}
    owner = mla_attention if merge_owner is None else merge_owner

    def mine() -> dict[str, Any]:
        return records.setdefault(coop.local.rank, {})

    correct, merge = dcp.correct_attn_out, owner.merge_attn_states

    def correct_attn_out(*args: Any, **kwargs: Any) -> Any:
        out, lse = correct(*args, **kwargs)
        mine()["combined_lse"] = lse.clone()
        return out, lse

    def merge_attn_states(*args: Any, **kwargs: Any) -> Any:
        mine()["context_lse"] = kwargs["prefix_lse"].clone()
        return merge(*args, **kwargs)

    with (
        replaced(dcp, "correct_attn_out", correct_attn_out),
        replaced(owner, "merge_attn_states", merge_attn_states),
    ):
        yield records


def run_rank(
    batch: Batch,
    layer: Any,
    rank: int,
    records: dict[int, dict[str, Any]],
    call: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """One rank's attention: ``call(output)`` with the layer's impl recording
    the LSE its decode kernel returns; the rank's output."""
    shape = batch.shape
    local_forward_mqa = layer.impl.forward_mqa

    def forward_mqa(*args: Any) -> Any:
        out, lse = local_forward_mqa(*args)
        records.setdefault(rank, {})["local_lse"] = lse
        return out, lse

    output = torch.zeros(
        batch.num_tokens,
        shape.heads_per_rank * shape.v_head_dim,
        dtype=shape.dtype,
        device=shape.device,
    )
    with replaced(layer.impl, "forward_mqa", forward_mqa):
        call(output)
    return output


def forward_inputs(
    batch: Batch, ranks: list[Rank]
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """The new tokens' latent and rope key (all requests), and every rank's
    metadata from its builder's real ``build``."""
    contexts = [c for c, _ in batch.shape.requests]
    new_kv_c = torch.cat([kv[c:] for kv, c in zip(batch.kv_c, contexts, strict=True)])
    new_k_pe = torch.cat([pe[c:] for pe, c in zip(batch.k_pe, contexts, strict=True)])
    dcp = len(ranks)
    metadata = [
        rank.builder.build(0, common_metadata(batch, dcp, rank.rank, rank.interleave))
        for rank in ranks
    ]
    return new_kv_c, new_k_pe, metadata


def rank_results(
    outputs: Sequence[torch.Tensor],
    layers: Sequence[Any],
    records: dict[int, dict[str, Any]],
    metadata: Sequence[Any],
) -> list[RankResult]:
    """Every rank's output with the LSEs its attention handed on: the
    combined decode LSE where the impl runs DCP (the all-to-all combine keeps
    it to itself: None then), else the local one."""
    results = []
    for r, output in enumerate(outputs):
        seen = records.get(r, {})
        # The combine spans the replica (K ranks) or the D-wide group.
        world = layers[r].impl.dcp_world_size
        combined = world > 1
        first = r // world * world
        results.append(
            RankResult(
                out=output,
                decode_lse=seen.get("combined_lse" if combined else "local_lse"),
                decode_lse_ranks=range(first, first + world),
                context_lse=seen.get("context_lse"),
                metadata=metadata[r],
            )
        )
    return results


def forward(
    batch: Batch, ranks: list[Rank], coop: CooperativeRanks
) -> list[RankResult]:
    """Every rank's ``MLAAttention.forward_impl`` over the batch."""
    shape = batch.shape
    new_kv_c, new_k_pe, metadata = forward_inputs(batch, ranks)

    def on_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(shape.device, shape.dtype).contiguous()

    def run(r: int) -> torch.Tensor:
        h = shape.heads_per_rank
        layer = ranks[r].layer

        def call(output: torch.Tensor) -> None:
            layer.forward_impl(
                on_device(batch.q[:, r * h : (r + 1) * h]),
                on_device(new_kv_c),
                on_device(new_k_pe)[:, None, :],
                ranks[r].kv_cache,
                metadata[r],
                output=output,
            )

        return run_rank(batch, layer, r, records, call)

    with recording(coop) as records:
        outputs = coop.run(run)
    return rank_results(outputs, [rank.layer for rank in ranks], records, metadata)


# One (D, K, I) case against the reference ------------------------------------------


def evaluate(batch: Batch, results: list[RankResult]) -> dict[str, Any]:
    """Every rank against the float64 single-device reference: max abs error
    of the output (decode and prefill rows apart), the decode LSE (None where
    the combine does not show it) and the prefill-context LSE."""
    shape = batch.shape
    expected = reference(batch)
    rows = shape.decode_rows
    h, v = shape.heads_per_rank, shape.v_head_dim
    worst: dict[str, float | None] = dict.fromkeys(
        ("decode_out", "prefill_out", "decode_lse", "context_lse"), 0.0
    )
    for r, result in enumerate(results):
        own = slice(r * h, (r + 1) * h)
        error = (
            result.out.double().cpu() - expected["out"][:, r * h * v : (r + 1) * h * v]
        ).abs()
        spanned = result.decode_lse_ranks
        heads = slice(spanned.start * h, spanned.stop * h)
        assert result.context_lse is not None
        errors: dict[str, float | None] = {
            "decode_out": error[:rows].max().item(),
            "prefill_out": error[rows:].max().item(),
            "decode_lse": None
            if result.decode_lse is None
            else max_error(result.decode_lse[:rows], expected["lse"][:rows, heads]),
            "context_lse": max_error(
                result.context_lse.T, expected["context_lse"][rows:, own]
            ),
        }
        for key, value in errors.items():
            seen = worst[key]
            worst[key] = None if value is None or seen is None else max(seen, value)
    return worst


def run_case(
    dcp: int,
    shard_count: int,
    interleave: int,
    *,
    patched: bool,
    shape: Shape = CPU,
    backend_name: str = "TRITON_MLA",
    comm_backend: str = "ag_rs",
    seed: int = 0,
    partial_collectives: str | None = None,
) -> dict[str, Any]:
    """Build the ranks of one (D, K, I) case, run one forward, evaluate it.
    A partial K runs within simulated replica groups (rule A6) unless
    ``partial_collectives`` is ``"dcp"`` (the D-wide group, masked).

    ``patched`` says whether the plugin is registered in this process: the
    spec then carries K; unpatched vLLM gets its own sharded MLA spec, while
    the caches hold K shards as the plugin's block tables write them. On CPU
    the ``cpu_shims`` stand in for what a CPU lacks; on a GPU only the
    collectives are simulated.
    """
    explicit = patched and shard_count != dcp
    batch = make_batch(dcp, shard_count, seed + 97 * dcp + 7 * shard_count, shape)
    coop = CooperativeRanks(dcp)
    setup = cpu_shims() if shape.device == "cpu" else simulated_collectives()
    with setup:
        ranks = make_ranks(
            batch,
            dcp,
            shard_count,
            interleave,
            spec=mla_spec(shard_count if explicit else None, shape=shape),
            backend_name=backend_name,
            coop=coop,
            comm_backend=comm_backend,
            partial_collectives=partial_collectives if patched else None,
        )
        results = forward(batch, ranks, coop)
    report = evaluate(batch, results)
    report["chunks"] = [
        len(result.metadata.prefill.chunked_context.chunks) for result in results
    ]
    report["decode_seq_lens"] = [
        result.metadata.decode.seq_lens.tolist() for result in results
    ]
    return report
