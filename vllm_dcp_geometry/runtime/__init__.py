# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What runs inside vLLM beside the patches: the code they share.

Every module here may import vLLM (inside functions, when vLLM's own modules
are loaded) and the contract; none imports the tooling
(``vllm_dcp_geometry.tooling``) or a patch module. Patch modules import
only this package and the contract (``tests/test_source_rules.py``).
"""
