# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Per-group local sequence lengths through the real, patched builders.

Every D in {1, 2, 4, 8, 16}, every K | D, every rank, interleave 1, 16 and B:
the real ``FlashAttentionMetadataBuilder`` (built per group from a spec with
``dcp_kv_shard_count=K``) must report, for each request, the contract's local
length of the rank's shard ``s = r % K``, and a ``max_dcp_context_kv_len``
that bounds every shard. FlashInfer's patched lengths are checked through the
module functions its builder calls (its builder needs a GPU to construct).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention import (
    cpu_platform,  # noqa: F401
    decode_batch,
    full_attention_spec,
    make_attention_layer,
    replica_groups_for,
    set_dcp_group,
    tiny_model_config,
)
from tests.support.sweeps import divisors
from vllm_dcp_geometry.contract import GroupGeometry, local_seq_len
from vllm_dcp_geometry.runtime.group_context import use_group_geometry
from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
from vllm_dcp_geometry.runtime.impl_binding import ReplicaForward, ReplicaMaskedCombine

pytestmark = pytest.mark.patches("worker.flash_attn", "worker.flashinfer")

BLOCK_SIZE = 32
DCP_SIZES = (1, 2, 4, 8, 16)
INTERLEAVES = (1, 16, BLOCK_SIZE)
# Context lengths (= seq_len - 1 for a decode step): empty, shorter than one
# interleave run, ragged tails, several virtual blocks, near max_model_len.
SEQ_LENS = [1, 2, 17, 33, 100, 513, 1000, 2049, 4096]


def _expected(seq_lens: list[int], k: int, shard: int, interleave: int) -> list[int]:
    return [local_seq_len(n, BLOCK_SIZE, k, interleave, shard) for n in seq_lens]


