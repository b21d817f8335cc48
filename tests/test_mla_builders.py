# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The MLA builder and impls of every rank follow the group's K: the full grid
D in {2, 4, 8}, every K dividing D, I in {1, B}, partial groups within their
replica and on the D-wide group, on real TRITON_MLA builders made by
``AttentionGroup.create_metadata_builders`` (no kernel runs).

About 25 s on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.support.mla import CPU, cpu_shims, make_batch, make_ranks, mla_spec
from tests.support.mla_forward import common_metadata
from tests.support.simulated_collectives import CooperativeRanks
from tests.support.sweeps import divisors
from vllm_dcp_geometry.contract import cdiv, local_seq_len
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine
from vllm_dcp_geometry.runtime.mla_geometry import ShardWorldForwardMqa

pytestmark = pytest.mark.patches(
    "worker.mla_attention", "worker.mla_dcp_manager", "worker.utils"
)

GRID = [
    (dcp, k, interleave)
    for dcp in (2, 4, 8)
    for k in divisors(dcp)
    for interleave in (1, CPU.block_size)
]


def _local(length: int, k: int, interleave: int, shard: int) -> int:
    return local_seq_len(length, CPU.block_size, k, interleave, shard)


def _check_context_plan(metadata, k: int, interleave: int, rows: int) -> None:
    """Chunks cover every context row once, each rank gathers at most its
    N/D share, and the per-shard local lengths are the contract's."""
    chunked = metadata.prefill.chunked_context
    contexts = [c for c, _ in CPU.requests[CPU.num_decodes :]]
    assert chunked.context_lens_list == contexts
    assert sum(chunk.num_context_tokens for chunk in chunked.chunks) == sum(contexts)
    for chunk in chunked.chunks:
        requests = range(chunk.request_slice.start, chunk.request_slice.stop)
        assert chunk.local_context_lens_allranks == [
            [_local(contexts[i], k, interleave, s) for s in range(k)] for i in requests
        ]
        assert chunk.num_local_context_tokens <= rows
        # A chunk starts on a whole interleave round of the K shards.
        assert all(start % interleave == 0 for start in chunk.local_starts)


# A partial group both within its replica and kept on the D-wide group.
CASES = [(*case, "replica") for case in GRID] + [
    (dcp, k, interleave, "dcp") for dcp, k, interleave in GRID if 1 < k < dcp
]


@pytest.mark.parametrize(("dcp", "k", "interleave", "where"), CASES)
def test_builder_follows_the_group(
    dcp: int, k: int, interleave: int, where: str
) -> None:
    """``where``: a partial group within its replica (rule A6: vLLM's builder
    for K sharded ranks on the replica group) or on the D-wide group."""
    within = where == "replica" and 1 < k < dcp
    world = k if within else dcp
    batch = make_batch(dcp, k, seed=dcp + k)
    seq_lens = [c + n for c, n in CPU.requests]
    decode_lens = seq_lens[: CPU.num_decodes]
    with cpu_shims():
        ranks = make_ranks(
            batch,
            dcp,
            k,
            interleave,
            spec=mla_spec(None if k == dcp else k),
            coop=CooperativeRanks(dcp),
            partial_collectives=where,
        )
        for rank in ranks:
            builder, impl = rank.builder, rank.layer.impl
            metadata = builder.build(
                0, common_metadata(batch, dcp, rank.rank, interleave)
            )
            decode = metadata.decode
            shard, replica = rank.rank % k, rank.rank // k
            local = [_local(n, k, interleave, shard) for n in decode_lens]
            assert decode.seq_lens.tolist() == local
            assert max(local) <= metadata.max_seq_len
            rows = builder.chunked_prefill_workspace_size
            if k == 1:
                # vLLM's DCP1 builder: full lengths, workspace N, no KV gather.
                assert (builder.dcp_world_size, builder.dcp_manager) == (1, None)
                assert builder.chunked_prefill_workspace.shape[0] == rows
                assert decode.dcp_tot_seq_lens is None
                assert metadata.max_seq_len == max(seq_lens)
                assert builder.supports_draft_decode_metadata_update
                assert metadata.prefill.chunked_context.chunks[0].local_starts is None
                assert (impl.dcp_world_size, impl.dcp_rank) == (1, 0)
            else:
                assert builder.dcp_world_size == world
                assert builder.chunked_prefill_workspace.shape[0] == (
                    rows + rows // world
                )
                assert decode.dcp_tot_seq_lens.tolist() == decode_lens
                bound = cdiv(max(seq_lens), k * interleave) * interleave
                assert metadata.max_seq_len == bound
                _check_context_plan(metadata, k, interleave, rows // world)
                assert impl.dcp_world_size == world
                manager = rank.layer.dcp_manager
                assert builder.dcp_manager is manager
                group = manager.group
                assert (group.world_size, group.rank_in_group) == (
                    (k, shard) if within else (dcp, rank.rank)
                )
            combine = rank.layer.dcp_manager.combine
            if 1 < k < dcp and not within:
                assert isinstance(combine, ReplicaMaskedCombine)
                assert combine.replica == replica
            else:
                assert not isinstance(combine, ReplicaMaskedCombine)
            bound_to = getattr(impl, BOUND_GEOMETRY_ATTR, None)
            if k == dcp:
                assert bound_to is None
                assert not isinstance(impl.forward_mqa, ShardWorldForwardMqa)
            else:
                assert bound_to is not None and bound_to.shard_world == (k, shard)
                assert isinstance(impl.forward_mqa, ShardWorldForwardMqa)
