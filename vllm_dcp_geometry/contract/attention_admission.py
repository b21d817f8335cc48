# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""How a KV-cache group's attention runs under DCP: the one admission rule.

``admit_attention`` decides, from a group's kind, its shard count K, the DCP
world size D, the K vLLM 0.33.0 itself would read the cache with, the layer
class (``layer_classes``), the attention backend (``attention_backends``) and
the DCP modes that matter, one of:

- ``local``: K = 1 (or D = 1). Every rank holds every position; attention is
  plain single-device attention: no query all-gather, no LSE combine.
- ``dcp``: K = D. vLLM's own DCP attention, untouched.
- ``dcp-partial``: 1 < K < D. The backend reads the rank's shard ``r % K``
  with the group's local lengths and combines exactly: within the rank's
  K-rank replica group (rule A6,
  ``attention_backends.collectives_within_replica``), or, with
  ``partial_collectives: "dcp"``, over the D-wide DCP group with duplicate
  replicas weighing 0.
- ``refused``: the layer class or the backend cannot honour K; ``reason`` is
  the one-line start-up error naming the group, layer, layer class, backend,
  K and D (and, for a class or backend refused by name, its model and why).
- ``none``: the group has no attention (recurrent state).

The runtime (the ``AttentionGroup.create_metadata_builders`` patch and the
builder patches) and ``vllm-dcp-geometry plan`` both call it, so ``plan``
prints what start-up does. Pure logic: no vLLM import.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_dcp_geometry.contract import DcpGeometryError, GroupGeometry
from vllm_dcp_geometry.contract.attention_backends import (
    ATTENTION_FEATURES,
    DCP_DROPPED_FEATURES,
    INTERLEAVE_ONE_ONLY_BACKENDS,
    TAUGHT_BACKENDS,
    AttentionKind,
    backend_is_taught,
    backend_layer_classes,
    is_sparse_backend_name,
    local_only_builder,
    refused_backend,
    vllm_shard_count,
)
from vllm_dcp_geometry.contract.layer_classes import (
    GENERIC_LAYERS,
    SPECIALIZED_DECODE_LAYERS,
    TAUGHT_LAYERS,
    refused_layer,
    taught_layer,
)


class AttentionMode(str, enum.Enum):
    LOCAL = "local"
    DCP = "dcp"
    DCP_PARTIAL = "dcp-partial"
    REFUSED = "refused"
    NONE = "none"


@dataclass(frozen=True)
class AttentionAdmission:
    """The decision for one group; ``reason`` is set when refused."""

    mode: AttentionMode
    reason: str = ""

    @property
    def refused(self) -> bool:
        return self.mode is AttentionMode.REFUSED

    def check(self) -> AttentionAdmission:
        """Raise the refusal as a start-up ``DcpGeometryError``."""
        if self.refused:
            raise DcpGeometryError(self.reason)
        return self


def _refusal(head: str, why: str, remedy: str) -> AttentionAdmission:
    return AttentionAdmission(AttentionMode.REFUSED, f"{head}: {why}; {remedy}")


def _remedy(kind: AttentionKind, backend: str) -> str:
    sparse = is_sparse_backend_name(backend)
    taught = ", ".join(
        n
        for n, t in TAUGHT_BACKENDS.items()
        if t.kind is kind and is_sparse_backend_name(n) == sparse
    )
    return f"use K=D ('sharded') for this group, or the {taught} backend"


def _untaught(
    head: str, kind: AttentionKind, backend: str, k: int, vllm_k: int
) -> AttentionAdmission:
    what = f"{backend} is"
    if local_only_builder(backend) is not None:
        what = f"{backend} is taught K=1 only and"
    return _refusal(
        head,
        f"{what} not taught per-group DCP shard counts and would read this "
        f"cache with vLLM's own K={vllm_k}",
        _remedy(kind, backend),
    )


def _untaught_layer(
    head: str, kind: AttentionKind, layer_class: str, k: int, vllm_k: int
) -> AttentionAdmission:
    taught = TAUGHT_LAYERS.get(layer_class)
    if taught is not None and taught.mla == (kind is AttentionKind.MLA):
        why = f"its layer class runs only K=1 here: {taught.why_not_partial}"
        remedy = "use K=1 ('replicated') or K=D ('sharded') for this layer"
    else:
        why = (
            "its layer class is not taught per-group DCP shard counts; its own "
            f"code reads this cache with vLLM's K={vllm_k}"
        )
        remedy = f"use K={vllm_k} for this layer"
    return _refusal(head, why, remedy)


