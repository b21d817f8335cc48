# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How the installed vLLM differs from the releases vllm-dcp-geometry knows.

    python tools/drift_report.py                    # every pin, every DCP site
    python tools/drift_report.py --against 0.33.0   # against one release's lock files
    python tools/drift_report.py --write            # record the installed release

Exit status: 0 when the installed vLLM matches a known release everywhere,
1 when a pinned symbol or a DCP site outside the patched modules differs.
"""

import os
import sys

# vLLM imports on a machine without a GPU; nothing here runs a kernel.
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

from vllm_dcp_geometry.tooling.drift.report import main

if __name__ == "__main__":
    sys.exit(main())
