# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The vLLM release the tools run on, and what the tools do differently on it.

The tools run on every release the plugin supports (``_version``); what they
build from vLLM differs where vLLM itself does:

- Model Runner V1 (``vllm.v1.worker.gpu_model_runner``, ``block_table``, its
  draft proposers) exists on 0.33.0 only; 0.34.0 removed it, with no switch
  back (``VLLM_USE_V2_MODEL_RUNNER=0`` raises there). Where it is gone the
  tools run Model Runner V2 and refuse the V1 options (``require_model_runner_v1``).
- MLA layers take the activation dtype in ``process_weights_after_loading`` on
  0.33.0 and keep it themselves on 0.34.0.

Nothing here imports vLLM: the release is the installed distribution's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, TypeVar

from vllm_dcp_geometry._version import installed_vllm_version
from vllm_dcp_geometry.tooling.topology import TopologyError

T = TypeVar("T")

MODEL_RUNNER_V1_RELEASES: tuple[str, ...] = ("0.33.0",)
"""The supported releases that still have Model Runner V1."""


def vllm_release() -> str:
    """The installed vLLM release, as the outputs name it."""
    return installed_vllm_version() or "(not installed)"


def has_model_runner_v1() -> bool:
    """Whether the installed vLLM has Model Runner V1 (0.33.0; not 0.34.0)."""
    return vllm_release() in MODEL_RUNNER_V1_RELEASES


def default_runner() -> str:
    """The model runner the tools simulate unless told otherwise: V1 where it
    exists (what 0.33.0 falls back to on a machine without Triton), else V2,
    the only runner left."""
    return "v1" if has_model_runner_v1() else "v2"


def require_model_runner_v1(option: str) -> None:
    """Refuse ``option`` (a Model Runner V1 option) on a release without V1:
    one line, exit 2."""
    if not has_model_runner_v1():
        raise TopologyError(
            f"{option}: vLLM {vllm_release()} removed Model Runner V1; "
            "use Model Runner V2 (--runner v2, the default there)"
        )


def process_weights_after_loading(layer: Any, dtype: Any) -> None:
    """``layer.process_weights_after_loading`` with activation dtype ``dtype``:
    0.33.0's MLA layers take it as the argument; 0.34.0's read it from
    ``act_dtype`` (the default dtype when built, used nowhere else), so it is
    set there first: the same weights as 0.33.0 makes."""
    method = layer.process_weights_after_loading
    if "act_dtype" in inspect.signature(method).parameters:
        method(dtype)
        return
    layer.act_dtype = dtype
    method()


def on_installed_release(per_release: Mapping[str, T]) -> T:
    """The installed release's entry of ``per_release`` (what a tool's pin or
    stand-in was written against there); a release without one is refused in
    one line naming the releases that have one."""
    release = vllm_release()
    if release not in per_release:
        raise TopologyError(
            f"the tools know vLLM {', '.join(per_release)} here, not {release}"
        )
    return per_release[release]
