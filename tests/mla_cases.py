# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One (D, K, I) case of the MLA harness, evaluated against the float64
single-device reference (see ``tests.mla_harness`` and ``tests.mla_ranks``).

Importable without the plugin: the unpatched baseline runs ``run_case`` in a
fresh process.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.mla_harness import (
    CPU,
    Batch,
    CooperativeRanks,
    Shape,
    cpu_shims,
    make_batch,
    reference,
    simulated_collectives,
)
from tests.mla_ranks import RankResult, forward, make_ranks, mla_spec


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max |got - want| where both are finite; inf where they disagree on
    which entries are infinite (an empty shard or context must stay -inf)."""
    got, want = got.double().cpu(), want.double().cpu()
    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return float("inf")
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    return (got[finite] - want[finite]).abs().max().item()


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
        heads = slice(None) if result.decode_lse_is_combined else own
        assert result.context_lse is not None
        errors: dict[str, float | None] = {
            "decode_out": error[:rows].max().item(),
            "prefill_out": error[rows:].max().item(),
            "decode_lse": None
            if result.decode_lse is None
            else _max_error(result.decode_lse[:rows], expected["lse"][:rows, heads]),
            "context_lse": _max_error(
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
) -> dict[str, Any]:
    """Build the ranks of one (D, K, I) case, run one forward, evaluate it.

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
