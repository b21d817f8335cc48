# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The scheduler benchmark times the manager as vLLM's engine core runs it:
with the GC heap frozen after set-up (``freeze_gc_heap``), and reports the
unfrozen figure beside it. No timing is asserted (timings are what
``python -m benchmarks`` reports); what is checked is that both settings ran
the same workload and that the freeze does not outlive the measurement.

Cost: about 2 s.
"""

from __future__ import annotations

import gc

import pytest

from benchmarks import scheduler


def test_replay_is_timed_frozen_and_unfrozen(monkeypatch) -> None:
    import vllm.utils.gc_utils as gc_utils

    frozen_counts: list[int] = []
    original = gc_utils.freeze_gc_heap

    def recording_freeze() -> None:
        original()
        frozen_counts.append(gc.get_freeze_count())

    monkeypatch.setattr(gc_utils, "freeze_gc_heap", recording_freeze)
    result = scheduler.measure("replay", 16, repeats=2)
    # vLLM's own freeze ran once per repeat and froze the set-up objects.
    assert len(frozen_counts) == 2 and min(frozen_counts) > 0
    assert gc.get_freeze_count() == 0
    assert result["best"]["allocations"] == result["best_unfrozen"]["allocations"]
    assert len(result["unfrozen_runs_us_per_allocation"]) == 2
    assert result["unfrozen_us_per_allocation"] == pytest.approx(
        min(result["unfrozen_runs_us_per_allocation"])
    )
