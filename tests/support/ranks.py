# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry ranks`` as the tests run it: ``ranks_run`` runs the
command in this process (its workers in their own, as always) and hands back
its exit code, its JSON report and what the launcher returned (every
worker's result, for merges the tests make again)."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from vllm_dcp_geometry.tooling.cli import main
from vllm_dcp_geometry.tooling.cli.ranks import run


def ranks_run(*args: str) -> dict[str, Any]:
    """``ranks ... --json``: its exit code, report and the workers' results
    as the launcher returned them (the patched run's)."""
    launched: list[Any] = []
    launch = run.launch

    def keep(*a: Any, **k: Any) -> Any:
        launched.append(launch(*a, **k))
        return launched[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setattr(run, "launch", keep)
        code = main(["ranks", *args, "--json", "--no-progress"])
    return {"code": code, "report": json.loads(out.getvalue()), "launched": launched}
