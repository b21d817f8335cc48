# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""FlashInfer partial groups within their replica (rule A6), checked where
this machine can: FlashInfer's builder and kernels need CUDA, so its module's
patched helpers, its prefill-wrapper hook and a real impl's binding are
driven directly. Within the replica the builder's world is ``(K, r % K)``
(so its plans count the K x H heads gathered over the replica), the module's
``get_dcp_group`` answers the replica inside the impl's bound forward, and
the prefill wrapper's combine is left unmasked; on the D-wide group
(``partial_collectives: "dcp"``) the builder keeps D and the combine is
replica-masked, as before.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from tests.support.attention import (
    HEAD_SIZE,
    cpu_platform,  # noqa: F401
    flashinfer_impls_without_a_gpu,
    set_dcp_group,
    tiny_model_config,
)
from vllm_dcp_geometry.contract import GroupGeometry

pytestmark = pytest.mark.patches("worker.flashinfer")

PARTIAL = GroupGeometry("attn", 2, 4, 3, interleave_size=1)


def _replica() -> Any:
    return types.SimpleNamespace(world_size=2, rank_in_group=1, ranks=[2, 3])


def test_the_builder_world_is_the_replicas_only_within_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.v1.attention.backends import flashinfer

    from vllm_dcp_geometry.runtime.group_context import (
        use_group_geometry,
        use_replica_group,
    )

    set_dcp_group(monkeypatch, 4, 3)
    with use_group_geometry(PARTIAL):
        # The D-wide partial builder keeps D: its plans count D x H heads.
        assert flashinfer.get_dcp_world_size_and_rank(True) == (4, 3)
        with use_replica_group(_replica()):
            assert flashinfer.get_dcp_world_size_and_rank(True) == (2, 1)
    assert flashinfer.get_dcp_world_size_and_rank(True) == (4, 3)


def test_the_module_group_is_the_replica_inside_a_bound_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed import parallel_state
    from vllm.v1.attention.backends import flashinfer

    from vllm_dcp_geometry.runtime.impl_binding import ReplicaForward

    set_dcp_group(monkeypatch, 4, 3)
    replica = _replica()
    seen = ReplicaForward(lambda: flashinfer.get_dcp_group(), replica)()
    assert seen is replica
    assert flashinfer.get_dcp_group() is parallel_state._DCP


def test_the_prefill_combine_is_masked_only_on_the_dcp_group() -> None:
    from vllm_dcp_geometry.patches.worker.flashinfer import _make_get_prefill_wrapper
    from vllm_dcp_geometry.runtime.group_geometry import BOUND_GEOMETRY_ATTR
    from vllm_dcp_geometry.runtime.impl_binding import ReplicaMaskedCombine
    from vllm_dcp_geometry.runtime.metadata_builders import REPLICA_GROUP_ATTR

    def combine(*args: Any, **kwargs: Any) -> None:
        return None

    def upstream(builder: Any, causal: bool) -> Any:
        return types.SimpleNamespace(_dcp_combine=combine)

    hook = _make_get_prefill_wrapper(upstream)
    within, d_wide = types.SimpleNamespace(), types.SimpleNamespace()
    for builder in (within, d_wide):
        setattr(builder, BOUND_GEOMETRY_ATTR, PARTIAL)
    setattr(within, REPLICA_GROUP_ATTR, _replica())
    assert hook(within, True)._dcp_combine is combine
    masked = hook(d_wide, True)._dcp_combine
    assert isinstance(masked, ReplicaMaskedCombine) and masked.replica == 1


@pytest.mark.usefixtures("cpu_platform")
def test_a_real_impl_is_bound_to_its_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ``FlashInferImpl`` of rank 3 at D = 4, K = 2, bound as the
    builder binds it: world ``(2, 1)`` for its DCP and total CP, every
    forward within the replica, its combine unmasked; a replica of another
    world is refused naming the group."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends import flashinfer

    from vllm_dcp_geometry.contract import DcpGeometryError
    from vllm_dcp_geometry.runtime.group_context import use_replica_group
    from vllm_dcp_geometry.runtime.impl_binding import (
        ReplicaForward,
        bind_impl_to_group,
    )

    flashinfer_impls_without_a_gpu(monkeypatch)
    set_dcp_group(monkeypatch, 4, 3)

    def make_impl(name: str) -> Any:
        with set_current_vllm_config(tiny_model_config(4, 1)):
            layer = Attention(
                1,
                HEAD_SIZE,
                HEAD_SIZE**-0.5,
                1,
                prefix=name,
                attn_backend=flashinfer.FlashInferBackend,
            )
        return layer.impl

    impl = make_impl("a")
    combine = impl.dcp_combine
    with use_replica_group(_replica()):
        bind_impl_to_group(impl, PARTIAL, "a")
    assert (impl.dcp_world_size, impl.dcp_rank) == (2, 1)
    assert (impl.total_cp_world_size, impl.total_cp_rank) == (2, 1)
    assert isinstance(impl.forward, ReplicaForward)
    assert impl.dcp_combine is combine
    wrong = types.SimpleNamespace(world_size=4, rank_in_group=3)
    other = make_impl("b")
    with (
        pytest.raises(DcpGeometryError, match="not the group's"),
        use_replica_group(wrong),
    ):
        bind_impl_to_group(other, PARTIAL, "b")
