# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Which of vLLM's own tests ``vllm_suite.py`` runs, where they come from,
and how one file of them runs.

``FILE_LISTS``: one list per vLLM release, the tests of what the plugin
patches. The tests themselves come from the installed release's PyPI sdist
(the wheel ships none), fetched once with ``pip download`` and cached under
``.cache/vllm-<version>-src``, keeping only ``KEEP``: vLLM's source tree must
never shadow the installed ``vllm``. ``run_file`` runs one file, or some of
its tests by node id, in a fresh process, patched or unpatched, and reads
every test's outcome from pytest's junit XML (``parse_junit``; ``node_id``
maps its test ids back to node ids).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache"

PLUGIN_NAME = "dcp_geometry"
"""The plugin's ``vllm.general_plugins`` entry-point name (pyproject.toml)."""

MODE_ENV = "VLLM_SUITE_MODE"
RECORD_ENV = "VLLM_SUITE_RECORD"
UNPATCHED, PATCHED = "unpatched", "patched"

_CORE_BOTH: tuple[str, ...] = (
    "tests/v1/core/test_prefix_caching.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py",
    "tests/v1/core/prefix_cache/test_partial_prefix_cache_primitives.py",
    "tests/v1/core/test_kv_cache_utils.py",
    "tests/v1/core/test_single_type_kv_cache_manager.py",
    "tests/v1/core/test_kv_cache_planning.py",
    "tests/v1/worker/test_gpu_block_table.py",
    "tests/v1/worker/test_gpu_model_runner.py",
    "tests/v1/worker/test_gpu_model_runner_v2.py",
)
"""The core files both releases' sdists carry."""

_CORE_0_33: tuple[str, ...] = (
    *_CORE_BOTH,
    "tests/v1/worker/test_gpu_input_batch.py",
)

_REST_0_33: tuple[str, ...] = (
    "tests/v1/test_kv_cache_spec_registry.py",
    "tests/v1/core/prefix_cache/test_hybrid_prefix_cache_hit_rate.py",
    "tests/v1/core/prefix_cache/test_mamba_eagle_resume_checkpoint.py",
    "tests/v1/core/test_kv_cache_config_builder.py",
    "tests/v1/core/test_swa_inflight_window_free.py",
    "tests/v1/core/test_contiguous_kv_packing.py",
    "tests/v1/core/test_mamba_align_chunk_split.py",
    "tests/v1/core/test_kv_sharing.py",
    "tests/v1/core/test_deferred_block_free.py",
    "tests/v1/core/test_worker_slot_overflow.py",
    "tests/v1/core/test_prefix_replay.py",
    "tests/v1/core/test_scheduler.py",
    "tests/v1/worker/test_gpu_input_batch_v2.py",
    "tests/v1/worker/test_cp_utils.py",
    "tests/v1/worker/test_attn_utils.py",
    "tests/v1/worker/test_utils.py",
    "tests/v1/worker/test_kv_cache_allocation_scope.py",
    "tests/v1/worker/test_mamba_utils.py",
    "tests/v1/worker/test_gpu_warmup_blocks.py",
    "tests/v1/worker/test_kv_block_zeroer.py",
    "tests/v1/attention/test_attention_backends.py",
    "tests/v1/attention/test_mla_backends.py",
    "tests/v1/attention/test_flashinfer_mla_dcp.py",
    "tests/v1/attention/test_dcp_a2a_pack_mask.py",
    "tests/v1/attention/test_mla_context_chunks.py",
    "tests/v1/attention/test_group_sliding_window.py",
    "tests/v1/attention/test_mamba_align_block_table.py",
)

_CORE_0_34: tuple[str, ...] = (
    *_CORE_BOTH,
    "tests/v1/worker/test_mixed_warmup_gate.py",
    "tests/v1/worker/test_extensible_kv_cache.py",
)

# The rest of the list is the same files on both releases.
_REST_0_34: tuple[str, ...] = _REST_0_33