@pytest.mark.usefixtures("cpu_platform")
@pytest.mark.parametrize("dcp", DCP_SIZES)
def test_flash_attn_builder_local_lengths_follow_the_group(
    dcp: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionMetadataBuilder,
    )

    contexts = [n - 1 for n in SEQ_LENS]
    checked = 0
    for interleave in INTERLEAVES:
        vllm_config = tiny_model_config(dcp, interleave)
        for k in divisors(dcp):
            for rank in range(dcp):
                set_dcp_group(monkeypatch, dcp, rank)
                name = f"model.layers.{k}_{rank}.self_attn.attn"
                layer = make_attention_layer(vllm_config, name, FlashAttentionBackend)
                with replica_groups_for([k] if 1 < k < dcp else []):
                    builder = FlashAttentionMetadataBuilder(
                        full_attention_spec(BLOCK_SIZE, k),
                        [name],
                        vllm_config,
                        torch.device("cpu"),
                    )
                metadata = builder.build(0, decode_batch(SEQ_LENS, 4096 // BLOCK_SIZE))
                shard = rank % k
                if k == 1:
                    # Replicated: plain local attention over the whole context.
                    assert (builder.dcp_world_size, builder.dcp_rank) == (1, 0)
                    assert metadata.dcp_context_kv_lens is None
                    assert metadata.seq_lens.tolist() == SEQ_LENS
                    assert layer.impl.dcp_world_size == 1
                    continue
                assert (builder.dcp_world_size, builder.dcp_rank) == (k, shard)
                lens = metadata.dcp_context_kv_lens.tolist()
                assert lens == _expected(contexts, k, shard, interleave), (
                    dcp,
                    k,
                    rank,
                    interleave,
                )
                # The kernel's max_seqlen_k must cover every shard's length.
                longest = max(
                    max(_expected(contexts, k, s, interleave)) for s in range(k)
                )
                assert metadata.max_dcp_context_kv_len >= longest
                # The FA3 scheduler sees the queries gathered over the K ranks
                # of the replica (rule A6), or over all D for K = D.
                assert builder.num_heads_q * builder.dcp_world_size == k
                assert not isinstance(layer.impl.dcp_combine, ReplicaMaskedCombine)
                assert (layer.impl.dcp_world_size, layer.impl.dcp_rank) == (
                    (k, shard) if k < dcp else (dcp, rank)
                )
                assert isinstance(layer.impl.forward, ReplicaForward) == (k < dcp)
                checked += 1
    assert checked == sum(
        dcp * sum(1 for k in divisors(dcp) if k > 1) for _ in INTERLEAVES
    )


def test_flash_attn_d_rank_bound_would_be_too_small() -> None:
    """Companion: the bound upstream derives from D undercounts a K-shard."""
    dcp, k, interleave = 16, 2, 16
    context = 4095
    d_bound = -(-context // (dcp * interleave)) * interleave
    assert max(local_seq_len(context, BLOCK_SIZE, k, interleave, s) for s in (0, 1)) > (
        d_bound
    )


@pytest.mark.parametrize("dcp", DCP_SIZES[1:])
def test_flashinfer_local_lengths_follow_the_group(dcp: int) -> None:
    """FlashInfer's build calls ``get_dcp_local_seq_lens(seq, D, r, I)`` and
    its trtllm decode reads ``dcp_local_seq_lens``: both must be the group's."""
    import vllm.v1.attention.backends.flashinfer as flashinfer

    from vllm_dcp_geometry.runtime.metadata_builders import (
        LOCAL_SEQ_LENS_BUFFER_ATTR,
        with_group_local_seq_lens,
    )

    seq = torch.tensor(SEQ_LENS, dtype=torch.int32)
    for interleave in INTERLEAVES:
        for k in divisors(dcp):
            for rank in range(dcp):
                geometry = GroupGeometry(
                    owner="test group",
                    dcp_world_size=dcp,
                    dcp_rank=rank,
                    shard_count=k,
                    interleave_size=interleave,
                    default_shard_count=dcp,
                )
                expected = _expected(SEQ_LENS, k, rank % k, interleave)
                upstream = flashinfer.get_dcp_local_seq_lens(
                    seq, dcp, rank, interleave
                ).tolist()
                assert upstream == _expected(SEQ_LENS, dcp, rank, interleave)
                with use_group_geometry(geometry):
                    answered = flashinfer.get_dcp_local_seq_lens(
                        seq, dcp, rank, interleave
                    ).tolist()
                if not geometry.is_partial:
                    # Sharded: untouched. Replicated builders never ask (D=1).
                    assert answered == upstream
                    continue
                assert answered == expected
                builder = type("Builder", (), {})()
                setattr(
                    builder,
                    LOCAL_SEQ_LENS_BUFFER_ATTR,
                    torch.full((len(SEQ_LENS) + 3,), -7, dtype=torch.int32),
                )
                metadata = with_group_local_seq_lens(
                    builder, decode_batch(SEQ_LENS, 128), geometry
                )
                assert metadata.dcp_local_seq_lens.tolist() == expected
                assert metadata.seq_lens.tolist() == SEQ_LENS
                # Rows past the batch read 0 (stale rows would leak into graphs).
                buffer = getattr(builder, LOCAL_SEQ_LENS_BUFFER_ATTR)
                assert buffer[len(SEQ_LENS) :].tolist() == [0, 0, 0]


@pytest.mark.usefixtures("cpu_platform")
def test_partial_builder_is_bound_to_its_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An impl serves one group: binding it to a second geometry is an error.
    Within its replica (the default) a partial group needs the replica groups
    made at start-up: none made is refused naming the way out; on the D-wide
    group (``partial_collectives: "dcp"``) it builds without them."""
    from vllm.v1.attention.backends.flash_attn import (
        FlashAttentionBackend,
        FlashAttentionMetadataBuilder,
    )

    from vllm_dcp_geometry.contract import DcpGeometryError

    vllm_config = tiny_model_config(8, 1)
    set_dcp_group(monkeypatch, 8, 5)
    name = "model.layers.0.self_attn.attn"
    make_attention_layer(vllm_config, name, FlashAttentionBackend)
    with pytest.raises(DcpGeometryError, match="partial_collectives"):
        FlashAttentionMetadataBuilder(
            full_attention_spec(BLOCK_SIZE, 4),
            [name],
            vllm_config,
            torch.device("cpu"),
        )
    vllm_config.additional_config = {"dcp_geometry": {"partial_collectives": "dcp"}}
    builder = FlashAttentionMetadataBuilder(
        full_attention_spec(BLOCK_SIZE, 4),
        [name],
        vllm_config,
        torch.device("cpu"),
    )
    geometry = getattr(builder, BOUND_GEOMETRY_ATTR)
    assert (geometry.shard, geometry.replica) == (1, 1)
    # A second builder of the same group (ubatching) binds idempotently.
    FlashAttentionMetadataBuilder(
        full_attention_spec(BLOCK_SIZE, 4), [name], vllm_config, torch.device("cpu")
    )
    with pytest.raises(DcpGeometryError, match="cannot also serve"):
        FlashAttentionMetadataBuilder(
            full_attention_spec(BLOCK_SIZE, 2),
            [name],
            vllm_config,
            torch.device("cpu"),
        )
