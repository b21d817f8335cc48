# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Patch ``vllm.v1.kv_cache_interface``: every spec answers its own DCP geometry.

What: adds ``dcp_kv_shard_count`` (keyword-only, default None) to every
``AttentionSpec`` as a real dataclass field, a ``dcp_shard_count(D)`` method to
every ``KVCacheSpec`` class and the module function
``get_kv_cache_dcp_shard_count(spec, D)``; wraps ``merge`` (layers with
different K never merge; the refusal is an ``AssertionError`` too, vLLM's
sign that specs belong in different groups),
``UniformTypeKVCacheSpecs.is_uniform_type``,
``AttentionSpec.max_num_blocks_per_req`` and
``FullAttentionSpec.max_memory_usage_bytes`` so they use K.

Why: vLLM 0.33.0 only has the boolean ``dcp_sharded`` and derives
``block_size * D`` from it; partial shard counts cannot be expressed, and
``merge`` rebuilds specs from an explicit field list that would drop any new
field.

Remove when: upstream vLLM carries a per-spec shard count through its specs
(a ``get_kv_cache_dcp_shard_count`` helper and a K-aware ``merge``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    ShardCountMergeError,
    TokenLayout,
    attention_block_table_width,
    check_dcp_world_size,
    check_shard_count_value,
    full_attention_pages_per_request,
    resolve_shard_count,
    resolve_uniform_shard_count,
)
from vllm_dcp_geometry.runtime.geometry import (
    SHARD_COUNT_FIELD_NAME,
    explicit_shard_count,
    get_kv_cache_dcp_shard_count,
    shard_count_unless_default,
)
from vllm_dcp_geometry.runtime.patching import (
    Patch,
    Pin,
    Wrap,
    add_attribute,
    set_item,
    wrap,
)
from vllm_dcp_geometry.runtime.upstream_symbols import UpstreamChangedError

GRAFTED_SPEC_CLASSES = (
    "FullAttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CircularBufferSpec",
    "CrossAttentionSpec",
    "EncoderOnlyAttentionSpec",
    "HiddenStateCacheSpec",
    "MLAAttentionSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
)
"""vLLM 0.33.0's dataclass subclasses of ``AttentionSpec``: each gets the
``dcp_kv_shard_count`` field grafted, which regenerates its dataclass
``__init__``, ``__eq__`` and ``__repr__`` (subclasses defined later get the
same through ``KVCacheSpec.__init_subclass__``)."""


@dataclass(frozen=True)
class _ShardCountFieldSource:
    # Built by the dataclass machinery so the Field is complete and public-API
    # made; it is grafted onto AttentionSpec and its subclasses below.
    dcp_kv_shard_count: int | None = field(default=None, kw_only=True, repr=False)


_SHARD_COUNT_FIELD = _ShardCountFieldSource.__dataclass_fields__[SHARD_COUNT_FIELD_NAME]


def spec_owner_name(spec: Any) -> str:
    """A readable name for a spec in error messages."""
    return f"{type(spec).__name__}(block_size={getattr(spec, 'block_size', '?')})"


def _unknown_spec_shard_count(self: Any, dcp_world_size: int) -> int:
    check_dcp_world_size(dcp_world_size)
    if dcp_world_size == 1:
        return 1
    raise DcpGeometryError(
        f"{type(self).__module__}.{type(self).__qualname__} is a KV-cache spec "
        "type the DCP geometry contract does not know: subclass AttentionSpec "
        "or MambaSpec, or define dcp_shard_count(dcp_world_size) on it"
    )


def _attention_shard_count(self: Any, dcp_world_size: int) -> int:
    layout = TokenLayout.SHARDED if self.dcp_sharded else TokenLayout.REPLICATED
    return resolve_shard_count(
        owner=spec_owner_name(self),
        layout=layout,
        dcp_world_size=dcp_world_size,
        dcp_kv_shard_count=explicit_shard_count(self),
    )


def _recurrent_shard_count(self: Any, dcp_world_size: int) -> int:
    return resolve_shard_count(
        owner=spec_owner_name(self),
        layout=TokenLayout.RECURRENT,
        dcp_world_size=dcp_world_size,
    )


def _self_addressed_shard_count(self: Any, dcp_world_size: int) -> int:
    # HiSparse pages are addressed by the spec itself; vLLM's own flag decides.
    layout = TokenLayout.SHARDED if self.dcp_sharded else TokenLayout.REPLICATED
    return resolve_shard_count(
        owner=spec_owner_name(self), layout=layout, dcp_world_size=dcp_world_size
    )


