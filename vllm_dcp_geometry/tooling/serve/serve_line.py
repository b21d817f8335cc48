# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""An operator's ``vllm serve`` flags, parsed by vLLM's own serve parser and
turned into the ``VllmConfig`` start-up would run with.

``engine_config(argv)`` takes the flags as ``vllm serve`` takes them (the
model directory first or as ``--model``); vLLM's validation applies, and its
error is one line naming vLLM's complaint (``TopologyError``, exit 2). Flags
that do not change geometry (``--port``, ``--served-model-name``, ...) are
accepted as ``vllm serve`` accepts them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.tooling.topology import TopologyError

SERVE_PREFIXES = (("vllm", "serve"), ("serve",))
"""How a pasted serve line may start (``plan -- vllm serve DIR ...``)."""


def strip_serve_prefix(argv: Sequence[str]) -> list[str]:
    """The flags of a pasted ``vllm serve ...`` line (its words after
    ``serve``); other lists are returned unchanged."""
    words = list(argv)
    for prefix in SERVE_PREFIXES:
        if tuple(words[: len(prefix)]) == prefix:
            return words[len(prefix) :]
    return words


PLANNING_FLAGS = (
    "--enforce-eager",
    "--load-format=dummy",
    "--compilation-config.pass_config.fuse_allreduce_rms=false",
)
"""Added to every planned serve line: a planning build reads no weights,
compiles nothing and captures no CUDA graph (none of which changes a KV-cache
spec), and vLLM's compile set-up needs CUDA kernels a planning process does
not have."""


class _ServeParserError(Exception):
    pass


def parse_serve_flags(argv: Sequence[str]) -> argparse.Namespace:
    """vLLM's ``vllm serve`` parser over ``argv``; the model directory is
    the positional ``model_tag`` or ``--model``, as ``vllm serve`` reads it."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # type: ignore[override]
            raise _ServeParserError(message)

    parser = make_arg_parser(Parser(prog="vllm serve"))
    try:
        args = parser.parse_args(list(argv))
    except _ServeParserError as exc:
        raise TopologyError(f"vllm serve flags: {exc}") from exc
    # What ``vllm serve`` itself does with its positional model.
    if args.model_tag is not None:
        args.model = args.model_tag
    return args


def engine_config(argv: Sequence[str]) -> Any:
    """The ``VllmConfig`` vLLM makes of the serve flags (on this machine's
    CPU: the planning platform must be current)."""
    from vllm.engine.arg_utils import EngineArgs

    args = parse_serve_flags([*strip_serve_prefix(argv), *PLANNING_FLAGS])
    if not os.path.isdir(args.model):
        raise TopologyError(
            f"--model {args.model!r}: not a model directory (a folder with the "
            "model's config.json; planning reads no weights and downloads nothing)"
        )
    try:
        return EngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:
        message = " ".join(str(exc).split())
        raise TopologyError(f"vLLM refuses the serve flags: {message}") from exc
