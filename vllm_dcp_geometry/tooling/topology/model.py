# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The topology model: cache groups and the parallel layout they are sized for.

A ``Topology`` is validated against the contract (``vllm_dcp_geometry.contract``)
and the ranges in ``topology.limits`` before any vLLM object is built, so a
layout the contract or vLLM forbids fails here with a message naming the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    TokenLayout,
    check_interleave,
    resolve_shard_count,
)
from vllm_dcp_geometry.contract.collectives import PARTIAL_COLLECTIVES, REPLICA
from vllm_dcp_geometry.tooling.topology.limits import (
    MODEL_LEN_RANGE,
    POSITIVE_INT32,
    REPLAY_TOKENS_RANGE,
    TopologyError,
    show,
)

ATTENTION_KINDS = ("full_attention", "mla", "sliding_window")
RECURRENT_KINDS = ("mamba",)
KINDS = ATTENTION_KINDS + RECURRENT_KINDS
MAMBA_CACHE_MODES = ("none", "align", "all")
TOPOLOGY_SOURCE = "topology"
MODEL_SOURCE = "model"
GROUP_SOURCES = (MODEL_SOURCE, "config", TOPOLOGY_SOURCE)
"""Where a group came from: built from vLLM's real layers (``--model``),
derived from vLLM's model config, or written in a topology file."""
ACTIVATION_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
"""The model dtypes (vLLM's ``ModelConfig.dtype``, by torch name) a group's
``activation_dtype`` may name, and the bytes of one element."""


@dataclass(frozen=True)
class CacheGroup:
    """One KV-cache group: layers sharing one block table and spec."""

    name: str
    kind: str
    layers: tuple[str, ...]
    block_size: int
    draft: bool = False
    spec_fields: Mapping[str, Any] = field(default_factory=dict)
    """Spec constructor fields besides ``block_size`` (validated per kind)."""
    layer_class: str | None = None
    """``module.qualname`` of the attention layer class that reads the cache
    (None: vLLM's generic ``Attention``/``MLAAttention``)."""
    attention_features: tuple[str, ...] = ()
    """``attention_backends.ATTENTION_FEATURES`` the layers use (sinks, a
    mask_mod), which some backends' DCP paths drop."""
    query_heads: int | None = None
    """The model's attention query heads across TP (None: not given). Not a
    spec field: it only sizes ``plan``'s decode collectives. A rank holds
    ``query_heads / tensor_parallel_size`` of them (the topology checks that
    TP divides it)."""
    kv_lora_rank: int | None = None
    """An MLA group's latent rank L (None: not given). Not a spec field: a
    cache row is L latent values then ``head_size - L`` rope values, so
    ``0 < L < head_size``."""
    activation_dtype: str | None = None
    """The dtype of the attention's queries and outputs: the model's dtype
    (vLLM's ``ModelConfig.dtype``, the draft's for a draft group), which
    vLLM builds the layer in (None: not given). Not a spec field: a quantized
    cache (fp8, ``fp8_ds_mla``) stores another dtype, and ``plan`` sizes the
    decode collectives from this one (``ACTIVATION_DTYPE_BYTES``)."""
    source: str = TOPOLOGY_SOURCE
    """``GROUP_SOURCES``: where the group came from."""
    built_backend: str | None = None
    """The attention backend vLLM built the layers on (``source`` "model"
    only; None: ``plan`` chooses as vLLM would on SM90)."""

    @property
    def rope_dim(self) -> int | None:
        """An MLA group's rope dimension R = ``head_size - kv_lora_rank``."""
        if self.kv_lora_rank is None:
            return None
        return int(self.spec_fields["head_size"]) - self.kv_lora_rank

    @property
    def is_attention(self) -> bool:
        return self.kind in ATTENTION_KINDS

    @property
    def layout(self) -> TokenLayout:
        """How the group stores token positions, before a count is chosen."""
        if not self.is_attention:
            return TokenLayout.RECURRENT
        return TokenLayout.SHARDED if self.dcp_sharded else TokenLayout.REPLICATED

    @property
    def dcp_sharded(self) -> bool:
        # Contract rule DR1: draft layers that run at DCP1 under a DCP target
        # are replicated.
        default = self.is_attention and not self.draft
        return bool(self.spec_fields.get("dcp_sharded", default))

    @property
    def dcp_kv_shard_count(self) -> int | None:
        return self.spec_fields.get("dcp_kv_shard_count")

    def shard_count(self, dcp_world_size: int) -> int:
        """K of this group under DCP world size D, from the contract."""
        return resolve_shard_count(
            owner=f"group {self.name!r}",
            layout=self.layout,
            dcp_world_size=dcp_world_size,
            dcp_kv_shard_count=self.dcp_kv_shard_count,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "block_size": self.block_size,
            "draft": self.draft,
            "layers": list(self.layers),
            **({"layer_class": self.layer_class} if self.layer_class else {}),
            **(
                {"attention_features": list(self.attention_features)}
                if self.attention_features
                else {}
            ),
            **(
                {"query_heads": self.query_heads}
                if self.query_heads is not None
                else {}
            ),
            **(
                {"kv_lora_rank": self.kv_lora_rank}
                if self.kv_lora_rank is not None
                else {}
            ),
            **(
                {"activation_dtype": self.activation_dtype}
                if self.activation_dtype is not None
                else {}
            ),
            **{k: _jsonable(v) for k, v in sorted(self.spec_fields.items())},
            **({"source": self.source} if self.source != TOPOLOGY_SOURCE else {}),
            **({"attention_backend": self.built_backend} if self.built_backend else {}),
        }


