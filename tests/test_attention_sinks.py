# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Attention sinks through FlashAttention at every K equal single-device
attention with sinks (rule A7).

D simulated ranks run the real ``FlashAttentionImpl.forward`` of a layer
with sinks (``tests.support.sinks``): the DCP query all-gather, vLLM's
``cp_lse_ag_out_rs`` (Triton, interpreted; replica-masked for a partial
group) and ``merge_attn_states`` are vLLM's, the FlashAttention kernel a
float64 stand-in that honours ``s_aux``. Every rank's output must match a
float64 single-device reference with sinks, for D in {2, 4}, every K, decode
and prefill with and without context. The ranks run as threads that share
the module, as vLLM's micro-batch threads do, so a fold that leaks from one
thread's call into another's fails here too. vLLM's own DCP path, unfolded,
misses the sinks (the negative control). ``tests/gpu/test_gpu_sinks.py``
runs the same on the compiled kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.attention import (
    cpu_platform,  # noqa: F401
    triton_interpreter_constexprs,  # noqa: F401
)
from tests.support.sinks import (
    CPU,
    FIRST_CHUNKS,
    MIXED,
    make_batch,
    max_error,
    run_ranks,
)

pytestmark = pytest.mark.patches("worker.flash_attn")

TOLERANCE = 1e-5
CASES = [(2, 2), (2, 1), (4, 4), (4, 2), (4, 1)]


@pytest.mark.usefixtures("cpu_platform", "triton_interpreter_constexprs")
@pytest.mark.parametrize(("dcp", "shard_count"), CASES)
@pytest.mark.parametrize("requests", [MIXED, FIRST_CHUNKS], ids=["mixed", "first"])
def test_sinks_enter_once_at_every_k(
    monkeypatch: pytest.MonkeyPatch,
    dcp: int,
    shard_count: int,
    requests: tuple[tuple[int, int], ...],
) -> None:
    seed = dcp * 10 + shard_count
    batch = make_batch(dcp, CPU.requests(requests), seed, CPU)
    outputs = run_ranks(monkeypatch, dcp, shard_count, batch, seed)
    assert max_error(outputs, batch, CPU) < TOLERANCE


