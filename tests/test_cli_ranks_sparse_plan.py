# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``ranks``' DeepSeek-V3.2 sparse MLA layer with no process: the planning
of its pair of groups and its refusals, the memory estimate, the fp8_ds_mla
values against the format's own encoding, the indexer op's stand-in beneath
the plugin's wrapper, and the pins of what the sparse runner drives and
stands in for. The real runs are in ``test_cli_ranks_sparse``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.deepseek_v32_layers import (
    PROFILE,
    L,
    R,
    layer_groups,
    topology_mapping,
)
from vllm_dcp_geometry.tooling.cli.ranks import cases
from vllm_dcp_geometry.tooling.topology import load_profile, topology_from_mapping

pytestmark = pytest.mark.patches(
    "worker.deepseek_v32_attention", "worker.sparse_attn_indexer"
)


# Planning (no process) ---------------------------------------------------------------


def _plan(*layers: list[dict[str, Any]], **kw: Any) -> dict[str, dict[str, Any]]:
    topology = topology_from_mapping(topology_mapping(*layers), source="test")
    planned = cases.plan_groups(
        topology, gpu=False, scale=1, partial_collectives="replica", **kw
    )
    return {g["name"]: g for g in planned}


def test_the_profile_plans_its_layer_as_one_pair() -> None:
    planned = cases.plan_groups(
        load_profile(PROFILE), gpu=False, scale=8, partial_collectives="replica"
    )
    by_name = {g["name"]: g for g in planned}
    for name, runner, backend in (
        ("latent.k4", "sparse_mla", "FLASHMLA_SPARSE"),
        ("indexer.k4", "sparse_indexer", "DEEPSEEK_V32_INDEXER"),
    ):
        g = by_name[name]
        assert g["run"] is True and g["runner"] == runner and g["backend"] == backend
        assert (g["sparse_latent"], g["sparse_indexer"]) == ("latent.k4", "indexer.k4")
        assert g["indexer_topk"] == 2048 and g["collective_world_size"] == 4
        assert g["shape"]["heads_per_rank"] == 2  # 128 / 8 / 8
        assert g["shape"]["dtype"] == "bfloat16"  # the activations, not uint8


def test_a_layer_ranks_cannot_run_whole_is_not_run_with_its_reason() -> None:
    latent, indexer = layer_groups(0, "k4", 4)
    alone = _plan([latent])
    assert "indexer caches are not one group" in alone["latent.k4"]["reason"]
    topk = _plan(layer_groups(0, "k4", 4, topk=256))
    assert "topk_buffer_width = 256" in topk["latent.k4"]["reason"]
    assert "top-k 256" in topk["indexer.k4"]["reason"]
    no_dtype = {k: v for k, v in latent.items() if k != "activation_dtype"}
    missing = _plan([no_dtype, indexer])
    assert "no activation_dtype" in missing["latent.k4"]["reason"]
    # --attention-backend reaches the latent group only: the layer fixes
    # its indexer's.
    named = _plan(layer_groups(0, "k4", 4), backend="TRITON_MLA")
    assert named["latent.k4"]["run"] is False
    assert named["indexer.k4"]["backend"] == "DEEPSEEK_V32_INDEXER"


def test_the_memory_check_sizes_the_sparse_layer() -> None:
    """The pre-flight estimate covers the layer (no shape of its own for the
    indexer group is needed): unscaled the profile's layer needs more than
    scaled."""
    from vllm_dcp_geometry.tooling.cli.ranks import resources

    topology = load_profile(PROFILE)
    sizes = []
    for scale in (1, 8):
        planned = cases.plan_groups(
            topology, gpu=False, scale=scale, partial_collectives="replica"
        )
        runnable = [g for g in planned if g["run"]]
        size, words = resources._largest_group(topology, runnable, scale)
        assert "512+64 bfloat16" in words
        sizes.append(size)
    assert sizes[0] > sizes[1] > 0


# Stand-ins and inputs (no process) --------------------------------------------------


def test_fp8_ds_mla_values_are_what_the_format_holds() -> None:
    """Each latent tile is float8_e4m3 values times a power-of-two scale
    with its largest magnitude at 448 scales (the writer's scale, whether
    raw or rounded to a power of two), rope bfloat16: encoding them as
    fp8_ds_mla and decoding gives them back exactly, and bfloat16 holds
    them. Plain normal rows do not survive either."""
    from vllm_dcp_geometry.tooling.sparse_rank_run import fp8_ds_mla_values

    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(40, L + R, generator=gen, dtype=torch.float64) * 3

    def encoded(values: torch.Tensor) -> torch.Tensor:
        tiles = values[:, :L].reshape(-1, 4, 128)
        scale = (tiles.abs().amax(-1, keepdim=True) / 448).float().double()
        fp8 = (tiles / scale).to(torch.float8_e4m3fn).double() * scale
        rope = values[:, L:].to(torch.bfloat16).double()
        return torch.cat([fp8.reshape(-1, L), rope], dim=1)

    values = fp8_ds_mla_values(rows)
    assert torch.equal(encoded(values), values)
    assert torch.equal(values.to(torch.bfloat16).double(), values)
    assert not torch.equal(encoded(rows), rows)
    assert not torch.equal(rows.to(torch.bfloat16).double(), rows)


def test_the_indexer_stand_in_runs_beneath_the_plugins_wrapper() -> None:
    """The layer's indexer call resolves to the plugin's wrapper in this
    (patched) process; re-made around a stand-in it is the same factory's
    wrapper and reaches the stand-in (no bound cache: upstream's arguments
    untouched). Unwrapped, the stand-in is what runs."""
    from vllm.models.deepseek_v32 import attention as dsv32

    from vllm_dcp_geometry.patches.worker import deepseek_v32_attention
    from vllm_dcp_geometry.runtime.patching import FACTORY_ATTR
    from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_indexer import (
        plugin_wrappers_around,
    )

    seen: list[tuple[Any, ...]] = []

    def stand_in(*args: Any, **kwargs: Any) -> str:
        seen.append((args, kwargs))
        return "stood in"

    remade = plugin_wrappers_around(dsv32.sparse_attn_indexer, stand_in)
    factory = deepseek_v32_attention._make_sparse_attn_indexer
    assert getattr(dsv32.sparse_attn_indexer, FACTORY_ATTR).endswith(
        factory.__qualname__
    )
    assert remade is not stand_in and remade.__code__ is factory(stand_in).__code__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(deepseek_v32_attention, "_bound_caches", [])
        assert remade("logits", "prefix", dcp_rank=1, dcp_world_size=4) == "stood in"
    assert seen == [(("logits", "prefix"), {"dcp_rank": 1, "dcp_world_size": 4})]
    assert plugin_wrappers_around(stand_in, print) is print


def test_the_sparse_runner_pins_what_it_drives_and_stands_in_for() -> None:
    from vllm_dcp_geometry.runtime.patching import verify_symbol
    from vllm_dcp_geometry.tooling.cli.ranks.runners.sparse_layer import RELIED_ON
    from vllm_dcp_geometry.tooling.sparse_rank_run import indexer_op_symbol
    from vllm_dcp_geometry.tooling.sparse_stand_ins import (
        FLASHMLA_SCHEDULER,
        sparse_stand_in_symbols,
    )

    for symbol in (
        *RELIED_ON,
        *sparse_stand_in_symbols(),
        FLASHMLA_SCHEDULER,
        indexer_op_symbol(),
    ):
        verify_symbol(symbol)