def _uniform_shard_count(self: Any, dcp_world_size: int) -> int:
    check_dcp_world_size(dcp_world_size)
    if dcp_world_size == 1:
        return 1
    counts = {
        name: get_kv_cache_dcp_shard_count(spec, dcp_world_size, owner=name)
        for name, spec in self.kv_cache_specs.items()
    }
    return resolve_uniform_shard_count(
        f"UniformTypeKVCacheSpecs({', '.join(self.kv_cache_specs)})", counts
    )


# Dataclass methods of specs that exist before the patch ----------------------


def _make_init(original: Callable[..., None]) -> Callable[..., None]:
    def __init__(
        self: Any, *args: Any, dcp_kv_shard_count: int | None = None, **kwargs: Any
    ) -> None:
        check_shard_count_value(type(self).__name__, dcp_kv_shard_count)
        if dcp_kv_shard_count is not None:
            # Unset, the class default (None) answers, so a spec without K
            # pickles byte-for-byte as it does in unpatched vLLM.
            object.__setattr__(self, SHARD_COUNT_FIELD_NAME, dcp_kv_shard_count)
        original(self, *args, **kwargs)

    return __init__


def _make_eq(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def __eq__(self: Any, other: Any) -> Any:
        result = original(self, other)
        if result is True:
            return explicit_shard_count(self) == explicit_shard_count(other)
        return result

    return __eq__


def _make_repr(original: Callable[[Any], str]) -> Callable[[Any], str]:
    def __repr__(self: Any) -> str:
        text = original(self)
        k = explicit_shard_count(self)
        if k is None or not text.endswith(")"):
            return text
        return f"{text[:-1]}, {SHARD_COUNT_FIELD_NAME}={k})"

    return __repr__


def _make_merge(original: Callable[..., Any]) -> Callable[..., Any]:
    def merge(cls: type, specs: list[Any]) -> Any:
        counts = {explicit_shard_count(spec) for spec in specs}
        if counts <= {None}:
            return original(cls, specs)
        if len(counts) > 1:
            raise ShardCountMergeError(
                f"{cls.__name__}.merge: layers with different dcp_kv_shard_count "
                f"({sorted(counts, key=str)}) cannot share one KV-cache group"
            )
        (count,) = counts
        bare = [dataclasses.replace(spec, dcp_kv_shard_count=None) for spec in specs]
        merged = original(cls, bare)
        return dataclasses.replace(merged, dcp_kv_shard_count=count)

    return merge


def _make_is_uniform_type(original: Callable[..., bool]) -> Callable[..., bool]:
    def is_uniform_type(cls: type, kv_cache_specs: dict[str, Any]) -> bool:
        counts = {explicit_shard_count(spec) for spec in kv_cache_specs.values()}
        if len(counts) > 1:
            return False
        return original(cls, kv_cache_specs)

    return is_uniform_type


def _make_attention_width(original: Callable[..., int]) -> Callable[..., int]:
    def max_num_blocks_per_req(self: Any, vllm_config: Any, max_len: int) -> int:
        if explicit_shard_count(self) is None:
            # K follows dcp_sharded: vLLM's own rule, nothing else read.
            return original(self, vllm_config, max_len)
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        k = shard_count_unless_default(self, dcp)
        if k is None:
            return original(self, vllm_config, max_len)
        return attention_block_table_width(max_len, self.block_size, k)

    return max_num_blocks_per_req


def _make_full_attention_memory(original: Callable[..., int]) -> Callable[..., int]:
    def max_memory_usage_bytes(self: Any, vllm_config: Any) -> int:
        if explicit_shard_count(self) is None:
            return original(self, vllm_config)
        dcp = vllm_config.parallel_config.decode_context_parallel_size
        k = shard_count_unless_default(self, dcp)
        if k is None:
            return original(self, vllm_config)
        pages = full_attention_pages_per_request(
            vllm_config.model_config.max_model_len, self.block_size, k
        )
        return pages * self.page_size_bytes

    return max_memory_usage_bytes


def _all_subclasses(cls: type) -> list[type]:
    seen: list[type] = []
    stack = [cls]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.append(current)
        stack.extend(current.__subclasses__())
    return seen


def graft_shard_count_field(cls: type) -> None:
    """Give an existing dataclass spec class the ``dcp_kv_shard_count`` field.

    Classes defined after the graft inherit the field through the dataclass
    machinery itself and need nothing here.
    """
    fields_map = cls.__dict__.get("__dataclass_fields__")
    if fields_map is None:
        raise UpstreamChangedError(
            f"{cls.__module__}.{cls.__qualname__} is no longer a dataclass"
        )
    if SHARD_COUNT_FIELD_NAME in fields_map:
        return
    set_item(fields_map, SHARD_COUNT_FIELD_NAME, _SHARD_COUNT_FIELD)
    for name, make in (
        ("__init__", _make_init),
        ("__eq__", _make_eq),
        ("__repr__", _make_repr),
    ):
        if name in cls.__dict__:
            wrap(cls, name, make)


def _make_init_subclass(base: type) -> Any:
    # Spec classes defined after the patch (models, other plugins) get the field
    # from the dataclass machinery, but a merge of their own with an explicit
    # field list would still drop it.
    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        if "merge" in cls.__dict__:
            wrap(cls, "merge", _make_merge)

    return classmethod(__init_subclass__)


def apply(module: ModuleType) -> None:
    add_attribute(
        module.KVCacheSpec, "__init_subclass__", _make_init_subclass(module.KVCacheSpec)
    )
    attention = module.AttentionSpec
    add_attribute(attention, SHARD_COUNT_FIELD_NAME, None)
    for cls in _all_subclasses(attention):
        graft_shard_count_field(cls)

    add_attribute(module.KVCacheSpec, "dcp_shard_count", _unknown_spec_shard_count)
    add_attribute(attention, "dcp_shard_count", _attention_shard_count)
    add_attribute(module.MambaSpec, "dcp_shard_count", _recurrent_shard_count)
    add_attribute(
        module.UniformTypeKVCacheSpecs, "dcp_shard_count", _uniform_shard_count
    )
    for self_addressed in (module.HiSparseHotSpec, module.HiSparseResidentSpec):
        add_attribute(self_addressed, "dcp_shard_count", _self_addressed_shard_count)

    for cls in _all_subclasses(module.KVCacheSpec):
        if "merge" in cls.__dict__:
            wrap(cls, "merge", _make_merge)

    add_attribute(module, "get_kv_cache_dcp_shard_count", get_kv_cache_dcp_shard_count)


def _merge(cls: str) -> Wrap:
    return Wrap(f"{cls}.merge", "cls, specs")  # every subclass's, by ``apply``


PATCH = Patch(
    upstream_module="vllm.v1.kv_cache_interface",
    replaces=(
        # Regenerated dataclass methods and merges: wrapped by ``apply``.
        Wrap("AttentionSpec.__init__"),
        Wrap("AttentionSpec.__eq__", "self, other"),
        Wrap("AttentionSpec.__repr__", "self"),
        Wrap(
            "AttentionSpec.max_num_blocks_per_req",
            "self, vllm_config, max_len",
            _make_attention_width,
        ),
        Wrap(
            "FullAttentionSpec.max_memory_usage_bytes",
            "self, vllm_config",
            _make_full_attention_memory,
        ),
        _merge("KVCacheSpec"),
        _merge("FullAttentionSpec"),
        _merge("MLAAttentionSpec"),
        _merge("RSWASpec"),
        _merge("SlidingWindowMLASpec"),
        _merge("SinkFullAttentionSpec"),
        Wrap(
            "UniformTypeKVCacheSpecs.is_uniform_type",
            "cls, kv_cache_specs",
            _make_is_uniform_type,
        ),
        *(
            Wrap(f"{cls}.{dunder}")
            for cls in GRAFTED_SPEC_CLASSES
            for dunder in ("__init__", "__eq__", "__repr__")
        ),
    ),
    relies_on=(
        Pin("KVCacheSpec.dcp_sharded"),
        Pin("AttentionSpec.dcp_sharded"),
        Pin("MambaSpec.max_num_blocks_per_req", "self, vllm_config, max_len"),
        Pin("HiSparseHotSpec"),
        Pin("HiSparseResidentSpec"),
    ),
    adds=(
        "KVCacheSpec.__init_subclass__",
        "AttentionSpec.dcp_kv_shard_count",
        "KVCacheSpec.dcp_shard_count",
        "AttentionSpec.dcp_shard_count",
        "MambaSpec.dcp_shard_count",
        "UniformTypeKVCacheSpecs.dcp_shard_count",
        "HiSparseHotSpec.dcp_shard_count",
        "HiSparseResidentSpec.dcp_shard_count",
        "get_kv_cache_dcp_shard_count",
    ),
    why=(
        "vLLM 0.33.0 specs carry only the boolean dcp_sharded; partial shard counts "
        "need a field that survives merge/replace/pickle and K-aware widths."
    ),
    remove_when="upstream specs carry a per-spec DCP shard count",
    related=(
        "vllm#40996 (review: move the DCP block-size rule into the spec); "
        "vllm#48392 (draft KV under DCP)"
    ),
    apply=apply,
)
