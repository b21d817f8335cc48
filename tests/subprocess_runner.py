# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Run a snippet in a fresh interpreter, patched or unpatched, and read back JSON.

Patches are process-wide, so "unpatched vLLM" is only ever a fresh process
that never calls ``register()``. The snippet must print one JSON document as
its last line of standard output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CPU_PRELUDE = """
import os
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ["TRITON_INTERPRET"] = "1"
import vllm.utils.torch_utils, vllm.v1.utils
vllm.v1.utils.PIN_MEMORY = False
vllm.utils.torch_utils.PIN_MEMORY = False
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
    imported, nothing patched) whatever ``patched`` says.
    """
    prelude = (CPU_PRELUDE + (REGISTER if patched else "")) if cpu_prelude else ""
    source = prelude + textwrap.dedent(code)
    full_env = dict(os.environ)
    full_env["VLLM_LOGGING_LEVEL"] = "ERROR"
    if not patched:
        # vLLM would load the plugin through its entry point if anything called
        # load_general_plugins(); an empty filter keeps the baseline unpatched.
        full_env["VLLM_PLUGINS"] = ""
    full_env.update(env or {})
    result = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=REPO_ROOT,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"subprocess failed ({result.returncode}):\n{result.stderr[-4000:]}"
        )
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"subprocess printed nothing:\n{result.stderr[-4000:]}")
    return json.loads(lines[-1])
