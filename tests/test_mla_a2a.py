# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""vLLM 0.34.0's fused a2a up-projection and a partial MLA group.

With ``dcp_comm_backend="a2a"`` vLLM 0.34.0's MLA layers (``MLAAttention``,
Kimi-K3's ``MultiHeadLatentAttention``) combine and up-project in one step,
``dcp_manager.v_up_proj_combine`` with ``W_UV_dcp``: the ``W_UV`` of all D
ranks, gathered at weight load. A partial group (1 < K < D) within its
replica gathers K*H query heads, so that step fails from 8 decode rows and
gives replicas q >= 1 another rank's heads below; on the D-wide group it
skips the replica mask. The binding drops both (``mla_geometry.
drop_fused_up_projection``): checked here on the bound layers, across a
weight reload, against K = D (untouched) and on 0.33.0 (nothing added), and
numerically through each layer class on simulated ranks (``tests.support``),
at 3 decode rows and at 8.

Cost on 2 cores: about 3 minutes on vLLM 0.34.0, 20 s on 0.33.0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.support.kimi_k3 import fused_op_stand_ins, make_kimi_ranks, run_kimi_case
from tests.support.mla import (
    CPU,
    cpu_shims,
    make_batch,
    make_ranks,
    mla_spec,
    process_groups,
    process_weights,
)
from tests.support.mla_forward import run_case
from tests.support.simulated_collectives import CooperativeRanks, SimulatedGroup

pytestmark = pytest.mark.patches(
    "worker.mla_attention",
    "worker.kimi_k3_mla",
    "worker.mla_dcp_manager",
    "worker.utils",
)

TOLERANCE = 1e-5
ON_0_34 = pytest.mark.vllm_releases("0.34.0")

# Eight single-token decodes (vLLM up-projects before the all-to-all from 8
# rows on), then a chunked-prefill continuation and a prefill without context.
EIGHT_DECODES = dataclasses.replace(
    CPU,
    requests=(
        *((36, 1), (4, 1), (62, 1), (20, 1), (9, 1), (50, 1), (1, 1), (33, 1)),
        *((45, 6), (0, 5)),
    ),
    num_decodes=8,
    max_num_seqs=16,
)


def _bound_layers(kind: str, dcp: int, shard_count: int, where: str) -> list[Any]:
    """Every rank's layer as the binding left it (the one in the forward
    context), built with ``dcp_comm_backend="a2a"``; nothing is run."""
    batch = make_batch(dcp, shard_count, 0)
    spec = mla_spec(shard_count if shard_count != dcp else None)
    coop = CooperativeRanks(dcp)
    with cpu_shims(), fused_op_stand_ins():
        if kind == "kimi":
            return make_kimi_ranks(
                batch,
                dcp,
                shard_count,
                1,
                spec=spec,
                coop=coop,
                comm_backend="a2a",
                partial_collectives=where,
            )[1]
        ranks = make_ranks(
            batch,
            dcp,
            shard_count,
            1,
            spec=spec,
            coop=coop,
            comm_backend="a2a",
            partial_collectives=where,
        )
    return [rank.layer for rank in ranks]


# The binding ---------------------------------------------------------------------


@ON_0_34
@pytest.mark.parametrize("kind", ["mla", "kimi"])
@pytest.mark.parametrize("where", ["replica", "dcp"])
def test_partial_layers_drop_the_fused_up_projection(kind: str, where: str) -> None:
    """K = 2 of D = 4: no ``W_UV_dcp`` on the layer, no ``v_up_proj_combine``
    on the manager it combines with (the replica's K-rank one, or its own
    masked D-wide one), so it combines, then up-projects its own heads; a
    weight reload gathers nothing again."""
    layers = _bound_layers(kind, 4, 2, where)
    for rank, layer in enumerate(layers):
        manager = layer.dcp_manager
        assert layer.W_UV_dcp is None, rank
        assert manager.v_up_proj_combine is None, rank
        assert manager.group.world_size == (2 if where == "replica" else 4), rank
    refuse = SimulatedGroup(None, 4, 0)  # any collective would assert
    with process_groups(refuse, refuse), fused_op_stand_ins():
        process_weights(layers[2], CPU.dtype)
    assert layers[2].W_UV_dcp is None


@ON_0_34
@pytest.mark.parametrize("kind", ["mla", "kimi"])
def test_sharded_layers_keep_upstreams_fused_up_projection(kind: str) -> None:
    """K = D is not bound: the layer keeps vLLM's ``W_UV_dcp`` (every rank's
    ``W_UV`` in DCP rank order) and its manager the fused combine."""
    layers = _bound_layers(kind, 4, 4, "replica")
    gathered = torch.cat([layer.W_UV for layer in layers])
    for layer in layers:
        assert layer.dcp_manager.v_up_proj_combine is not None
        assert torch.equal(layer.W_UV_dcp, gathered)


@pytest.mark.vllm_releases("0.33.0")
@pytest.mark.parametrize("where", ["replica", "dcp"])
def test_nothing_is_added_on_0_33(where: str) -> None:
    """vLLM 0.33.0 has no fused up-projection: the binding of a partial
    layer adds neither attribute."""
    for layer in _bound_layers("mla", 4, 2, where):
        assert not hasattr(layer, "W_UV_dcp")
        assert not hasattr(layer.dcp_manager, "v_up_proj_combine")


# Numerics ------------------------------------------------------------------------

RUNNERS: dict[str, Callable[..., dict[str, Any]]] = {
    "mla": run_case,
    "kimi": run_kimi_case,
}


@pytest.mark.parametrize("kind", ["mla", "kimi"])
@pytest.mark.parametrize("where", ["replica", "dcp"])
def test_a2a_partial_group_matches_single_device(kind: str, where: str) -> None:
    """K = 2 of D = 4 with the all-to-all combine, 3 decode rows: every
    rank's output equals the float64 reference (replicas q >= 1 took rank
    r % K's up-projection before the fix)."""
    report = RUNNERS[kind](
        4, 2, 1, patched=True, comm_backend="a2a", partial_collectives=where
    )
    assert report["decode_lse"] is None  # the all-to-all keeps it
    for key in ("decode_out", "prefill_out", "context_lse"):
        assert report[key] <= TOLERANCE, (kind, where, key, report)


@ON_0_34
@pytest.mark.parametrize(("dcp", "shard_count"), [(4, 2), (4, 4)])
def test_a2a_with_eight_decode_rows_matches_single_device(
    dcp: int, shard_count: int
) -> None:
    """From 8 decode rows vLLM up-projects before the all-to-all: a partial
    group within its replica (a batch-size error before the fix) and, as
    the harness's check, vLLM's own K = D path are exact."""
    report = run_case(
        dcp, shard_count, 1, patched=True, comm_backend="a2a", shape=EIGHT_DECODES
    )
    for key in ("decode_out", "prefill_out", "context_lse"):
        assert report[key] <= TOLERANCE, (dcp, shard_count, key, report)
