# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One DCP rank of ``vllm-dcp-geometry ranks``: a worker process.

``python -m vllm_dcp_geometry.tooling.cli.ranks.worker PLAN.json RESULT.json``. The
process loads the plugin through vLLM's own plugin loader
(``vllm.plugins.load_general_plugins``: the ``vllm.general_plugins`` entry
point; an unpatched baseline child has ``VLLM_PLUGINS=""``), initialises
vLLM's real distributed state (``init_distributed_environment``,
``initialize_model_parallel`` with TP = DCP = D), then for every MLA group of
the plan builds the rank's real ``MLAAttention`` layer (TRITON_MLA impl; on
CPU the ``cpu_sdpa`` prefill backend) and its builder through
``AttentionGroup.create_metadata_builders``, writes the rank's shard of random
K/V at the contract's slot mapping for the group's K (the KV-cache write op,
stood in for on CPU), and runs ``MLAAttention.forward_impl`` twice: a decode
step and a chunked prefill over a context, with vLLM's real collectives over
the real DCP ``GroupCoordinator``. Every collective through the DCP group is
counted (``Traffic``). The rank's output and LSEs are compared with the
float64 single-device reference; the result file holds the errors and bytes.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.contract.collectives import collective_bytes
from vllm_dcp_geometry.contract.overrides import (
    CONFIG_KEY,
    LAYERS_KEY,
    PARTIAL_COLLECTIVES_KEY,
)
from vllm_dcp_geometry.tooling.cli.ranks import cpu
from vllm_dcp_geometry.tooling.cli.ranks.cases import (
    Shape,
    decode_requests,
    prefill_requests,
)
from vllm_dcp_geometry.tooling.mla_rank_run import (
    STAND_IN_OPS,
    build_mla_layer,
    max_error,
    mla_reference,
    write_deepseek_config,
)

LAYER = "model.layers.0.self_attn.attn"


