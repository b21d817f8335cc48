# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""From a parsed TOML/JSON document to a validated ``Topology``.

Every key is known, every value is type- and range-checked here, and each
error names the table, group or field and the rule it broke.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract.collectives import REPLICA
from vllm_dcp_geometry.tooling.topology.limits import (
    NON_NEGATIVE_INT32,
    POSITIVE_INT32,
    TopologyError,
    show,
)
from vllm_dcp_geometry.tooling.topology.model import (
    ACTIVATION_DTYPE_BYTES,
    ATTENTION_KINDS,
    GROUP_SOURCES,
    KINDS,
    MAMBA_CACHE_MODES,
    TOPOLOGY_SOURCE,
    CacheGroup,
    Topology,
)

# Spec fields a group may set, by kind; anything else is a typo and an error.
_ATTENTION_FIELDS = frozenset(
    {
        "dcp_sharded",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "dcp_kv_shard_count",
        "page_size_padded",
        "max_tp_shards",
        "kv_quant_mode",
        "block_stride_alignment",
        "block_stride_multiple_of",
    }
)
_MAMBA_FIELDS = frozenset(
    {
        "shapes",
        "dtypes",
        "mamba_type",
        "num_speculative_blocks",
        "num_prefill_checkpoint_blocks",
        "mamba_cache_mode",
        "page_size_padded",
        "prefill_checkpoint_alignment",
        "block_stride_alignment",
        "block_stride_multiple_of",
    }
)
_SPEC_FIELDS: dict[str, frozenset[str]] = {
    "full_attention": _ATTENTION_FIELDS | {"sliding_window"},
    "mla": _ATTENTION_FIELDS
    | {
        "cache_dtype_str",
        "non_causal_multi_token_decode",
        "cache_role",
        "state_content_bytes",
        "topk_buffer_width",
        "is_index_group_leader",
    },
    "sliding_window": _ATTENTION_FIELDS | {"sliding_window"},
    "mamba": _MAMBA_FIELDS,
}
_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "full_attention": ("num_kv_heads", "head_size", "dtype"),
    "mla": ("head_size", "dtype"),
    "sliding_window": ("num_kv_heads", "head_size", "dtype", "sliding_window"),
    "mamba": ("shapes", "dtypes"),
}
_POSITIVE_FIELDS = (
    "block_stride_alignment",
    "block_stride_multiple_of",
    "max_tp_shards",
    "topk_buffer_width",
    "state_content_bytes",
    "page_size_padded",
    "prefill_checkpoint_alignment",
    "num_kv_heads",
    "head_size",
    "head_size_v",
    "sliding_window",
    "dcp_kv_shard_count",
)
_COUNT_FIELDS = ("num_speculative_blocks", "num_prefill_checkpoint_blocks")
_NAME_FIELDS = (
    "kv_quant_mode",
    "dtype",
    "cache_dtype_str",
    "mamba_type",
    "mamba_cache_mode",
    "cache_role",
)
_GROUP_KEYS = frozenset(
    {
        "name",
        "kind",
        "layers",
        "layer_template",
        "layer_ids",
        "block_size",
        "draft",
        "layer_class",
        "attention_features",
        "source",
        "attention_backend",
    }
)
# Per-group model shapes that only size plan's decode collectives: never spec
# fields (vLLM's spec constructors do not take them, and ``ranks`` reads every
# spec field as something its stand-in layers must build).
_COST_FIELDS: dict[str, frozenset[str]] = {
    "full_attention": frozenset({"query_heads", "activation_dtype"}),
    "mla": frozenset({"query_heads", "kv_lora_rank", "activation_dtype"}),
    "sliding_window": frozenset({"query_heads", "activation_dtype"}),
    "mamba": frozenset(),
}
_COST_DTYPE_FIELDS = frozenset({"activation_dtype"})
_TOP_KEYS = frozenset(
    {"name", "description", "parallel", "limits", "cache", "replay", "groups"}
)
_PARALLEL_KEYS = frozenset(
    {
        "tensor_parallel_size",
        "decode_context_parallel_size",
        "cp_kv_cache_interleave_size",
        "partial_collectives",
    }
)
_LIMIT_KEYS = frozenset({"max_model_len", "max_num_seqs"})
_CACHE_KEYS = frozenset({"block_size", "mamba_cache_mode"})
_REPLAY_KEYS = frozenset({"tokens", "step_tokens"})