@dataclass(frozen=True)
class FileList:
    """One release's tests of what the plugin patches: KV-cache specs,
    planning, managers, prefix caching, block tables, runners, warmup, DCP
    attention."""

    core: tuple[str, ...]
    """What CI runs: prefix caching and partial prefix hits,
    ``kv_cache_utils``, single-type managers, planning, block tables,
    runners (on 0.34.0 also the V2 warmup's gate, patched there, and the
    extensible KV cache)."""
    rest: tuple[str, ...]
    """What ``--all`` adds."""
    absent: Mapping[str, str] = field(default_factory=dict)
    """Files of another release's list that this release's sdist lacks, and
    why: named, never skipped silently."""

    @property
    def all(self) -> tuple[str, ...]:
        return (*self.core, *self.rest)


FILE_LISTS: dict[str, FileList] = {
    "0.33.0": FileList(
        _CORE_0_33,
        _REST_0_33,
        absent={
            "tests/v1/worker/test_extensible_kv_cache.py": "new in vLLM 0.34.0",
        },
    ),
    "0.34.0": FileList(
        _CORE_0_34,
        _REST_0_34,
        absent={
            "tests/v1/worker/test_gpu_input_batch.py": "Model Runner V1 "
            "was removed, its InputBatch (v1/worker/gpu_input_batch.py) with it",
        },
    ),
}
"""The file lists by vLLM release (the installed one picks its list)."""


class SourceUnavailable(RuntimeError):
    """vLLM's sdist could not be fetched (no network, no such release)."""


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


# Naming the tests ----------------------------------------------------------------