# Collective traffic -------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes this rank sent plus received through the DCP group, by
    collective, counted at vLLM's ``GroupCoordinator`` methods and at the
    ``torch.distributed`` calls vLLM makes on the DCP device group directly
    (the context KV gather, the all-to-all combine); the model of one call
    is ``collectives.collective_bytes``."""

    counting: bool = False
    total: int = 0
    calls: int = 0

    def __post_init__(self) -> None:
        self.by_op: dict[str, int] = {}
        self.worlds: set[int] = set()
        self._inside = threading.local()

    def add(self, op: str, world: int, tensor: Any) -> None:
        depth: int = getattr(self._inside, "depth", 0)
        if not self.counting or depth > 0:
            return
        moved = collective_bytes(op, world, tensor.numel() * tensor.element_size())
        self.by_op[op] = self.by_op.get(op, 0) + moved
        self.total += moved
        self.calls += 1
        self.worlds.add(world)

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            yield
        finally:
            self._inside.depth -= 1

    def reset(self) -> None:
        self.total = self.calls = 0
        self.by_op = {}
        self.worlds = set()


def install_traffic_counter(traffic: Traffic) -> None:
    """Wrap ``GroupCoordinator.all_gather/reduce_scatter/all_reduce`` (for
    the DCP group and the replica groups) and
    ``torch.distributed.all_gather_into_tensor`` / ``all_to_all_single`` (on
    their device groups) to count into ``traffic``. Installed before any
    builder exists: the MLA builder binds the KV gather function when it is
    made."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from vllm_dcp_geometry.runtime.replica_groups import made_replica_groups

    coordinator = parallel_state.GroupCoordinator

    def counted_groups() -> list[Any]:
        groups = [parallel_state._DCP, *made_replica_groups().values()]
        return [g for g in groups if g is not None]

    def wrap_method(name: str) -> None:
        original = getattr(coordinator, name)

        def counted(self: Any, input_: Any, *args: Any, **kwargs: Any) -> Any:
            if any(self is g for g in counted_groups()):
                traffic.add(name, self.world_size, input_)
            with traffic.inside():
                return original(self, input_, *args, **kwargs)

        setattr(coordinator, name, counted)

    for name in ("all_gather", "reduce_scatter", "all_reduce"):
        wrap_method(name)

    def wrap_function(name: str, local_arg: int) -> None:
        original = getattr(dist, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            for owner in counted_groups():
                if group is owner.device_group:
                    traffic.add(name, owner.world_size, args[local_arg])
            with traffic.inside():
                return original(*args, **kwargs)

        setattr(dist, name, counted)

    wrap_function("all_gather_into_tensor", 1)
    wrap_function("all_to_all_single", 1)


# vLLM set-up ---------------------------------------------------------------------


def model_dir(world: int, shape: Shape) -> Path:
    """A DeepSeek-V3-shaped Hugging Face config (no weights) with ``world``
    times ``heads_per_rank`` attention heads."""
    return write_deepseek_config(
        world * shape.heads_per_rank,
        kv_lora_rank=shape.kv_lora_rank,
        nope_dim=shape.nope_dim,
        rope_dim=shape.rope_dim,
        v_head_dim=shape.v_head_dim,
        dtype=shape.dtype,
        max_position_embeddings=8192,
        prefix="vllm_dcp_geometry_ranks_",
    )


def vllm_config(
    path: Path,
    world: int,
    interleave: int,
    block_size: int,
    shape: Shape,
    device: str,
    partial_collectives: str | None = None,
) -> Any:
    """A real ``VllmConfig``: TP = DCP = ``world``, the group's block size,
    and (patched) where partial groups run their collectives."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    length = shape.max_model_len
    return VllmConfig(
        parallel_config=ParallelConfig(
            tensor_parallel_size=world,
            decode_context_parallel_size=world,
            cp_kv_cache_interleave_size=interleave,
        ),
        cache_config=CacheConfig(block_size=block_size),
        model_config=ModelConfig(
            model=str(path),
            skip_tokenizer_init=True,
            dtype=shape.dtype,
            max_model_len=length,
        ),
        scheduler_config=SchedulerConfig(
            max_model_len=length,
            is_encoder_decoder=False,
            max_num_seqs=shape.max_num_seqs,
            max_num_batched_tokens=length * shape.max_num_seqs,
        ),
        device_config=DeviceConfig(device=device),
        additional_config=(
            {}
            if partial_collectives is None
            else {CONFIG_KEY: {PARTIAL_COLLECTIVES_KEY: partial_collectives}}
        ),
    )


def _constexpr_indices(self: Any) -> list[int]:
    """The indices of a Triton function's ``tl.constexpr`` parameters, what
    vLLM's kernel launcher reads as ``kernel.constexprs`` (the interpreter's
    function object has no such attribute)."""
    import inspect

    parameters = inspect.signature(self.fn).parameters.values()
    return [i for i, p in enumerate(parameters) if "constexpr" in str(p.annotation)]


def cpu_stand_ins() -> list[str]:
    """What this CPU process lacks for vLLM's MLA path, stood in for, for the
    rest of the process: the three ``vllm._C`` cache ops (the library's torch
    stand-ins), a device type and SM count for the unspecified platform, no
    pinned host memory, and ``constexprs`` on Triton's interpreted functions.
    Returns the stand-in op names."""
    import vllm._custom_ops as ops
    from triton.runtime import interpreter
    from vllm.platforms import current_platform

    from vllm_dcp_geometry.tooling import mla_rank_run

    for name in STAND_IN_OPS:
        setattr(ops, name, getattr(mla_rank_run, name))
    current_platform.device_type = "cpu"
    current_platform.num_compute_units = lambda *_: 4  # type: ignore[method-assign]
    cpu.disable_pinned_memory()
    function: Any = interpreter.InterpretedFunction
    if not hasattr(function, "constexprs"):
        function.constexprs = property(_constexpr_indices)
    return [f"vllm._custom_ops.{name}" for name in STAND_IN_OPS]


# One group -----------------------------------------------------------------------


@dataclass
class Inputs:
    """Float64 inputs of one forward, identical on every rank (one seed)."""

    requests: list[tuple[int, int]]
    kv_c: list[Any]
    k_pe: list[Any]
    q: Any
    rows: list[Any]


def make_inputs(
    requests: list[tuple[int, int]],
    weight_heads: int,
    shape: Shape,
    num_blocks: int,
    width: int,
    seed: int,
) -> Inputs:
    import torch

    gen = torch.Generator().manual_seed(seed)

    def rand(*size: int) -> Any:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    kv_c = [rand(c + n, shape.kv_lora_rank) for c, n in requests]
    k_pe = [rand(c + n, shape.rope_dim) for c, n in requests]
    tokens = sum(n for _, n in requests)
    q = rand(tokens, weight_heads, shape.nope_dim + shape.rope_dim)
    blocks = torch.randperm(num_blocks, generator=gen)
    rows = [blocks[i * width : (i + 1) * width] for i in range(len(requests))]
    return Inputs(list(requests), kv_c, k_pe, q, rows)


def group_spec(group: dict[str, Any], shape: Shape, patched: bool) -> Any:
    """The group's ``MLAAttentionSpec`` at the run's (scaled-down) head size
    and dtype, with the topology's block size, sharding and K."""
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    extra: dict[str, Any] = {}
    if patched and group["dcp_kv_shard_count"] is not None:
        extra["dcp_kv_shard_count"] = group["dcp_kv_shard_count"]
    return MLAAttentionSpec(
        block_size=group["block_size"],
        num_kv_heads=1,
        head_size=shape.kv_lora_rank + shape.rope_dim,
        dtype=getattr(torch, shape.dtype),
        dcp_sharded=group["dcp_sharded"],
        is_draft=group["draft"],
        **extra,
    )


