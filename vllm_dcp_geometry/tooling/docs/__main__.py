# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Print the table of patched vLLM symbols
(``python -m vllm_dcp_geometry.tooling.docs``)."""

from vllm_dcp_geometry.tooling.docs.patch_table import patch_table_markdown

print(patch_table_markdown())
