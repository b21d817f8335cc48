# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the DCP geometry contract costs, measured against unpatched vLLM.

Run ``python -m benchmarks`` from the repository root. Every timed number
comes from a fresh process: patched processes call
``vllm_dcp_geometry.register()``, unpatched ones never do (``VLLM_PLUGINS=""``).
Importing this package imports nothing from vLLM.
"""
