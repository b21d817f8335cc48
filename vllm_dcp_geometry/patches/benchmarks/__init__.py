# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patches of vLLM's benchmark tools (``vllm bench``), not of the serving path."""
