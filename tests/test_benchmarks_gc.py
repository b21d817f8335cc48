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


def test_the_startup_timing_times_every_patch_as_it_applies() -> None:
    """``_time_register`` times each patch through the plugin's own apply
    step: every patch applied after ``register()`` (and the imports that
    trigger the rest) was timed, so a renamed step fails here, not only in
    ``python -m benchmarks``. A fresh unpatched process (about 20 s)."""
    from tests.support.processes import run_python

    out = run_python(
        """
        import importlib, json
        from benchmarks import scheduler
        timing = scheduler._time_register(True)
        from vllm_dcp_geometry import plugin
        from vllm_dcp_geometry.patches import declarations
        from vllm_dcp_geometry.runtime.releases import active_release
        for patch in declarations().values():
            if patch.declared_for(active_release()):
                importlib.import_module(patch.upstream_module)
        print(json.dumps({
            "timed": sorted(timing["_applied_ns"]),
            "applied": sorted(plugin.applied_patches()),
        }))
        """,
        patched=False,
    )
    assert out["applied"] and out["timed"] == out["applied"]