def build_layer(config: Any, weight: Any, rank: int, shape: Shape, device: str) -> Any:
    """The rank's ``MLAAttention`` (TRITON_MLA) with its slice of
    ``kv_b_proj`` (a real ``ColumnParallelLinear`` over the TP group)."""
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum["TRITON_MLA"].get_class()
    layer = build_mla_layer(
        config,
        shape,
        kv_b_weight=weight,
        rank=rank,
        backend=backend,
        dtype=getattr(torch, shape.dtype),
        device=device,
        layer_name=LAYER,
    )
    return layer, backend


def group_slots(
    inputs: Inputs,
    block_size: int,
    shard_count: int,
    interleave: int,
    shard: int,
    positions: Callable[[int, int], range],
) -> list[Any]:
    """Per request, the contract's slot of each position in ``positions(c,
    n)`` on ``shard`` (-1 where another shard owns it)."""
    return [
        reference_slot_mapping(
            positions(context, new),
            inputs.rows[i],
            block_size=block_size,
            shard_count=shard_count,
            interleave_size=interleave,
            shard=shard,
        )
        for i, (context, new) in enumerate(inputs.requests)
    ]


def write_cache(
    inputs: Inputs, group: dict[str, Any], shape: Shape, num_blocks: int, device: str
) -> Any:
    """The rank's paged cache with its shard of every position, written by
    vLLM's KV-write op (``concat_and_cache_mla``) at the contract's slots."""
    import torch
    import vllm._custom_ops as ops

    dtype = getattr(torch, shape.dtype)
    block = group["block_size"]
    cache = torch.zeros(num_blocks, block, shape.kv_lora_rank + shape.rope_dim)
    cache = cache.to(device, dtype)
    slots = group_slots(
        inputs,
        block,
        group["shard_count"],
        group["interleave"],
        group["shard"],
        lambda c, n: range(c + n),
    )
    for i, row_slots in enumerate(slots):
        ops.concat_and_cache_mla(
            inputs.kv_c[i].to(device, dtype),
            inputs.k_pe[i].to(device, dtype),
            cache,
            torch.as_tensor(row_slots, device=device),
            "auto",
            torch.ones((), device=device),
        )
    return cache


def common_metadata(
    inputs: Inputs,
    group: dict[str, Any],
    world: int,
    rank: int,
    device: str,
    slots: Any,
) -> Any:
    """The runner's ``CommonAttentionMetadata`` (vLLM's global (D, r) local
    lengths, as both model runners compute them)."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    requests = inputs.requests
    seq_cpu = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    query = torch.tensor([n for _, n in requests], dtype=torch.int32)
    starts_cpu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    starts_cpu[1:] = query.cumsum(0)
    seq = seq_cpu.to(device)
    return CommonAttentionMetadata(
        query_start_loc=starts_cpu.to(device),
        query_start_loc_cpu=starts_cpu,
        seq_lens=seq,
        num_reqs=len(requests),
        num_actual_tokens=int(query.sum()),
        max_query_len=int(query.max()),
        max_seq_len=int(seq_cpu.max()),
        block_table_tensor=torch.stack(inputs.rows).to(device, torch.int32),
        slot_mapping=slots.to(device),
        dcp_local_seq_lens=get_dcp_local_seq_lens(
            seq, world, rank, group["interleave"]
        ),
        seq_lens_cpu_upper_bound=seq_cpu,
    )


@contextlib.contextmanager
def lse_recording(layer: Any) -> Iterator[dict[str, Any]]:
    """The LSEs the rank's attention hands on: the decode kernel's own
    (``forward_mqa``), the DCP combine's (``correct_attn_out``) and the
    prefill context's (``merge_attn_states``)."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.v1.attention.ops import dcp

    seen: dict[str, Any] = {}
    correct, merge = dcp.correct_attn_out, mla_attention.merge_attn_states
    local_forward_mqa = layer.impl.forward_mqa

    def correct_attn_out(*args: Any, **kwargs: Any) -> Any:
        out, lse = correct(*args, **kwargs)
        seen["combined_lse"] = lse.clone()
        return out, lse

    def merge_attn_states(*args: Any, **kwargs: Any) -> Any:
        seen["context_lse"] = kwargs["prefix_lse"].clone()
        return merge(*args, **kwargs)

    def forward_mqa(*args: Any) -> Any:
        out, lse = local_forward_mqa(*args)
        seen["local_lse"] = lse
        return out, lse

    dcp.correct_attn_out = correct_attn_out
    mla_attention.merge_attn_states = merge_attn_states
    layer.impl.forward_mqa = forward_mqa
    try:
        yield seen
    finally:
        dcp.correct_attn_out = correct
        mla_attention.merge_attn_states = merge
        layer.impl.forward_mqa = local_forward_mqa


