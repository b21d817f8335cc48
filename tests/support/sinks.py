# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""FlashAttention with attention sinks over D simulated DCP ranks, and the
float64 single-device reference it is held to (rule A7).

Each rank holds a real ``Attention`` layer with its own heads' sinks (as
gpt-oss's layers pass them), its builder made by
``AttentionGroup.create_metadata_builders`` (so the plugin binds the impl to
the group's K), real metadata from that builder, and a paged cache written
with the contract's slot mapping for its shard. The real
``FlashAttentionImpl.forward`` runs on every rank in cooperative threads
(``tests.support.simulated_collectives``): only the DCP collectives are
simulated. On CPU the
FlashAttention kernel (no CPU build) is the tooling's ``varlen_attention``
(``flash_attn_stand_ins``), a float64 stand-in that honours ``s_aux`` as
FlashAttention does; on a CUDA device
(``Setup.on_device``) every kernel is the real one. Importable without the
plugin.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
    replica_groups_of,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.tooling.flash_attn_stand_ins import varlen_attention

HEADS = 2  # query heads per rank, one KV head (gpt-oss at TP32: 2 and 1)
# (context, new tokens), decodes first as vLLM orders a batch: decodes over
# long, short and one-token contexts, a prefill chunk over context and a
# first prefill chunk with none.
MIXED = ((29, 1), (6, 1), (1, 1), (11, 3), (0, 4))
# First chunks only: the DCP path's no-context branch.
FIRST_CHUNKS = ((0, 3), (0, 1))


@dataclass(frozen=True)
class Setup:
    """Sizes, device and dtype of one run."""

    head_size: int = 16
    block_size: int = 4
    num_blocks: int = 64
    scale_requests: int = 1
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    @property
    def on_device(self) -> bool:
        return self.device != "cpu"

    @property
    def scale(self) -> float:
        return float(self.head_size**-0.5)

    def requests(self, base: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
        return [(c * self.scale_requests, n) for c, n in base]


CPU = Setup()
# gpt-oss's head size and vLLM's FlashAttention block size, in bfloat16.
GPU = Setup(
    head_size=64,
    block_size=16,
    num_blocks=256,
    scale_requests=16,
    device="cuda",
    dtype=torch.bfloat16,
)


@dataclass
class Batch:
    requests: list[tuple[int, int]]
    keys: list[torch.Tensor]  # per request [context + new, head_size], float64
    values: list[torch.Tensor]
    queries: torch.Tensor  # [T, D * HEADS, head_size], float64
    sinks: torch.Tensor  # [D * HEADS], float64


def make_batch(
    dcp: int, requests: list[tuple[int, int]], seed: int, setup: Setup
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    d = setup.head_size

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    num_tokens = sum(n for _, n in requests)
    # Sinks of either sign and of the scores' size, so they matter.
    return Batch(
        requests=requests,
        keys=[rand(c + n, d) for c, n in requests],
        values=[rand(c + n, d) for c, n in requests],
        queries=rand(num_tokens, dcp * HEADS, d),
        sinks=rand(dcp * HEADS) * 2,
    )


def reference(batch: Batch, setup: Setup, *, sinks: bool = True) -> torch.Tensor:
    """Float64 single-device causal attention (with the sinks), every head."""
    outs, t = [], 0
    for i, (context, new) in enumerate(batch.requests):
        for j in range(new):
            k = batch.keys[i][: context + j + 1]
            v = batch.values[i][: context + j + 1]
            scores = batch.queries[t] @ k.T * setup.scale  # [heads, n]
            denominator = scores
            if sinks:
                denominator = torch.cat([scores, batch.sinks[:, None]], dim=-1)
            weights = torch.exp(scores - torch.logsumexp(denominator, -1)[:, None])
            outs.append(weights @ v)
            t += 1
    return torch.stack(outs)


def max_error(
    outputs: list[torch.Tensor], batch: Batch, setup: Setup, *, sinks: bool = True
) -> float:
    """The largest error of any rank's output for its own heads."""
    expected = reference(batch, setup, sinks=sinks)
    return max(
        (out.double().cpu() - expected[:, r * HEADS : (r + 1) * HEADS])
        .abs()
        .max()
        .item()
        for r, out in enumerate(outputs)
    )


class PerRankWorkspace:
    """vLLM's workspace is one buffer per process; threads standing in for
    processes each need their own."""

    def __init__(self, device: str) -> None:
        self.device = device

    def get_simultaneous(self, *specs: tuple[tuple[int, ...], torch.dtype]) -> Any:
        return [torch.empty(s, dtype=t, device=self.device) for s, t in specs]


def _spec(setup: Setup, dcp: int, shard_count: int) -> Any:
    """A full-attention spec with the DCP fields an override of K writes
    (the contract's ``target_geometry``, as start-up applies it)."""
    import dataclasses as dc

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_dcp_geometry.contract.overrides import (
        LayerKind,
        LayerOverride,
        target_geometry,
    )

    geometry = target_geometry(
        "sinks",
        LayerOverride("sinks", shard_count),
        LayerKind.FULL_ATTENTION,
        dcp_world_size=dcp,
    )
    assert geometry is not None
    return FullAttentionSpec(
        block_size=setup.block_size,
        num_kv_heads=1,
        head_size=setup.head_size,
        dtype=setup.dtype,
        **dc.asdict(geometry),
    )


def _write_cache(
    batch: Batch, setup: Setup, table: torch.Tensor, shard_count: int, shard: int
) -> torch.Tensor:
    """A rank's FlashAttention cache, ``[blocks, KV heads, block, 2d]`` as
    vLLM lays it out, holding its shard of every position."""
    d = setup.head_size
    kv_cache = torch.zeros(setup.num_blocks, setup.block_size, 1, 2 * d)
    rows = kv_cache.view(-1, 2 * d)
    for i, (context, new) in enumerate(batch.requests):
        slots = torch.as_tensor(
            reference_slot_mapping(
                range(context + new),
                table[i].tolist(),
                block_size=setup.block_size,
                shard_count=shard_count,
                interleave_size=1,
                shard=shard,
            )
        )
        mine = slots >= 0
        rows[slots[mine], :d] = batch.keys[i][mine].float()
        rows[slots[mine], d:] = batch.values[i][mine].float()
    return kv_cache.transpose(1, 2).to(setup.device, setup.dtype)


def _stand_in_kernels(monkeypatch: pytest.MonkeyPatch, setup: Setup) -> None:
    """Off a GPU, FlashAttention's kernel and its sinks support stood in for;
    on every device, a workspace per rank."""
    from vllm.v1.attention.backends import flash_attn

    if not setup.on_device:
        monkeypatch.setattr(
            flash_attn, "flash_attn_supports_sinks", lambda: True, raising=False
        )
        monkeypatch.setattr(
            flash_attn, "flash_attn_varlen_func", varlen_attention, raising=False
        )
        # K = 1 runs the single-device path, through FA4's dispatcher, which
        # ends in the same kernel.
        monkeypatch.setattr(flash_attn, "_FA4_DENSE_ATTENTION_KERNEL", varlen_attention)
    monkeypatch.setattr(
        flash_attn, "current_workspace_manager", lambda: PerRankWorkspace(setup.device)
    )


def _common_metadata(
    batch: Batch, setup: Setup, shard_count: int, seed: int
) -> tuple[Any, torch.Tensor]:
    """The runner's ``CommonAttentionMetadata`` of ``batch`` on the setup's
    device, and its block table (random blocks, K-shard width)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    requests = batch.requests
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(setup.num_blocks, generator=gen)
    width = max(cdiv(c + n, setup.block_size * shard_count) for c, n in requests)
    table = torch.stack(
        [blocks[i * width : (i + 1) * width] for i in range(len(requests))]
    ).int()
    query_lens = torch.tensor([n for _, n in requests], dtype=torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).int()])
    seq_lens = torch.tensor([c + n for c, n in requests], dtype=torch.int32)
    num_tokens = int(query_lens.sum())
    device = setup.device
    common = CommonAttentionMetadata(
        query_start_loc=starts.to(device),
        query_start_loc_cpu=starts,
        seq_lens=seq_lens.to(device),
        num_reqs=len(requests),
        num_actual_tokens=num_tokens,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=table.to(device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64).to(device),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )
    return common, table


def _make_rank(
    monkeypatch: pytest.MonkeyPatch,
    group: SimulatedGroup,
    vllm_config: Any,
    batch: Batch,
    setup: Setup,
    shard_count: int,
    replicas: list[int],
    common_and_table: tuple[Any, torch.Tensor],
) -> dict[str, Any]:
    """DCP rank ``group.rank``'s real ``Attention`` layer (its heads' sinks),
    the metadata its group's builder builds, its cache shard and inputs."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends import flash_attn
    from vllm.v1.worker.utils import AttentionGroup

    r, dcp = group.rank_in_group, group.world_size
    common, table = common_and_table
    monkeypatch.setattr(parallel_state, "_DCP", group)
    name = f"model.layers.{r}.self_attn.attn"
    heads = slice(r * HEADS, (r + 1) * HEADS)
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            HEADS,
            setup.head_size,
            setup.scale,
            1,
            prefix=name,
            attn_backend=flash_attn.FlashAttentionBackend,
            sinks=batch.sinks[heads].float().to(setup.device),
        ).to(setup.device)
    if not setup.on_device:
        # FlashAttention 3 (Hopper), the version gpt-oss's sinks run on.
        layer.impl.vllm_flash_attn_version = 3
    attention_group = AttentionGroup(
        flash_attn.FlashAttentionBackend, [name], _spec(setup, dcp, shard_count), 0
    )
    with replica_groups_of(group, replicas):
        attention_group.create_metadata_builders(
            vllm_config, torch.device(setup.device)
        )
    (builder,) = attention_group.metadata_builders
    shard = GroupGeometry("sinks", shard_count, dcp, r).shard
    new = [
        (k[c:], v[c:])
        for k, v, (c, _) in zip(batch.keys, batch.values, batch.requests, strict=True)
    ]
    new_keys = torch.cat([k for k, _ in new]).to(setup.dtype).to(setup.device)
    new_values = torch.cat([v for _, v in new]).to(setup.dtype).to(setup.device)
    return {
        "group": group,
        "layer": layer,
        "metadata": builder.build(0, common),
        "kv_cache": _write_cache(batch, setup, table, shard_count, shard),
        "query": batch.queries[:, heads].to(setup.dtype).to(setup.device).contiguous(),
        "key": new_keys[:, None, :],
        "value": new_values[:, None, :],
    }


def run_ranks(
    monkeypatch: pytest.MonkeyPatch,
    dcp: int,
    shard_count: int,
    batch: Batch,
    seed: int,
    setup: Setup = CPU,
    *,
    partial_collectives: str | None = None,
    keep: list[dict[str, Any]] | None = None,
) -> list[torch.Tensor]:
    """Every rank's output for its own heads, from the real forward. A
    partial K runs within simulated replica groups unless
    ``partial_collectives`` is ``"dcp"``; ``keep`` receives every rank's
    layer, builder metadata and groups."""
    from vllm.distributed import parallel_state

    _stand_in_kernels(monkeypatch, setup)
    additional = (
        None
        if partial_collectives is None
        else {"dcp_geometry": {"partial_collectives": partial_collectives}}
    )
    vllm_config = make_vllm_config(
        dcp,
        tp=16,
        model_dir=_model_dir(),
        dtype=str(setup.dtype).removeprefix("torch."),
        additional_config=additional,
    )
    common_and_table = _common_metadata(batch, setup, shard_count, seed)
    coop = CooperativeRanks(dcp)
    # A partial group runs within its replica (rule A6, the default).
    within = 1 < shard_count < dcp and partial_collectives != "dcp"
    replicas = [shard_count] if within else []
    ranks = [
        _make_rank(
            monkeypatch,
            SimulatedGroup(coop, dcp, r),
            vllm_config,
            batch,
            setup,
            shard_count,
            replicas,
            common_and_table,
        )
        for r in range(dcp)
    ]
    local = threading.local()
    # vLLM's get_dcp_group reads this at every call (the plugin's wrapper of
    # the module's getter answers a bound replica first): each thread's own.
    monkeypatch.setattr(parallel_state, "_DCP", ThreadLocalGroup(local))

    def forward(r: int) -> torch.Tensor:
        rank = ranks[r]
        local.group = rank["group"]
        layer = rank["layer"]
        output = torch.zeros_like(rank["query"])
        layer.impl.forward(
            layer,
            rank["query"],
            rank["key"],
            rank["value"],
            rank["kv_cache"],
            rank["metadata"],
            output,
        )
        return output

    if keep is not None:
        keep.extend(ranks)
    return coop.run(forward)


class ThreadLocalGroup:
    """The DCP group as each rank's thread sees it (``local.group``)."""

    def __init__(self, local: threading.local) -> None:
        self._local = local

    def __getattr__(self, name: str) -> Any:
        return getattr(self._local.group, name)


def _model_dir() -> Any:
    from tests.support.attention import tiny_model_dir

    return tiny_model_dir()
