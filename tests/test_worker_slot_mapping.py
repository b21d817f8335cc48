# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Slot mappings of every DCP rank, from vLLM's real block tables and kernels.

Model Runner V1 (``MultiGroupBlockTable`` / ``ComputeSlotMappingKernel``) and V2
(``BlockTables`` / ``_compute_slot_mappings_kernel``) run on CPU under the
Triton interpreter. All D ranks of a group are simulated; each rank's slots
must equal ``contract.reference_slot_mapping`` and, over the K ranks of one
replica group, cover every scheduled position exactly once inside the
request's own blocks. The cases and checks are ``tests.support.slot_mapping``,
which the GPU script runs with CUDA tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support import worker as h
from tests.support.processes import run_python
from tests.support.slot_mapping import (
    D16,
    MIXED_COUNTS,
    SWEEP,
    L,
    check_mixed,
    check_sweep,
    mixed_scenario,
    mixed_specs,
    mixed_v1_slots,
    mixed_v2_slots,
    v1_sweep,
    v2_sweep,
)
from tests.support.unpatched_slots import (
    check_unpatched_mixed_fails,
    dcp1_outputs,
    unpatched_mixed_data,
)
from tests.support.vllm_configs import make_vllm_config
from vllm_dcp_geometry import contract as c
from vllm_dcp_geometry.runtime.geometry import (
    block_table_layout,
    upstream_get_block_table_width,
)

pytestmark = pytest.mark.patches(
    "worker.block_table", "worker.gpu_model_runner", "worker.gpu_block_table"
)

REPO = str(Path(__file__).resolve().parents[1])

MODEL_RUNNER_V1 = pytest.mark.vllm_releases("0.33.0")
"""Model Runner V1 exists on vLLM 0.33.0 only (0.34.0 removed it); the
unpatched and D = 1 baselines run V1 and V2 side by side."""


# The sweep: D in {1, 2, 4, 8, 16}, every K | D, I in {1, 16, B} -----------------


@MODEL_RUNNER_V1
@pytest.mark.parametrize(("dcp", "interleave"), SWEEP)
def test_v1_every_rank_matches_reference(dcp: int, interleave: int) -> None:
    slots, scenario = v1_sweep(dcp, interleave)
    check_sweep(slots, scenario, dcp, interleave, "V1")


@pytest.mark.parametrize(("dcp", "interleave"), SWEEP)
def test_v2_every_rank_matches_reference(
    dcp: int, interleave: int, v2_on_cpu: None
) -> None:
    slots, scenario = v2_sweep(dcp, interleave)
    check_sweep(slots, scenario, dcp, interleave, "V2")


# Mixed topology at D = 16 ---------------------------------------------------------


def test_mixed_topology_widths_match_the_contract() -> None:
    config = make_vllm_config(D16, interleave=1, real=True)
    layout = block_table_layout(mixed_specs(), config, L, D16, 5)
    assert [t.shard_count for t in layout.tables] == MIXED_COUNTS
    # The contract's worked examples.
    assert [t.max_num_blocks_per_req for t in layout.tables] == [977, 3907, 15625, 1310]
    assert [t.width for t in layout.tables] == [978, 3908, 15626, 1310]
    assert [t.uses_slot_mapping for t in layout.tables] == [True, True, True, False]
    for table, kk in zip(layout.tables[:3], MIXED_COUNTS[:3], strict=True):
        assert table.width == upstream_get_block_table_width()(
            c.attention_block_table_width(L, 64, kk), 64, token_alignment=128
        )
    assert layout.tables[3].width == c.recurrent_align_block_table_width(L, 768, 7)
    v2 = h.v2_table_args(h.kv_cache_config(mixed_specs()), config, L)
    assert v2["max_num_blocks_per_group"] == [t.width for t in layout.tables]


@MODEL_RUNNER_V1
def test_mixed_topology_v1_every_rank() -> None:
    scenario = mixed_scenario()
    check_mixed(mixed_v1_slots(scenario), scenario, 3, "V1 mixed")


def test_mixed_topology_v2_every_rank(v2_on_cpu: None) -> None:
    scenario = mixed_scenario()
    # V2 maps slots for the recurrent group too (uses_slot_mapping), as K = 1.
    check_mixed(mixed_v2_slots(scenario), scenario, 4, "V2 mixed")


# Unpatched vLLM gets the replicated and partial groups wrong ----------------------

UNPATCHED_CODE = """
import json
from tests.support import worker as h
from tests.support.unpatched_slots import dcp1_outputs, unpatched_mixed
h.enable_v2_on_cpu()
data = json.loads(DATA)
print(json.dumps({"mixed": unpatched_mixed(data), "dcp1": dcp1_outputs(patched=False)}))
"""


def run_unpatched(code: str, data: dict[str, Any]) -> Any:
    source = f"DATA = {json.dumps(json.dumps(data))}\n" + code
    return run_python(
        source,
        patched=False,
        env={"PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )


@pytest.fixture(scope="module")
def unpatched() -> dict[str, Any]:
    """Both unpatched baselines, from one fresh unpatched process."""
    return run_unpatched(UNPATCHED_CODE, unpatched_mixed_data())


@MODEL_RUNNER_V1
def test_unpatched_vllm_fails_the_same_checks(unpatched: dict[str, Any]) -> None:
    check_unpatched_mixed_fails(unpatched["mixed"])


# D = 1 is byte-identical to unpatched vLLM ----------------------------------------


@MODEL_RUNNER_V1
def test_dcp1_is_byte_identical_to_unpatched(
    unpatched: dict[str, Any], v2_on_cpu: None
) -> None:
    patched = dcp1_outputs(patched=True)
    baseline = unpatched["dcp1"]
    assert baseline["v1_runner"]["slots"][3] is None  # Mamba: no slot mapping
    assert patched["v1_layout"] == baseline["v1_runner"]
    patched.pop("v1_layout")
    assert patched == baseline
    # The comparison is not vacuous: slots were written and masking happened.
    assert any(s != -1 for s in patched["v1_runner"]["slots"][0][:100])
    assert patched["v2_window"][2][0][0] == 0
