# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Kimi-K3's DSpark draft replicated under DCP: vLLM runs MLA drafts at DCP D,
so its DSpark DCP backend check and its draft slot kernel read D. For a
replicated (K = 1) draft the plugin makes both read the group."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.support import worker as h
from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.runtime.group_context import use_group_geometry

pytestmark = pytest.mark.patches("worker.dflash_speculator", "worker.mla_attention")


def full(block_size: int, **kw: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float16, **kw
    )


def _draft_config() -> Any:
    return h.kv_cache_config(
        [
            ("model.layers.0.attn", full(64)),
            ("draft.layers.0.attn", full(64, dcp_sharded=False)),
            ("draft.layers.1.attn", full(64, dcp_kv_shard_count=4)),
        ]
    )


def _set_attn(group_ids: list[int], dcp_size: int) -> Any:
    from vllm_dcp_geometry.patches.worker.dflash_speculator import _make_set_attn

    speculator = SimpleNamespace(draft_kv_cache_group_ids=group_ids, dcp_size=dcp_size)
    calls: list[int] = []

    def upstream(self: Any, *args: Any) -> None:
        calls.append(self.dcp_size)

    _make_set_attn(upstream)(
        speculator, None, _draft_config(), SimpleNamespace(cp_size=16), None, None
    )
    assert calls == [dcp_size]
    return speculator


def test_a_replicated_mla_draft_computes_replicated_slots() -> None:
    """An MLA draft (speculator at DCP D) whose groups are all K = 1 runs its
    slot kernel with CP_SIZE = 1; a sharded one keeps D; a mix is refused."""
    assert _set_attn([1], 16).dcp_size == 1
    assert _set_attn([0], 16).dcp_size == 16
    with pytest.raises(DcpGeometryError, match=r"KV-cache group 1 .*K=1 \(D=16\)"):
        _set_attn([1, 2], 16)
    # A dense draft at DCP 1 is left as vLLM built it.
    assert _set_attn([1], 1).dcp_size == 1


def test_the_dspark_dcp_backend_check_reads_the_group() -> None:
    """vLLM's DSpark check reads the parallel config's D; a replicated group
    (constructed in its world 1) skips it as at DCP 1, others run it."""
    from vllm.model_executor.layers.attention.mla_attention import (
        MLACommonMetadataBuilder,
    )

    from vllm_dcp_geometry.patches.worker.mla_attention import _make_validate_dspark
    from vllm_dcp_geometry.runtime.patching import original_of

    method = MLACommonMetadataBuilder._validate_dspark_dcp_support
    assert original_of(method) is not method
    seen: list[bool] = []

    def upstream(self: Any, supports: bool) -> None:
        seen.append(supports)

    check = _make_validate_dspark(upstream)
    check(None, True)
    assert seen == [True]
    for k, runs in ((1, False), (2, True), (4, True)):
        seen.clear()
        with use_group_geometry(GroupGeometry("draft", k, 4, 3)):
            check(None, False)
        assert seen == ([False] if runs else []), k
