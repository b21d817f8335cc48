# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The test-only stand-ins of ``tests.support.mla`` do what vLLM's ``vllm._C``
ops and collectives do, checked against the contract.

- The KV write at the contract's slots puts every position of a request on
  exactly one shard of a replica group, in block ``slot // B`` at offset
  ``slot % B``.
- The context gathers read a rank's tokens in local order: local token ``j``
  of a shard is the ``j``-th position (in position order) whose owner shard is
  that shard - the order vLLM's context path and the contract's local length
  assume.
- The collectives exchange what ``torch.distributed`` would.

Under a second on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.mla import (
    concat_and_cache_mla,
    cp_gather_cache,
    gather_and_maybe_dequant_cache,
)
from tests.support.simulated_collectives import (
    CooperativeRanks,
    SimulatedGroup,
    all_gather_into_tensor,
    all_to_all_single,
)
from tests.support.sweeps import divisors
from vllm_dcp_geometry.contract import (
    PAD_SLOT_ID,
    local_seq_len,
    reference_slot_mapping,
)

B, DIM, NUM_BLOCKS, LENGTH, DCP = 8, 3, 64, 77, 4


def _written(k: int, interleave: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    """One request of ``LENGTH`` positions written on the K shards of replica 0."""
    gen = torch.Generator().manual_seed(k * 10 + interleave)
    values = torch.randn(LENGTH, DIM, generator=gen)
    row = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-LENGTH // (B * k))]
    caches = []
    for shard in range(k):
        cache = torch.zeros(NUM_BLOCKS, B, DIM)
        slots = reference_slot_mapping(
            range(LENGTH),
            row,
            block_size=B,
            shard_count=k,
            interleave_size=interleave,
            shard=shard,
        )
        concat_and_cache_mla(
            values[:, :2], values[:, 2:], cache, torch.as_tensor(slots), "auto", None
        )
        caches.append((cache, slots))
    return values, row, caches


@pytest.mark.parametrize("k", divisors(DCP))
@pytest.mark.parametrize("interleave", [1, 2, B])
def test_kv_write_puts_each_position_on_one_shard(k: int, interleave: int) -> None:
    values, _, caches = _written(k, interleave)
    owners = torch.zeros(LENGTH, dtype=torch.int64)
    for cache, slots in caches:
        mine = slots != PAD_SLOT_ID
        owners += torch.as_tensor(mine)
        flat = cache.view(-1, DIM)
        assert torch.equal(flat[torch.as_tensor(slots[mine])], values[mine])
        # PAD_SLOT_ID writes nothing: exactly the owned slots are non-zero.
        assert int((flat != 0).any(dim=1).sum()) == int(mine.sum())
    assert torch.equal(owners, torch.ones(LENGTH, dtype=torch.int64))


@pytest.mark.parametrize("k", divisors(DCP))
@pytest.mark.parametrize("interleave", [1, 2, B])
def test_gathers_read_a_shard_in_local_order(k: int, interleave: int) -> None:
    values, row, caches = _written(k, interleave)
    table = row[None, :].to(torch.int32)
    for shard, (cache, slots) in enumerate(caches):
        owned = values[torch.as_tensor(slots != PAD_SLOT_ID)]
        n = local_seq_len(LENGTH, B, k, interleave, shard)
        assert owned.shape[0] == n
        for start in (0, B, n // 2):
            count = n - start
            cu = torch.tensor([0, count], dtype=torch.int32)
            out = torch.zeros(count, DIM)
            cp_gather_cache(cache, out, table, cu, 1, torch.tensor([start]))
            assert torch.equal(out, owned[start:])
            if start % B:
                with pytest.raises(AssertionError, match="unaligned"):
                    gather_and_maybe_dequant_cache(
                        cache, out, table, cu, None, count, "auto", None,
                        torch.tensor([start]),
                    )  # fmt: skip
                continue
            out.zero_()
            gather_and_maybe_dequant_cache(
                cache, out, table, cu, None, count, "auto", None, torch.tensor([start])
            )
            assert torch.equal(out, owned[start:])


def test_collectives_exchange_as_torch_distributed() -> None:
    world = 3
    coop = CooperativeRanks(world)
    inputs = [torch.arange(6.0) + 10 * r for r in range(world)]

    def rank(r: int) -> tuple[torch.Tensor, ...]:
        group = SimulatedGroup(coop, world, r)
        gathered = torch.empty(6 * world)
        all_gather_into_tensor(gathered, inputs[r], group=group)
        swapped = torch.empty(6)
        all_to_all_single(swapped, inputs[r], group=group, async_op=True).wait()
        scattered = group.reduce_scatter(inputs[r].view(1, 6), dim=1)
        return gathered, swapped, scattered

    for r, (gathered, swapped, scattered) in enumerate(coop.run(rank)):
        assert torch.equal(gathered, torch.cat(inputs))
        assert torch.equal(swapped, torch.cat([x.chunk(world)[r] for x in inputs]))
        total = sum(inputs)
        assert torch.equal(scattered, total.view(1, 6).chunk(world, dim=1)[r])
