# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""MLA attention of a group with K shards over D simulated ranks equals
float64 single-device attention, on every rank.

Each case runs vLLM's real MLA path per rank (``tests.support.mla``): the
builder's ``build()``, ``MLAAttention.forward_impl`` with the TRITON_MLA
decode kernel (interpreted), the ``cpu_sdpa`` prefill backend, the chunked
prefill-context path with its KV all-gather, ``correct_attn_out``
(interpreted) and ``merge_attn_states``. One batch holds decodes over long and
short contexts, chunked-prefill continuations, a block-aligned prefix-cache
hit and a prefill without context. Partial groups run within simulated
replica groups (rule A6, the default) and, in a second set, on the D-wide
group with duplicate replicas masked (``partial_collectives: "dcp"``). The
same cases on unpatched vLLM (a fresh process) show the error the plugin
removes.

Cost on 2 cores: about 70 s for the patched cases, 30 s for the baseline.
"""

from __future__ import annotations

import pytest

from tests.support.mla import CPU
from tests.support.mla_forward import run_case
from tests.support.processes import run_python
from vllm_dcp_geometry.contract import local_seq_len

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "worker.mla_attention", "worker.mla_dcp_manager", "worker.utils"
    ),
]

TOLERANCE = 1e-5
B = CPU.block_size
# Every (D, K) with D in {2, 4, 8} and K in {1, proper divisors, D}; I in
# {1, B} alternates. (8, 2, 1) splits a context over three chunks, one a
# continuation; (2, 2, B) and (8, 4, B) put a whole block on one shard.
CASES = [
    (2, 1, 1),
    (2, 2, B),
    (4, 1, B),
    (4, 2, 1),
    (4, 2, B),
    (4, 4, 1),
    (8, 1, 1),
    (8, 2, 1),
    (8, 4, B),
    (8, 8, B),
]


@pytest.mark.parametrize(("dcp", "shard_count", "interleave"), CASES)
def test_mla_group_matches_single_device(
    dcp: int, shard_count: int, interleave: int
) -> None:
    report = run_case(dcp, shard_count, interleave, patched=True)
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= TOLERANCE, (key, report)
    # Decode read the group's local lengths (all of them for K = 1).
    for rank, lengths in enumerate(report["decode_seq_lens"]):
        shard = rank % shard_count
        expected = [
            local_seq_len(c + n, B, shard_count, interleave, shard)
            for c, n in CPU.requests[:3]
        ]
        assert lengths == expected, (rank, lengths, expected)
    if (dcp, shard_count, interleave) == (8, 2, 1):
        # Within its replica a chunk holds the whole N-row budget.
        assert max(report["chunks"]) <= 2, report["chunks"]
    assert CPU.max_model_len >= max(c + n for c, n in CPU.requests)


@pytest.mark.parametrize(
    ("dcp", "shard_count", "interleave"), [(4, 2, 1), (8, 2, 1), (8, 4, B)]
)
def test_partial_group_on_the_dcp_group_matches_single_device(
    dcp: int, shard_count: int, interleave: int
) -> None:
    """``partial_collectives: "dcp"``: the D-wide gather and masked combine
    are exact too; its context chunks shrink to N*K/D rows."""
    report = run_case(
        dcp, shard_count, interleave, patched=True, partial_collectives="dcp"
    )
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert report[key] <= TOLERANCE, (key, report)
    if (dcp, shard_count, interleave) == (8, 2, 1):
        assert min(report["chunks"]) >= 3, report["chunks"]


def test_all_to_all_combine_reads_the_partial_group() -> None:
    """``dcp_comm_backend="a2a"``: vLLM's all-to-all LSE combine (its Triton
    pack and combine kernels, interpreted) on a partial group. It returns no
    LSE, so the decode output and the context LSE are what can be checked."""
    for where in ("replica", "dcp"):
        report = run_case(
            4, 2, 1, patched=True, comm_backend="a2a", partial_collectives=where
        )
        assert report["decode_lse"] is None
        for key in ("decode_out", "prefill_out", "context_lse"):
            assert report[key] <= TOLERANCE, (where, key, report)


BASELINE = """
import json
from tests.support.mla_forward import run_case
print(json.dumps({
    "replicated": run_case(4, 1, 1, patched=False),
    "partial": run_case(4, 2, 1, patched=False),
    "sharded": run_case(4, 4, 1, patched=False),
}))
"""


@pytest.mark.unpatched_baseline
def test_unpatched_vllm_reads_replicated_and_partial_mla_wrongly() -> None:
    """vLLM 0.33.0 reads an MLA cache with K = 1 or K = 2 at D = 4 as if it
    were sharded over D: decode and prefill-context outputs are wrong, with
    no error; its own sharded case is exact (the harness is fair)."""
    got = run_python(BASELINE, patched=False)
    sharded = got["sharded"]
    for key in ("decode_out", "prefill_out", "decode_lse", "context_lse"):
        assert sharded[key] <= TOLERANCE, (key, sharded)
    for case in ("replicated", "partial"):
        report = got[case]
        assert report["decode_out"] > 1e-2, (case, report)
        assert report["prefill_out"] > 1e-2, (case, report)
        assert report["context_lse"] > 1e-2, (case, report)
