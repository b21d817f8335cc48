#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Run vLLM's own unit tests patched, and unpatched what fails patched;
fail on what only the plugin breaks.

vLLM's tests for the code this plugin patches are the best check that every
wrapper takes upstream's path where it should. The installed release's tests
come from its PyPI sdist (the wheel ships none), fetched once with
``pip download`` and cached under ``.cache/vllm-<version>-src`` (only
``tests/`` and ``pyproject.toml``: vLLM's source tree must never shadow the
installed ``vllm``). Each run is a fresh process on CPU
(``CUDA_VISIBLE_DEVICES=``, ``TRITON_INTERPRET=1``, the hub offline). Every
test file runs patched (the plugin loaded through vLLM's own
``load_general_plugins`` entry point). A test that passes patched is no
regression whatever it does unpatched, so only the rest runs unpatched
(``VLLM_PLUGINS=`` empty, no plugin loads): one process per file, with
exactly the node ids that did not pass patched; the whole file where the
patched run crashed or timed out, so that every test it held is compared. A
file that passed entirely patched runs once. This module is also the pytest
plugin (``-p vllm_suite``) of those runs: it loads the plugins and asserts
the plugin is active exactly in the patched runs.

The files come from ``FILE_LISTS``, one entry per vLLM release (the
installed release picks its own): vLLM 0.34.0 removed Model Runner V1 and
its tests, and added tests of code the plugin patches there. A file one
release's list drops because that release's sdist lacks it is named in its
``absent`` (and in the report), never skipped silently; a file the list
names that the sdist lacks, or an ``absent`` one it has, is bad input.

Exit status: 0 when every test that passes unpatched passes patched, 1 when
any does not (or a test rerun unpatched gave no outcome there), 2 on bad
input or when the sdist cannot be fetched. Tests that fail or skip in both
runs (hub models, GPUs, missing test dependencies) are reported as such,
grouped by reason. Whether a test passing patched fails unpatched (fixed by
the plugin) is not measured.

    python tools/vllm_suite.py            # the installed release's core list (CI)
    python tools/vllm_suite.py --all      # every file of the list
    python tools/vllm_suite.py tests/v1/core/test_kv_cache_utils.py
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path


def _load_sibling(name: str):  # type: ignore[no-untyped-def]
    """A module beside this one, however this one was loaded (as a script,
    as ``-p vllm_suite`` or by file location): ``tools/`` is no package."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, Path(__file__).resolve().parent / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_source = _load_sibling("vllm_suite_source")
FILE_LISTS = _source.FILE_LISTS
FileList = _source.FileList
SourceUnavailable = _source.SourceUnavailable
installed_vllm_version = _source.installed_vllm_version
fetch_source = _source.fetch_source
check_files = _source.check_files
parse_junit = _source.parse_junit
node_id = _source.node_id
FileRun = _source.FileRun
run_file = _source.run_file
MODE_ENV, RECORD_ENV = _source.MODE_ENV, _source.RECORD_ENV
UNPATCHED, PATCHED = _source.UNPATCHED, _source.PATCHED


# Choosing what runs unpatched ---------------------------------------------------


def to_rerun(patched: FileRun) -> list[str] | None:
    """What of a patched run's file to run unpatched: None, nothing (every
    test passed); the tests that did not pass; ``[]``, the whole file (the
    run crashed, or one of those ids names no test: a collection error)."""
    if patched.crashed:
        return []
    tests = [t for t, outcome in patched.outcomes.items() if outcome != "passed"]
    if not tests:
        return None
    return tests if all(node_id(patched.file, t) for t in tests) else []


# Comparing ------------------------------------------------------------------------


@dataclass
class Comparison:
    """Per-test outcomes of both runs, classified."""

    regressions: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Passed unpatched, not passed patched: test id -> (outcome, reason)."""
    passed_patched: int = 0
    """Passed patched, whatever they do unpatched (not run there)."""
    not_passing_both: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Failed or skipped in both: test id -> (unpatched outcome, reason)."""
    not_compared: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Not passed patched, asked of an unpatched run that gave no outcome:
    test id -> (patched outcome, why)."""
    crashed: dict[str, str] = field(default_factory=dict)
    """Patched runs that crashed: file -> why (the whole file ran unpatched)."""

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.not_compared


def compare(
    unpatched: Mapping[str, str],
    patched: Mapping[str, str],
    reasons: Mapping[str, str] | None = None,
    patched_reasons: Mapping[str, str] | None = None,
    asked: Iterable[str] = (),
) -> Comparison:
    """Classify every test of either run. A test that passes patched needs
    no unpatched outcome; one the patched run lacks (its process crashed, it
    was not collected) counts as not passed there. ``asked``: the tests the
    unpatched runs were asked for by id; one with no outcome there is not
    compared, and fails the run."""
    reasons = reasons or {}
    patched_reasons = patched_reasons or {}
    asked = set(asked)
    result = Comparison()
    for test in sorted(set(unpatched) | set(patched) | asked):
        before = unpatched.get(test)
        after = patched.get(test, "missing")
        if after == "passed":
            result.passed_patched += 1
        elif before == "passed":
            result.regressions[test] = (after, patched_reasons.get(test, ""))
        elif before is None and test in asked:
            why = reasons.get(test, "no unpatched outcome")
            result.not_compared[test] = (after, why)
        else:
            result.not_passing_both[test] = (before or "missing", reasons.get(test, ""))
    return result


