# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM's real MLA attention over D simulated DCP ranks on CPU
(``simulated_collectives``): the harness's sizes (``Shape``, ``CPU``) and
batches, stand-ins for the three ``vllm._C`` cache ops a CPU build lacks
(checked against the contract in ``test_mla_stand_ins``), and each rank's
real ``MLAAttention`` layer, TRITON_MLA impl, ``cpu_sdpa`` prefill backend and
builder made by ``AttentionGroup.create_metadata_builders``. One forward and a
case against the float64 reference are in ``mla_forward``. Importable without
the plugin, so the unpatched baseline runs the very same code in a fresh
process.

vLLM 0.34.0: every rank's model is loaded before any builder is made, as a
worker does, so the weights 0.34.0 all-gathers over the DCP ranks at load
(``W_UV_dcp``, ``W_UK_T_dcp_qrep``) hold every rank's (``gathers_at_load``,
``complete_load_gathers``) before the plugin's binding sees the layers.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
    replica_groups_of,
    simulated_collectives,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import cdiv, reference_slot_mapping
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced as replaced
from vllm_dcp_geometry.tooling.custom_op_stand_ins import STAND_IN_OPS
from vllm_dcp_geometry.tooling.mla_rank_run import (
    build_mla_layer,
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


# Stand-ins for vllm._C cache ops (see test_mla_stand_ins): the library's
# (``vllm_dcp_geometry.tooling.cpu_stand_ins``), which ``vllm-dcp-geometry ranks`` uses too.


# CPU set-up ----------------------------------------------------------------------


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
