# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry simulate``: vLLM's scheduler feeding all D worker ranks.

``replay`` drives the engine-core side only (vLLM's ``KVCacheManager``). This
command runs one engine and its D workers end to end, with no weights and no
GPU (``run``): vLLM's real ``Scheduler`` (``engine``) schedules a workload
(``workloads``) with chunked prefill, prefix caching, preemption and
speculative decoding; every ``SchedulerOutput`` is handed to every DCP rank's
block tables of the chosen model runner (``workers``, ``workers_v2``); each
rank's slot mapping and each attention group's local sequence lengths are
checked at every step and every group (``checks``, over ``views``). Slot
mappings come from a vectorized twin of vLLM's kernels, cross-checked against
vLLM's own slot-mapping kernel on sampled steps (``kernels``): on a GPU, or on
a machine with none in a CPU process of its own, started with the tooling's
CPU switches (``cpu_stand_ins.child_environment``: the Triton interpreter),
which runs the whole command and prints its report. The report
and its text are in ``report``; what a run takes, and the hooks a caller may
give it, in ``options``.

``--runner v1`` (Model Runner V1) needs vLLM 0.33.0; 0.34.0 removed V1, and
runs V2 by default. ``--baseline`` runs the same simulation on vLLM as installed, in a
fresh interpreter that never registers the plugin, and reports the first step
and position where it breaks.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_dcp_geometry.tooling.cli.common import capacity, runs
from vllm_dcp_geometry.tooling.cli.common.flags import (
    add_run_args,
    add_topology_args,
    int_flag,
    load_topology,
)
from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import (
    checked_start_up_grouping,
    with_grouping_notice,
)
from vllm_dcp_geometry.tooling.cli.simulate.options import SimulationOptions
from vllm_dcp_geometry.tooling.cli.simulate.report import (
    compare_runs,
    format_baseline,
    format_report,
)
from vllm_dcp_geometry.tooling.cli.simulate.run import run_simulation
from vllm_dcp_geometry.tooling.cli.simulate.workloads import (
    MIXED_MAX_OUTPUT,
    MIXED_REQUESTS,
    RUNNERS,
    WORKLOADS,
    mixed_shape,
)
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError
from vllm_dcp_geometry.tooling.topology.limits import NON_NEGATIVE_INT32, POSITIVE_INT32
from vllm_dcp_geometry.tooling.vllm_release import (
    default_runner,
    require_model_runner_v1,
)

HELP = (
    "vLLM's scheduler feeding every DCP rank's block tables, checked each step, "
    "no weights"
)

SIMULATE_MAX_RANK_TOKENS = 2**31
"""Ranks times scheduled tokens times slot-mapped groups a run may check
(about 0.3 us each): the default profile's replay checks 8 * 10**7, so a
simulation stays within minutes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``simulate``'s flags: the topology flags, those it shares with
    ``replay``, then its own."""
    add_topology_args(parser)
    add_run_args(
        parser,
        tokens="replay length (default: the profile's, else max_model_len)",
        step_tokens="the scheduler's token budget per step (max_num_batched_tokens)",
        num_pages="pool size in pages (default: replay, one max-length request "
        "+ null page; mixed, what the wave's prompts hold, so it must preempt)",
        baseline="also simulate on unpatched vLLM (fresh process)",
    )
    parser.add_argument(
        "--runner",
        choices=RUNNERS,
        default=default_runner(),
        help=f"the model runner the workers run (default {default_runner()}; "
        "v1 needs vLLM 0.33.0: 0.34.0 removed Model Runner V1)",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="replay",
        help="replay: the profile's long request (default); "
        "mixed: many requests shaped by the profile's block sizes that must "
        "preempt, hit the prefix cache and accept drafts (exit 1 if one "
        "never happens)",
    )
    parser.add_argument(
        "--requests",
        type=int_flag(POSITIVE_INT32),
        help="requests of the mixed workload (default 32)",
    )
    parser.add_argument(
        "--seed",
        type=int_flag(NON_NEGATIVE_INT32),
        default=0,
        help="seed of the mixed workload and the draft acceptance",
    )


def check_inputs(topology: Topology, args: argparse.Namespace) -> int:
    """Refuse, before vLLM is imported, a simulation vLLM could not schedule
    or that would not end in minutes; the replay length."""
    tokens = runs.replay_tokens(topology, args.tokens)
    if args.workload == "replay":
        runs.check_replay_inputs(
            topology, tokens, runs.replay_step_tokens(topology, args.step_tokens)
        )
        if args.requests is not None:
            raise TopologyError("--requests applies to --workload mixed only")
        work = tokens
    else:
        if args.tokens is not None:
            raise TopologyError("--tokens applies to --workload replay only")
        count = args.requests or MIXED_REQUESTS
        shape = mixed_shape(topology, args.step_tokens, count)
        work = count * (shape.longest_prompt + MIXED_MAX_OUTPUT)
    slot_groups = sum(1 for g in topology.groups if g.is_attention)
    checked = work * topology.decode_context_parallel_size * max(slot_groups, 1)
    if checked > SIMULATE_MAX_RANK_TOKENS:
        raise TopologyError(
            f"simulating {work:,} tokens on {topology.decode_context_parallel_size} "
            f"ranks over {slot_groups} attention groups checks {checked:,} slot "
            f"writes, beyond SIMULATE_MAX_RANK_TOKENS={SIMULATE_MAX_RANK_TOKENS:,} "
            "(so that a simulation ends in minutes); lower --tokens or --requests"
        )
    return tokens


def check_capacity(topology: Topology, args: argparse.Namespace, tokens: int) -> None:
    """What needs vLLM's specs: the pool and tables fit what vLLM represents."""
    if args.workload == "replay":
        capacity.check_replay_capacity(
            topology,
            tokens=tokens,
            step_tokens=runs.replay_step_tokens(topology, args.step_tokens),
            num_pages=args.num_pages,
        )
    else:
        capacity.check_topology_capacity(topology)


def run_unpatched_baseline(
    topology: Topology, args: argparse.Namespace, tokens: int
) -> dict[str, Any]:
    """The same simulation on vLLM as installed, in a fresh
    interpreter that never registers the plugin."""
    return runs.run_unpatched(
        "simulate",
        topology,
        [
            ("--runner", args.runner),
            ("--workload", args.workload),
            ("--seed", args.seed),
            ("--tokens", tokens if args.workload == "replay" else None),
            ("--step-tokens", args.step_tokens),
            ("--requests", args.requests),
            ("--num-pages", args.num_pages),
        ],
    )


def rerun_in_cpu_process(args: argparse.Namespace) -> int:
    """The same command line in a fresh process with the CPU switches, where
    vLLM's Triton kernels run under the interpreter; its exit status."""
    from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
    from vllm_dcp_geometry.tooling.fresh_process import run_fresh_python_in_view

    unpatched = bool(getattr(args, "unpatched_baseline", False))
    return run_fresh_python_in_view(
        ["-m", "vllm_dcp_geometry", *args.argv],
        patched=not unpatched,
        env=child_environment(),
    )


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry simulate``."""
    if args.runner == "v1":
        require_model_runner_v1("--runner v1")
    from vllm_dcp_geometry.tooling.cpu_stand_ins import kernels_need_a_cpu_process

    if kernels_need_a_cpu_process():
        return rerun_in_cpu_process(args)
    topology = load_topology(args)
    tokens = check_inputs(topology, args)
    unpatched = runs.start_vllm(args)
    grouping = None if unpatched else checked_start_up_grouping(topology)
    check_capacity(topology, args, tokens)
    options = SimulationOptions(
        runner=args.runner,
        workload=args.workload,
        tokens=tokens,
        step_tokens=args.step_tokens,
        num_pages=args.num_pages,
        requests=args.requests,
        seed=args.seed,
        progress=not args.no_progress,
        verbose=getattr(args, "verbose", False),
    )
    report = run_simulation(topology, options)
    report.update(runs.versions())
    report["inputs"] = {
        **runs.source_inputs(args),
        "runner": args.runner,
        "workload": args.workload,
        "tokens": tokens,
        "step_tokens": args.step_tokens,
        "requests": args.requests,
        "seed": args.seed,
        "num_pages": args.num_pages,
        "topology": topology.to_dict(),
    }
    text = format_report(report)
    text = with_grouping_notice(
        report,
        text,
        grouping,
        len(topology.groups),
        "simulate ran vLLM's scheduler on the topology's groups, not start-up's",
    )
    if args.baseline and not unpatched:
        text = runs.show_before_baseline(text, args.json)
        baseline = run_unpatched_baseline(topology, args, tokens)
        report["baseline"] = baseline
        report["comparison"] = compare_runs(report, baseline)
        text += format_baseline(baseline, report["comparison"])
    return runs.finish(args, "simulate", report, text)
