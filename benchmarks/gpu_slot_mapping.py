# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""GPU: the Model Runner V1 slot-mapping path, patched vs unpatched.

    python -m benchmarks.gpu_slot_mapping            # needs CUDA; else exits 0
    python -m benchmarks.gpu_slot_mapping --allow-cpu  # smoke test only

Model Runner V1 exists on vLLM 0.33.0 only: on 0.34.0, which removed it, the
benchmark exits 2 saying so.

For mixed topologies (the default profile: sharded MLA, Mamba align and a
replicated draft group; and ``partial-shard-tp8-dcp8``: K = 8, K = 4 and a
replicated draft), each fresh process builds vLLM's real
``MultiGroupBlockTable`` on rank 5 of the DCP group, fills the rows of a decode
batch and a prefill batch and times ``compute_slot_mapping`` (vLLM's own Triton
kernel for every token-slot group) with CUDA events. Patched processes build
the tables from the contract's layout (``block_table_layout``: each group's K,
width and slot mode); unpatched ones build upstream's tables and give every
table the global DCP size and rank, as vLLM 0.33.0 does inside a DCP group
(it has no per-group K, so the K = 4 group runs as K = D there). Pairs
alternate unpatched/patched; the patched side also checks every slot against
the contract's reference mapping.

Writes ``benchmarks/results/<date>-gpu.json`` (``--output`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROFILES = ("kimi-k3-tp16-dcp16", "partial-shard-tp8-dcp8")
DCP_RANK = 5
MAX_LEN = 131_072
# name -> (requests, tokens scheduled per request, context length per request)
BATCHES = {
    "decode": (256, 1, 32_768),
    "prefill": (4, 8_192, 8_192),
}
CPU_BATCHES = {"decode": (8, 1, 2_048), "prefill": (1, 512, 512)}
WARMUP = 20
ITERS = 200


def _cpu_switches() -> dict[str, str]:
    # Run vLLM's Triton kernels under the interpreter on CPU tensors.
    return {"CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}


def _build_tables(
    topology: Any, *, patched: bool, device: Any, max_reqs: int, max_tokens: int
) -> tuple[Any, list[str]]:
    from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode

    from vllm_dcp_geometry.tooling import vllm_objects as _vllm

    dcp = topology.decode_context_parallel_size
    interleave = topology.interleave_size
    config = _vllm.sizing_config(topology.with_layout(max_model_len=MAX_LEN))
    specs = [_vllm.build_spec(g, topology, patched=patched) for g in topology.groups]
    names = [g.name for g in topology.groups]
    pin = device.type == "cuda"
    if patched:
        from vllm_dcp_geometry.runtime.geometry import block_table_layout

        layout = block_table_layout(
            list(zip(names, specs, strict=True)), config, MAX_LEN, dcp, DCP_RANK
        )
        tables = MultiGroupBlockTable(
            max_reqs,
            max_tokens,
            pin,
            device,
            [t.block_size for t in layout.tables],
            [t.max_num_blocks_per_req for t in layout.tables],
            interleave,
            [
                SlotMappingMode.TOKEN_TO_KV_SLOT
                if t.uses_slot_mapping
                else SlotMappingMode.NONE
                for t in layout.tables
            ],
            dcp_layout=layout,
        )
        return tables, names
    tables = MultiGroupBlockTable(
        max_reqs,
        max_tokens,
        pin,
        device,
        [s.block_size for s in specs],
        [s.max_num_blocks_per_req(config, MAX_LEN) for s in specs],
        interleave,
        [
            SlotMappingMode.NONE
            if g.kind == "mamba"
            else SlotMappingMode.TOKEN_TO_KV_SLOT
            for g in topology.groups
        ],
    )
    # What vLLM 0.33.0 gives every table on rank DCP_RANK of a real DCP group.
    for table in tables.block_tables:
        table.dcp_world_size = dcp
        table.dcp_rank = DCP_RANK
    return tables, names


def _fill(tables: Any, batch: tuple[int, int, int], seed: int) -> tuple[Any, Any]:
    """Random distinct block ids per group, by each table's own geometry;
    returns (query_start_loc, positions) on the tables' device."""
    import numpy as np
    import torch

    from vllm_dcp_geometry.contract import cdiv, virtual_block_size

    num_reqs, new_tokens, context = batch
    rng = np.random.default_rng(seed)
    rows_by_group = []
    for table in tables.block_tables:
        # Under the patch a table's dcp_world_size is its group's K.
        need = cdiv(context, virtual_block_size(table.block_size, table.dcp_world_size))
        width = table.block_table.np.shape[1]
        need = min(need, width)
        ids = rng.permutation(num_reqs * need * 2)[: num_reqs * need] + 1
        rows_by_group.append(ids.reshape(num_reqs, need).tolist())
    tables.clear()
    for req in range(num_reqs):
        tables.add_row(tuple(rows[req] for rows in rows_by_group), req)
    tables.commit_block_table(num_reqs)
    device = tables.block_tables[0].block_table.gpu.device
    query_start_loc = torch.arange(
        0, (num_reqs + 1) * new_tokens, new_tokens, dtype=torch.int32
    ).to(device)
    positions = (
        torch.arange(context - new_tokens, context, dtype=torch.int64)
        .repeat(num_reqs)
        .to(device)
    )
    return query_start_loc, positions


def _check_against_contract(
    tables: Any, names: list[str], positions: Any, batch: tuple[int, int, int]
) -> list[str]:
    """Slots that differ from the contract's reference mapping."""
    import numpy as np

    from vllm_dcp_geometry.contract import reference_slot_mapping

    num_reqs, new_tokens, _ = batch
    pos = positions.cpu().numpy().reshape(num_reqs, new_tokens)
    problems = []
    for name, table in zip(names, tables.block_tables, strict=True):
        if table.slot_mapping_mode.name == "NONE":
            continue
        got = table.slot_mapping.gpu[: num_reqs * new_tokens].cpu().numpy()
        rows = table.block_table.gpu[:num_reqs].cpu().numpy()
        want = np.concatenate(
            [
                reference_slot_mapping(
                    pos[req],
                    rows[req],
                    block_size=table.block_size,
                    shard_count=table.dcp_world_size,
                    interleave_size=table.cp_kv_cache_interleave_size,
                    shard=table.dcp_rank,
                )
                for req in range(num_reqs)
            ]
        )
        if not np.array_equal(got, want):
            bad = int(np.flatnonzero(got != want)[0])
            problems.append(f"{name}: slot {bad} is {got[bad]}, want {want[bad]}")
    return problems


def _time(fn: Any, *, cuda: bool, warmup: int, iters: int) -> float:
    """Microseconds per call."""
    import torch

    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - began) * 1e6 / iters


def child(patched: bool, cpu: bool) -> dict[str, Any]:
    """One measurement process: every profile and batch, one mode."""
    if cpu:
        from vllm_dcp_geometry.tooling import cpu_stand_ins

        cpu_stand_ins.disable_pinned_memory(cpu_stand_ins.HOST_BUFFER_MODULES)
    if patched:
        import vllm_dcp_geometry

        vllm_dcp_geometry.register()
    import torch

    from vllm_dcp_geometry.tooling import vllm_objects as _vllm
    from vllm_dcp_geometry.tooling.topology import load_profile

    if _vllm.is_vllm_patched() != patched:
        raise RuntimeError("the process is not in the mode it was started for")
    device = torch.device("cpu" if cpu else "cuda")
    batches = CPU_BATCHES if cpu else BATCHES
    warmup, iters = (1, 2) if cpu else (WARMUP, ITERS)
    max_reqs = max(b[0] for b in batches.values())
    max_tokens = max(b[0] * b[1] for b in batches.values())
    results = []
    for profile in PROFILES:
        topology = load_profile(profile)
        tables, names = _build_tables(
            topology,
            patched=patched,
            device=device,
            max_reqs=max_reqs,
            max_tokens=max_tokens,
        )
        for label, batch in batches.items():
            qsl, positions = _fill(tables, batch, seed=len(results))

            def map_slots(
                tables: Any = tables,
                n: int = batch[0],
                q: Any = qsl,
                p: Any = positions,
            ) -> None:
                tables.compute_slot_mapping(n, q, p)

            def commit_and_map(
                tables: Any = tables,
                n: int = batch[0],
                q: Any = qsl,
                p: Any = positions,
            ) -> None:
                tables.commit_block_table(n)
                tables.compute_slot_mapping(n, q, p)

            us = _time(map_slots, cuda=not cpu, warmup=warmup, iters=iters)
            us_commit = _time(commit_and_map, cuda=not cpu, warmup=warmup, iters=iters)
            problems = (
                _check_against_contract(tables, names, positions, batch)
                if patched
                else []
            )
            results.append(
                {
                    "profile": profile,
                    "batch": label,
                    "requests": batch[0],
                    "tokens": batch[0] * batch[1],
                    "context": batch[2],
                    "slot_mapping_us": us,
                    "commit_and_slot_mapping_us": us_commit,
                    "shard_counts": [t.dcp_world_size for t in tables.block_tables],
                    "contract_mismatches": problems,
                }
            )
    return {
        "mode": "patched" if patched else "unpatched",
        "device": torch.cuda.get_device_name() if not cpu else "cpu",
        "results": results,
    }


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _run_pairs(pairs: int, cuda: bool) -> dict[str, list[dict[str, Any]]]:
    """Alternate unpatched/patched child processes, ``pairs`` times."""
    from benchmarks.common import run_child

    extra_env = {} if cuda else _cpu_switches()
    runs: dict[str, list[dict[str, Any]]] = {"unpatched": [], "patched": []}
    for pair in range(pairs):
        for mode in ("unpatched", "patched"):
            print(f"  pair {pair + 1}/{pairs}: {mode}", file=sys.stderr, flush=True)
            argv_child = ["-m", "benchmarks.gpu_slot_mapping", "--child", mode]
            if not cuda:
                argv_child.append("--allow-cpu")
            runs[mode].append(
                run_child(argv_child, patched=mode == "patched", extra_env=extra_env)
            )
    return runs


def _summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per profile and batch: ratios over the pairs, mismatches."""
    from benchmarks.common import pair_summary

    rows = []
    for i, first in enumerate(runs["patched"][0]["results"]):
        unpatched = [r["results"][i] for r in runs["unpatched"]]
        patched = [r["results"][i] for r in runs["patched"]]
        row = {k: first[k] for k in ("profile", "batch", "requests", "tokens")}
        row["shard_counts"] = {
            "patched": first["shard_counts"],
            "unpatched": unpatched[0]["shard_counts"],
        }
        for metric in ("slot_mapping_us", "commit_and_slot_mapping_us"):
            row[metric] = pair_summary(
                [r[metric] for r in unpatched], [r[metric] for r in patched]
            )
        row["contract_mismatches"] = sorted(
            {m for r in patched for m in r["contract_mismatches"]}
        )
        rows.append(row)
    return rows


def _print_rows(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        s = row["slot_mapping_us"]
        print(
            f"{row['profile']:<24} {row['batch']:<8} {row['tokens']:>6} tokens: "
            f"unpatched {s['unpatched_median']:8.1f} us, patched "
            f"{s['patched_median']:8.1f} us, ratio {s['ratio_median']:.3f} "
            f"[{s['ratio_min']:.3f}-{s['ratio_max']:.3f}]"
            + (" CONTRACT MISMATCH" if row["contract_mismatches"] else "")
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_slot_mapping")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--output", type=Path)
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, smoke-test on CPU (Triton interpreter, tiny batches)",
    )
    parser.add_argument(
        "--child", choices=("patched", "unpatched"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1, vllm_release

    if not has_model_runner_v1():
        print(
            f"gpu_slot_mapping: vLLM {vllm_release()} removed Model Runner V1, "
            "whose slot-mapping path this benchmark times",
            file=sys.stderr,
        )
        return 2
    cpu = args.allow_cpu and os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    if args.child:
        print(json.dumps(child(args.child == "patched", cpu)))
        return 0

    from benchmarks.common import RESULTS_DIR, machine_info, versions

    cuda = _cuda_available()
    if not cuda and not args.allow_cpu:
        print("no CUDA device: GPU slot-mapping benchmark skipped")
        return 0
    pairs = args.pairs if cuda else 1
    runs = _run_pairs(pairs, cuda)
    rows = _summarise(runs)
    doc = {
        "date": datetime.date.today().isoformat(),
        **versions(),
        "machine": machine_info(),
        "device": runs["patched"][0]["device"],
        "smoke_test_only": not cuda,
        "pairs": pairs,
        "timing": "CUDA events" if cuda else "perf_counter (Triton interpreter)",
        "slot_mapping": rows,
    }
    suffix = "gpu" if cuda else "cpu-smoke"
    output = args.output or RESULTS_DIR / f"{doc['date']}-{suffix}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    _print_rows(rows)
    print(f"results: {output}")
    return 1 if any(r["contract_mismatches"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