def run_forward(
    inputs: Inputs,
    layer: Any,
    builder: Any,
    group: dict[str, Any],
    ctx: dict[str, Any],
) -> tuple[Any, dict[str, Any], Any]:
    """One ``MLAAttention.forward_impl`` of this rank over ``inputs``: its
    output [tokens, h * V], the LSEs it handed on, its metadata."""
    import torch

    shape: Shape = ctx["shape"]
    device, world, rank = ctx["device"], ctx["world"], ctx["rank"]
    dtype = getattr(torch, shape.dtype)
    new = group_slots(
        inputs,
        group["block_size"],
        group["shard_count"],
        group["interleave"],
        group["shard"],
        lambda c, n: range(c, c + n),
    )
    slots = torch.as_tensor([s for row in new for s in row], dtype=torch.int64)
    metadata = builder.build(
        0, common_metadata(inputs, group, world, rank, device, slots)
    )
    contexts = [c for c, _ in inputs.requests]
    kv_c = torch.cat([kv[c:] for kv, c in zip(inputs.kv_c, contexts, strict=True)])
    k_pe = torch.cat([pe[c:] for pe, c in zip(inputs.k_pe, contexts, strict=True)])
    h = shape.heads_per_rank

    def on_device(tensor: Any) -> Any:
        return tensor.to(device, dtype).contiguous()

    output = torch.zeros(
        inputs.q.shape[0], h * shape.v_head_dim, dtype=dtype, device=device
    )
    with lse_recording(layer) as seen:
        layer.forward_impl(
            on_device(inputs.q[:, rank * h : (rank + 1) * h]),
            on_device(kv_c),
            on_device(k_pe)[:, None, :],
            ctx["cache"],
            metadata,
            output=output,
        )
    return output, seen, metadata


