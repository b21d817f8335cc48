# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a ``ranks`` worker relies on, checked without a whole run: the
KV-write stand-in at the contract's slots, the vLLM symbols a worker wraps
or stands in for (pinned, all or nothing), the Triton interpreter's bfloat16
``tl.dot`` stand-in, the replica groups a worker makes as ``vllm serve``
workers do, and traffic counted where a forward's collectives happen (two
gloo ranks). The whole runs are in ``test_cli_ranks``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from vllm_dcp_geometry.contract import reference_slot_mapping
from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape

pytestmark = pytest.mark.patches("worker.gpu_worker")


# The KV-write stand-in against the contract --------------------------------------


@pytest.mark.parametrize(
    ("shard_count", "interleave"), [(1, 1), (2, 1), (4, 4), (2, 8)]
)
def test_the_kv_write_stand_in_writes_the_contracts_slots(
    monkeypatch: pytest.MonkeyPatch, shard_count: int, interleave: int
) -> None:
    """``group.write_cache`` (through ``vllm._custom_ops.concat_and_cache_mla``,
    the stand-in) puts every position of every request on the shard the
    contract names, at the slot it names, once across the K shards."""
    import torch
    import vllm._custom_ops as ops

    from vllm_dcp_geometry.tooling import custom_op_stand_ins as cpu_stand_ins
    from vllm_dcp_geometry.tooling.cli.ranks.runners import inputs as group

    monkeypatch.setattr(ops, "concat_and_cache_mla", cpu_stand_ins.concat_and_cache_mla)
    shape = Shape(2, kv_lora_rank=5, rope_dim=3, dtype="float32", max_model_len=64)
    block, num_blocks = 8, 40
    requests = [(37, 1), (3, 1), (16, 5)]
    width = -(-64 // (block * shard_count))
    inputs = group.make_inputs(requests, 2, shape, num_blocks, width, seed=3)
    written = torch.zeros(len(requests), 64, dtype=torch.int64)
    for shard in range(shard_count):
        layout = group.ShardLayout(block, shard_count, interleave, shard)
        cache = group.write_cache(inputs, layout, shape, num_blocks, "cpu")
        flat = cache.view(-1, cache.shape[-1])
        for i, (context, new) in enumerate(requests):
            slots = reference_slot_mapping(
                range(context + new),
                inputs.rows[i],
                block_size=block,
                shard_count=shard_count,
                interleave_size=interleave,
                shard=shard,
            )
            for position, slot in enumerate(slots):
                if slot < 0:
                    continue
                written[i, position] += 1
                want = torch.cat([inputs.kv_c[i][position], inputs.k_pe[i][position]])
                assert torch.equal(flat[slot], want.float()), (shard, i, position)
    for i, (context, new) in enumerate(requests):
        assert written[i, : context + new].tolist() == [1] * (context + new)


# The worker's pins and start-up ---------------------------------------------------


def test_the_worker_pins_what_it_wraps_and_stands_in_for() -> None:
    """Every vLLM symbol a worker wraps to measure (``measuring.METERED``
    and ``PYNCCL_METERED``) or stands in for on CPU (``cpu_stand_ins.STAND_IN_SYMBOLS``) has, in the
    installed vLLM, the parameters its code was written against; a changed
    parameter list is refused."""
    import dataclasses

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, verify_symbol
    from vllm_dcp_geometry.tooling.cli.ranks.measuring import METERED
    from vllm_dcp_geometry.tooling.cli.ranks.traffic import PYNCCL_METERED
    from vllm_dcp_geometry.tooling.custom_op_stand_ins import STAND_IN_SYMBOLS

    for symbol in (*METERED, *PYNCCL_METERED, *STAND_IN_SYMBOLS):
        verify_symbol(symbol)
    for symbol in (METERED[0], PYNCCL_METERED[0], STAND_IN_SYMBOLS[0]):
        changed = dataclasses.replace(symbol, parameters="self, x")
        with pytest.raises(UpstreamChangedError, match="parameters changed"):
            verify_symbol(changed)


def test_the_interpreter_dot_stand_in_multiplies_bfloat16_values() -> None:
    """The Triton interpreter's own ``tl.dot`` of bfloat16 operands
    multiplies their uint16 bits (garbage of order 1e9 here); the stand-in
    a CPU worker installs (``cpu_stand_ins.INTERPRETER_DOT``, pinned) widens
    them to the float32 values they are and gets the exact product; float32
    operands pass through unchanged."""
    import dataclasses

    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, verify_symbol
    from vllm_dcp_geometry.tooling import cpu_stand_ins

    verify_symbol(cpu_stand_ins.INTERPRETER_DOT)
    changed = dataclasses.replace(cpu_stand_ins.INTERPRETER_DOT, parameters="a, b")
    with pytest.raises(UpstreamChangedError, match="parameters changed"):
        verify_symbol(changed)
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2))
    exact = (a.double() @ b.double()).numpy()

    def handle(x: Any) -> Any:
        return interpreter.TensorHandle(x.view(torch.uint16).numpy(), tl.bfloat16)

    def dot(create_dot: Any, x: Any, y: Any) -> Any:
        zero = interpreter.TensorHandle(np.zeros((16, 16), np.float32), tl.float32)
        return create_dot(None, x, y, zero, None, None).data

    original = interpreter.InterpreterBuilder.create_dot
    original = getattr(original, "__wrapped__", original)
    stand_in = cpu_stand_ins._dot_of_bfloat16_values(original)
    assert np.abs(dot(original, handle(a), handle(b)) - exact).max() > 1e6
    assert np.abs(dot(stand_in, handle(a), handle(b)) - exact).max() < 1e-4
    floats = [interpreter.TensorHandle(x.float().numpy(), tl.float32) for x in (a, b)]
    assert np.array_equal(dot(stand_in, *floats), dot(original, *floats))