def parse_junit(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Outcome (passed, failed, error, skipped) and failure reason by test id
    (``classname::name``)."""
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


def node_id(file: str, test: str) -> str | None:
    """The pytest node id of ``parse_junit``'s ``test`` in ``file``; None if
    it names no test of ``file`` (a collection error's entry).

    pytest's junit XML splits a node id ``file::Class::test[params]`` into a
    ``classname`` (the file's path dotted, without ``.py``, then each class
    after a dot) and a ``name`` (the function with its parameters, which may
    hold dots, spaces or ``::``)."""
    classname, _, name = test.partition("::")
    module = file.removesuffix(".py").replace("/", ".")
    if not name or not (classname + ".").startswith(module + "."):
        return None
    classes = classname[len(module) :].split(".")[1:]
    if not all(c.isidentifier() for c in classes):
        return None
    return "::".join([file, *classes, name])


def selection_args(file: str, tests: Sequence[str], argsfile: Path) -> list[str]:
    """pytest's arguments for ``tests`` of ``file``: an ``@argsfile`` of node
    ids, one a line (pytest reads it with argparse, in the locale encoding),
    or the ids themselves where one is not plain printable ASCII."""
    ids = [node_id(file, t) or "" for t in tests]
    if not all(ids):
        raise ValueError(f"not tests of {file}: {tests}")
    if all(i.isascii() and i.isprintable() for i in ids):
        argsfile.write_text("".join(f"{i}\n" for i in ids), encoding="ascii")
        return [f"@{argsfile}"]
    return ids


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
    tests: list[str] = field(default_factory=list)
    """The tests (``parse_junit``'s ids) the run was asked for; none: all."""

    @property
    def crashed(self) -> bool:
        """No clean pytest exit with outcomes: crashed, timed out, interrupted."""
        return bool(self.note) or not self.outcomes or self.returncode not in (0, 1)


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


def run_file(
    src: Path,
    file: str,
    mode: str,
    out_dir: Path,
    timeout: float,
    tests: Sequence[str] = (),
) -> FileRun:
    """``file`` under pytest in a fresh process (``mode``: patched or not);
    ``tests``: only these (``parse_junit``'s ids), else every test."""
    stem = f"{mode}-" + file.replace("/", "_").removesuffix(".py")
    junit, record = out_dir / f"{stem}.xml", out_dir / f"{stem}.json"
    selection = (
        selection_args(file, tests, out_dir / f"{stem}.args") if tests else [file]
    )
    command = [sys.executable, "-m", "pytest", "-p", "vllm_suite"]
    command += ["-p", "no:cacheprovider", "-q", "--junitxml", str(junit)]
    start = time.monotonic()
    note = ""
    try:
        done = subprocess.run(
            [*command, *selection],
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
    run.tests = list(tests)
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


# Fetching the tests ---------------------------------------------------------------

KEEP = ("tests", "pyproject.toml", "PKG-INFO")
"""What the cache keeps of the sdist: the tests and vLLM's pytest settings."""


def installed_vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm")


def source_dir(version: str, cache_dir: Path = CACHE_DIR) -> Path:
    return cache_dir / f"vllm-{version}-src"


def _is_release_tree(path: Path, version: str) -> bool:
    info = path / "PKG-INFO"
    if not (info.is_file() and (path / "tests").is_dir()):
        return False
    head = info.read_text(encoding="utf-8", errors="replace").splitlines()[:10]
    return "Name: vllm" in head and f"Version: {version}" in head


def _copy_kept(tree: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    staging.chmod(0o755)
    for name in KEEP:
        source = tree / name
        if source.is_dir():
            shutil.copytree(source, staging / name, symlinks=True)
        elif source.is_file():
            shutil.copy2(source, staging / name)
    try:
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract_archive(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        members = [
            m for m in tar.getmembers() if m.name.split("/")[1:2] in [[k] for k in KEEP]
        ]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, members=members, filter="data")
        else:  # Python < 3.10.12 / 3.11.4: no extraction filters
            tar.extractall(into, members=members)
    roots = {m.name.split("/")[0] for m in members}
    if len(roots) != 1:
        raise SourceUnavailable(f"{archive.name}: not one source tree")
    return into / roots.pop()


def pip_command() -> list[str]:
    """This interpreter's pip, else the first one on ``PATH``: a virtual
    environment made with uv has none, and any pip downloads an sdist."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip3", "pip"):
        found = shutil.which(name)
        if found:
            return [found]
    raise SourceUnavailable("no pip in this interpreter or on PATH")


def fetch_source(version: str, cache_dir: Path = CACHE_DIR) -> Path:
    """vLLM ``version``'s tests, from the cache or its sdist.

    ``pip download --no-binary :all:`` fetches the sdist and unpacks it to
    prepare its metadata, which fails for vLLM (its build needs CUDA tooling);
    ``--no-clean`` keeps the unpacked tree, which is all we need. Nothing is
    built or installed (``--no-build-isolation --no-deps``).
    """
    target = source_dir(version, cache_dir)
    if _is_release_tree(target, version):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-sdist.", dir=cache_dir))
    try:
        downloads, scratch = work / "download", work / "tmp"
        downloads.mkdir()
        scratch.mkdir()
        command = [
            *pip_command(),
            "download",
            f"vllm=={version}",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            "--no-clean",
            "--progress-bar",
            "off",
            "-d",
            str(downloads),
        ]
        env = {**os.environ, "TMPDIR": str(scratch), "PIP_NO_INPUT": "1"}
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=1800
        )
        trees = [
            _extract_archive(a, work / "unpacked")
            for a in sorted(downloads.glob(f"vllm-{version}.tar.gz"))
        ]
        trees += [p.parent for p in scratch.glob("*/*/PKG-INFO")]
        tree = next((t for t in trees if _is_release_tree(t, version)), None)
        if tree is None:
            tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
            raise SourceUnavailable(
                f"could not fetch vllm=={version}'s sdist with pip (exit "
                f"{done.returncode}): " + " | ".join(tail)
            )
        if target.exists():
            shutil.rmtree(target)
        try:
            _copy_kept(tree, target)
        except OSError:
            if not _is_release_tree(target, version):  # not another fetch's
                raise
        return target
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as exc:
        raise SourceUnavailable(
            f"could not fetch vllm=={version}'s sdist: {exc}"
        ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
