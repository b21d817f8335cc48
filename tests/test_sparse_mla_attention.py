# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2 sparse attention over a K-shard latent and indexer cache, end
to end on D simulated ranks (``tests.support.sparse_mla_case.run_sparse_case``).

Per rank, every step vLLM's own code where it runs on CPU: the indexer call
through the plugin's DeepSeek-V3.2 call wrapper (around a stand-in of the
CUDA-only indexer op that scores the rank's own shard), vLLM's top-k merge
(patched; real pack kernel, the all-gather, CuteDSL selector stood in),
then the layer's DCP steps: the query all-gather where the impl's world is
> 1, the impl's ``forward_mqa`` as bound by ``layer_binding.bind_group_layers``
(upstream's ``SparseMLACommonImpl.forward_mqa``: vLLM's
``triton_filter_and_convert_dcp_index`` in the shard world ``(K, r % K)``
that ``ShardWorldForwardMqa`` gives it, or the plain conversion at K = 1),
vLLM's Triton sparse MLA kernel over the rank's own paged cache (K
geometry, every unowned slot NaN) with its output stored in fp32 (generated
from the installed kernel, only the store changed), and the layer's
``MLADCPManager`` combine (``cp_lse_ag_out_rs``, the real
``correct_attn_out``). A partial K runs within its replica (rule A6, the
default: the indexer cache and the layer bound in simulated replica groups,
the merge gathering K x top-k candidates, the layer's replica manager
gathering queries and combining over K ranks) and on the D-wide group
(``partial_collectives: "dcp"``: D x top-k candidates gathered, of which
vLLM 0.34's selector reads the first replica's K x top-k; the combine
replica-masked by ``impl_binding.mask_combine``). K = 1 runs local: no
query gather, no merge, no combine.

Every rank is held to the same kernel on one device over the whole cache
(<= 1e-5) and to float64 sparse attention (<= 1e-5, the kernel's own
single-device error is about 1e-6); output and LSE. Negative controls: the
unwrapped merge selects ids twice, so does a replica-mode merge gathering
over all D ranks, and the unmasked D-wide combine shifts the LSE by ln(D/K).

About 45 s on 2 cores.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.sparse_mla import (
    CPU_SPARSE,
    FP32_TOLERANCE,
    LATENT_DIM,
    SCALE,
    sparse_attention,
)
from tests.support.sparse_mla_case import evaluate_sparse_case, run_sparse_case
from tests.support.sweeps import divisors
from vllm_dcp_geometry.tooling.sparse_rank_run import has_repeated_ids
from vllm_dcp_geometry.tooling.sparse_stand_ins import selector_reads_rank_major

pytestmark = [
    pytest.mark.long_running,
    pytest.mark.patches(
        "worker.sparse_attn_indexer",
        "worker.deepseek_v32_attention",
        "common.kv_cache_interface",
    ),
]

B = CPU_SPARSE.block_size
# partial_collectives changes only partial groups: both for them.
GRID = [
    (dcp, k, interleave, collectives)
    for dcp in (2, 4)
    for k in divisors(dcp)
    for interleave in (1, B)
    for collectives in (("replica", "dcp") if 1 < k < dcp else ("replica",))
]


def _seed(dcp: int, k: int, interleave: int) -> int:
    return 100 * dcp + 10 * k + interleave


@pytest.mark.parametrize(("dcp", "k", "interleave", "collectives"), GRID)
def test_sparse_attention_on_every_rank_is_single_device(
    dcp: int, k: int, interleave: int, collectives: str
) -> None:
    partial = 1 < k < dcp
    report = run_sparse_case(
        dcp, k, interleave, seed=_seed(dcp, k, interleave), collectives=collectives
    )
    worst = evaluate_sparse_case(report, k)
    assert all(worst["selections_ok"]), worst
    assert worst["single_f64"] <= FP32_TOLERANCE, worst
    for key in ("out_single", "out_f64", "lse_f64"):
        assert worst[key] <= FP32_TOLERANCE, (key, worst)
    # What the layer and the indexer op were handed: the impl's world (1 for
    # a local group, K within its replica, D otherwise) and the indexer's
    # shard world (K, r % K); the merge's selector read K x top-k candidates
    # per row within the replica, on the D-wide group D x top-k (vLLM 0.33:
    # duplicate replicas' as padding) or the first replica's K x top-k (0.34,
    # which views the gather by K).
    world = k if collectives == "replica" and partial else (1 if k == 1 else dcp)
    selected = k if partial and selector_reads_rank_major() else world
    assert report["gathered_widths"] == [selected * CPU_SPARSE.topk] * (
        0 if k == 1 else dcp
    )
    for r, result in enumerate(report["ranks"]):
        assert result.impl_world == world
        call = report["indexer_calls"][r]
        assert (call.dcp_world_size, call.dcp_rank) == (k, r % k)
        assert (call.indexer_geometry is not None) == partial
        if partial:
            assert call.indexer_geometry.shard_world == (k, r % k)
    assert sorted(report["selector_calls"]) == ([] if k == 1 else list(range(dcp)))


