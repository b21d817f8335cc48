# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DCP attention over D simulated ranks equals single-device attention.

Each simulated rank holds its shard of every request's context in a paged
cache written with the contract's slot mapping, attends with the queries of
all D ranks (the DCP all-gather) over its group-local lengths, and hands its
output and LSE to the plugin's replica-masked combine; the all-gather of LSEs
and the reduce-scatter are simulated around vLLM's own ``correct_attn_out``
(Triton kernel, interpreted), and the result is merged with new-token
attention by vLLM's ``merge_attn_states`` (torch path). Replicated groups run
plain local attention. The result must match a float64 reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.support.attention import triton_interpreter_constexprs  # noqa: F401
from vllm_dcp_geometry.contract import GroupGeometry, cdiv, reference_slot_mapping
from vllm_dcp_geometry.runtime.impl_binding import mask_combine
from vllm_dcp_geometry.runtime.metadata_builders import group_local_seq_lens

BLOCK_SIZE = 8
HEAD_DIM = 16
HEADS_PER_RANK = 1
NUM_BLOCKS = 128
SCALE = HEAD_DIM**-0.5
# (context length, new tokens): a chunk with no context, decodes, a prefill
# chunk (query length > 1) over context, and contexts shorter than one round
# of shards (some shards hold nothing).
REQUESTS = [(0, 2), (5, 1), (37, 3), (100, 1), (3, 1), (64, 2)]


@dataclass
class Batch:
    keys: list[torch.Tensor]  # per request [context + new, HEAD_DIM], float64
    values: list[torch.Tensor]
    queries: torch.Tensor  # [T, D * HEADS_PER_RANK, HEAD_DIM], float64
    rows: list[torch.Tensor]  # per request block-table row


