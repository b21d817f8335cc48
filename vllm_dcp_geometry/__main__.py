# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``python -m vllm_dcp_geometry``: the ``vllm-dcp-geometry`` command."""

import sys

from vllm_dcp_geometry.tooling.cli import main

if __name__ == "__main__":
    sys.exit(main())