def compare_runs(runs: Iterable[FileRun]) -> Comparison:
    by_mode: dict[str, dict[str, str]] = {UNPATCHED: {}, PATCHED: {}}
    why: dict[str, dict[str, str]] = {UNPATCHED: {}, PATCHED: {}}
    asked: list[str] = []
    crashed: dict[str, str] = {}
    for run in runs:
        by_mode[run.mode].update(run.outcomes)
        why[run.mode].update(run.reasons)
        if run.mode == PATCHED and run.crashed:
            crashed[run.file] = run.note or f"pytest exit {run.returncode}"
        for test in run.tests:
            asked.append(test)
            if test not in run.outcomes:
                why[run.mode][test] = "unpatched run: " + (
                    run.note or f"no outcome (pytest exit {run.returncode})"
                )
    result = compare(
        by_mode[UNPATCHED], by_mode[PATCHED], why[UNPATCHED], why[PATCHED], asked
    )
    result.crashed = crashed
    return result


def _cell(run: FileRun | None) -> str:
    if run is None:
        return "not run"
    if not run.outcomes:
        return "no outcomes"
    counts = collections.Counter(run.outcomes.values())
    return (
        f"{counts['passed']:>4}p {counts['failed'] + counts['error']:>3}f "
        f"{counts['skipped']:>3}s {run.seconds:>4.0f}s"
    )


def _table(runs: Sequence[FileRun], absent: Mapping[str, str]) -> list[str]:
    lines = [f"{'file':<66} {'patched':>17} {'unpatched (rerun)':>28}"]
    by_file: dict[str, dict[str, FileRun]] = collections.defaultdict(dict)
    for run in runs:
        by_file[run.file][run.mode] = run
    for file, modes in by_file.items():
        rerun = modes.get(UNPATCHED)
        what = "" if rerun is None else "whole file"
        what = f"{len(rerun.tests)} ids" if rerun and rerun.tests else what
        cells = (_cell(modes.get(PATCHED)), f"{what} {_cell(rerun)}".strip())
        lines.append(f"{file:<66} {cells[0]:>17} {cells[1]:>28}")
    for file, because in absent.items():
        lines.append(f"{file:<66} not in this release, not run: {because}")
    return lines


def _summary(runs: Sequence[FileRun], result: Comparison) -> list[str]:
    reruns = [r for r in runs if r.mode == UNPATCHED]
    not_passing = (
        len(result.regressions)
        + len(result.not_passing_both)
        + len(result.not_compared)
    )
    whole = [r.file for r in reruns if not r.tests]
    lines = [
        f"passed patched: {result.passed_patched} (no unpatched run needed; "
        "whether the plugin fixed any of them is not measured)",
        f"not passing patched: {not_passing}; rerun unpatched: "
        f"{sum(len(r.tests) for r in reruns)} tests by id in "
        f"{len(reruns) - len(whole)} files, {len(whole)} whole files",
    ]
    for file, why in result.crashed.items():
        lines.append(
            f"  patched run crashed, whole file rerun unpatched: {file}: {why}"
        )
    lines.append(f"failed or skipped in both: {len(result.not_passing_both)}")
    why = collections.Counter(
        f"{outcome}: {reason}" for outcome, reason in result.not_passing_both.values()
    )
    for reason, count in why.most_common(12):
        lines.append(f"  {count:>5} x {reason}")
    if len(why) > 12:
        lines.append(f"  ... {len(why) - 12} other reasons")
    lines.append(
        f"regressions (pass unpatched, not patched): {len(result.regressions)}"
    )
    for test, (outcome, reason) in result.regressions.items():
        lines.append(f"  {test}: {outcome}: {reason}")
    if result.not_compared:
        lines.append(f"not compared (no unpatched outcome): {len(result.not_compared)}")
        for test, (outcome, reason) in result.not_compared.items():
            lines.append(f"  {test}: {outcome} patched; {reason}")
    return lines


