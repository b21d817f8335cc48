# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The runners ``ranks`` has, by the layer class each builds (``RUNNERS``),
which one runs a group (``runner_of``) and why none does
(``why_not_run``).

A runner is one module implementing ``interface.LayerRunner``: ``mla``
(vLLM's generic ``MLAAttention``), ``kimi_k3`` (Kimi-K3's own layer),
``sparse_mla`` (DeepSeek-V3.2's sparse layer and its indexer cache, one
runner per cache, run together), ``flash_attention`` (vLLM's generic
``Attention`` on FLASH_ATTN: full-attention and sliding-window groups).
Teaching ``ranks`` another layer class is one more runner module and its
line in ``RUNNERS``; what runners share lives beside them (``inputs``;
``mla_cases`` and ``mla_phases`` for the dense MLA ones; ``sparse_*`` for
DeepSeek-V3.2's; ``flash_attention_inputs`` and ``flash_attention_phases``
for FlashAttention's).
"""

from __future__ import annotations

from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
    GENERIC_LAYERS,
    KIMI_K3_MLA,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners import (
    flash_attention,
    kimi_k3,
    mla,
    sparse_mla,
)
from vllm_dcp_geometry.tooling.cli.ranks.runners.interface import LayerRunner
from vllm_dcp_geometry.tooling.topology import CacheGroup

RUNNERS: dict[str, LayerRunner] = {
    GENERIC_LAYERS[True]: mla.RUNNER,
    GENERIC_LAYERS[False]: flash_attention.RUNNER,
    KIMI_K3_MLA: kimi_k3.RUNNER,
    # One DeepSeek-V3.2 layer reads both groups: the runner runs them together.
    DEEPSEEK_V32_ATTENTION: sparse_mla.LATENT_RUNNER,
    DEEPSEEK_V32_INDEXER_CACHE: sparse_mla.INDEXER_RUNNER,
}
"""The layer classes ``ranks`` builds, by the class a group's layers are (a
topology naming no class: its kind's generic class, ``GENERIC_LAYERS``)."""

RUNNERS_BY_NAME = {runner.name: runner for runner in RUNNERS.values()}

LAYOUT_ONLY_SPEC_FIELDS = frozenset(
    {
        "num_kv_heads",
        "head_size",
        "dtype",
        "dcp_sharded",
        "dcp_kv_shard_count",
        "max_tp_shards",
        "block_stride_multiple_of",
    }
)
"""Spec fields every runner takes as they are: the shapes and K it runs at,
and how pages are laid out in memory (not how a position is attended)."""


def runner_of(group: CacheGroup) -> LayerRunner | None:
    """The runner of the group's layer class and kind (None: ``ranks``
    builds none)."""
    named = group.layer_class
    runner = RUNNERS.get(
        GENERIC_LAYERS[group.kind == "mla"] if named is None else named
    )
    return runner if runner is not None and group.kind in runner.kinds else None


def _spec_refusal(group: CacheGroup, runner: LayerRunner) -> str | None:
    """Why the runner cannot run the group's spec (None: it can): a field
    whose value it does not run, or one it does not know."""
    for field_name, value in sorted(group.spec_fields.items()):
        if field_name in LAYOUT_ONLY_SPEC_FIELDS:
            continue
        allowed = runner.spec_values.get(field_name)
        if allowed is None:
            return (
                f"not run: spec field {field_name} needs a kernel or layer not "
                "built here"
            )
        if value not in allowed:
            return (
                f"not run: {field_name} = {value!r} needs a kernel or layer not "
                "built here"
            )
    return None


def why_not_run(group: CacheGroup, *, gpu: bool, dcp: int) -> str | None:
    """Why ``group`` is not run by ``ranks`` here for what it is (None: its
    kind, layer class and spec run; its runner's ``plan`` checks its
    shapes)."""
    if not group.is_attention:
        return "no attention (recurrent state, not token-sharded)"
    runner = runner_of(group)
    if runner is not None:
        return _spec_refusal(group, runner)
    name = (group.layer_class or "").rsplit(".", 1)[-1]
    taught = ", ".join(
        cls.rsplit(".", 1)[-1] for cls, r in RUNNERS.items() if group.kind in r.kinds
    )
    return f"not run: layer class {name} (ranks builds {taught})"
