# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""D simulated DCP ranks running vLLM's real MLA attention on CPU.

Every rank gets its own ``VllmConfig``, a real ``MLAAttention`` layer (TRITON_MLA
impl, the ``cpu_sdpa`` prefill backend, the layer's ``MLADCPManager``) and a
real metadata builder made by ``AttentionGroup.create_metadata_builders``. The
ranks run ``MLAAttention.forward_impl`` in cooperative threads - one runs at a
time; they hand over only inside a collective - so the real query all-gather,
LSE combine (``correct_attn_out``, interpreted) and context KV all-gather see
their peers. Only what a CPU lacks is stood in for: the DCP/TP process groups
(the collectives), and three ``vllm._C`` cache ops (the KV write and the two
context gathers), each checked against the contract in ``test_mla_stand_ins``.

Importable without the plugin, so the unpatched baseline runs the very same
code in a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_dcp_geometry.contract import cdiv


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


# Stand-ins for vllm._C cache ops (see test_mla_stand_ins) ---------------------------


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, *a):
    """``vllm._C`` KV write: row ``slot`` of the flattened paged cache gets
    ``[kv_c, k_pe]``; ``PAD_SLOT_ID`` (< 0) writes nothing."""
    assert kv_cache_dtype == "auto"
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    mine = slot_mapping >= 0
    rows = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
    flat[slot_mapping[mine].long()] = rows[mine].to(flat.dtype)


def _gather_rows(src_cache, block_row, start: int, count: int) -> torch.Tensor:
    tokens = torch.arange(start, start + count)
    blocks = block_row[tokens // src_cache.shape[1]].long()
    return src_cache[blocks, tokens % src_cache.shape[1]]


def cp_gather_cache(
    src_cache, dst, block_table, cu_seq_lens, batch_size, seq_starts=None
):
    """``vllm._C`` gather: ``dst[cu[b] + i] = cache[token starts[b] + i of
    request b]``, tokens numbered in the rank's own (local) order."""
    for b in range(batch_size):
        lo, hi = int(cu_seq_lens[b]), int(cu_seq_lens[b + 1])
        start = 0 if seq_starts is None else int(seq_starts[b])
        dst[lo:hi] = _gather_rows(src_cache, block_table[b], start, hi - lo)


def gather_and_maybe_dequant_cache(
    src_cache, dst, block_table, cu_seq_lens, token_to_seq, num_tokens,
    kv_cache_dtype, scale, seq_starts=None,
):  # fmt: skip
    """``vllm._C`` gather of the DCP1 context path; its kernel takes chunk
    starts in whole blocks, so an unaligned start is an error here too."""
    assert kv_cache_dtype == "auto"
    for b in range(cu_seq_lens.shape[0] - 1):
        lo, hi = int(cu_seq_lens[b]), min(int(cu_seq_lens[b + 1]), num_tokens)
        start = 0 if seq_starts is None else int(seq_starts[b])
        assert start % src_cache.shape[1] == 0, "unaligned chunk start"
        if hi > lo:
            dst[lo:hi] = _gather_rows(src_cache, block_table[b], start, hi - lo)


# CPU set-up ----------------------------------------------------------------------


@contextmanager
def replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


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
        for name in (
            "concat_and_cache_mla",
            "cp_gather_cache",
            "gather_and_maybe_dequant_cache",
        ):
            stack.enter_context(replaced(ops, name, getattr(this, name)))
        yield


@contextmanager
def cpu_shims() -> Iterator[None]:
    """What a CPU process lacks for this path, stood in for while a case runs:
    a device type and SM count for the unspecified platform, no pinned host
    memory in the MLA builder, and the ``constexprs`` attribute vLLM's kernel
    launcher reads from Triton's interpreter (see ``tests.attention_support``)."""
    from triton.runtime import interpreter
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.platforms import current_platform

    from tests.attention_support import _interpreted_constexprs

    def compute_units(*_: Any) -> int:
        return 4

    function = interpreter.InterpretedFunction
    shim = (
        None if hasattr(function, "constexprs") else property(_interpreted_constexprs)
    )
    if shim is not None:
        function.constexprs = shim  # type: ignore[attr-defined]
    try:
        with (
            replaced(current_platform, "device_type", "cpu"),
            replaced(current_platform, "num_compute_units", compute_units),
            replaced(mla_attention, "PIN_MEMORY", False),
            cpu_stand_ins(),
            simulated_collectives(),
        ):
            yield
    finally:
        if shim is not None:
            del function.constexprs  # type: ignore[attr-defined]


# Model and batch ------------------------------------------------------------------


def model_dir(dcp: int, shape: Shape = CPU) -> Path:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "num_attention_heads": dcp * shape.heads_per_rank,
        "num_key_value_heads": dcp * shape.heads_per_rank,
        "num_hidden_layers": 1,
        "vocab_size": 128,
        "max_position_embeddings": 4096,
        "torch_dtype": str(shape.dtype).removeprefix("torch."),
        "kv_lora_rank": shape.kv_lora_rank,
        "q_lora_rank": None,
        "qk_nope_head_dim": shape.nope_dim,
        "qk_rope_head_dim": shape.rope_dim,
        "v_head_dim": shape.v_head_dim,
    }
    path = Path(tempfile.mkdtemp(prefix="vllm_dcp_geometry_mla_"))
    (path / "config.json").write_text(json.dumps(config))
    return path


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
    everything it sees [H], and the LSE over its request's context [H]."""
    shape = batch.shape
    heads = batch.q.shape[1]
    outs, lses, context_lses, t = [], [], [], 0
    for i, (context, new) in enumerate(shape.requests):
        kv = batch.kv_c[i] @ batch.kv_b_weight.T
        kv = kv.view(-1, heads, shape.nope_dim + shape.v_head_dim)
        k_nope, v = kv.split([shape.nope_dim, shape.v_head_dim], dim=-1)
        k_pe = batch.k_pe[i][:, None, :].expand(-1, heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        for j in range(new):
            seen = context + j + 1
            scores = torch.einsum("hd,shd->hs", batch.q[t], k[:seen]) * shape.scale
            outs.append(torch.einsum("hs,shv->hv", scores.softmax(-1), v[:seen]))
            lses.append(scores.logsumexp(-1))
            context_lses.append(scores[:, :context].logsumexp(-1))
            t += 1
    return {
        "out": torch.stack(outs).flatten(1),
        "lse": torch.stack(lses),
        "context_lse": torch.stack(context_lses),
    }
