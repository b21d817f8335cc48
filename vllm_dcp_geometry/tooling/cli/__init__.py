# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The ``vllm-dcp-geometry`` command (also ``python -m vllm_dcp_geometry``):
``main`` and its parser.

- ``profiles``: list the built-in topologies.
- ``plan``: per-group DCP geometry and block-table cost, against vLLM 0.33.0.
- ``replay``: drive vLLM's real KV-cache manager through one long request with
  no model weights, checking ownership, widths and addressability each step.
- ``simulate``: vLLM's real scheduler feeding every DCP rank's block tables,
  checking slot mappings and local lengths of every group at every step.
- ``ranks``: D real worker processes running vLLM's MLA attention with its
  real collectives, every rank checked against a float64 reference.

Each command is a package of this one (``cli.profiles``, ``cli.plan``,
``cli.replay``, ``cli.simulate``, ``cli.ranks``): its ``__init__`` holds its
``HELP``, its flags (``add_arguments``) and the command (``command``), its
other modules what only it needs. What the commands share is in ``cli.common``.

Exit status (``cli.common.status``): 0 clean, 1 a replay or simulation found a
violation (``ranks``: wrong numerics), 2 bad input, 130 interrupted. Every bad
input is one line on standard error naming the flag, field or group and the
allowed range.
vLLM is imported only inside the commands that need it, with third-party
import noise hidden unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from vllm_dcp_geometry.tooling.cli import plan, profiles, ranks, replay, simulate
from vllm_dcp_geometry.tooling.cli.common.status import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_VIOLATION,
    PROG,
    CliError,
    bad_input_errors,
    report_bad_input,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_OK", "EXIT_VIOLATION", "build_parser", "main"]

COMMANDS = {
    "profiles": profiles,
    "plan": plan,
    "replay": replay,
    "simulate": simulate,
    "ranks": ranks,
}
"""Each command's package, in the order ``--help`` lists them."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit 2."""

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command and flag."""
    parser = _Parser(
        prog=PROG,
        description="Per-cache DCP KV-cache geometry for vLLM: plan and replay.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, package in COMMANDS.items():
        p = sub.add_parser(name, help=package.HELP)
        package.add_arguments(p)
        p.set_defaults(func=package.command)
    _add_common_flags(parser, sub)
    return parser


def _add_common_flags(parser: argparse.ArgumentParser, sub: Any) -> None:
    """Flags every command takes, before or after its name."""
    verbose = "show the third-party import output (torch, vLLM) hidden by default"
    parser.add_argument("--verbose", "-v", action="store_true", help=verbose)
    for command in sub.choices.values():
        # SUPPRESS: a command that is not given the flag keeps the top level's.
        command.add_argument(
            "--verbose",
            "-v",
            action="store_true",
            default=argparse.SUPPRESS,
            help=verbose,
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # What this parser does not know goes to vLLM's serve parser when a
        # model is planned (``flags.model_serve_flags``); otherwise it is
        # refused there.
        args, serve_flags = build_parser().parse_known_args(argv)
        args.serve_flags = serve_flags
        if serve_flags and not hasattr(args, "model"):
            raise CliError(f"unrecognized arguments: {' '.join(serve_flags)}")
        args.argv = argv
        return int(args.func(args))
    except SystemExit as exc:  # argparse's --help
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BrokenPipeError:
        # The reader (e.g. `| head`) went away; that is not our failure.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if isinstance(exc, bad_input_errors()):
            return report_bad_input(exc)
        raise
