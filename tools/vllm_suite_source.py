# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Which of vLLM's own tests ``vllm_suite.py`` runs, and where they come from.

``FILE_LISTS``: one list per vLLM release, the tests of what the plugin
patches. The tests themselves come from the installed release's PyPI sdist
(the wheel ships none), fetched once with ``pip download`` and cached under
``.cache/vllm-<version>-src``, keeping only ``KEEP``: vLLM's source tree must
never shadow the installed ``vllm``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO_ROOT / ".cache"

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
