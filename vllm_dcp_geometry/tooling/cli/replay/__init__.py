# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry replay``: drive vLLM's real KV-cache manager, no weights.

Feeds one long request to vLLM's ``KVCacheManager`` in chunked-prefill steps
(``run``); after every step it checks ownership, widths, addressability and
each manager's allocation unit against the contract (``checks``); the text
output is in ``output``.

Run unpatched (``--baseline``: a fresh process that never registers the
plugin), the same replay shows where vLLM 0.33.0 diverges from the contract.
"""

from __future__ import annotations

import argparse

from vllm_dcp_geometry.tooling.cli.common import capacity, runs
from vllm_dcp_geometry.tooling.cli.common.flags import (
    add_run_args,
    add_topology_args,
    load_topology,
)
from vllm_dcp_geometry.tooling.cli.common.start_up_grouping import (
    checked_start_up_grouping,
    with_grouping_notice,
)
from vllm_dcp_geometry.tooling.cli.replay.output import format_baseline, format_replay
from vllm_dcp_geometry.tooling.cli.replay.run import compare_replays, run_replay

HELP = "drive vLLM's KV-cache manager through one long request, no weights"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``replay``'s flags."""
    add_topology_args(parser)
    add_run_args(
        parser,
        tokens="request length (default: the profile's, else max_model_len)",
        step_tokens="tokens per scheduler step (default: the profile's, else "
        "the cache block size)",
        num_pages="pool size in pages (default: one max-length request + null page)",
        baseline="also replay on unpatched vLLM (fresh process) and compare",
    )


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry replay``."""
    topology = load_topology(args)
    tokens = runs.replay_tokens(topology, args.tokens)
    step_tokens = runs.replay_step_tokens(topology, args.step_tokens)
    runs.check_replay_inputs(topology, tokens, step_tokens)
    unpatched = runs.start_vllm(args)
    grouping = None if unpatched else checked_start_up_grouping(topology)
    capacity.check_replay_capacity(
        topology, tokens=tokens, step_tokens=step_tokens, num_pages=args.num_pages
    )
    report = run_replay(
        topology,
        tokens=tokens,
        step_tokens=step_tokens,
        num_pages=args.num_pages,
        progress=not args.no_progress,
    )
    report.update(runs.versions())
    report["inputs"] = {
        **runs.source_inputs(args),
        "tokens": tokens,
        "step_tokens": step_tokens,
        "num_pages": args.num_pages,
        "enable_prefix_caching": False,
        "topology": topology.to_dict(),
    }
    text = format_replay(report)
    text = with_grouping_notice(
        report,
        text,
        grouping,
        len(topology.groups),
        "replay ran vLLM's manager on the topology's groups, not start-up's",
    )
    if args.baseline and not unpatched:
        text = runs.show_before_baseline(text, args.json)
        baseline = runs.run_unpatched(
            "replay",
            topology,
            [
                ("--tokens", tokens),
                ("--step-tokens", step_tokens),
                ("--num-pages", args.num_pages),
            ],
        )
        diffs = compare_replays(report, baseline)
        report["baseline"] = baseline
        report["divergence"] = diffs
        text += format_baseline(baseline, diffs)
    return runs.finish(args, "replay", report, text)
