# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""DeepSeek-V3.2's indexer call on one ``ranks`` worker: what vLLM's indexer
op computes before its merge (DeepGEMM's fp8 logits over the indexer cache)
stood in for on every device (``indexer_op_stood_in``: the plugin's wrappers,
re-made by their own factories, around ``sparse_rank_run.indexer_op_stand_in``;
on a CPU the merge's CuteDSL selector too), and the layer call's collectives
counted in order, the indexer call's apart from the attention's
(``CallTraffic``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.tooling.cli.ranks.traffic import Collective, Traffic
from vllm_dcp_geometry.tooling.cpu_stand_ins import replaced
from vllm_dcp_geometry.tooling.sparse_rank_run import IndexerCall, indexer_op_stand_in


@dataclass
class CallTraffic:
    """The collectives of one layer call, counted in order in back-to-back
    ``Traffic.counted`` blocks (the meter counts one block at a time): the
    indexer call's (its top-k merge, part ``indexer``) and everything else
    the call runs before and after it (the attention's query all-gather and
    combine, part ``attention``); each collective lands in exactly one."""

    traffic: Traffic
    parts: dict[str, list[Collective]] = field(default_factory=dict)
    indexer_s: float | None = None
    _open: tuple[str, Any] | None = None

    def _start(self, name: str) -> None:
        counting = self.traffic.counted()
        counting.__enter__()
        self._open = (name, counting)

    def _stop(self) -> None:
        assert self._open is not None
        name, counting = self._open
        self._open = None
        counting.__exit__(None, None, None)
        self.parts.setdefault(name, []).extend(self.traffic.collectives)

    @contextlib.contextmanager
    def layer_call(self) -> Iterator[None]:
        self._start("attention")
        try:
            yield
        finally:
            self._stop()

    def around_indexer(self, op: Callable[..., Any]) -> Callable[..., Any]:
        def counted_indexer(*args: Any, **kwargs: Any) -> Any:
            self._stop()
            self._start("indexer")
            started = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.indexer_s = time.perf_counter() - started
                self._stop()
                self._start("attention")

        return counted_indexer

    def part(self, name: str) -> Traffic:
        """One part's collectives, as a ``Traffic`` (its totals and
        breakdowns)."""
        return Traffic(self.traffic.backend, collectives=list(self.parts.get(name, [])))


def plugin_wrappers_around(current: Any, stand_in: Callable[..., Any]) -> Any:
    """``current`` (a vLLM function, maybe wrapped by the plugin's patches)
    with what lies beneath its wrappers replaced by ``stand_in``: each
    installed wrapper re-made by its own factory (``FACTORY_ATTR``), in the
    same order. Unwrapped (unpatched vLLM): ``stand_in`` itself."""
    import importlib

    from vllm_dcp_geometry.runtime.patching import FACTORY_ATTR
    from vllm_dcp_geometry.runtime.upstream_symbols import ORIGINAL_ATTR, callable_of

    target = callable_of(current)
    factory_path = getattr(target, FACTORY_ATTR, None)
    if factory_path is None or not hasattr(target, ORIGINAL_ATTR):
        return stand_in
    module, _, name = factory_path.rpartition(".")
    factory = getattr(importlib.import_module(module), name)
    return factory(plugin_wrappers_around(getattr(target, ORIGINAL_ATTR), stand_in))


@contextlib.contextmanager
def indexer_op_stood_in(
    record: Callable[[IndexerCall], None],
    split: CallTraffic | None = None,
) -> Iterator[None]:
    """While the block runs: the name the layer calls its indexer by
    (``vllm.models.deepseek_v32.attention.sparse_attn_indexer``) is the
    plugin's wrappers (where loaded) around ``indexer_op_stand_in``, and, on
    a CPU, the merge's CuteDSL selector is stood in for; ``split`` counts the
    call's collectives apart."""
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.models.deepseek_v32 import attention as dsv32
    from vllm.platforms import current_platform

    from vllm_dcp_geometry.runtime.upstream_symbols import original_of

    current = dsv32.sparse_attn_indexer
    # What the layer's name resolves to beneath any wrapper is vLLM's op.
    innermost = current
    while original_of(innermost) is not innermost:
        innermost = original_of(innermost)
    if innermost is not original_of(sai.sparse_attn_indexer):
        raise RuntimeError(
            f"{dsv32.__name__}.sparse_attn_indexer is not vLLM's indexer op"
        )
    call = plugin_wrappers_around(current, indexer_op_stand_in(record))
    if split is not None:
        call = split.around_indexer(call)
    with contextlib.ExitStack() as stack:
        stack.enter_context(replaced(dsv32, "sparse_attn_indexer", call))
        if current_platform.device_type == "cpu":
            from vllm_dcp_geometry.tooling.sparse_stand_ins import (
                cutedsl_merge_stand_ins,
            )

            stack.enter_context(cutedsl_merge_stand_ins())
        yield
