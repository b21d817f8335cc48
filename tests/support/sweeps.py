# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The grids the geometry sweeps run over: ``divisors(d)``, every shard count K
a DCP world of ``d`` ranks admits (K divides D), in increasing order, for the
attention, MLA and slot-mapping sweeps alike.
"""

from __future__ import annotations


def divisors(n: int) -> list[int]:
    """Every K dividing ``n``, from 1 to ``n``."""
    return [k for k in range(1, n + 1) if n % k == 0]