def report(
    runs: Sequence[FileRun],
    result: Comparison,
    out: Path | None,
    absent: Mapping[str, str] | None = None,
) -> str:
    """The table of the runs by file, the counts, the reasons, the verdict;
    ``absent``: the list's files this release lacks, named (not run)."""
    absent = absent or {}
    active = sorted({p for r in runs if r.mode == PATCHED for p in r.patches})
    lines = _table(runs, absent)
    lines.append(f"patch modules applied in the patched runs: {len(active)}")
    lines += _summary(runs, result)
    if result.regressions:
        lines.append(f"FAIL: {len(result.regressions)} pass unpatched, not patched")
    elif result.not_compared:
        lines.append(f"FAIL: {len(result.not_compared)} not compared unpatched")
    else:
        lines.append(
            "OK: every test that passes unpatched passes patched (none of those "
            "not passing patched passes unpatched)"
        )
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "runs": [asdict(r) for r in runs],
                    "regressions": result.regressions,
                    "passed_patched": result.passed_patched,
                    "not_passing_both": result.not_passing_both,
                    "not_compared": result.not_compared,
                    "crashed": result.crashed,
                    "absent": dict(absent),
                },
                indent=1,
            )
        )
    return "\n".join(lines)


def _run_file_both(
    src: Path, file: str, out_dir: Path, timeout: float
) -> list[FileRun]:
    patched = run_file(src, file, PATCHED, out_dir, timeout)
    tests = to_rerun(patched)
    if tests is None:
        return [patched]
    return [patched, run_file(src, file, UNPATCHED, out_dir, timeout, tests)]


def run_suite(
    src: Path, files: Sequence[str], *, jobs: int, timeout: float
) -> list[FileRun]:
    """Each file patched, then unpatched what did not pass patched (a file's
    two runs on one worker, ``jobs`` files at a time)."""
    problems = check_files(src, files, {})
    if problems:
        raise SystemExit("; ".join(problems))
    with (
        tempfile.TemporaryDirectory(prefix="vllm-suite.") as tmp,
        ThreadPoolExecutor(max_workers=max(1, jobs)) as pool,
    ):
        futures = [
            pool.submit(_run_file_both, src, f, Path(tmp), timeout) for f in files
        ]
        return [run for f in futures for run in f.result()]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="test files (default: core list)")
    parser.add_argument("--all", action="store_true", help="every file of the list")
    parser.add_argument("--list", action="store_true", help="print the files")
    parser.add_argument("--src", type=Path, help="vLLM source tree with tests/")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=1200, help="s per file")
    parser.add_argument("--json", type=Path, help="write every outcome here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    version = installed_vllm_version()
    lists = FILE_LISTS.get(version)
    if lists is None and not args.files:
        print(
            f"vllm_suite: no file list for vLLM {version} (lists: "
            f"{', '.join(FILE_LISTS)}); add one to FILE_LISTS or name the files",
            file=sys.stderr,
        )
        return 2
    absent = dict(lists.absent) if lists is not None else {}
    if args.files or lists is None:
        files = list(args.files)
    else:
        files = list(lists.all if args.all else lists.core)
    if args.list:
        print("\n".join(files))
        for file, why in absent.items():
            print(f"not in vLLM {version}'s tests: {file} ({why})", file=sys.stderr)
        return 0
    try:
        src = args.src or fetch_source(version)
    except SourceUnavailable as exc:
        print(f"vllm_suite: {exc}", file=sys.stderr)
        return 2
    problems = check_files(src, files, absent)
    if problems:
        print("vllm_suite: " + "\nvllm_suite: ".join(problems), file=sys.stderr)
        return 2
    start = time.monotonic()
    runs = run_suite(src, files, jobs=args.jobs, timeout=args.timeout)
    result = compare_runs(runs)
    print(report(runs, result, args.json, absent={} if args.files else absent))
    reruns = sum(r.mode == UNPATCHED for r in runs)
    print(
        f"vLLM {version}: {len(files)} files patched, {reruns} of them rerun "
        f"unpatched, in {time.monotonic() - start:.0f} s"
    )
    return 0 if result.ok else 1


# The pytest plugin of the runs (-p vllm_suite) ----------------------------------


def pytest_configure(config: object) -> None:
    """Load vLLM's general plugins the way its processes do, then check the
    plugin is active exactly in the patched run (its public API is there)."""
    mode = os.environ.get(MODE_ENV)
    if mode is None:
        return
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    import vllm.v1.kv_cache_interface as kv_cache_interface

    active = hasattr(kv_cache_interface, "get_kv_cache_dcp_shard_count")
    if active != (mode == PATCHED):
        raise RuntimeError(
            f"vllm_suite: {mode} run, but the DCP geometry plugin is "
            f"{'active' if active else 'not active'}"
        )


def pytest_sessionfinish(session: object, exitstatus: int) -> None:
    """Record which patch modules applied during the run."""
    record = os.environ.get(RECORD_ENV)
    if os.environ.get(MODE_ENV) is None or not record:
        return
    plugin = sys.modules.get("vllm_dcp_geometry.plugin")
    patches = sorted(plugin.applied_patches()) if plugin is not None else []
    if os.environ[MODE_ENV] == UNPATCHED and patches:
        raise RuntimeError(f"vllm_suite: unpatched run applied {patches}")
    Path(record).write_text(json.dumps({"patches": patches}))


if __name__ == "__main__":
    sys.exit(main())