def run_group(group: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Build and run one MLA group on this rank; its errors and traffic."""
    import torch
    from vllm.v1.worker.utils import AttentionGroup

    shape: Shape = ctx["shape"]
    world, rank, device = ctx["world"], ctx["rank"], ctx["device"]
    traffic: Traffic = ctx["traffic"]
    k, block = group["shard_count"], group["block_size"]
    group = {**group, "shard": GroupGeometry(group["name"], k, world, rank).shard}
    heads = world * shape.heads_per_rank
    gen = torch.Generator().manual_seed(ctx["seed"] + 7919 * group["index"])
    weight = torch.randn(
        heads * (shape.nope_dim + shape.v_head_dim),
        shape.kv_lora_rank,
        generator=gen,
        dtype=torch.float64,
    )
    weight *= shape.kv_lora_rank**-0.5
    length = shape.max_model_len
    width = cdiv(length, block * k)
    cases = {
        "decode": decode_requests(block, k, world, shape),
        "prefill": prefill_requests(block, k, world, shape),
    }
    num_blocks = width * max(len(r) for r in cases.values()) + 1
    config = vllm_config(
        ctx["model_dir"],
        world,
        group["interleave"],
        block,
        shape,
        device,
        ctx["partial_collectives"],
    )
    layer, backend = build_layer(config, weight, rank, shape, device)
    spec = group_spec(group, shape, ctx["patched"])
    attn_group = AttentionGroup(backend, [LAYER], spec, 0)
    attn_group.create_metadata_builders(config, torch.device(device))
    builder = attn_group.get_metadata_builder()
    report: dict[str, Any] = {"name": group["name"]}
    h, v = shape.heads_per_rank, shape.v_head_dim
    for phase, requests in cases.items():
        inputs = make_inputs(
            requests,
            heads,
            shape,
            num_blocks,
            width,
            ctx["seed"] + 31 * group["index"] + len(phase),
        )
        ctx["cache"] = write_cache(inputs, group, shape, num_blocks, device)
        traffic.reset()
        traffic.counting = True
        try:
            output, seen, _ = run_forward(inputs, layer, builder, group, ctx)
        finally:
            traffic.counting = False
        expected = mla_reference(
            inputs.kv_c,
            inputs.k_pe,
            inputs.q,
            weight,
            inputs.requests,
            nope_dim=shape.nope_dim,
            v_head_dim=v,
            scale=shape.scale,
        )
        want = expected["out"][:, rank * h * v : (rank + 1) * h * v]
        out_error = max_error(output, want)
        lse_error: float | None = None
        if phase == "decode":
            # The combine's LSE covers the query heads of every rank its
            # collectives span (the replica's, or all D); a local one its own.
            w = layer.impl.dcp_world_size
            combined = w > 1
            got = seen.get("combined_lse" if combined else "local_lse")
            first = rank // w * w
            heads_seen = slice(first * h, (first + w) * h)
            if got is not None:
                lse_error = max_error(got, expected["lse"][:, heads_seen])
            report["decode_tokens"] = inputs.q.shape[0]
            report["impl_dcp_world_size"] = int(layer.impl.dcp_world_size)
        else:
            got = seen.get("context_lse")
            own = slice(rank * h, (rank + 1) * h)
            if got is not None:
                lse_error = max_error(got.T, expected["context_lse"][:, own])
        report[f"{phase}_max_abs_error"] = out_error
        report[f"{phase}_max_lse_error"] = lse_error
        report[f"{phase}_bytes"] = traffic.total
        report[f"{phase}_bytes_by_op"] = dict(traffic.by_op)
        report[f"{phase}_collective_calls"] = traffic.calls
        report[f"{phase}_collective_worlds"] = sorted(traffic.worlds)
    return report


# The process ---------------------------------------------------------------------


def make_replica_groups(
    plan: dict[str, Any], shape: Shape, path: Path, device: str
) -> tuple[int, ...]:
    """What every ``vllm serve`` worker does once its distributed state
    exists (the ``Worker.init_device`` patch): ``replica_groups.make_replica_groups``
    on a real ``VllmConfig`` whose overrides give each group of the plan its
    K, as an operator's would; the K made."""
    from vllm_dcp_geometry.runtime.replica_groups import (
        make_replica_groups as at_init_device,
    )

    config = vllm_config(path, plan["world"], 1, 16, shape, device)
    config.additional_config = {
        CONFIG_KEY: {
            LAYERS_KEY: {
                f"{LAYER}.{g['index']}": g["shard_count"] for g in plan["groups"]
            },
            PARTIAL_COLLECTIVES_KEY: plan["partial_collectives"],
        }
    }
    return at_init_device(config)


def run_rank(plan: dict[str, Any]) -> dict[str, Any]:
    """This rank's whole run, from its plan; a JSON-ready result."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_dcp_geometry.tooling import vllm_objects

    patched = vllm_objects.is_vllm_patched()
    world, rank = plan["world"], plan["rank"]
    shape = Shape(**plan["shape"])
    device = plan["device"]
    stand_ins = cpu_stand_ins() if device == "cpu" else []
    if device != "cpu":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    path = model_dir(world, shape)
    config = vllm_config(path, world, 1, 16, shape, device)
    traffic = Traffic()
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world,
            rank,
            f"tcp://127.0.0.1:{plan['port']}",
            rank,
            backend=plan["backend"],
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=world,
            decode_context_model_parallel_size=world,
        )
    install_traffic_counter(traffic)
    dcp = parallel_state.get_dcp_group()
    made = make_replica_groups(plan, shape, path, device) if patched else ()
    ctx = {
        "shape": shape,
        "world": world,
        "rank": rank,
        "device": device,
        "traffic": traffic,
        "seed": plan["seed"],
        "model_dir": path,
        "patched": patched,
        "partial_collectives": plan["partial_collectives"] if patched else None,
    }
    groups = [run_group(group, ctx) for group in plan["groups"]]
    if patched:
        from vllm_dcp_geometry.runtime.replica_groups import destroy_replica_groups

        destroy_replica_groups()
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    return {
        "rank": rank,
        "patched": patched,
        "dcp_group": {
            "class": type(dcp).__name__,
            "world_size": dcp.world_size,
            "rank_in_group": dcp.rank_in_group,
            "backend": plan["backend"],
        },
        "stand_ins": stand_ins,
        "replica_groups": list(made),
        "groups": groups,
    }


def main(argv: list[str]) -> int:
    plan_path, result_path = argv
    with open(plan_path, encoding="utf-8") as fh:
        plan = json.load(fh)
    result = run_rank(plan)
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
