# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Documentation generated from the code: the patch table and the audit of
vLLM's attention layer classes."""
