#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Run vLLM's own unit tests unpatched and patched; fail on what only the
plugin breaks.

vLLM's tests for the code this plugin patches are the best check that every
wrapper takes upstream's path where it should. The installed release's tests
come from its PyPI sdist (the wheel ships none), fetched once with
``pip download`` and cached under ``.cache/vllm-<version>-src`` (only
``tests/`` and ``pyproject.toml``: vLLM's source tree must never shadow the
installed ``vllm``). Every test file runs twice, each time in a fresh process
on CPU (``CUDA_VISIBLE_DEVICES=``, ``TRITON_INTERPRET=1``, the hub offline):
unpatched (``VLLM_PLUGINS=`` empty, no plugin loads) and patched (the plugin
loaded through vLLM's own ``load_general_plugins`` entry point). This module
is also the pytest plugin (``-p vllm_suite``) of those runs: it loads the
plugins and asserts the plugin is active exactly in the patched run.

The files come from ``FILE_LISTS``, one entry per vLLM release (the
installed release picks its own): vLLM 0.34.0 removed Model Runner V1 and
its tests, and added tests of code the plugin patches there. A file one
release's list drops because that release's sdist lacks it is named in its
``absent`` (and in the report), never skipped silently; a file the list
names that the sdist lacks, or an ``absent`` one it has, is bad input.

Exit status: 0 when every test that passes unpatched passes patched, 1 when
any does not, 2 on bad input or when the sdist cannot be fetched. Tests that
fail or skip in both runs (hub models, GPUs, missing test dependencies) are
reported as such, grouped by reason.

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
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

PLUGIN_NAME = "dcp_geometry"
"""The plugin's ``vllm.general_plugins`` entry-point name (pyproject.toml)."""

MODE_ENV = "VLLM_SUITE_MODE"
RECORD_ENV = "VLLM_SUITE_RECORD"
UNPATCHED, PATCHED = "unpatched", "patched"


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
CACHE_DIR = _source.CACHE_DIR
FILE_LISTS = _source.FILE_LISTS
FileList = _source.FileList
SourceUnavailable = _source.SourceUnavailable
installed_vllm_version = _source.installed_vllm_version
fetch_source = _source.fetch_source
pip_command = _source.pip_command
_is_release_tree = _source._is_release_tree
_copy_kept = _source._copy_kept
_extract_archive = _source._extract_archive


# Running one file -----------------------------------------------------------------


@dataclass
class FileRun:
    """One test file in one mode: every test's outcome and why it failed."""

    file: str
    mode: str
    returncode: int
    seconds: float
    outcomes: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    note: str = ""


def run_env(mode: str, record: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        CUDA_VISIBLE_DEVICES="",
        TRITON_INTERPRET="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parent), env.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep),
        VLLM_PLUGINS="" if mode == UNPATCHED else PLUGIN_NAME,
        **{MODE_ENV: mode, RECORD_ENV: str(record)},
    )
    return env


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome (passed, failed, error, skipped) and failure reason by test id."""
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag in ("skipped", "error", "failure"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or found.text or "").strip()
                reasons[test] = message.splitlines()[0][:160] if message else tag
        # A teardown error after a failure keeps the failure.
        if outcomes.get(test) in ("failed", "error"):
            continue
        outcomes[test] = outcome
    return outcomes, reasons


def run_file(src: Path, file: str, mode: str, out_dir: Path, timeout: float) -> FileRun:
    """``file`` under pytest in a fresh process (``mode``: patched or not)."""
    stem = file.replace("/", "_").removesuffix(".py")
    junit = out_dir / f"{mode}-{stem}.xml"
    record = out_dir / f"{mode}-{stem}.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "vllm_suite",
        "-p",
        "no:cacheprovider",
        "-q",
        "--junitxml",
        str(junit),
        file,
    ]
    start = time.monotonic()
    note = ""
    try:
        done = subprocess.run(
            command,
            cwd=src,
            env=run_env(mode, record),
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, note = -1, f"timed out after {timeout:.0f} s"
        output = (exc.stdout or b"").decode(errors="replace") if exc.stdout else ""
    run = FileRun(file, mode, returncode, time.monotonic() - start, note=note)
    if junit.is_file():
        try:
            run.outcomes, run.reasons = parse_junit(junit)
        except ET.ParseError as exc:
            run.note = run.note or f"unreadable junit XML: {exc}"
    if record.is_file():
        run.patches = json.loads(record.read_text())["patches"]
    if not run.outcomes and not run.note:
        tail = output.strip().splitlines()[-3:]
        run.note = f"no test outcomes (pytest exit {returncode}): " + " | ".join(tail)
    return run


# Comparing ------------------------------------------------------------------------


@dataclass
class Comparison:
    """Per-test outcomes of both runs, classified."""

    regressions: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Passed unpatched, not passed patched: test id -> (outcome, reason)."""
    passed_both: int = 0
    fixed: list[str] = field(default_factory=list)
    """Failed or skipped unpatched, passed patched."""
    not_passing_both: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Failed or skipped in both: test id -> (unpatched outcome, reason)."""

    @property
    def ok(self) -> bool:
        return not self.regressions


def compare(
    unpatched: Mapping[str, str],
    patched: Mapping[str, str],
    reasons: Mapping[str, str] | None = None,
    patched_reasons: Mapping[str, str] | None = None,
) -> Comparison:
    """Classify every test of either run; a test the patched run lacks (its
    process crashed, it was not collected) counts as not passed there."""
    reasons = reasons or {}
    patched_reasons = patched_reasons or {}
    result = Comparison()
    for test in sorted(set(unpatched) | set(patched)):
        before = unpatched.get(test, "missing")
        after = patched.get(test, "missing")
        if before == "passed" and after == "passed":
            result.passed_both += 1
        elif before == "passed":
            result.regressions[test] = (after, patched_reasons.get(test, ""))
        elif after == "passed":
            result.fixed.append(test)
        else:
            result.not_passing_both[test] = (before, reasons.get(test, ""))
    return result


def compare_runs(runs: Iterable[FileRun]) -> Comparison:
    by_mode: dict[str, dict[str, str]] = {UNPATCHED: {}, PATCHED: {}}
    why: dict[str, dict[str, str]] = {UNPATCHED: {}, PATCHED: {}}
    for run in runs:
        by_mode[run.mode].update(run.outcomes)
        why[run.mode].update(run.reasons)
        if not run.outcomes:
            key = f"{run.file}::<file>"
            by_mode[run.mode][key] = "crashed"
            why[run.mode][key] = run.note
    return compare(by_mode[UNPATCHED], by_mode[PATCHED], why[UNPATCHED], why[PATCHED])


def report(
    runs: Sequence[FileRun],
    result: Comparison,
    out: Path | None,
    absent: Mapping[str, str] | None = None,
) -> str:
    """The table of both runs by file, the reasons, the verdict; ``absent``:
    the list's files this release lacks, named (not run)."""
    absent = absent or {}
    lines = [f"{'file':<66} {'unpatched':>17} {'patched':>17}"]
    by_file: dict[str, dict[str, FileRun]] = collections.defaultdict(dict)
    for run in runs:
        by_file[run.file][run.mode] = run
    for file, modes in by_file.items():
        cells = []
        for mode in (UNPATCHED, PATCHED):
            run = modes[mode]
            counts = collections.Counter(run.outcomes.values())
            cells.append(
                f"{counts['passed']:>4}p {counts['failed'] + counts['error']:>3}f "
                f"{counts['skipped']:>3}s {run.seconds:>4.0f}s"
                if run.outcomes
                else f"{'no outcomes':>17}"
            )
        lines.append(f"{file:<66} {cells[0]:>17} {cells[1]:>17}")
    for file, because in absent.items():
        lines.append(f"{file:<66} not in this release, not run: {because}")
    active = sorted({p for r in runs if r.mode == PATCHED for p in r.patches})
    lines.append(f"patch modules applied in the patched runs: {len(active)}")
    lines.append(
        f"passed in both: {result.passed_both}; fixed by the plugin: "
        f"{len(result.fixed)}; failed or skipped in both: "
        f"{len(result.not_passing_both)}"
    )
    why = collections.Counter(
        f"{outcome}: {reason}" for outcome, reason in result.not_passing_both.values()
    )
    for reason, count in why.most_common(12):
        lines.append(f"  {count:>5} x {reason}")
    if len(why) > 12:
        lines.append(f"  ... {len(why) - 12} other reasons")
    if result.regressions:
        lines.append(f"FAIL: {len(result.regressions)} pass unpatched, not patched:")
        for test, (outcome, reason) in result.regressions.items():
            lines.append(f"  {test}: {outcome}: {reason}")
    else:
        lines.append("OK: every test that passes unpatched passes patched")
    text = "\n".join(lines)
    if out is not None:
        out.write_text(
            json.dumps(
                {
                    "runs": [asdict(r) for r in runs],
                    "regressions": result.regressions,
                    "fixed": result.fixed,
                    "not_passing_both": result.not_passing_both,
                    "passed_both": result.passed_both,
                    "absent": dict(absent),
                },
                indent=1,
            )
        )
    return text


def run_suite(
    src: Path, files: Sequence[str], *, jobs: int, timeout: float
) -> list[FileRun]:
    problems = check_files(src, files, {})
    if problems:
        raise SystemExit("; ".join(problems))
    with tempfile.TemporaryDirectory(prefix="vllm-suite.") as tmp:
        tasks = [(f, m) for f in files for m in (UNPATCHED, PATCHED)]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [
                pool.submit(run_file, src, f, m, Path(tmp), timeout) for f, m in tasks
            ]
            return [f.result() for f in futures]


def check_files(
    src: Path, files: Sequence[str], absent: Mapping[str, str]
) -> list[str]:
    """What is wrong with the files to run in ``src``: a file it lacks, or a
    file the list says the release lacks that is there (a stale list)."""
    problems = [
        f"not in {src}: {f}" + (f" ({absent[f]})" if f in absent else "")
        for f in files
        if not (src / f).is_file()
    ]
    problems += [
        f"{f} is in {src}, but the file list says the release lacks it"
        for f in absent
        if (src / f).is_file()
    ]
    return problems


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
    print(
        f"vLLM {version}: {len(files)} files, both modes, in "
        f"{time.monotonic() - start:.0f} s"
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
