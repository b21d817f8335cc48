# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the ``simulate`` tests run: the tests' ``SimulationOptions`` (the
command's, plus two test-only hooks that go through the simulation's extension
point ``vllm_dcp_geometry.tooling.cli.simulate.options.SimulationHooks``:
``on_step(view)``, called after each step's checks with the step's
``StepView``, to feed the same outputs to vLLM's own worker code or hand a
check a deliberately wrong input, and ``shift_shard=(group, rank)``, where that
rank's table of that group stores the next shard instead of its own, a broken
geometry the checks must catch), and small topologies with every kind of
group at once: ``hybrid(dcp)`` has a sharded attention group (K = D), a
partially sharded one (K = 2 where D > 2), a recurrent Mamba group in align
mode with speculative blocks and a replicated draft group (K = 1) at TP = DCP
= ``dcp``, small enough that a simulation is a few dozen steps; the CLI input
tests start from its ``attention_group``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from vllm_dcp_geometry.tooling.cli.simulate import options
from vllm_dcp_geometry.tooling.topology import Topology, topology_from_mapping

MODEL_RUNNER_V1 = pytest.mark.vllm_releases("0.33.0")
"""Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it)."""

RUNNERS = [pytest.param("v1", marks=MODEL_RUNNER_V1), "v2"]
"""Both model runners, for ``parametrize``: V1 where the release has it."""

# Hooks ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulationOptions(options.SimulationOptions):
    """``options.SimulationOptions`` with the tests' hooks."""

    shift_shard: tuple[int, int] | None = None
    """(group, rank) whose shard is shifted by one."""
    on_step: Callable[[options.StepView], None] | None = None
    """Called after each step's checks."""
    as_on_a_gpu: bool = True
    """Cross-check as a GPU run does (the tests' topologies are small enough
    to feed vLLM's tables every step under the interpreter)."""

    def hooks(self) -> options.SimulationHooks:
        return _TestHooks(self.shift_shard, self.on_step, self.as_on_a_gpu)


class _TestHooks(options.SimulationHooks):
    def __init__(
        self,
        shift_shard: tuple[int, int] | None,
        on_step: Callable[[options.StepView], None] | None,
        as_on_a_gpu: bool,
    ) -> None:
        self.shift_shard = shift_shard
        self.on_step = on_step
        self.as_on_a_gpu = as_on_a_gpu

    def cross_checks_as_on_a_gpu(self) -> bool:
        return self.as_on_a_gpu

    def shard(self, group: int, rank: int, shard: int, shard_count: int) -> int:
        if self.shift_shard != (group, rank):
            return shard
        if shard_count == 1:
            raise ValueError("shifting a shard needs a group with K > 1")
        return (shard + 1) % shard_count

    def step_checked(self, view: options.StepView) -> None:
        if self.on_step is not None:
            self.on_step(view)


# Topologies -------------------------------------------------------------------------


def attention_group(name: str = "g", layer: str = "l0", **extra: Any) -> dict[str, Any]:
    """A small full-attention group of a topology file (``extra`` adds or
    replaces fields); the CLI input tests start from it too."""
    return {
        "name": name,
        "kind": "full_attention",
        "layers": [layer],
        "block_size": 16,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "bfloat16",
        **extra,
    }


def hybrid_mapping(dcp: int) -> dict[str, Any]:
    groups = [attention_group("attn.kD", "model.layers.0.attn")]
    if dcp > 2:
        groups.append(
            attention_group("attn.k2", "model.layers.1.attn", dcp_kv_shard_count=2)
        )
    groups.append(
        {
            "name": "state",
            "kind": "mamba",
            "layers": ["model.layers.2.mixer"],
            "block_size": 64,
            "shapes": [[3, 32], [2, 16, 16]],
            "dtypes": ["bfloat16", "float32"],
            "num_speculative_blocks": 2,
        }
    )
    groups.append(attention_group("draft", "model.mtp.layers.0.attn", draft=True))
    return {
        "name": f"test-hybrid-dcp{dcp}",
        "description": "simulate test topology",
        "parallel": {
            "tensor_parallel_size": dcp,
            "decode_context_parallel_size": dcp,
            "cp_kv_cache_interleave_size": 1,
        },
        "limits": {"max_model_len": 4096, "max_num_seqs": 4},
        "cache": {"block_size": 64, "mamba_cache_mode": "align"},
        "replay": {"tokens": 2048, "step_tokens": 256},
        "groups": groups,
    }


def hybrid(dcp: int) -> Topology:
    return topology_from_mapping(hybrid_mapping(dcp), source=f"test hybrid {dcp}")


def group_index(topology: Topology, name: str) -> int:
    return next(i for i, g in enumerate(topology.groups) if g.name == name)
