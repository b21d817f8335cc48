#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Run the tests against another vLLM release the plugin serves.

    python tools/test_release.py 0.34.0                 # the patch tests on 0.34.0
    python tools/test_release.py 0.34.0 -- -k warmup    # other pytest arguments

Makes (or reuses) ``.venv-<release>`` beside ``.venv`` with this checkout and
that vLLM release installed by uv, then runs pytest there. By default it runs
every test that exercises a patch and every test written for particular
releases, less the demonstrations that a checker fails on unpatched vLLM
and the runs that repeat at more ranks what a smaller run shows
(``-m "(patches or vllm_releases) and not unpatched_baseline and not
larger_repeat"``: the whole suite shows those once), on a worker per core as the
README's test command does; arguments after ``--`` replace that.
``tools/release_overrides/vllm-<release>.txt``, where present, holds the
requirement overrides the package index these machines reach needs
(vLLM 0.34.0's ``flashinfer-python==0.7.3`` is not there; 0.7.4 is): they
apply to this test environment only, never to what a user installs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = ROOT / "tools" / "release_overrides"
RELEASE_TESTS = (
    "(patches or vllm_releases) and not unpatched_baseline and not larger_repeat"
)
"""Every test that exercises a patch, and every test written for particular
releases, less the demonstrations on unpatched vLLM and the larger repeats
of what it runs smaller."""
PARALLEL = ["-n", "auto", "--maxprocesses", "4", "--dist", "loadfile"]
"""As the README's test command runs the suite: a worker per core, up to 4,
each test file on one worker (its module fixtures built once)."""


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which(
        "uv"
    )
    if found is None:
        raise SystemExit("uv is not installed: pip install uv (the test extra has it)")
    return found


def environment(release: str) -> Path:
    """``.venv-<release>`` with this checkout and vLLM ``release``."""
    venv = ROOT / f".venv-{release}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run(
            [uv(), "venv", "-q", "-p", sys.executable, str(venv)], check=True
        )
    # pip compiles bytecode as it installs; uv does not, and where the
    # environment forbids writing it (PYTHONDONTWRITEBYTECODE, as on CI) every
    # fresh interpreter would compile torch and vLLM again.
    install = [
        uv(),
        "pip",
        "install",
        "-q",
        "--compile-bytecode",
        "--python",
        str(python),
    ]
    overrides = OVERRIDES / f"vllm-{release}.txt"
    if overrides.is_file():
        install += ["--override", str(overrides)]
    install += ["-e", f"{ROOT}[test]", f"vllm=={release}"]
    subprocess.run(install, check=True, cwd=ROOT)
    return python


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("release", help="the vLLM release, e.g. 0.34.0")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = parser.parse_args(argv)
    python = environment(args.release)
    pytest_args = args.pytest_args or [*PARALLEL, "-q", "-m", RELEASE_TESTS]
    print(f"+ vLLM {args.release}: pytest {' '.join(pytest_args)}", flush=True)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    return subprocess.run(
        [str(python), "-m", "pytest", *pytest_args], cwd=ROOT, env=env
    ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
