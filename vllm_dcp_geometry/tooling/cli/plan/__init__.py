# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry plan``: per-group geometry and cost, before renting GPUs.

For each cache group: its shard count K, block-table widths and bytes per
rank, KV bytes per token and per request per rank, with the same numbers
from unpatched vLLM 0.33.0 (``document``), and how its attention runs at
start-up (``attention``); the text output is in ``output``. A group whose
attention start-up would refuse makes the command exit 2 with start-up's
one-line error.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_dcp_geometry.tooling.cli.common import capacity, runs
from vllm_dcp_geometry.tooling.cli.common.flags import (
    add_topology_args,
    json_object_flag,
    load_topology,
)
from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import start_up_grouping
from vllm_dcp_geometry.tooling.cli.common.status import (
    EXIT_OK,
    EXIT_VIOLATION,
    report_bad_input,
)
from vllm_dcp_geometry.tooling.cli.plan.attention import (
    check_draft_attention_backend,
)
from vllm_dcp_geometry.tooling.cli.plan.document import build_plan, first_refusal
from vllm_dcp_geometry.tooling.cli.plan.optimize import (
    BUDGET_FLAGS,
    format_optimize,
    make_budget,
    optimize_shard_counts,
    plot_frontier,
)
from vllm_dcp_geometry.tooling.cli.plan.output import format_plan

HELP = "per-group shard count, widths and block-table bytes vs unpatched vLLM"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``plan``'s flags."""
    add_topology_args(parser)
    parser.add_argument(
        "--attention-backend",
        metavar="NAME",
        help="vLLM attention backend for the target's groups of its kind (MLA "
        "or not) and the drafts that inherit it; default: vLLM's first choice "
        "on SM90 (FLASH_ATTN_MLA, FLASH_ATTN)",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        type=json_object_flag("--speculative-config", optional=True),
        help="vllm serve's flag: its attention_backend is the drafts' (else a "
        "DSpark draft gets vLLM's choice, an EAGLE/MTP draft the target's)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    optimize = parser.add_argument_group(
        "--optimize", "choose each attention group's K for a per-rank budget"
    )
    optimize.add_argument(
        "--optimize",
        action="store_true",
        help="print the capacity / decode-cost frontier over every admitted K "
        "and the --additional-config line of the recommended point",
    )
    for flag, kind, default, metavar, help_text in BUDGET_FLAGS:
        optimize.add_argument(
            flag, type=kind, default=default, metavar=metavar, help=help_text
        )
    optimize.add_argument(
        "--plot", metavar="FILE.png", help="draw the frontier (matplotlib)"
    )
    optimize.add_argument(
        "--objective", choices=("capacity", "latency"), default="capacity"
    )
    optimize.add_argument(
        "--shard-counts",
        type=_shard_counts,
        metavar="K,K,...",
        help="candidate K for every chosen group (default: every divisor of "
        "D); drafts keep theirs",
    )
    optimize.add_argument(
        "--max-decode-overhead",
        type=float,
        default=1.10,
        metavar="RATIO",
        help="capacity objective: modeled step time at most this times every "
        "group's largest K (default 1.10)",
    )


def _shard_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}"
        ) from None


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry plan``."""
    topology = load_topology(args)
    runs.prepare_vllm(args, patched=True)
    capacity.check_topology_capacity(topology)
    if args.optimize:
        return _optimize(args, topology)
    document = build_plan(
        topology,
        args.attention_backend,
        draft_attention_backend=check_draft_attention_backend(args.speculative_config),
    )
    document["inputs"]["additional_config"] = args.additional_config
    document["start_up_grouping"] = grouping = start_up_grouping(
        topology,
        {g["attention_backend"] for g in document["groups"] if g["attention_backend"]},
    )
    document.update(runs.versions())
    runs.emit(document, args.json, format_plan(document))
    refusal = first_refusal(document) or grouping.get("refusal")
    # A group start-up would refuse: the same one-line error, exit 2.
    return EXIT_OK if refusal is None else report_bad_input(refusal)


def _optimize(args: argparse.Namespace, topology: Any) -> int:
    budget = make_budget(
        **{
            flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
            for flag, *_ in BUDGET_FLAGS
        },
        model_weight_bytes=topology.weight_bytes_per_rank,
    )
    result = optimize_shard_counts(
        topology,
        budget,
        objective=args.objective,
        max_decode_overhead=args.max_decode_overhead,
        attention_backend=args.attention_backend,
        draft_attention_backend=check_draft_attention_backend(args.speculative_config),
        shard_counts=args.shard_counts,
    )
    document = {
        "command": "plan --optimize",
        "topology": topology.name,
        "source": topology.source,
        **result,
        **runs.versions(),
    }
    if args.plot:
        plot_frontier(result, topology, args.plot)
    runs.emit(document, args.json, format_optimize(result, topology))
    # vLLM's scheduler must admit what vLLM's own rule says the pool holds.
    return EXIT_OK if result["capacity_check"]["holds"] else EXIT_VIOLATION