@dataclass(frozen=True)
class Topology:
    """Cache groups plus the parallel layout and limits to size them for."""

    name: str
    groups: tuple[CacheGroup, ...]
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    interleave_size: int = 1
    partial_collectives: str = REPLICA
    """Where partial (1 < K < D) groups on a dense MLA backend run their
    decode collectives (``collectives.PARTIAL_COLLECTIVES``): within their
    K-rank replica (rule A6, the default) or on the D-wide DCP group, as
    ``additional_config["dcp_geometry"]["partial_collectives"]`` sets it."""
    max_model_len: int = 4096
    max_num_seqs: int = 1
    mamba_cache_mode: str = "none"
    cache_block_size: int | None = None
    replay_tokens: int | None = None
    replay_step_tokens: int | None = None
    description: str = ""
    source: str = ""
    weight_bytes_per_rank: int | None = None
    """The parameters of the model vLLM built, per rank (``--model`` only: a
    topology file states no weights, and none is written to one)."""

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def heads_per_rank(self, group: CacheGroup) -> int | None:
        """The group's query heads on one TP rank (None without
        ``query_heads``); ``validate`` checks that TP divides them."""
        if group.query_heads is None:
            return None
        return group.query_heads // self.tensor_parallel_size

    @property
    def scheduler_cache_block_size(self) -> int:
        """``cache_config.block_size``: the recurrent block size in a hybrid
        (where vLLM aligns chunk ends), else the first group's."""
        if self.cache_block_size is not None:
            return self.cache_block_size
        for group in self.groups:
            if not group.is_attention:
                return group.block_size
        return self.groups[0].block_size

    def with_layout(
        self,
        *,
        dcp: int | None = None,
        tp: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        interleave: int | None = None,
    ) -> Topology:
        """A copy with command-line overrides applied, then re-validated."""
        changes: dict[str, Any] = {}
        if dcp is not None:
            changes["decode_context_parallel_size"] = dcp
        if tp is not None:
            changes["tensor_parallel_size"] = tp
        if max_model_len is not None:
            changes["max_model_len"] = max_model_len
        if max_num_seqs is not None:
            changes["max_num_seqs"] = max_num_seqs
        if interleave is not None:
            changes["interleave_size"] = interleave
        updated = replace(self, **changes)
        updated.validate()
        return updated

    def validate(self) -> None:
        """Check the layout against the contract and vLLM's ranges; raise
        ``TopologyError`` naming the field or group."""
        where = f"topology {self.name!r}"
        self._check_parallel_layout(where)
        self._check_group_names(where)
        for group in self.groups:
            self._check_group(group, where)
        self._check_kv_heads_under_dcp(where)
        self._check_indexer_caches(where)
        if self.replay_tokens is not None:
            REPLAY_TOKENS_RANGE.check(self.replay_tokens, f"{where}: replay tokens")
        if self.replay_step_tokens is not None:
            POSITIVE_INT32.check(
                self.replay_step_tokens, f"{where}: replay step_tokens"
            )

    def _check_parallel_layout(self, where: str) -> None:
        for label, value in (
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("decode_context_parallel_size", self.decode_context_parallel_size),
            ("cp_kv_cache_interleave_size", self.interleave_size),
            ("max_num_seqs", self.max_num_seqs),
        ):
            POSITIVE_INT32.check(value, f"{where}: {label}")
        MODEL_LEN_RANGE.check(self.max_model_len, f"{where}: max_model_len")
        if self.partial_collectives not in PARTIAL_COLLECTIVES:
            raise TopologyError(
                f"{where}: [parallel] partial_collectives must be one of "
                f"{list(PARTIAL_COLLECTIVES)}, got {show(self.partial_collectives)}"
            )
        if self.cache_block_size is not None:
            POSITIVE_INT32.check(self.cache_block_size, f"{where}: [cache] block_size")
        dcp = self.decode_context_parallel_size
        if self.tensor_parallel_size % dcp != 0:
            raise TopologyError(
                f"{where}: the DCP size {dcp} must divide the tensor-parallel "
                f"size {self.tensor_parallel_size} (DCP ranks are carved out "
                "of the TP group)"
            )

    def _check_group_names(self, where: str) -> None:
        if not self.groups:
            raise TopologyError(f"{where}: no cache groups")
        names = [g.name for g in self.groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise TopologyError(f"{where}: duplicate group names {dupes}")
        seen: dict[str, str] = {}
        for group in self.groups:
            for layer in group.layers:
                if layer in seen:
                    raise TopologyError(
                        f"{where}: layer {layer!r} is in both group "
                        f"{seen[layer]!r} and group {group.name!r}"
                    )
                seen[layer] = group.name

    def _check_indexer_caches(self, where: str) -> None:
        """A DSA indexer cache and its latent cache share one K (the rule
        start-up applies to the specs, ``overrides.check_indexer_caches``)."""
        from vllm_dcp_geometry.contract.overrides import check_indexer_caches

        dcp = self.decode_context_parallel_size
        shard_counts = {
            layer: group.shard_count(dcp)
            for group in self.groups
            if group.is_attention
            for layer in group.layers
        }
        try:
            check_indexer_caches(shard_counts, dcp)
        except DcpGeometryError as exc:
            raise TopologyError(f"{where}: {exc}") from exc

    def _check_group(self, group: CacheGroup, where: str) -> None:
        dcp = self.decode_context_parallel_size
        try:
            k = group.shard_count(dcp)
            check_interleave(group.block_size, k, self.interleave_size)
        except TopologyError:
            raise
        except DcpGeometryError as exc:
            raise TopologyError(f"{where}: {exc}") from exc
        if group.kind == "sliding_window" and group.dcp_sharded and dcp > 1:
            # vLLM's SlidingWindowSpec.max_memory_usage_bytes asserts this.
            raise TopologyError(
                f"{where}: group {group.name!r} is a sliding-window cache sharded "
                f"over DCP (D={dcp}), which vLLM 0.33.0 does not support; set "
                "dcp_sharded = false (K = 1) or decode_context_parallel_size = 1"
            )
        if (
            group.kind == "mamba"
            and self.mamba_cache_mode == "none"
            and group.block_size != self.max_model_len
        ):
            # vLLM sizes a "none"-mode state block to max_model_len and only
            # accepts another --mamba-block-size with prefix caching (align).
            raise TopologyError(
                f"{where}: group {group.name!r} has block_size "
                f"{group.block_size:,} but mamba_cache_mode 'none' keeps one state "
                f"block of max_model_len ({self.max_model_len:,}) tokens; set "
                "block_size = max_model_len or mamba_cache_mode = 'align'"
            )
        self._check_cost_fields(group, where)
        mode = group.spec_fields.get("mamba_cache_mode")
        if mode is not None and mode != self.mamba_cache_mode:
            raise TopologyError(
                f"{where}: group {group.name!r} asks for mamba_cache_mode="
                f"{mode!r} but the cache uses {self.mamba_cache_mode!r} "
                "(vLLM sizes tables from the cache-wide mode)"
            )

    def _check_kv_heads_under_dcp(self, where: str) -> None:
        """vLLM 0.33.0 runs DCP for a GQA/MQA model only where TP exceeds the
        model's total KV heads (``ModelConfig.verify_with_parallel_config``),
        so each rank holds one KV head (replicated). An MLA model, and a
        draft (its own config runs at DCP 1), are not held to it."""
        dcp = self.decode_context_parallel_size
        targets = [g for g in self.groups if g.is_attention and not g.draft]
        if dcp == 1 or any(g.kind == "mla" for g in targets):
            return
        for group in targets:
            heads = group.spec_fields.get("num_kv_heads", 1)
            if heads != 1:
                raise TopologyError(
                    f"{where}: group {group.name!r} has num_kv_heads {heads} per "
                    f"rank at DCP {dcp}, which vLLM 0.33.0 cannot start: DCP for "
                    "a GQA/MQA model needs --tensor-parallel-size above the "
                    "model's total KV heads, so every rank holds one KV head; "
                    "set num_kv_heads = 1 or decode_context_parallel_size = 1"
                )

    def _check_cost_fields(self, group: CacheGroup, where: str) -> None:
        """``query_heads`` split evenly over TP and ``kv_lora_rank`` inside
        the MLA row; re-checked after ``--tp`` overrides."""
        tp = self.tensor_parallel_size
        if group.query_heads is not None and group.query_heads % tp:
            raise TopologyError(
                f"{where}: group {group.name!r} has query_heads "
                f"{group.query_heads} which tensor_parallel_size {tp} does not "
                "divide (each TP rank holds query_heads / TP query heads)"
            )
        rank = group.kv_lora_rank
        if rank is not None:
            head_size = group.spec_fields["head_size"]
            if not 0 < rank < head_size:
                raise TopologyError(
                    f"{where}: group {group.name!r} has kv_lora_rank {rank} but "
                    f"head_size {head_size}; an MLA cache row is kv_lora_rank "
                    "latent values then head_size - kv_lora_rank rope values, "
                    "so 0 < kv_lora_rank < head_size"
                )

    def to_dict(self) -> dict[str, Any]:
        """The topology as a TOML/JSON-shaped mapping (round-trips through
        ``topology_from_mapping``)."""
        cache: dict[str, Any] = {"mamba_cache_mode": self.mamba_cache_mode}
        if self.cache_block_size is not None:
            cache["block_size"] = self.cache_block_size
        replay: dict[str, Any] = {}
        if self.replay_tokens is not None:
            replay["tokens"] = self.replay_tokens
        if self.replay_step_tokens is not None:
            replay["step_tokens"] = self.replay_step_tokens
        data: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "parallel": {
                "tensor_parallel_size": self.tensor_parallel_size,
                "decode_context_parallel_size": self.decode_context_parallel_size,
                "cp_kv_cache_interleave_size": self.interleave_size,
                "partial_collectives": self.partial_collectives,
            },
            "limits": {
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
            },
            "cache": cache,
            "groups": [g.to_dict() for g in self.groups],
        }
        if replay:
            data["replay"] = replay
        return data


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value
