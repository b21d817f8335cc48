# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``--receipt FILE``: a command's JSON report with what produced it.

A receipt carries the report plus the exact command line, the time, the
Python and platform, next to the vLLM and plugin versions and the inputs the
report already names, so a run can be reproduced and compared later.
"""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from vllm_dcp_geometry.tooling.cli.common.status import PROG, CliError


def write_receipt(
    path: str, command: str, argv: Sequence[str], report: dict[str, Any]
) -> None:
    """Write ``report`` as the receipt of ``command`` to ``path``."""
    receipt = {
        "receipt": f"{PROG} {command}",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": [PROG, *argv],
        "python": platform.python_version(),
        "platform": platform.platform(),
        **report,
    }
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(receipt, fh, indent=2)
            fh.write("\n")
    except OSError as exc:
        raise CliError(f"cannot write receipt {path}: {exc}") from exc
