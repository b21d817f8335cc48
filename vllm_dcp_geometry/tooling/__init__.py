# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What runs beside vLLM: the ``vllm-dcp-geometry`` command and its parts.

``cli`` (plan, replay, simulate, ranks), the topologies and built-in
profiles, the builders of real vLLM objects for them, the CPU stand-ins that
let vLLM's GPU-side code run on a machine with no GPU, and the generated
documentation. A server never imports this package (the runtime is checked
not to); it may import everything.
"""
