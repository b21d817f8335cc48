# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The runner of vLLM's generic ``MLAAttention`` (a group whose topology names
no layer class, or that one): the dense MLA group built by
``vllm_setup.build_layer`` on the group's backend and run through
``MLAAttention.forward_impl`` (``mla_phases``), planned by ``mla_cases`` and
held to ``verdict.measure_dense``.
"""

from __future__ import annotations

from typing import Any

from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import (
    LayerRunner,
    PlannedGroup,
    RankRun,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_cases import (
    DENSE_SPEC_VALUES,
    dense_case,
    dense_worker_bytes,
    mla_shape_refused,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.mla_phases import (
    GroupSetUp,
    run_set_up,
    set_up_group,
)
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
from vllm_dcp_geometry.tooling.cli.ranks.verdict import measure_dense
from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import build_layer


def forward_impl_attend(
    set_up: GroupSetUp,
    q: Any,
    kv_c: Any,
    k_pe: Any,
    cache: Any,
    metadata: Any,
    slots: Any,
    output: Any,
) -> None:
    """``MLAAttention.forward_impl``: the new tokens' latents are written by
    the caller's cache (the runner's KV write runs before the layer)."""
    set_up.layer.forward_impl(q, kv_c, k_pe, cache, metadata, output=output)


def build_mla_attention(
    config: Any, weight: Any, rank: int, shape: Shape, device: str, group: PlannedGroup
) -> tuple[Any, Any]:
    """vLLM's generic ``MLAAttention`` (``vllm_setup.build_layer``)."""
    return build_layer(config, weight, rank, shape, device)


def run_group(group: PlannedGroup, run: RankRun) -> dict[str, Any]:
    """Build and run one group of vLLM's ``MLAAttention`` on this rank."""
    set_up = set_up_group(group, run, build_mla_attention, forward_impl_attend)
    return run_set_up(set_up, run)


RUNNER = LayerRunner(
    "mla",
    DENSE_SPEC_VALUES,
    plan=dense_case,
    refuse_shape=mla_shape_refused,
    worker_bytes=dense_worker_bytes,
    run_group=run_group,
    measure=measure_dense,
)