def describe_layer(layer_name: str | None, layer_class: str | None, mla: bool) -> str:
    """``layer NAME (CLASS)`` as the start-up errors name a group's layer."""
    path = GENERIC_LAYERS[mla] if layer_class is None else layer_class
    return f"layer {layer_name or '(any)'} ({path})"


def impl_world_refusal(head: str, impl_dcp_world_size: int) -> AttentionAdmission:
    """A sharded cache read by an impl vLLM built for fewer DCP ranks (the
    dense DFlash/DSpark drafts of Model Runner V2 run at DCP 1)."""
    return _refusal(
        head,
        f"its attention impl was built for a DCP world of {impl_dcp_world_size} "
        "and would read a cache sharded over D as if it held every position",
        "leave this layer replicated (K=1), as vLLM builds it",
    )


def admit_attention(
    *,
    owner: str,
    kind: AttentionKind,
    backend: str | None,
    shard_count: int,
    dcp_world_size: int,
    default_shard_count: int,
    pcp_world_size: int = 1,
    interleave_size: int = 1,
    dcp_q_replicate: bool = False,
    layer_class: str | None = None,
    layer_name: str | None = None,
    impl_dcp_world_size: int | None = None,
    specialized_decode: bool = False,
    layer_features: frozenset[str] = frozenset(),
) -> AttentionAdmission:
    """How ``owner``'s attention runs (see the module docstring): contract
    rule A4, and P1's refusal of K < D with PCP.

    ``default_shard_count`` is the contract's reading of the spec's
    ``dcp_sharded`` (D or 1); ``backend`` is vLLM's backend name
    (``AttentionBackend.get_name()``). ``dcp_q_replicate`` is MLA's DCP query
    replication (the layer brings D*H query heads), ``interleave_size`` the
    ``cp_kv_cache_interleave_size``. ``layer_class`` is the ``module.qualname``
    of the class that reads the cache (None: vLLM's generic layer for the
    kind), ``layer_name`` one of its layers, ``impl_dcp_world_size`` the DCP
    world its attention impl was built for (None: D, as vLLM builds target
    layers), ``specialized_decode`` whether Kimi-K3's specialized decode is
    on, ``layer_features`` the ``ATTENTION_FEATURES`` the layer uses.
    """
    # The contract's rules for D and K (rank 0 stands for any rank).
    GroupGeometry(owner, shard_count, dcp_world_size, 0)
    d, k = dcp_world_size, shard_count
    if kind is AttentionKind.NONE:
        return AttentionAdmission(AttentionMode.NONE)
    if d == 1:
        return AttentionAdmission(AttentionMode.LOCAL)
    mla = kind is AttentionKind.MLA
    head = (
        f"{owner}: {describe_layer(layer_name, layer_class, mla)}, "
        f"attention backend {backend}, K={k}, D={d}"
    )
    dropped = sorted(layer_features & DCP_DROPPED_FEATURES.get(backend or "", set()))
    if k > 1 and dropped:
        return _dropped_features_refusal(head, backend, dropped)
    if k == d:
        if impl_dcp_world_size is not None and impl_dcp_world_size != d:
            return impl_world_refusal(head, impl_dcp_world_size)
        return AttentionAdmission(AttentionMode.DCP)
    if pcp_world_size > 1:
        return _prefill_context_parallel_refusal(head, pcp_world_size)
    vllm_k = vllm_shard_count(kind, d, default_shard_count)
    if k == vllm_k:
        # The K the layer's own code and its backend read the cache with.
        return AttentionAdmission(AttentionMode.LOCAL)
    named = _named_refusal(head, kind, backend, layer_class, vllm_k)
    if named is not None:
        return named
    if backend is None or not backend_is_taught(kind, backend, k):
        return _untaught(head, kind, backend or "(none)", k, vllm_k)
    refusal = _layer_class_refusal(
        head, kind, backend, layer_class, k, vllm_k, specialized_decode
    )
    if refusal is not None:
        return refusal
    return _admit_taught(
        head,
        kind,
        backend,
        k,
        interleave_size=interleave_size,
        dcp_q_replicate=dcp_q_replicate,
    )