@pytest.mark.usefixtures("cpu_platform", "triton_interpreter_constexprs")
@pytest.mark.parametrize(("dcp", "shard_count"), [(4, 4), (4, 2)])
def test_vllms_own_dcp_path_misses_the_sinks(
    monkeypatch: pytest.MonkeyPatch, dcp: int, shard_count: int
) -> None:
    """Negative control: vLLM 0.33.0's DCP path, without the fold, computes
    attention as if the layer had no sinks."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

    from vllm_dcp_geometry.runtime.patching import original_of

    monkeypatch.setattr(
        FlashAttentionImpl,
        "_forward_with_dcp",
        original_of(FlashAttentionImpl._forward_with_dcp),
    )
    batch = make_batch(dcp, CPU.requests(MIXED), 7, CPU)
    outputs = run_ranks(monkeypatch, dcp, shard_count, batch, 7)
    assert max_error(outputs, batch, CPU) > 1e-2
    assert max_error(outputs, batch, CPU, sinks=False) < TOLERANCE


def test_fold_leaves_rows_without_keys_as_the_kernel_gave_them() -> None:
    """A padded row (no keys: FlashAttention's LSE is +inf or -inf) keeps
    its output and LSE; a row with keys is that attention with the sink."""
    from vllm_dcp_geometry.runtime.attention_sinks import fold_sinks

    out = torch.ones(3, 1, 2)
    lse = torch.tensor([[0.0, float("inf"), float("-inf")]])
    folded = fold_sinks(out, lse, torch.tensor([0.0]))
    assert folded[0, 0].item() == pytest.approx(math.log(2))
    assert folded[0, 1:].tolist() == [float("inf"), float("-inf")]
    assert out[:, 0, 0].tolist() == [0.5, 1.0, 1.0]


def test_a_changed_kernel_contract_fails_loudly() -> None:
    """The fold needs the new-token call's LSE and its output in ``out=``;
    a DCP path that stops asking for either is an upstream change, not a
    silent skip. Calls on other keys, or outside a fold, pass through."""
    from vllm_dcp_geometry.runtime.attention_sinks import SinkFoldingKernel
    from vllm_dcp_geometry.runtime.upstream_symbols import UpstreamChangedError

    def kernel(**kwargs):
        out = kwargs["out"] if "out" in kwargs else torch.zeros(1, 1, 1)
        return (out, torch.zeros(1, 1)) if kwargs.get("return_softmax_lse") else out

    folding = SinkFoldingKernel(kernel)
    keys, out = torch.zeros(1), torch.ones(1, 1, 1)
    assert folding(k=keys, out=out) is out
    with folding.folding(keys, torch.zeros(1)):
        assert folding(k=torch.zeros(1), out=out) is out
        with pytest.raises(UpstreamChangedError, match="LSE"):
            folding(k=keys, out=out)
        _, lse = folding(k=keys, out=out, return_softmax_lse=True)
    copying = SinkFoldingKernel(lambda **_: (torch.ones(1, 1, 1), torch.zeros(1, 1)))
    with (
        copying.folding(keys, torch.zeros(1)),
        pytest.raises(UpstreamChangedError, match="out="),
    ):
        copying(k=keys, out=torch.ones(1, 1, 1), return_softmax_lse=True)
    assert lse.item() == pytest.approx(math.log(2))
    assert out.item() == pytest.approx(0.5)
    # A DCP path whose new-token call no longer gets the keys it was given
    # (a copy, say) would fold nothing: that fails loudly, not silently.
    with (
        pytest.raises(UpstreamChangedError, match="step's own keys"),
        folding.folding(keys, torch.zeros(1)),
    ):
        folding(k=keys.clone(), out=out, return_softmax_lse=True)


@pytest.mark.usefixtures("cpu_platform", "triton_interpreter_constexprs")
def test_a_partial_group_attends_within_its_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D = 4, K = 2 (rule A6): every impl runs with (K, r % K) through its
    replica forward, its combine unmasked, the builder plans the K x H heads
    gathered over the replica; each rank's query all-gather and combine see
    the K ranks of its replica only (a replica's exchange picks those), and
    the output is exact with the sinks."""
    from vllm_dcp_geometry.runtime.impl_binding import (
        ReplicaForward,
        ReplicaMaskedCombine,
    )

    batch = make_batch(4, CPU.requests(MIXED), 5, CPU)
    ranks: list[dict[str, object]] = []
    outputs = run_ranks(monkeypatch, 4, 2, batch, 5, keep=ranks)
    assert max_error(outputs, batch, CPU) < TOLERANCE
    for r, rank in enumerate(ranks):
        impl = rank["layer"].impl  # type: ignore[attr-defined]
        assert (impl.dcp_world_size, impl.dcp_rank) == (2, r % 2)
        assert isinstance(impl.forward, ReplicaForward)
        assert impl.forward.replica.ranks == [r // 2 * 2, r // 2 * 2 + 1]
        assert not isinstance(impl.dcp_combine, ReplicaMaskedCombine)


@pytest.mark.usefixtures("cpu_platform", "triton_interpreter_constexprs")
def test_a_partial_group_on_the_dcp_group_stays_masked_and_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``partial_collectives: "dcp"``: the impl keeps D, its combine is
    replica-masked, and the output is exact."""
    from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine

    batch = make_batch(4, CPU.requests(MIXED), 6, CPU)
    ranks: list[dict[str, object]] = []
    outputs = run_ranks(
        monkeypatch, 4, 2, batch, 6, partial_collectives="dcp", keep=ranks
    )
    assert max_error(outputs, batch, CPU) < TOLERANCE
    for rank in ranks:
        impl = rank["layer"].impl  # type: ignore[attr-defined]
        assert impl.dcp_world_size == 4
        assert isinstance(impl.dcp_combine, ReplicaMaskedCombine)