def _expect(mapping: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(mapping, Mapping):
        raise TopologyError(f"{what} must be a table/object, got {show(mapping)}")
    return mapping


def _reject_unknown(
    mapping: Mapping[str, Any], allowed: Iterable[str], what: str
) -> None:
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise TopologyError(
            f"{what}: unknown key(s) {show(unknown)}; allowed: {sorted(allowed)}"
        )


def _name(value: Any, what: str) -> str:
    """A name printed in tables and errors: a non-empty printable string."""
    if not isinstance(value, str) or not value or not value.isprintable():
        raise TopologyError(
            f"{what} must be a non-empty string of printable characters, "
            f"got {show(value)}"
        )
    return value


def _template_names(template: Any, ids: Any, where: str) -> tuple[str, ...]:
    rule = (
        f"{where}: 'layer_template' must be a string with exactly one '{{}}' "
        "and no other replacement field (write '{{' and '}}' for literal "
        f"braces), got {show(template)}"
    )
    if not isinstance(template, str):
        raise TopologyError(rule)
    try:
        fields = [
            (name, spec, conversion)
            for _, name, spec, conversion in string.Formatter().parse(template)
            if name is not None
        ]
    except ValueError as exc:
        raise TopologyError(f"{rule} ({exc})") from exc
    if fields != [("", "", None)]:
        raise TopologyError(rule)
    if (
        not isinstance(ids, list)
        or not ids
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
    ):
        raise TopologyError(
            f"{where}: 'layer_ids' must be a non-empty list of integers (a group "
            f"needs at least one layer), got {show(ids)}"
        )
    return tuple(template.format(i) for i in ids)


def _layer_names(raw: Mapping[str, Any], where: str) -> tuple[str, ...]:
    if "layers" in raw:
        if "layer_template" in raw or "layer_ids" in raw:
            raise TopologyError(
                f"{where}: give either 'layers' or 'layer_template' + 'layer_ids'"
            )
        layers = raw["layers"]
        if not isinstance(layers, list) or not layers:
            raise TopologyError(
                f"{where}: 'layers' must be a non-empty list of layer names (a "
                f"group needs at least one layer), got {show(layers)}"
            )
        names = tuple(_name(n, f"{where}: each of 'layers'") for n in layers)
    elif "layer_template" in raw:
        names = _template_names(raw["layer_template"], raw.get("layer_ids"), where)
    else:
        raise TopologyError(f"{where}: no layers ('layers' or 'layer_template')")
    if len(set(names)) != len(names):
        raise TopologyError(f"{where}: repeated layer names")
    return names


def _group_from_mapping(raw: Any, index: int) -> CacheGroup:
    raw = _expect(raw, f"groups[{index}]")
    name = _name(raw.get("name", f"group{index}"), f"groups[{index}]: 'name'")
    where = f"group {name!r}"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise TopologyError(
            f"{where}: 'kind' must be one of {list(KINDS)}, got {show(kind)}"
        )
    _reject_unknown(raw, _GROUP_KEYS | _SPEC_FIELDS[kind] | _COST_FIELDS[kind], where)
    block_size = POSITIVE_INT32.check(raw.get("block_size"), f"{where}: block_size")
    draft = raw.get("draft", False)
    if not isinstance(draft, bool):
        raise TopologyError(f"{where}: 'draft' must be true or false")
    if draft and kind not in ATTENTION_KINDS:
        raise TopologyError(f"{where}: only attention groups can be draft groups")
    spec_fields = {k: v for k, v in raw.items() if k in _SPEC_FIELDS[kind]}
    missing = [k for k in _REQUIRED_FIELDS[kind] if k not in spec_fields]
    if missing:
        raise TopologyError(f"{where}: missing spec field(s) {missing}")
    _check_spec_fields(spec_fields, where)
    if kind == "mamba":
        _check_state_shapes(spec_fields, where)
    layer_class = raw.get("layer_class")
    if layer_class is not None:
        if kind not in ATTENTION_KINDS:
            raise TopologyError(f"{where}: only attention groups have a layer_class")
        _layer_class(layer_class, where)
    features = _attention_features(raw.get("attention_features", []), kind, where)
    source = raw.get("source", TOPOLOGY_SOURCE)
    if source not in GROUP_SOURCES:
        raise TopologyError(
            f"{where}: 'source' must be one of {list(GROUP_SOURCES)}, "
            f"got {show(source)}"
        )
    built_backend = raw.get("attention_backend")
    if built_backend is not None and (source != "model" or kind not in ATTENTION_KINDS):
        raise TopologyError(
            f"{where}: 'attention_backend' is the backend vLLM built the layers "
            "on, for a group with source 'model' only"
        )
    cost = {
        key: POSITIVE_INT32.check(raw[key], f"{where}: {key}")
        for key in sorted(_COST_FIELDS[kind] - _COST_DTYPE_FIELDS)
        if key in raw
    }
    activation_dtype = raw.get("activation_dtype")
    if activation_dtype is not None and (
        not isinstance(activation_dtype, str)
        or activation_dtype not in ACTIVATION_DTYPE_BYTES
    ):
        raise TopologyError(
            f"{where}: activation_dtype must be the model's dtype, one of "
            f"{sorted(ACTIVATION_DTYPE_BYTES)}, got {show(activation_dtype)}"
        )
    return CacheGroup(
        name=name,
        kind=kind,
        layers=_layer_names(raw, where),
        block_size=block_size,
        draft=draft,
        spec_fields=spec_fields,
        layer_class=layer_class,
        attention_features=features,
        query_heads=cost.get("query_heads"),
        kv_lora_rank=cost.get("kv_lora_rank"),
        activation_dtype=activation_dtype,
        source=source,
        built_backend=built_backend,
    )


def _attention_features(value: Any, kind: str, where: str) -> tuple[str, ...]:
    """Attention features the group's layers use (``attention_sinks`` ...),
    which some backends' DCP paths drop."""
    from vllm_dcp_geometry.contract.attention_backends import ATTENTION_FEATURES

    names = sorted(ATTENTION_FEATURES)
    if not isinstance(value, list) or not all(v in ATTENTION_FEATURES for v in value):
        raise TopologyError(
            f"{where}: attention_features must be a list of {names}, got {show(value)}"
        )
    if value and kind not in ATTENTION_KINDS:
        raise TopologyError(f"{where}: only attention groups have attention_features")
    return tuple(sorted(set(value)))


def _layer_class(value: Any, where: str) -> str:
    """A ``module.qualname`` of Python identifiers, as vLLM classes are named."""
    parts = value.split(".") if isinstance(value, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise TopologyError(
            f"{where}: layer_class must be a class's module.qualname (e.g. "
            f"'vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention'), got "
            f"{show(value)}"
        )
    return str(value)


def _check_spec_fields(fields_: dict[str, Any], where: str) -> None:
    for key in _POSITIVE_FIELDS:
        if key in fields_:
            POSITIVE_INT32.check(fields_[key], f"{where}: {key}")
    for key in _COUNT_FIELDS:
        if key in fields_:
            NON_NEGATIVE_INT32.check(fields_[key], f"{where}: {key}")
    for key in (
        "dcp_sharded",
        "non_causal_multi_token_decode",
        "is_index_group_leader",
    ):
        if key in fields_ and not isinstance(fields_[key], bool):
            raise TopologyError(f"{where}: {key} must be true or false")
    for key in _NAME_FIELDS:
        if key in fields_:
            _name(fields_[key], f"{where}: {key}")
    if fields_.get("mamba_cache_mode", "none") not in MAMBA_CACHE_MODES:
        raise TopologyError(
            f"{where}: mamba_cache_mode must be one of {list(MAMBA_CACHE_MODES)}, "
            f"got {show(fields_['mamba_cache_mode'])}"
        )


def _check_state_shapes(fields_: dict[str, Any], where: str) -> None:
    shapes, dtypes = fields_["shapes"], fields_["dtypes"]
    rule = (
        f"{where}: 'shapes' must be a non-empty list of state shapes (non-empty "
        f"lists of integers in [{POSITIVE_INT32.low}, {POSITIVE_INT32.high}]), "
        f"got {show(shapes)}"
    )
    if not isinstance(shapes, list) or not shapes:
        raise TopologyError(rule)
    for shape in shapes:
        if not isinstance(shape, list) or not shape:
            raise TopologyError(rule)
        for dim in shape:
            POSITIVE_INT32.check(dim, f"{where}: each dimension of 'shapes'")
    if (
        not isinstance(dtypes, list)
        or len(dtypes) != len(shapes)
        or not all(isinstance(d, str) for d in dtypes)
    ):
        raise TopologyError(
            f"{where}: 'dtypes' must be a list of dtype names, one per shape, "
            f"got {show(dtypes)}"
        )
    for dtype in dtypes:
        _name(dtype, f"{where}: each of 'dtypes'")
    fields_["shapes"] = tuple(tuple(s) for s in shapes)
    fields_["dtypes"] = tuple(dtypes)


def _tables(data: Mapping[str, Any], source: str) -> dict[str, Mapping[str, Any]]:
    tables = {}
    for key, allowed in (
        ("parallel", _PARALLEL_KEYS),
        ("limits", _LIMIT_KEYS),
        ("cache", _CACHE_KEYS),
        ("replay", _REPLAY_KEYS),
    ):
        table = _expect(data.get(key, {}), f"{source}: [{key}]")
        _reject_unknown(table, allowed, f"{source}: [{key}]")
        tables[key] = table
    return tables


def _build(data: Any, source: str) -> Topology:
    data = _expect(data, f"{source}: the document")
    _reject_unknown(data, _TOP_KEYS, source)
    tables = _tables(data, source)
    parallel, limits = tables["parallel"], tables["limits"]
    cache, replay = tables["cache"], tables["replay"]
    raw_groups = data.get("groups")
    if not isinstance(raw_groups, list) or not raw_groups:
        raise TopologyError(f"{source}: 'groups' must be a non-empty list")
    groups = tuple(_group_from_mapping(g, i) for i, g in enumerate(raw_groups))
    mode = cache.get("mamba_cache_mode", "none")
    if mode not in MAMBA_CACHE_MODES:
        raise TopologyError(
            f"{source}: [cache] mamba_cache_mode must be one of "
            f"{list(MAMBA_CACHE_MODES)}, got {show(mode)}"
        )
    description = data.get("description", "")
    if not isinstance(description, str):
        raise TopologyError(f"{source}: 'description' must be a string")
    topology = Topology(
        name=_name(data.get("name", Path(source).stem), f"{source}: 'name'"),
        description=description,
        groups=groups,
        tensor_parallel_size=parallel.get("tensor_parallel_size", 1),
        decode_context_parallel_size=parallel.get("decode_context_parallel_size", 1),
        interleave_size=parallel.get("cp_kv_cache_interleave_size", 1),
        partial_collectives=parallel.get("partial_collectives", REPLICA),
        max_model_len=limits.get("max_model_len", 4096),
        max_num_seqs=limits.get("max_num_seqs", 1),
        mamba_cache_mode=mode,
        cache_block_size=cache.get("block_size"),
        replay_tokens=replay.get("tokens"),
        replay_step_tokens=replay.get("step_tokens"),
        source=source,
    )
    topology.validate()
    return topology


def topology_from_mapping(data: Any, source: str = "<mapping>") -> Topology:
    """Build and validate a topology from parsed TOML/JSON."""
    try:
        return _build(data, source)
    except TopologyError as exc:
        if source in str(exc):
            raise
        raise TopologyError(f"{source}: {exc}") from exc
