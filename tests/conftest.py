# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Test-only set-up: run vLLM's real GPU-side code on CPU.

These settings must be in place before anything imports vLLM, which is why
they live here and never in library code. Also here: ``--patch NAME``, which
keeps only the test modules whose ``pytest.mark.patches(...)`` names the patch
module ``NAME`` (relative to ``vllm_dcp_geometry.patches``, e.g.
``worker.block_table``; the marker is registered in ``pyproject.toml``).
"""

import os
from collections.abc import Iterator

# An empty (not unset) CUDA_VISIBLE_DEVICES keeps vLLM's Triton check on with
# no GPU; the interpreter then runs the real @triton.jit kernels on CPU tensors.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
# As every CPU worker the tooling starts has it (cpu_stand_ins.child_environment):
# no background CUDA build when vLLM's MoE layers are imported; and one
# environment, so the suite's children and the ranks workers share a warm server.
os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"
# Nothing here reaches a hub; planning sets this in-process too (setdefault),
# and a variable that appears mid-run would need a second warm server.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# Every fresh vLLM process the suite starts is forked past the libraries'
# imports (tooling.warm_start): most of each child's start on CPU.
os.environ["VLLM_DCP_GEOMETRY_WARM_START"] = "1"

import pytest

from tests.support.processes import run_python  # noqa: F401


@pytest.fixture
def v2_on_cpu() -> Iterator[None]:
    """Model Runner V2's block tables on CPU (no UVA, CPU device type)."""
    from tests.support import worker

    undo = worker.enable_v2_on_cpu()
    try:
        yield
    finally:
        undo()


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]):
    """``run_cli(*args)``: the command line in this process, its exit
    status, stdout and stderr."""
    from vllm_dcp_geometry.tooling.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


PATCH_PACKAGE = "vllm_dcp_geometry.patches."


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--patch",
        action="append",
        default=[],
        metavar="NAME",
        help="run only the test modules that declare pytest.mark.patches(NAME), "
        "NAME relative to vllm_dcp_geometry.patches (e.g. worker.block_table); "
        "repeat it for the tests of any of several patches",
    )


def declared_patches(item: pytest.Item) -> set[str]:
    """The patch modules ``item``'s ``patches`` markers name (its module's
    ``pytestmark`` included)."""
    return {str(name) for mark in item.iter_markers("patches") for name in mark.args}


def _skip_other_releases(items: list[pytest.Item]) -> None:
    """A test marked ``vllm_releases("0.33.0", ...)`` runs only on those vLLM
    releases (Model Runner V1 exists on 0.33.0 alone, for instance)."""
    from vllm_dcp_geometry._version import installed_vllm_version

    installed = installed_vllm_version()
    for item in items:
        marks = list(item.iter_markers("vllm_releases"))
        releases = {str(r) for mark in marks for r in mark.args}
        if marks and installed not in releases:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"runs on vLLM {', '.join(sorted(releases))} only "
                    f"(installed: {installed})"
                )
            )


def _long_running_first(items: list[pytest.Item]) -> None:
    """The modules marked ``long_running`` before the rest, each module's
    tests in their order. pytest-xdist's ``--dist loadfile`` hands modules
    out in this order (``pytest_configure`` turns off its own reordering,
    by number of tests, which put the few-test multi-process modules last),
    so no minutes-long module starts when the others are nearly done."""
    heavy = {item.path for item in items if item.get_closest_marker("long_running")}
    items.sort(key=lambda item: item.path not in heavy)


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    _skip_other_releases(items)
    _long_running_first(items)
    wanted = set(config.getoption("patch"))
    if not wanted:
        return
    keep = [item for item in items if declared_patches(item) & wanted]
    dropped = [item for item in items if not declared_patches(item) & wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def _check_patch_option(config: pytest.Config) -> None:
    from vllm_dcp_geometry.patches import PATCH_MODULES

    known = {name.removeprefix(PATCH_PACKAGE) for name in PATCH_MODULES}
    unknown = sorted(set(config.getoption("patch")) - known)
    if unknown:
        raise pytest.UsageError(
            f"--patch {', '.join(unknown)}: not a patch module; one of "
            + ", ".join(sorted(known))
        )


def pytest_configure(config: pytest.Config) -> None:
    _check_patch_option(config)
    if hasattr(config.option, "loadscopereorder"):
        # Collection order is the hand-out order (_long_running_first).
        config.option.loadscopereorder = False
    from vllm_dcp_geometry.tooling import cpu_stand_ins

    cpu_stand_ins.disable_pinned_memory(cpu_stand_ins.HOST_BUFFER_MODULES)
    import vllm_dcp_geometry

    # Tests in this process run patched vLLM; unpatched baselines run in a
    # subprocess (tests.support.processes.run_python(..., patched=False)).
    vllm_dcp_geometry.register()