def test_meters_on_a_changed_vllm_wrap_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """``install_meters`` is all or nothing: one changed symbol (here the
    last) and no communicator or attention function is wrapped; with torch's
    flight recorder off it refuses to count at all."""
    import importlib

    from vllm_dcp_geometry.runtime.patching import UpstreamChangedError, UpstreamSymbol
    from vllm_dcp_geometry.tooling.cli.ranks import measuring

    def metered() -> list[object]:
        found = []
        for symbol in (*measuring.METERED, *measuring.PYNCCL_METERED):
            owner: object = importlib.import_module(symbol.module)
            *path, name = symbol.qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            found.append(vars(owner)[name])
        return found

    before = metered()
    monkeypatch.delenv(measuring.FLIGHT_RECORDER_ENV, raising=False)
    with pytest.raises(RuntimeError, match="flight recorder is off"):
        measuring.install_meters.__wrapped__()
    monkeypatch.setenv(measuring.FLIGHT_RECORDER_ENV, "64")
    changed = UpstreamSymbol(measuring.TRITON_MLA, "TritonMLAImpl.forward_mqa", "q")
    monkeypatch.setattr(measuring, "METERED", (*measuring.METERED, changed))
    with pytest.raises(UpstreamChangedError, match=r"TritonMLAImpl\.forward_mqa"):
        measuring.install_meters.__wrapped__()
    monkeypatch.undo()
    assert all(a is b for a, b in zip(metered(), before, strict=True))


def test_the_ranks_make_replica_groups_as_vllm_serve_workers_do(
    tmp_path: Path,
) -> None:
    """A worker calls the start-up function itself
    (``replica_groups.make_replica_groups``, what the ``Worker.init_device``
    patch calls), on the config a ``vllm serve`` worker of the plan holds:
    the plan's partial K only, and none with ``--partial-collectives dcp``."""
    from vllm_dcp_geometry.runtime import replica_groups
    from vllm_dcp_geometry.tooling.cli.ranks import vllm_setup, worker

    assert worker.make_replica_groups is replica_groups.make_replica_groups
    shape = Shape(2, 512, 64, "bfloat16", max_model_len=192)
    path = vllm_setup.model_dir(4, shape)
    groups = [{"index": i, "shard_count": k} for i, k in enumerate((4, 2, 1))]
    for where, counts in (("replica", (2,)), ("dcp", ())):
        plan = {"world": 4, "partial_collectives": where, "groups": groups}
        config = vllm_setup.serving_config(plan, shape, path, "cpu")
        assert replica_groups.replica_shard_counts(config) == counts


# Traffic counted where it happens --------------------------------------------------


def test_traffic_is_counted_where_it_happens() -> None:
    """Two gloo ranks with the ``ranks`` worker's distributed state issue a
    collective through each API a forward could use inside the meter's
    counted block (``traffic_worker.CASES``): vLLM's ``GroupCoordinator``,
    ``torch.distributed`` on the DCP device group directly, a functional
    collective, a broadcast on the DCP CPU group and an all-reduce on the TP
    group. Every one is counted, once, at the bytes the ring model gives its
    input, restated here: the coordinator's reduce-scatter as the all-reduce
    gloo runs it, the broadcast as unmodeled (0 bytes, named), the TP one
    under the TP group's vLLM name (``tp:0``); the all-gather before the
    block is not."""
    import socket
    import subprocess
    import sys

    from tests.support.processes import REPO_ROOT
    from tests.support.traffic_worker import CASES, ELEMENTS

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.traffic_worker", str(r), str(port)],
            cwd=REPO_ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [w.communicate(timeout=300) for w in workers]
    for worker, (_, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:]
    n = ELEMENTS * 4
    gather, reduce = 2 * (2 - 1) * n, 4 * (2 - 1) * n // 2
    want = [
        ("all_gather", "dcp", gather),
        ("all_reduce", "dcp", reduce),
        ("all_gather", "dcp", gather),
        ("all_gather", "dcp", gather),
        (None, "dcp", 0),
        ("all_reduce", "other:tp:0", reduce),
    ]
    assert len(want) == len(CASES)
    for out, _ in outputs:
        result = json.loads(out.strip().splitlines()[-1])
        seen = [(c["op"], c["group"], c["moved"]) for c in result["collectives"]]
        assert seen == want, result
        assert all(
            c["world"] == 2 and c["input_bytes"] == n for c in result["collectives"]
        )
        assert result["total"] == sum(moved for _, _, moved in want)
        assert result["unmodeled"] == ["gloo:broadcast on dcp"]