def test_the_unwrapped_merge_gives_a_wrong_output() -> None:
    """vLLM's own merge on a partial indexer cache (D=4, K=2): both replicas
    of each shard send their candidates, repeated ids displace real tokens,
    the attention reads the wrong tokens (vLLM 0.33); vLLM 0.34 views the
    D ranks' candidates by K and fails."""
    if selector_reads_rank_major():
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            run_sparse_case(
                4, 2, 1, seed=_seed(4, 2, 1), mask_merge=False, collectives="dcp"
            )
        return
    report = run_sparse_case(
        4, 2, 1, seed=_seed(4, 2, 1), mask_merge=False, collectives="dcp"
    )
    worst = evaluate_sparse_case(report, 2)
    assert not any(worst["selections_ok"]), worst
    assert all(has_repeated_ids(result.selection) for result in report["ranks"])
    assert worst["out_single"] > 1e-2 and worst["out_f64"] > 1e-2, worst


def test_a_merge_gathering_d_wide_in_replica_mode_is_wrong() -> None:
    """Within its replica the merge sends every replica's candidates (none
    masked): gathered over all D ranks instead (the module's
    ``get_dcp_group`` unwrapped), each shard arrives D/K times and repeated
    ids displace real tokens (vLLM 0.33), or the D ranks' candidates fail
    0.34's view by K."""
    if selector_reads_rank_major():
        with pytest.raises(RuntimeError, match="is invalid for input of size"):
            run_sparse_case(4, 2, 1, seed=_seed(4, 2, 1), merge_in_replica=False)
        return
    report = run_sparse_case(4, 2, 1, seed=_seed(4, 2, 1), merge_in_replica=False)
    worst = evaluate_sparse_case(report, 2)
    assert report["gathered_widths"] == [4 * CPU_SPARSE.topk] * 4
    assert not any(worst["selections_ok"]), worst
    assert all(has_repeated_ids(result.selection) for result in report["ranks"])


@pytest.mark.parametrize(("dcp", "k"), [(4, 2), (4, 1)])
def test_the_unmasked_combine_counts_replicas(dcp: int, k: int) -> None:
    """D=4, K=2 with the layer's combine unmasked: the selection and output
    stay right (the replicas hold identical partials) but the combined LSE
    counts each shard D/K times, ln(D/K) too high. K=1 combines nothing."""
    report = run_sparse_case(
        dcp, k, 1, seed=_seed(dcp, k, 1), mask_combine=False, collectives="dcp"
    )
    worst = evaluate_sparse_case(report, k)
    assert all(worst["selections_ok"]), worst
    assert worst["out_single"] <= FP32_TOLERANCE, worst
    if k == 1:
        assert worst["lse_f64"] <= FP32_TOLERANCE, worst
        return
    assert worst["lse_f64"] > FP32_TOLERANCE
    assert abs(worst["lse_f64"] - math.log(dcp / k)) <= FP32_TOLERANCE, worst
    for r in range(dcp):
        lse = report["combined_lse"][r].double()
        shift = lse - report["single"]["ref_lse"]
        assert torch.allclose(
            shift, torch.full_like(shift, math.log(dcp / k)), atol=1e-5
        )


def test_the_fp32_store_kernel_differs_from_vllms_only_in_the_store() -> None:
    """The generated kernel's output rounded to bf16 is vLLM's kernel's
    output (the Triton interpreter rounds toward zero) and its LSE is
    vLLM's, bit for bit: the same kernel, only the store kept in fp32."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, rows, topk = 3, 20, 100, 32
    q = torch.randn(tokens, heads, LATENT_DIM, generator=gen)
    kv = torch.randn(rows, LATENT_DIM, generator=gen)
    indices = torch.stack(
        [torch.randperm(rows, generator=gen)[:topk] for _ in range(tokens)]
    ).to(torch.int32)
    indices[0, 7:] = -1
    indices[1, :16] = -1  # a first tile of padding only
    fp32_out, fp32_lse = sparse_attention(q, kv, indices, SCALE)
    out, lse = sparse_attention(q, kv, indices, SCALE, fp32_store=False)
    assert torch.equal(lse, fp32_lse)
    truncated = (fp32_out.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(out, truncated)
    assert not torch.equal(out, fp32_out)
