# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry ranks``: DCP attention across D real worker processes.

``simulate`` runs every rank in one process; this command starts D worker
processes on this machine (``run``; gloo on CPU, NCCL where D GPUs are
visible), each initialising vLLM's real distributed state and loading the
plugin through vLLM's own plugin loader (``worker``). Each builds the
topology's attention groups (MLA, and full-attention and sliding-window ones
on FLASH_ATTN) on vLLM's real layer, impl and builder (the runner of the
group's layer class, ``runners``, over ``vllm_setup``'s objects), writes
random K/V at the contract's slot mapping for the group's K, runs a decode step and
a chunked prefill over a context with vLLM's real collectives (partial groups
within their K-rank replica groups, made by the same start-up code as
``vllm serve``'s workers; ``--partial-collectives dcp`` keeps them on the
D-wide DCP group), and holds every rank's output and LSE to a float64
single-device reference, counting the bytes each rank moves through the DCP
and replica groups (``measuring``, ``traffic``). Every group runs at its own shapes
(``cases``: query heads per rank, latent and rope dims, dtype, block size,
K, interleave); ``--scale N`` divides the query heads per rank by N where
the operator asks, and the output says so. Partial groups' collectives go where the
topology's ``[parallel] partial_collectives`` says, as for ``plan``, unless
``--partial-collectives`` says otherwise. Groups whose backends need CUDA,
recurrent groups, layer classes this command does not build and groups with
no shapes in the topology are listed with the reason (a FlashAttention
group's CUDA kernel is stood in for on a CPU, ``flash_attn_stand_ins``); a
topology with no group to run is refused. The CPU switches the workers need
are set only in their environment (``tooling.cpu_stand_ins``). The text is
``report``'s.

``--baseline`` also runs the same ranks on unpatched vLLM (children with
``VLLM_PLUGINS=""``); the exit status is then 1 where unpatched vLLM is
wrong too. Exit 0 clean, 1 wrong numerics or bytes that differ from the
traffic formula, 2 bad input (no group to run, a machine that cannot hold
the run).
"""

from __future__ import annotations

import argparse
import importlib

from vllm_dcp_geometry.contract.collectives import PARTIAL_COLLECTIVES
from vllm_dcp_geometry.tooling.cli.common import runs
from vllm_dcp_geometry.tooling.cli.common.flags import (
    add_topology_args,
    int_flag,
    load_topology,
    output_file,
)
from vllm_dcp_geometry.tooling.cli.common.noise import (
    third_party_noise_hidden,
    vllm_notes_held_back,
)
from vllm_dcp_geometry.tooling.cli.common.status import EXIT_OK, CliError
from vllm_dcp_geometry.tooling.cli.ranks.report import format_baseline, format_report
from vllm_dcp_geometry.tooling.cli.ranks.run import (
    DEVICES,
    run_ranks,
    torchrun_environment,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners import RUNNERS
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError
from vllm_dcp_geometry.tooling.topology.limits import NON_NEGATIVE_INT32, IntRange

HELP = (
    "DCP attention across D real worker processes (vLLM's collectives), "
    "checked against a float64 reference"
)

MAX_RANKS = 16
"""Worker processes one run may start (each imports vLLM; the memory D of them
need is checked against this machine's before they start:
``resources.check_memory``)."""

MLA_ATTENTION = "vllm.model_executor.layers.attention.mla_attention"

SCALE_RANGE = IntRange(1, 1024, "a divisor of the groups' query heads per rank")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``ranks``' flags: the topology flags, then its own."""
    add_topology_args(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--receipt", metavar="FILE", type=output_file, help="write a JSON receipt"
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also run the ranks on unpatched vLLM (VLLM_PLUGINS='')",
    )
    parser.add_argument(
        "--partial-collectives",
        choices=PARTIAL_COLLECTIVES,
        default=None,
        help="where partial groups run their collectives: within their "
        "K-rank replica or on the D-wide DCP group (default: the topology's "
        "[parallel] partial_collectives, as plan reads it)",
    )
    parser.add_argument(
        "--scale",
        type=int_flag(SCALE_RANGE),
        default=1,
        metavar="N",
        help="run smaller shapes: divide every group's query heads per rank "
        "by N, rounded up but not below 2 (default 1: the groups' own "
        "shapes); kv_lora_rank, "
        "rope dim, dtype, block size, K and interleave stay (vLLM's MLA "
        "admits latent rows of 320, 512 or 576 only)",
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the ranks run: cuda (one worker per GPU, NCCL, the "
        "compiled backends), cpu (gloo, vLLM's Triton kernels interpreted) or "
        "auto (cuda where D GPUs are visible); under torchrun each process is "
        "one rank on its local GPU",
    )
    parser.add_argument(
        "--attention-backend",
        choices=("auto", *backend_choices()),
        default="auto",
        metavar="NAME",
        help="the backend every MLA group runs on (default auto: TRITON_MLA on "
        "a CPU; on a GPU the group's SM90 backend, as plan reports it; "
        "FlashAttention groups always run FLASH_ATTN): " + ", ".join(backend_choices()),
    )
    parser.add_argument(
        "--float32",
        action="store_true",
        help="run every group in float32 instead of its own dtype (the check "
        "against float64 is then float32's: within about 1e-5)",
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also capture each group's decode step in a CUDA graph and "
        "replay it, held to the same reference (GPU runs)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--seed",
        type=int_flag(NON_NEGATIVE_INT32),
        default=0,
        help="seed of the random K/V, queries and weights",
    )


def backend_choices() -> list[str]:
    """Every backend some runner runs (``runners.RUNNERS``)."""
    names = {name for runner in RUNNERS.values() for name in runner.backends}
    return sorted(names)


def import_mla_quietly(verbose: bool) -> None:
    """Import vLLM's MLA module (planning asks it which latent rows it
    admits) with its import notes kept out of the output: torch's (hidden
    by ``noise``) and vLLM's platform warnings (a CPU build has no
    ``vllm._C``), which it logs before its log format is set."""
    if verbose:
        importlib.import_module(MLA_ATTENTION)
        return
    with third_party_noise_hidden():
        importlib.import_module("vllm.logger")
        with vllm_notes_held_back():
            importlib.import_module(MLA_ATTENTION)


def check_inputs(topology: Topology) -> None:
    """Refuse, before any process starts, a run this machine cannot hold."""
    dcp = topology.decode_context_parallel_size
    IntRange(1, MAX_RANKS, "MAX_RANKS: one process per rank").check(
        dcp, "ranks: the DCP size"
    )
    if dcp < 2:
        raise TopologyError(
            f"ranks: the DCP size must be at least 2 (got {dcp}); with one rank "
            "there are no collectives to run"
        )


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry ranks``."""
    topology = load_topology(args)
    check_inputs(topology)
    verbose = getattr(args, "verbose", False)
    progress = not args.no_progress
    import_mla_quietly(verbose)
    where = args.partial_collectives or topology.partial_collectives
    if args.baseline and torchrun_environment() is not None:
        raise CliError(
            "ranks --baseline starts fresh unpatched workers, which torchrun "
            "does not: run the baseline as its own torchrun with VLLM_PLUGINS=''"
        )
    device = {
        "device": args.device,
        "backend": args.attention_backend,
        "cuda_graph": args.cuda_graph,
        "dtype": "float32" if args.float32 else None,
    }
    report = run_ranks(
        topology,
        patched=True,
        seed=args.seed,
        progress=progress,
        verbose=verbose,
        scale=args.scale,
        partial_collectives=where,
        **device,
    )
    if report is None:
        # A torchrun rank other than 0: rank 0 reports for every rank.
        return EXIT_OK
    report.update(runs.versions())
    report["dtype_override"] = device["dtype"]
    report["inputs"] = {
        **runs.source_inputs(args),
        "seed": args.seed,
        "scale": args.scale,
        **device,
        "partial_collectives": where,
        "partial_collectives_from": "--partial-collectives"
        if args.partial_collectives
        else "topology [parallel] partial_collectives",
        "topology": topology.to_dict(),
    }
    text = format_report(report)
    if args.baseline:
        text = runs.show_before_baseline(text, args.json)
        baseline = run_ranks(
            topology,
            patched=False,
            seed=args.seed,
            progress=progress,
            verbose=verbose,
            scale=args.scale,
            **device,
        )
        assert baseline is not None
        report["baseline"] = baseline
        report["patched_ok"] = report["ok"]
        report["ok"] = report["ok"] and baseline["ok"]
        text += format_baseline(baseline)
    return runs.finish(args, "ranks", report, text)
