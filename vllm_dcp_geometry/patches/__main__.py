# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Print the table of patched vLLM symbols (``python -m vllm_dcp_geometry.patches``)."""

from vllm_dcp_geometry.patches import patch_table_markdown

print(patch_table_markdown())
