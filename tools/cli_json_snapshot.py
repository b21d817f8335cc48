#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Write ``plan``/``replay``/``simulate --json`` of every built-in profile.

``cli_json_snapshot.py OUT_DIR`` runs the CLI of the checkout it is run from
(``python -m vllm_dcp_geometry`` with that checkout first on the path) and
writes one file per command and profile, with the run-time fields (seconds
elapsed) dropped, so that two checkouts' snapshots compare with ``diff -r``:
a restructuring must leave them identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMANDS = ("plan", "replay", "simulate")
RUN_TIME_FIELDS = frozenset({"elapsed_s"})


def without_run_time(value: Any) -> Any:
    if isinstance(value, dict):
        return {
            k: without_run_time(v) for k, v in value.items() if k not in RUN_TIME_FIELDS
        }
    if isinstance(value, list):
        return [without_run_time(v) for v in value]
    return value


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    profiles = sorted(
        p.stem
        for p in (root / "vllm_dcp_geometry" / "tooling" / "profiles").glob("*.toml")
    )
    for profile in profiles:
        for command in COMMANDS:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "vllm_dcp_geometry",
                    command,
                    "-p",
                    profile,
                    "--json",
                ],
                capture_output=True,
                text=True,
                cwd=root,
                env=env,
                check=False,
            )
            document = {"exit_status": done.returncode}
            if done.stdout.strip():
                document["output"] = without_run_time(json.loads(done.stdout))
            path = out / f"{command}-{profile}.json"
            path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
            print(f"{path}: exit {done.returncode}")


if __name__ == "__main__":
    main()