def make_batch(dcp: int, shard_count: int, seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    total = sum(c + n for c, n in REQUESTS)
    keys = torch.randn(total, HEAD_DIM, generator=gen, dtype=torch.float64)
    values = torch.randn(total, HEAD_DIM, generator=gen, dtype=torch.float64)
    num_tokens = sum(n for _, n in REQUESTS)
    queries = torch.randn(
        num_tokens, dcp * HEADS_PER_RANK, HEAD_DIM, generator=gen, dtype=torch.float64
    )
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    rows, key_list, value_list, start, used = [], [], [], 0, 0
    for context, new in REQUESTS:
        width = max(1, cdiv(context, BLOCK_SIZE * shard_count))
        rows.append(blocks[used : used + width])
        used += width
        key_list.append(keys[start : start + context + new])
        value_list.append(values[start : start + context + new])
        start += context + new
    return Batch(key_list, value_list, queries, rows)


def reference(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 causal attention, and the LSE over each token's context."""
    outs, context_lses, t = [], [], 0
    for i, (context, new) in enumerate(REQUESTS):
        for j in range(new):
            q = batch.queries[t]
            k = batch.keys[i][: context + j + 1]
            scores = q @ k.T * SCALE
            outs.append(torch.softmax(scores, dim=-1) @ batch.values[i][: len(k)])
            context_lses.append(torch.logsumexp(scores[:, :context], dim=-1))
            t += 1
    return torch.stack(outs), torch.stack(context_lses)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention of q [n, H, d] over k, v [m, d]: (out, lse [n, H]).
    Empty keys give output 0 and LSE -inf, as the kernels do."""
    n, heads, _ = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q), torch.full((n, heads), float("-inf"))
    scores = torch.einsum("nhd,md->nhm", q, k) * SCALE
    if causal_offset is not None:
        allowed = torch.arange(k.shape[0])[None, :] <= (
            torch.arange(n)[:, None] + causal_offset
        )
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhm,md->nhd", torch.softmax(scores, dim=-1), v)
    return out, lse


class Rank:
    """One simulated DCP rank: its paged cache holds the group's shard."""

    def __init__(self, batch: Batch, geometry: GroupGeometry) -> None:
        self.geometry = geometry
        self.k_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
        self.v_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
        for i, (context, _) in enumerate(REQUESTS):
            slots = torch.as_tensor(
                reference_slot_mapping(
                    range(context),
                    batch.rows[i],
                    block_size=BLOCK_SIZE,
                    shard_count=geometry.shard_count,
                    interleave_size=geometry.interleave_size,
                    shard=geometry.shard,
                )
            )
            mine = slots >= 0
            self.k_cache[slots[mine]] = batch.keys[i][:context][mine].float()
            self.v_cache[slots[mine]] = batch.values[i][:context][mine].float()
        contexts = torch.tensor([c for c, _ in REQUESTS], dtype=torch.int32)
        self.local_lens = group_local_seq_lens(contexts, geometry).tolist()

    def local_context(self, batch: Batch, i: int) -> tuple[torch.Tensor, ...]:
        """The request's local tokens in local order, read through the table:
        local token j sits in column j // B at offset j % B."""
        j = torch.arange(self.local_lens[i])
        slots = batch.rows[i][j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE
        return self.k_cache[slots], self.v_cache[slots]

    def context_pass(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """All D ranks' queries over this rank's shard: [T, D*h, d], [T, D*h]."""
        outs, lses, t = [], [], 0
        for i, (_, new) in enumerate(REQUESTS):
            k, v = self.local_context(batch, i)
            out, lse = attend(batch.queries[t : t + new].float(), k, v, None)
            outs.append(out)
            lses.append(lse)
            t += new
        return torch.cat(outs), torch.cat(lses)

    def heads(self) -> slice:
        r = self.geometry.dcp_rank
        return slice(r * HEADS_PER_RANK, (r + 1) * HEADS_PER_RANK)

    def new_token_pass(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        outs, lses, t = [], [], 0
        for i, (context, new) in enumerate(REQUESTS):
            q = batch.queries[t : t + new, self.heads()].float()
            k = batch.keys[i][context:].float()
            v = batch.values[i][context:].float()
            out, lse = attend(q, k, v, 0)
            outs.append(out)
            lses.append(lse)
            t += new
        return torch.cat(outs), torch.cat(lses)

    def local_attention(self, batch: Batch) -> torch.Tensor:
        """Replicated group: plain attention over the whole local cache."""
        outs, t = [], 0
        for i, (context, new) in enumerate(REQUESTS):
            kc, vc = self.local_context(batch, i)
            k = torch.cat([kc, batch.keys[i][context:].float()])
            v = torch.cat([vc, batch.values[i][context:].float()])
            q = batch.queries[t : t + new, self.heads()].float()
            outs.append(attend(q, k, v, context)[0])
            t += new
        return torch.cat(outs)


class SimulatedCombine:
    """The collective around ``correct_attn_out``: collects what each rank
    hands to its DCP combine, then all-gathers LSEs and reduce-scatters."""

    def __init__(self) -> None:
        self.submitted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def combine_for(self, rank: int, replica: int):
        def submit(out: torch.Tensor, lse: torch.Tensor, group: object) -> None:
            self.submitted[rank] = (out, lse)

        # The exact wrapper the plugin installs on impls and prefill wrappers.
        return mask_combine(submit, replica)

    def finish(self, dcp: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        from vllm.v1.attention.ops.dcp import CPTritonContext, correct_attn_out

        lses = torch.stack([self.submitted[r][1] for r in range(dcp)]).contiguous()
        corrected, lse = [], None
        for r in range(dcp):
            out, lse = correct_attn_out(
                self.submitted[r][0].clone(), lses, r, CPTritonContext()
            )
            corrected.append(out)
        total = torch.stack(corrected).sum(dim=0)
        h = HEADS_PER_RANK
        return [total[:, r * h : (r + 1) * h] for r in range(dcp)], lse


def dcp_attention(
    dcp: int, shard_count: int, interleave: int, batch: Batch, *, masked: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Every rank's final output for its own heads, and the combined LSE."""
    from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch

    ranks = [
        Rank(
            batch,
            GroupGeometry(
                owner="test group",
                dcp_world_size=dcp,
                dcp_rank=r,
                shard_count=shard_count,
                interleave_size=interleave,
                default_shard_count=dcp,
            ),
        )
        for r in range(dcp)
    ]
    if shard_count == 1:
        return [rank.local_attention(batch) for rank in ranks], None
    collective = SimulatedCombine()
    for rank in ranks:
        out, lse = rank.context_pass(batch)
        replica = rank.geometry.replica if masked else 0
        collective.combine_for(rank.geometry.dcp_rank, replica)(out, lse, None)
    context_outs, context_lse = collective.finish(dcp)
    finals = []
    for rank, context_out in zip(ranks, context_outs, strict=True):
        new_out, new_lse = rank.new_token_pass(batch)
        output = torch.empty_like(new_out)
        _merge_attn_states_torch(
            output,
            context_out.contiguous(),
            context_lse[:, rank.heads()].T.contiguous(),
            new_out,
            new_lse.T.contiguous(),
        )
        finals.append(output)
    return finals, context_lse


CASES = [
    # (D, K, I)
    (4, 4, 1),  # sharded
    (4, 2, 1),  # partial
    (4, 2, BLOCK_SIZE),
    (8, 2, 2),
    (8, 4, BLOCK_SIZE),
    (4, 1, 1),  # replicated
    (8, 1, 4),
]


@pytest.mark.usefixtures("triton_interpreter_constexprs")
@pytest.mark.parametrize(("dcp", "shard_count", "interleave"), CASES)
def test_dcp_attention_matches_single_device(
    dcp: int, shard_count: int, interleave: int
) -> None:
    batch = make_batch(dcp, shard_count, seed=dcp * 100 + shard_count * 10 + interleave)
    expected, _ = reference(batch)
    finals, _ = dcp_attention(dcp, shard_count, interleave, batch)
    h = HEADS_PER_RANK
    scale = expected.abs().max().item()
    for r, final in enumerate(finals):
        assert torch.isfinite(final).all()
        error = (final.double() - expected[:, r * h : (r + 1) * h]).abs().max().item()
        assert error / scale < 1e-5, (dcp, shard_count, interleave, r, error)


@pytest.mark.usefixtures("triton_interpreter_constexprs")
@pytest.mark.parametrize(("dcp", "shard_count", "interleave"), [(4, 2, 1)])
def test_unmasked_partial_combine_inflates_lse_by_log_replicas(
    dcp: int, shard_count: int, interleave: int
) -> None:
    """Companion: counting every replica adds ln(D/K) to the combined LSE and
    skews the merge with new-token attention; masking removes exactly that."""
    batch = make_batch(dcp, shard_count, seed=7)
    expected, context_lse = reference(batch)
    has_context = torch.tensor(
        [context > 0 for context, new in REQUESTS for _ in range(new)]
    )
    _, masked_lse = dcp_attention(dcp, shard_count, interleave, batch)
    finals, unmasked_lse = dcp_attention(
        dcp, shard_count, interleave, batch, masked=False
    )
    exact = context_lse[has_context]
    assert torch.allclose(masked_lse[has_context].double(), exact, atol=1e-5)
    inflation = unmasked_lse[has_context].double() - exact
    assert torch.allclose(
        inflation, torch.full_like(inflation, math.log(dcp / shard_count)), atol=1e-5
    )
    # Rows without context stay -inf either way (no NaN from -inf - -inf).
    assert torch.isneginf(unmasked_lse[~has_context]).all()
    assert torch.isneginf(masked_lse[~has_context]).all()
    h = HEADS_PER_RANK
    skew = max(
        (final.double() - expected[:, r * h : (r + 1) * h]).abs().max().item()
        for r, final in enumerate(finals)
    )
    assert skew > 1e-3


@pytest.mark.usefixtures("triton_interpreter_constexprs")
def test_every_replica_masked_row_gives_zero_not_nan() -> None:
    """A padded row every rank leaves empty (LSE -inf everywhere, even on
    replica 0) combines to output 0 and LSE -inf, and the merge then returns
    the new-token attention unchanged."""
    from vllm.v1.attention.ops.merge_attn_states import _merge_attn_states_torch

    dcp, shard_count = 4, 2
    collective = SimulatedCombine()
    for r in range(dcp):
        out = torch.randn(3, dcp * HEADS_PER_RANK, HEAD_DIM)
        lse = torch.full((3, dcp * HEADS_PER_RANK), float("-inf"))
        collective.combine_for(r, r // shard_count)(out, lse, None)
    outs, lse = collective.finish(dcp)
    assert torch.isneginf(lse).all()
    new_out = torch.randn(3, HEADS_PER_RANK, HEAD_DIM)
    new_lse = torch.randn(HEADS_PER_RANK, 3)
    for out in outs:
        assert (out == 0).all()
        merged = torch.empty_like(new_out)
        _merge_attn_states_torch(
            merged,
            out.contiguous(),
            lse[:, :HEADS_PER_RANK].T.contiguous(),
            new_out,
            new_lse,
        )
        assert torch.equal(merged, new_out)
