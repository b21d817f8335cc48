# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Fresh interpreters for the tests, patched or unpatched: ``run_python`` runs a
snippet and reads back the JSON document it prints as its last line of
standard output. Patches are process-wide, so "unpatched vLLM" is only ever a
fresh process that never calls ``register()``. The process itself is the
library's one fresh-process runner (``vllm_dcp_geometry.tooling.fresh_process``,
whose ``run_fresh_python`` is re-exported here); what only tests need, the CPU
switches (``CPU_PRELUDE``) and registering the plugin, is prepended here, and
``REPO_ROOT`` is the working directory every child starts in.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from typing import Any

from vllm_dcp_geometry.tooling.fresh_process import (
    FreshProcessError,
    run_fresh_python,
    run_process,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CPU_PRELUDE = """
import os
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
from vllm_dcp_geometry.tooling import cpu_stand_ins
cpu_stand_ins.disable_pinned_memory(cpu_stand_ins.HOST_BUFFER_MODULES)
"""

REGISTER = """
from vllm.plugins import load_general_plugins
load_general_plugins()
import vllm_dcp_geometry.plugin as _plugin
assert "vllm_dcp_geometry.patches.common.kv_cache_interface" in _plugin.PATCH_MODULES
_plugin.register()
"""


def run_python(
    code: str,
    *,
    patched: bool,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cpu_prelude: bool = True,
) -> Any:
    """Run ``code`` in a fresh Python; return the JSON of its last stdout line.

    ``cpu_prelude=False`` starts from a bare interpreter (nothing of vLLM
    imported, nothing patched, started cold: not even torch is imported)
    whatever ``patched`` says; any other child is forked warm
    (``WARM_START_ENV``, set in conftest), past torch's and the other
    libraries' imports but before any of vLLM's.
    """
    prelude = (CPU_PRELUDE + (REGISTER if patched else "")) if cpu_prelude else ""
    source = prelude + textwrap.dedent(code)
    try:
        return run_fresh_python(
            ["-c", source],
            patched=patched,
            env={"VLLM_LOGGING_LEVEL": "ERROR", **(env or {})},
            cwd=REPO_ROOT,
            timeout=timeout,
            warm=None if cpu_prelude else False,
        )
    except FreshProcessError as exc:
        if exc.returncode != 0:
            raise AssertionError(
                f"subprocess failed ({exc.returncode}):\n{exc.stderr}"
            ) from exc
        raise AssertionError(f"subprocess printed nothing:\n{exc.stderr}") from exc


def run_command(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python args...`` (``-m vllm_dcp_geometry plan ...``, say) in a fresh
    process from ``REPO_ROOT``, forked warm, with ``env`` as its whole
    environment (this process's by default); as ``subprocess.run`` reports
    it, output captured as text."""
    return run_process(
        args,
        env=dict(os.environ) if env is None else env,
        cwd=REPO_ROOT,
        timeout=timeout,
    )
