# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One forward of vLLM's real MLA attention over the ranks ``mla`` builds, and
one (D, K, I) case held to the float64 single-device reference: the runner's
common metadata per rank, each rank's forward recorded (its LSEs and
outputs) in cooperative threads, and ``run_case``. Importable without the
plugin, so the unpatched baseline runs the very same code in a fresh process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tests.support.mla import (
    CPU,
    Batch,
    Rank,
    Shape,
    cpu_shims,
    make_batch,
    make_ranks,
    mla_spec,
)
from tests.support.simulated_collectives import (
    CooperativeRanks,
    simulated_collectives,
)
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.mla_rank_run import (
    max_error,
    mla_reference,
)


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
