# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""KV-cache topologies: the cache groups of a model and its parallel layout.

A topology is what the ``vllm-dcp-geometry`` commands plan and replay: one
entry per KV-cache group (kind, layer names, block size and spec fields such
as ``dcp_kv_shard_count`` or Mamba state shapes) plus the parallel layout and
limits it is sized for. Topologies come from the built-in profiles
(``vllm_dcp_geometry/profiles/*.toml``) or from a user's TOML or JSON file.

This module imports nothing from vLLM: a topology is validated against the
contract (``vllm_dcp_geometry.contract``) before any vLLM object is built, so a
layout the contract forbids fails here with a message naming the group.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    TokenLayout,
    check_interleave,
    resolve_shard_count,
)

DEFAULT_PROFILE = "kimi-k3-tp16-dcp16"

ATTENTION_KINDS = ("full_attention", "mla", "sliding_window")
RECURRENT_KINDS = ("mamba",)
KINDS = ATTENTION_KINDS + RECURRENT_KINDS
MAMBA_CACHE_MODES = ("none", "align", "all")

# Spec fields a group may set, by kind; anything else is a typo and an error.
_ATTENTION_FIELDS = frozenset(
    {
        "dcp_sharded",
        "num_kv_heads",
        "head_size",
        "head_size_v",
        "dtype",
        "dcp_kv_shard_count",
    }
)
_SPEC_FIELDS: dict[str, frozenset[str]] = {
    "full_attention": _ATTENTION_FIELDS | {"sliding_window"},
    "mla": _ATTENTION_FIELDS | {"cache_dtype_str"},
    "sliding_window": _ATTENTION_FIELDS | {"sliding_window"},
    "mamba": frozenset(
        {
            "shapes",
            "dtypes",
            "mamba_type",
            "num_speculative_blocks",
            "num_prefill_checkpoint_blocks",
            "mamba_cache_mode",
        }
    ),
}
_REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "full_attention": ("num_kv_heads", "head_size", "dtype"),
    "mla": ("head_size", "dtype"),
    "sliding_window": ("num_kv_heads", "head_size", "dtype", "sliding_window"),
    "mamba": ("shapes", "dtypes"),
}
_GROUP_KEYS = frozenset(
    {"name", "kind", "layers", "layer_template", "layer_ids", "block_size", "draft"}
)
_TOP_KEYS = frozenset(
    {"name", "description", "parallel", "limits", "cache", "replay", "groups"}
)
_PARALLEL_KEYS = frozenset(
    {
        "tensor_parallel_size",
        "decode_context_parallel_size",
        "cp_kv_cache_interleave_size",
    }
)
_LIMIT_KEYS = frozenset({"max_model_len", "max_num_seqs"})
_CACHE_KEYS = frozenset({"block_size", "mamba_cache_mode"})
_REPLAY_KEYS = frozenset({"tokens", "step_tokens"})


class TopologyError(DcpGeometryError):
    """A topology file or profile is malformed, or asks for a layout the
    contract forbids."""


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
        # Draft layers that run at DCP1 under a DCP target are replicated.
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
            **{k: _jsonable(v) for k, v in sorted(self.spec_fields.items())},
        }


@dataclass(frozen=True)
class Topology:
    """Cache groups plus the parallel layout and limits to size them for."""

    name: str
    groups: tuple[CacheGroup, ...]
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    interleave_size: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 1
    mamba_cache_mode: str = "none"
    cache_block_size: int | None = None
    replay_tokens: int | None = None
    replay_step_tokens: int | None = None
    description: str = ""
    source: str = ""

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

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
        """Check the layout against the contract; raise ``TopologyError``."""
        where = f"topology {self.name!r}"
        for label, value in (
            ("tensor_parallel_size", self.tensor_parallel_size),
            ("decode_context_parallel_size", self.decode_context_parallel_size),
            ("cp_kv_cache_interleave_size", self.interleave_size),
            ("max_model_len", self.max_model_len),
            ("max_num_seqs", self.max_num_seqs),
        ):
            _positive_int(value, f"{where}: {label}")
        dcp = self.decode_context_parallel_size
        if self.tensor_parallel_size % dcp != 0:
            raise TopologyError(
                f"{where}: the DCP size {dcp} must divide the tensor-parallel "
                f"size {self.tensor_parallel_size} (DCP ranks are carved out "
                "of the TP group)"
            )
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
            try:
                k = group.shard_count(dcp)
                check_interleave(group.block_size, k, self.interleave_size)
            except TopologyError:
                raise
            except DcpGeometryError as exc:
                raise TopologyError(f"{where}: {exc}") from exc
            mode = group.spec_fields.get("mamba_cache_mode")
            if mode is not None and mode != self.mamba_cache_mode:
                raise TopologyError(
                    f"{where}: group {group.name!r} asks for mamba_cache_mode="
                    f"{mode!r} but the cache uses {self.mamba_cache_mode!r} "
                    "(vLLM sizes tables from the cache-wide mode)"
                )
        if self.replay_tokens is not None:
            _positive_int(self.replay_tokens, f"{where}: replay tokens")
        if self.replay_step_tokens is not None:
            _positive_int(self.replay_step_tokens, f"{where}: replay step_tokens")

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


# Loading ------------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TopologyError(f"{what} must be a positive integer, got {value!r}")
    return value


def _expect(mapping: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(mapping, Mapping):
        raise TopologyError(f"{what} must be a table/object, got {mapping!r}")
    return mapping


def _reject_unknown(mapping: Mapping[str, Any], allowed: Iterable[str], what: str):
    unknown = sorted(set(mapping) - set(allowed))
    if unknown:
        raise TopologyError(
            f"{what}: unknown key(s) {unknown}; allowed: {sorted(allowed)}"
        )


def _layer_names(raw: Mapping[str, Any], where: str) -> tuple[str, ...]:
    if "layers" in raw:
        if "layer_template" in raw or "layer_ids" in raw:
            raise TopologyError(
                f"{where}: give either 'layers' or 'layer_template' + 'layer_ids'"
            )
        layers = raw["layers"]
        if not isinstance(layers, list) or not all(
            isinstance(name, str) and name for name in layers
        ):
            raise TopologyError(f"{where}: 'layers' must be a list of layer names")
        names = tuple(layers)
    elif "layer_template" in raw:
        template, ids = raw["layer_template"], raw.get("layer_ids")
        if not isinstance(template, str) or "{}" not in template:
            raise TopologyError(
                f"{where}: 'layer_template' must be a string with one '{{}}', "
                f"got {template!r}"
            )
        if not isinstance(ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids
        ):
            raise TopologyError(f"{where}: 'layer_ids' must be a list of integers")
        names = tuple(template.format(i) for i in ids)
    else:
        raise TopologyError(f"{where}: no layers ('layers' or 'layer_template')")
    if not names:
        raise TopologyError(f"{where}: a group needs at least one layer")
    if len(set(names)) != len(names):
        raise TopologyError(f"{where}: repeated layer names")
    return names


def _group_from_mapping(raw: Any, index: int) -> CacheGroup:
    raw = _expect(raw, f"groups[{index}]")
    name = raw.get("name", f"group{index}")
    if not isinstance(name, str) or not name:
        raise TopologyError(f"groups[{index}]: 'name' must be a non-empty string")
    where = f"group {name!r}"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise TopologyError(
            f"{where}: 'kind' must be one of {list(KINDS)}, got {kind!r}"
        )
    allowed = _GROUP_KEYS | _SPEC_FIELDS[kind]
    _reject_unknown(raw, allowed, where)
    block_size = _positive_int(raw.get("block_size"), f"{where}: block_size")
    draft = raw.get("draft", False)
    if not isinstance(draft, bool):
        raise TopologyError(f"{where}: 'draft' must be true or false")
    spec_fields = {k: v for k, v in raw.items() if k in _SPEC_FIELDS[kind]}
    missing = [k for k in _REQUIRED_FIELDS[kind] if k not in spec_fields]
    if missing:
        raise TopologyError(f"{where}: missing spec field(s) {missing}")
    _check_spec_fields(kind, spec_fields, where)
    if draft and kind not in ATTENTION_KINDS:
        raise TopologyError(f"{where}: only attention groups can be draft groups")
    return CacheGroup(
        name=name,
        kind=kind,
        layers=_layer_names(raw, where),
        block_size=block_size,
        draft=draft,
        spec_fields=spec_fields,
    )


def _check_spec_fields(kind: str, fields_: dict[str, Any], where: str) -> None:
    for key in ("num_kv_heads", "head_size", "head_size_v", "sliding_window"):
        if key in fields_:
            _positive_int(fields_[key], f"{where}: {key}")
    for key in ("num_speculative_blocks", "num_prefill_checkpoint_blocks"):
        if key in fields_:
            value = fields_[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise TopologyError(
                    f"{where}: {key} must be a non-negative integer, got {value!r}"
                )
    if "dcp_sharded" in fields_ and not isinstance(fields_["dcp_sharded"], bool):
        raise TopologyError(f"{where}: dcp_sharded must be true or false")
    if "dcp_kv_shard_count" in fields_:
        _positive_int(fields_["dcp_kv_shard_count"], f"{where}: dcp_kv_shard_count")
    for key in ("dtype", "cache_dtype_str", "mamba_type", "mamba_cache_mode"):
        if key in fields_ and not isinstance(fields_[key], str):
            raise TopologyError(f"{where}: {key} must be a string")
    if fields_.get("mamba_cache_mode", "none") not in MAMBA_CACHE_MODES:
        raise TopologyError(
            f"{where}: mamba_cache_mode must be one of {list(MAMBA_CACHE_MODES)}"
        )
    if kind == "mamba":
        shapes, dtypes = fields_["shapes"], fields_["dtypes"]
        if (
            not isinstance(shapes, list)
            or not shapes
            or not all(
                isinstance(s, list)
                and s
                and all(
                    isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in s
                )
                for s in shapes
            )
        ):
            raise TopologyError(
                f"{where}: 'shapes' must be a list of state shapes (lists of "
                f"positive integers), got {shapes!r}"
            )
        if (
            not isinstance(dtypes, list)
            or len(dtypes) != len(shapes)
            or not all(isinstance(d, str) for d in dtypes)
        ):
            raise TopologyError(
                f"{where}: 'dtypes' must be a list of dtype names, one per shape"
            )
        fields_["shapes"] = tuple(tuple(s) for s in shapes)
        fields_["dtypes"] = tuple(dtypes)


def topology_from_mapping(data: Any, source: str = "<mapping>") -> Topology:
    """Build and validate a topology from parsed TOML/JSON."""
    try:
        data = _expect(data, f"{source}: the document")
        _reject_unknown(data, _TOP_KEYS, source)
        parallel = _expect(data.get("parallel", {}), f"{source}: [parallel]")
        _reject_unknown(parallel, _PARALLEL_KEYS, f"{source}: [parallel]")
        limits = _expect(data.get("limits", {}), f"{source}: [limits]")
        _reject_unknown(limits, _LIMIT_KEYS, f"{source}: [limits]")
        cache = _expect(data.get("cache", {}), f"{source}: [cache]")
        _reject_unknown(cache, _CACHE_KEYS, f"{source}: [cache]")
        replay_cfg = _expect(data.get("replay", {}), f"{source}: [replay]")
        _reject_unknown(replay_cfg, _REPLAY_KEYS, f"{source}: [replay]")
        raw_groups = data.get("groups")
        if not isinstance(raw_groups, list) or not raw_groups:
            raise TopologyError(f"{source}: 'groups' must be a non-empty list")
        groups = tuple(_group_from_mapping(g, i) for i, g in enumerate(raw_groups))
        mode = cache.get("mamba_cache_mode", "none")
        if mode not in MAMBA_CACHE_MODES:
            raise TopologyError(
                f"{source}: [cache] mamba_cache_mode must be one of "
                f"{list(MAMBA_CACHE_MODES)}, got {mode!r}"
            )
        cache_block = cache.get("block_size")
        if cache_block is not None:
            _positive_int(cache_block, f"{source}: [cache] block_size")
        name = data.get("name", Path(source).stem)
        if not isinstance(name, str) or not name:
            raise TopologyError(f"{source}: 'name' must be a non-empty string")
        topology = Topology(
            name=name,
            description=str(data.get("description", "")),
            groups=groups,
            tensor_parallel_size=parallel.get("tensor_parallel_size", 1),
            decode_context_parallel_size=parallel.get(
                "decode_context_parallel_size", 1
            ),
            interleave_size=parallel.get("cp_kv_cache_interleave_size", 1),
            max_model_len=limits.get("max_model_len", 4096),
            max_num_seqs=limits.get("max_num_seqs", 1),
            mamba_cache_mode=mode,
            cache_block_size=cache_block,
            replay_tokens=replay_cfg.get("tokens"),
            replay_step_tokens=replay_cfg.get("step_tokens"),
            source=source,
        )
        topology.validate()
    except TopologyError as exc:
        if source in str(exc):
            raise
        raise TopologyError(f"{source}: {exc}") from exc
    return topology


def _parse_toml(text: str, source: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as exc:
            raise TopologyError(
                f"{source}: reading TOML needs Python 3.11+ or the 'tomli' "
                "package; use a JSON topology instead"
            ) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError(f"{source}: not valid TOML: {exc}") from exc


def load_topology_file(path: str | Path) -> Topology:
    """Load a topology from a ``.toml`` or ``.json`` file."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"cannot read topology file {source}: {exc}") from exc
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TopologyError(f"{source}: not valid JSON: {exc}") from exc
    elif suffix == ".toml":
        data = _parse_toml(text, source)
    else:
        raise TopologyError(
            f"{source}: a topology file must end in .toml or .json, got "
            f"{suffix or 'no suffix'!r}"
        )
    return topology_from_mapping(data, source)


def _profiles_dir() -> Any:
    return resources.files("vllm_dcp_geometry").joinpath("profiles")


def profile_names() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(
        entry.name[: -len(".toml")]
        for entry in _profiles_dir().iterdir()
        if entry.name.endswith(".toml")
    )


def load_profile(name: str) -> Topology:
    """Load a built-in profile by name."""
    names = profile_names()
    if name not in names:
        raise TopologyError(
            f"unknown profile {name!r}; built-in profiles: {', '.join(names)} "
            "(or pass --topology FILE)"
        )
    entry = _profiles_dir().joinpath(f"{name}.toml")
    data = _parse_toml(entry.read_text(encoding="utf-8"), f"profile {name}")
    return topology_from_mapping(data, f"profile {name}")
