# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Slot mappings for ``simulate``: a vectorized twin of vLLM's kernels.

vLLM computes slot mappings with Triton kernels (Model Runner V1:
``ComputeSlotMappingKernel``; V2: ``_compute_slot_mappings_kernel``). They run
on a GPU, or on CPU under the Triton interpreter, which must be switched on
before vLLM is imported (``simulate`` then runs in a CPU process of its own);
without either, vLLM replaces Triton with a placeholder and no kernel runs.
Interpreted they are also too slow for every step of a 1,000,000-token replay
on 16 ranks.

So every step's slot mappings come from a twin: for each request, the
contract's ``reference_slot_mapping`` over the request's row of the worker's
own block table, with exactly the scalars the kernel would be launched with
(V1: the table's ``block_size``, ``dcp_world_size``, ``dcp_rank`` and
interleave; V2: the group's block size and the ``CP_SIZE``/rank/sharded flag
its launch carries). A column beyond the table reads ``SENTINEL_BLOCK``, so a
position the table cannot address shows up as a slot outside every block.
Where vLLM's kernels run (a GPU, or the Triton interpreter in the CPU process
``simulate`` starts on a machine without one), ``probe_real_kernels`` says
so and the simulation also runs them on sampled steps and compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_dcp_geometry.contract import (
    PAD_SLOT_ID,
    reference_slot_mapping,
    virtual_block_size,
)
from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1

if TYPE_CHECKING:
    import numpy as np

SENTINEL_BLOCK = -2
"""Block id read for a column beyond the table: its slots are negative and
never equal ``PAD_SLOT_ID``, so they can be told from "not this rank"."""

CROSS_CHECK_EVERY = 64
"""On a GPU, every 64th step is cross-checked against the real kernel (and
every step in which a request crosses a virtual block of a slot-mapped
group)."""


def interpreted_check_due(step: int, due: int) -> tuple[bool, int]:
    """Under the Triton interpreter, whether ``step`` is cross-checked, and the
    step from which the next one is: steps 1, 2, 4, 8, ... (the first step
    with work from each), so a run of S steps checks about log2(S) of them,
    early and late. An interpreted launch takes about 0.1 s per rank and
    step, every step of the default replay (1,304 steps on 16 ranks) over
    half an hour."""
    if step < due:
        return False, due
    return True, 2 * max(step, 1)


@dataclass(frozen=True)
class KernelGeometry:
    """The scalars one slot-mapping launch gives one group's table."""

    block_size: int
    shard_count: int
    """What the kernel divides positions among (V1: ``dcp_world_size``;
    V2: ``CP_SIZE``, or 1 for a group launched unsharded)."""
    shard: int
    interleave_size: int


def twin_slot_mapping(
    rows: np.ndarray,
    query_start_loc: np.ndarray,
    positions: np.ndarray,
    geometry: KernelGeometry,
) -> np.ndarray:
    """Slots of every scheduled token, request ``i`` reading ``rows[i]``.

    The kernel's arithmetic is the contract's reference mapping; a column past
    the row's end reads ``SENTINEL_BLOCK``.
    """
    import numpy as np

    out = np.full(positions.shape[0], PAD_SLOT_ID, dtype=np.int64)
    virtual = virtual_block_size(geometry.block_size, geometry.shard_count)
    for i in range(rows.shape[0]):
        start, stop = int(query_start_loc[i]), int(query_start_loc[i + 1])
        if start == stop:
            continue
        pos = positions[start:stop]
        row = rows[i]
        need = int(pos.max()) // virtual + 1
        if need > row.shape[0]:
            row = np.concatenate(
                [row, np.full(need - row.shape[0], SENTINEL_BLOCK, dtype=row.dtype)]
            )
        out[start:stop] = reference_slot_mapping(
            pos,
            row,
            block_size=geometry.block_size,
            shard_count=geometry.shard_count,
            interleave_size=geometry.interleave_size,
            shard=geometry.shard,
        )
    return out


def crosses_virtual_block(
    first_positions: np.ndarray, num_tokens: np.ndarray, virtual_sizes: list[int]
) -> bool:
    """Whether some request's scheduled range crosses a virtual-block boundary
    of some slot-mapped group."""
    last = first_positions + num_tokens - 1
    return any(
        bool(((first_positions // v) != (last // v)).any()) for v in virtual_sizes
    )


def probe_real_kernels(device: Any) -> tuple[bool, str]:
    """Whether vLLM's Triton slot-mapping kernels run here, and why not.

    Launches a real slot-mapping kernel on a one-request table (Model Runner
    V1's where the release has it, else V2's); any failure to launch means
    "not here" (without a GPU, Triton has no backend unless the interpreter
    is on). Whether it agrees with the twin is what the sampled cross-checks
    then establish, step by step.
    """
    import torch
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        return False, "vLLM found no usable Triton on this machine (no GPU)"
    launch = _launch_v1_kernel if has_model_runner_v1() else _launch_v2_kernel
    try:
        launch(torch.device(device))
    except Exception as exc:  # any launch failure means "not on this machine"
        detail = str(exc).strip().splitlines()
        reason = f": {detail[0]}" if detail else ""
        return False, (
            f"vLLM's Triton kernels cannot run here ({type(exc).__name__}{reason})"
        )
    where = torch.device(device).type
    if where == "cpu":
        where = "cpu, Triton interpreter"
    return True, f"vLLM's Triton kernels run here ({where})"


def _launch_v1_kernel(device: Any) -> None:
    """Model Runner V1's slot-mapping kernel on 40 tokens of one request."""
    import torch
    from vllm.v1.worker.block_table import BlockTable

    table = BlockTable(16, 1, 4, 64, False, device, 1)
    table.add_row([3, 5, 7], 0)
    table.commit_block_table(1)
    positions = torch.arange(40, dtype=torch.int64, device=device)
    start = torch.tensor([0, 40], dtype=torch.int32, device=device)
    table.compute_slot_mapping(1, start, positions)
    table.slot_mapping.gpu[:40].cpu()


def _launch_v2_kernel(device: Any) -> None:
    """Model Runner V2's staged writes and slot-mapping kernel on 40 tokens of
    one request (the only runner of a release without V1)."""
    import torch
    from vllm.v1.worker.gpu.block_table import BlockTables

    tables = BlockTables(
        block_sizes=[16],
        max_num_reqs=1,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[4],
        device=device,
    )
    tables.append_block_ids(0, ([3, 5, 7],), True)
    tables.apply_staged_writes()
    index = torch.zeros(1, dtype=torch.int32, device=device)
    positions = torch.arange(40, dtype=torch.int64, device=device)
    start = torch.tensor([0, 40], dtype=torch.int32, device=device)
    tables.compute_slot_mappings(index, start, positions, 40).cpu()
