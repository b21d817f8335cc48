# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry profiles``: list the built-in topologies (no vLLM);
``--check`` builds the model each model profile stands for with vLLM's model
code and names every difference (``drift``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vllm_dcp_geometry.tooling.cli.common import runs
from vllm_dcp_geometry.tooling.cli.common.status import (
    EXIT_OK,
    EXIT_VIOLATION,
    CliError,
)
from vllm_dcp_geometry.tooling.topology import (
    DEFAULT_PROFILE,
    load_profile,
    profile_models,
    profile_names,
)

HELP = "list the built-in topologies"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``profiles``'s flags."""
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--check",
        nargs="*",
        metavar="NAME",
        help="build the model each named profile (default: every model "
        "profile) stands for with vLLM's model code and name every "
        "difference; exit 1 on any",
    )


def _check(args: argparse.Namespace) -> int:
    from vllm_dcp_geometry.tooling.cli.profiles.drift import profile_drift
    from vllm_dcp_geometry.tooling.serve.deployment import model_topology

    models = profile_models()
    names = args.check or sorted(models)
    unknown = [name for name in names if name not in models]
    if unknown:
        raise CliError(
            f"--check: {', '.join(unknown)} stand(s) for no model; model "
            f"profiles: {', '.join(sorted(models))}"
        )
    runs.prepare_vllm(args, patched=True)
    rows = []
    for name in names:
        model = models[name]
        drift = profile_drift(load_profile(name), model_topology(model.serve_argv()))
        rows.append(
            {
                "name": name,
                "model": model.model,
                "serve_flags": list(model.serve_flags),
                "drift": drift,
            }
        )
    versions = runs.versions()
    lines = [f"profiles --check on vLLM {versions['vllm_version']}"]
    for row in rows:
        verdict = "differs from" if row["drift"] else "equals"
        lines.append(
            f"{row['name']} {verdict} vLLM's build of model_configs/{row['model']}"
        )
        lines += [f"    {line}" for line in row["drift"]]
    document = {"command": "profiles", "checks": rows, **versions}
    runs.emit(document, args.json, "\n".join(lines))
    return EXIT_VIOLATION if any(row["drift"] for row in rows) else EXIT_OK


def command(args: argparse.Namespace) -> int:
    """``vllm-dcp-geometry profiles``."""
    if args.check is not None:
        return _check(args)
    models = profile_models()
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
                "model": models[name].model if name in models else None,
            }
        )
    versions = runs.versions()
    if args.json:
        print(json.dumps({"profiles": rows, **versions}))
        return EXIT_OK
    # Listing imports no vLLM; the installed release is what --check would build.
    print(f"built-in topologies (vLLM {versions['vllm_version']} installed)")
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
        if row["model"]:
            print(f"    vLLM's model code for model_configs/{row['model']} (--check)")
        else:
            print("    hypothetical: written by hand, no model's")
    return EXIT_OK
