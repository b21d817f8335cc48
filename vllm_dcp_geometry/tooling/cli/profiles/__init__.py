# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry profiles``: list the built-in topologies (no vLLM)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.status import EXIT_OK
from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    load_profile,
    profile_names,
)

HELP = "list the built-in topologies"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``profiles``'s flags."""
    parser.add_argument("--json", action="store_true")


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry profiles``."""
    rows: list[dict[str, Any]] = []
    for name in profile_names():
        topology = load_profile(name)
        rows.append(
            {
                "name": name,
                "default": name == DEFAULT_PROFILE,
                "groups": len(topology.groups),
                "layers": topology.num_layers,
                "draft_layers": sum(len(g.layers) for g in topology.groups if g.draft),
                "tp": topology.tensor_parallel_size,
                "dcp": topology.decode_context_parallel_size,
                "max_model_len": topology.max_model_len,
                "description": topology.description,
            }
        )
    if args.json:
        print(json.dumps({"profiles": rows}))
        return EXIT_OK
    for row in rows:
        mark = " (default)" if row["default"] else ""
        print(f"{row['name']}{mark}")
        print(
            f"    {row['groups']} groups, {row['layers'] - row['draft_layers']} "
            f"layers + {row['draft_layers']} draft, TP{row['tp']}/"
            f"DCP{row['dcp']}, max_model_len {row['max_model_len']:,}"
        )
        if row["description"]:
            print(f"    {row['description']}")
    return EXIT_OK
