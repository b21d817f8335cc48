# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Planning from the operator's own deployment: their model directory and
``vllm serve`` flags in, the KV-cache groups vLLM itself would build out.

- ``serve_line``: the flags, parsed by vLLM's serve parser, into vLLM's
  ``VllmConfig``.
- ``planning_platform``: what vLLM's layers are told about the GPU (SM90).
- ``model_build``: the model's real vLLM modules on the meta device, their
  specs collected as a worker's runner collects them, grouped by vLLM's
  planner.
- ``deployment``: the groups as a ``Topology`` every command takes, each
  naming where it came from.

``prepare_planning`` must run before anything imports vLLM's attention or
model modules (they bind the platform when imported).
"""

from __future__ import annotations

import os

OFFLINE = "HF_HUB_OFFLINE"


def prepare_planning() -> None:
    """Make this process a planning process: nothing is downloaded (a model
    is a local directory), vLLM's platform is the planning platform and the
    FlashAttention backends import without their CUDA kernels."""
    os.environ.setdefault(OFFLINE, "1")
    import vllm.platforms

    from vllm_dcp_geometry.tooling.planning_stand_ins import install_planning_stand_ins
    from vllm_dcp_geometry.tooling.serve.planning_platform import (
        make_planning_platform,
    )

    if type(vllm.platforms.current_platform).__name__ != "PlanningPlatform":
        vllm.platforms.current_platform = make_planning_platform()
    install_planning_stand_ins()