def _named_refusal(
    head: str,
    kind: AttentionKind,
    backend: str | None,
    layer_class: str | None,
    vllm_k: int,
) -> AttentionAdmission | None:
    """K other than vLLM's on a class or backend refused by name
    (``layer_classes.REFUSED_LAYERS``, ``attention_backends.REFUSED_BACKENDS``):
    the message names it, its model and why; the class goes first, since no
    backend would make its own DCP reads follow the group's K."""
    layer = refused_layer(layer_class)
    if layer is not None and layer_class is not None:
        return _refusal(
            head,
            f"{layer.describe(layer_class)} is not taught per-group DCP shard "
            f"counts: {layer.why}; its own code reads this cache with vLLM's "
            f"K={vllm_k}",
            f"use K={vllm_k} for this layer",
        )
    refused = refused_backend(backend or "")
    if refused is not None and backend is not None:
        return _refusal(
            head,
            f"{refused.label} is not taught per-group DCP shard counts: "
            f"{refused.why}; it would read this cache with vLLM's own K={vllm_k}",
            _remedy(kind, backend),
        )
    return None


def _dropped_features_refusal(
    head: str, backend: str | None, dropped: list[str]
) -> AttentionAdmission:
    """K > 1 on a backend whose DCP path does not keep features the layer
    uses."""
    return _refusal(
        head,
        f"its DCP attention path does not keep "
        f"{', '.join(ATTENTION_FEATURES[f] for f in dropped)}, which the layer "
        "uses: the output would be wrong",
        f"use K=1 ('replicated') for this layer (its single-device {backend} "
        "path keeps them) or another backend",
    )


def _prefill_context_parallel_refusal(
    head: str, pcp_world_size: int
) -> AttentionAdmission:
    """K < D with PCP (rule P1)."""
    # vLLM's PCP attention spans the PCP ranks too; nothing shows it right
    # for a cache with fewer shards than D, so it is not run.
    return _refusal(
        head,
        f"prefill context parallelism (PCP={pcp_world_size}) runs vLLM's "
        "own context-parallel attention, which is only known right for K=D",
        "use K=D ('sharded') or turn PCP off",
    )


def _layer_class_refusal(
    head: str,
    kind: AttentionKind,
    backend: str,
    layer_class: str | None,
    k: int,
    vllm_k: int,
    specialized_decode: bool,
) -> AttentionAdmission | None:
    """Why the layer class cannot run K < D on ``backend`` (a taught one), or
    None where it can."""
    mla = kind is AttentionKind.MLA
    layer = taught_layer(layer_class, mla)
    if layer is None or (k > 1 and not layer.partial):
        path = GENERIC_LAYERS[mla] if layer_class is None else layer_class
        return _untaught_layer(head, kind, path, k, vllm_k)
    if layer.backends is not None and backend not in layer.backends:
        return _refusal(
            head,
            f"its layer class is taught per-group DCP shard counts only with "
            f"{', '.join(sorted(layer.backends))}",
            f"use one of them, or K={vllm_k} for this layer",
        )
    backend_layers = backend_layer_classes(backend)
    if backend_layers is not None and layer.path not in backend_layers:
        return _refusal(
            head,
            f"{backend} is taught per-group DCP shard counts only for "
            f"{', '.join(sorted(backend_layers))} (whose own indexer call is "
            f"taught the group's K); this layer class would read the cache with "
            f"vLLM's own K={vllm_k}",
            f"use K={vllm_k} for this layer",
        )
    if specialized_decode and layer.path in SPECIALIZED_DECODE_LAYERS:
        return _refusal(
            head,
            "Kimi-K3's specialized decode (decode_backend=latency_specialized) "
            "runs its own DCP mailboxes over all D ranks and bypasses the impl "
            "(on vLLM 0.34.0 its drafter too: DraftDcp, built at load from the "
            "layer's D on the DCP group)",
            "use K=D ('sharded') for this group or turn specialized decode off",
        )
    return None


def _admit_taught(
    head: str,
    kind: AttentionKind,
    backend: str,
    k: int,
    *,
    interleave_size: int,
    dcp_q_replicate: bool,
) -> AttentionAdmission:
    """K < D on a backend the plugin taught."""
    partial = k > 1
    if kind is AttentionKind.MLA and dcp_q_replicate:
        return _refusal(
            head,
            "DCP query replication (dcp_q_replicate) brings every rank the "
            "query heads of all D ranks, which only a D-way combine reduces",
            "use K=D ('sharded') or set dcp_q_replicate=False",
        )
    if backend in INTERLEAVE_ONE_ONLY_BACKENDS and interleave_size != 1:
        return _refusal(
            head,
            f"its builder refuses cp_kv_cache_interleave_size={interleave_size} "
            "whenever DCP is on",
            "use cp_kv_cache_interleave_size=1 or another backend",
        )
    if partial:
        return AttentionAdmission(AttentionMode.DCP_PARTIAL)
    return AttentionAdmission(AttentionMode.LOCAL)
