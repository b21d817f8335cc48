# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Checks of vLLM's compiled kernels on a CUDA device, run outside the suite
(``tests/conftest.py`` hides every GPU); what the scripts share is in
``tests.support.gpu``."""
