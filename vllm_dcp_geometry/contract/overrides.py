# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Operator overrides of per-layer DCP geometry, from ``--additional-config``
(contract rule C1).

``--additional-config '{"dcp_geometry": {"layers": {GLOB: VALUE}}}'`` where
``GLOB`` is an ``fnmatch`` pattern over layer names (case-sensitive,
``fnmatch.fnmatchcase``) and ``VALUE`` is an integer K, ``"sharded"`` (K = D)
or ``"replicated"`` (K = 1).

Rules, checked at start-up in every worker when it collects its KV-cache
specs (so every worker applies the same overrides the same way):

- every pattern must match at least one layer (with pipeline parallelism a
  worker only sees its own stage, so the per-worker check is skipped there and
  the engine core checks the union of all workers' layers instead);
- a layer matched by several patterns must get the same geometry from all of
  them (``1`` and ``"replicated"`` agree, as do D and ``"sharded"``),
  otherwise the overrides conflict and nothing is guessed;
- K must divide D (``1 <= K <= D``, ``D % K == 0``);
- recurrent state (Mamba) is never token-sharded: only ``"replicated"`` / 1 is
  accepted there, and it changes nothing;
- K > 1 needs full attention (MLA included): sliding-window and other
  attention kinds reject it (vLLM only shards full attention under DCP); a
  partial K (``1 < K < D``) with prefill context parallelism > 1 is refused;
- a DSA indexer cache (``P.indexer.k_cache``) takes its latent cache's
  (``P.attn``) overrides where no pattern matches it, and both must end with
  the same K: vLLM plans caches of different K as separate KV-cache groups,
  and MLA pages of the latent and indexer sizes do not divide under the
  default layout (its planner raises ``NotImplementedError``);
- whether the layer's attention backend can run the K it gets is decided at
  start-up, when its builder is made, by the one admission rule
  (``vllm_dcp_geometry.contract.attention_admission``), which names the backend;
- ``"partial_collectives"`` (``"replica"``, the default, or ``"dcp"``) says
  where partial MLA groups run their collectives (``collectives``, rule A6):
  within their K-rank replica groups, or on the D-wide DCP group with
  duplicate replicas masked; read only where a partial MLA group exists;
- at D = 1 overrides are validated and change nothing (every geometry is K = 1
  there, and DCP1 stays byte-identical to upstream).

The result is written in vLLM's own terms: K = 1 becomes ``dcp_sharded=False``
and K = D becomes ``dcp_sharded=True`` with no explicit count, so upstream code
paths keep handling the geometries they already know; only 1 < K < D sets
``dcp_kv_shard_count``.

This module is pure Python: it imports nothing from vLLM. The overrides are
applied to vLLM's specs by ``vllm_dcp_geometry.runtime.spec_overrides``.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_dcp_geometry.contract import (
    DcpGeometryError,
    TokenLayout,
    check_dcp_world_size,
    check_prefill_context_parallel,
    check_shard_count_divides,
    resolve_shard_count,
)
from vllm_dcp_geometry.contract.collectives import PARTIAL_COLLECTIVES, REPLICA
from vllm_dcp_geometry.contract.layer_classes import indexer_latent_name

CONFIG_KEY = "dcp_geometry"
"""Key of this plugin's section in ``VllmConfig.additional_config``."""

LAYERS_KEY = "layers"
PARTIAL_COLLECTIVES_KEY = "partial_collectives"
"""Where partial MLA groups run their collectives (``collectives``' rule A6):
``"replica"`` (K ranks, the default) or ``"dcp"`` (the D-wide DCP group)."""
SECTION_KEYS = (LAYERS_KEY, PARTIAL_COLLECTIVES_KEY)

SHARDED = "sharded"
REPLICATED = "replicated"

OverrideValue = int | str


class LayerKind(str, enum.Enum):
    """What an override may do to a layer, decided by its spec type."""

    FULL_ATTENTION = "full_attention"
    """Full attention, MLA included: any K dividing D (the backend's
    admission at start-up decides whether it can run that K)."""

    OTHER_ATTENTION = "other_attention"
    """Sliding window, chunked local, cross attention...: replicated only."""

    RECURRENT = "recurrent"
    """Mamba-like state: never token-sharded; replicated is a no-op."""

    UNSUPPORTED = "unsupported"
    """A spec type overrides cannot change."""


@dataclass(frozen=True)
class LayerOverride:
    """One ``pattern: value`` entry of the operator's overrides."""

    pattern: str
    value: OverrideValue

    def describe(self) -> str:
        return f"{self.pattern!r}: {self.value!r}"


@dataclass(frozen=True)
class SpecGeometry:
    """The DCP fields an override writes onto an attention spec."""

    dcp_sharded: bool
    dcp_kv_shard_count: int | None


def _check_value(pattern: str, value: Any) -> OverrideValue:
    if isinstance(value, bool):
        raise DcpGeometryError(
            f"dcp_geometry override {pattern!r}: value must be an integer K, "
            f"{SHARDED!r} or {REPLICATED!r}, got {value!r}"
        )
    if isinstance(value, int):
        if value < 1:
            raise DcpGeometryError(
                f"dcp_geometry override {pattern!r}: shard count K must be >= 1, "
                f"got {value}"
            )
        return value
    if value in (SHARDED, REPLICATED):
        return value
    hint = ""
    if isinstance(value, str) and value.strip().isdigit():
        hint = f" (write the integer {int(value)} without quotes)"
    raise DcpGeometryError(
        f"dcp_geometry override {pattern!r}: value must be an integer K, "
        f"{SHARDED!r} or {REPLICATED!r}, got {value!r}{hint}"
    )


def _section(additional_config: Any) -> Mapping[str, Any]:
    """This plugin's checked section of ``additional_config`` (empty if none).

    ``additional_config`` is ``VllmConfig.additional_config``: a dict, or an
    object vLLM hashes itself (which cannot carry this section).
    """
    if not isinstance(additional_config, Mapping):
        return {}
    if CONFIG_KEY not in additional_config:
        return {}
    section = additional_config[CONFIG_KEY]
    if not isinstance(section, Mapping):
        raise DcpGeometryError(
            f"additional_config[{CONFIG_KEY!r}] must be a mapping like "
            f'{{"{LAYERS_KEY}": {{"model.layers.3.attn": 4}}}}, got {section!r}'
        )
    unknown = sorted(str(key) for key in section if key not in SECTION_KEYS)
    if unknown:
        hints = [
            f"{key!r} resembles {known!r}"
            for key in unknown
            for known in SECTION_KEYS
            if _resembles(key, known)
        ]
        hint = f" ({'; '.join(hints)})" if hints else ""
        raise DcpGeometryError(
            f"additional_config[{CONFIG_KEY!r}] has unknown keys {unknown}; "
            f"the keys are {list(SECTION_KEYS)}{hint}"
        )
    return section


NEAR_MISS_EDITS = 2
"""How many single-character edits (insert, delete, substitute, swap two
neighbours; case and ``-``/``_`` ignored) make a key resemble another."""


def _edit_distance(a: str, b: str) -> int:
    """Optimal string alignment distance: Levenshtein plus adjacent swaps."""
    rows = [list(range(len(b) + 1))]
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            row[j] = min(row[j - 1] + 1, rows[i - 1][j] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], rows[i - 2][j - 2] + 1)
        rows.append(row)
    return rows[-1][-1]


def _resembles(key: str, known: str) -> bool:
    def folded(text: str) -> str:
        return text.strip().lower().replace("-", "_")

    return key != known and _edit_distance(folded(key), folded(known)) <= (
        NEAR_MISS_EDITS
    )


def near_miss_sections(additional_config: Any) -> tuple[str, ...]:
    """One warning per ``additional_config`` key that resembles this plugin's
    section but is not it (``"dcp_geomtry"``): that section is ignored, so
    the operator's K does not apply. Warned, never refused: vLLM shares
    ``additional_config`` with other plugins, whose keys are theirs."""
    if not isinstance(additional_config, Mapping):
        return ()
    return tuple(
        f"additional_config key {key!r} resembles {CONFIG_KEY!r}, the "
        "vllm-dcp-geometry section, and is ignored: what it says does not "
        f"apply (spell it {CONFIG_KEY!r} to apply it)"
        for key in additional_config
        if isinstance(key, str) and _resembles(key, CONFIG_KEY)
    )


def partial_collectives(additional_config: Any) -> str:
    """Where partial MLA groups run their collectives: ``"replica"`` (the
    default) or ``"dcp"``; anything else is an error naming the key."""
    value = _section(additional_config).get(PARTIAL_COLLECTIVES_KEY, REPLICA)
    if value not in PARTIAL_COLLECTIVES:
        raise DcpGeometryError(
            f"additional_config[{CONFIG_KEY!r}][{PARTIAL_COLLECTIVES_KEY!r}] must "
            f"be one of {list(PARTIAL_COLLECTIVES)}, got {value!r}"
        )
    return str(value)


def parse_overrides(additional_config: Any) -> tuple[LayerOverride, ...]:
    """The layer overrides in ``additional_config`` (empty if none)."""
    section = _section(additional_config)
    if not section:
        return ()
    layers = section.get(LAYERS_KEY, {})
    if not isinstance(layers, Mapping):
        raise DcpGeometryError(
            f"additional_config[{CONFIG_KEY!r}][{LAYERS_KEY!r}] must map layer "
            f"name patterns to a shard count, got {layers!r}"
        )
    overrides = []
    for pattern, value in layers.items():
        if not isinstance(pattern, str) or not pattern.strip():
            raise DcpGeometryError(
                f"dcp_geometry override patterns must be non-empty strings, "
                f"got {pattern!r}"
            )
        overrides.append(LayerOverride(pattern, _check_value(pattern, value)))
    return tuple(overrides)


def match_layers(
    overrides: Iterable[LayerOverride],
    layer_names: Iterable[str],
    *,
    require_every_pattern: bool = True,
) -> dict[str, tuple[LayerOverride, ...]]:
    """Every override matching each layer, in pattern order (layers no
    pattern matches are absent); ``layer_geometry`` decides whether they agree.

    A pattern that matches no layer is an error when ``require_every_pattern``.
    """
    overrides = tuple(overrides)
    names = sorted(layer_names)
    matches: dict[str, tuple[LayerOverride, ...]] = {}
    for override in overrides:
        matched = [n for n in names if fnmatch.fnmatchcase(n, override.pattern)]
        if not matched and require_every_pattern:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise DcpGeometryError(
                f"dcp_geometry override {override.describe()} matches no layer "
                f"with a KV cache (layers: {shown or 'none'})"
            )
        for name in matched:
            matches[name] = (*matches.get(name, ()), override)
    return matches


def override_shard_count(
    layer_name: str, override: LayerOverride, dcp_world_size: int
) -> int:
    """K an override asks for under DCP world size D (validated)."""
    check_dcp_world_size(dcp_world_size)
    owner = f"layer {layer_name!r} (dcp_geometry override {override.describe()})"
    if override.value == SHARDED:
        return dcp_world_size
    if override.value == REPLICATED:
        return 1
    assert isinstance(override.value, int)
    if dcp_world_size == 1:
        check_shard_count_divides(owner, override.value, 1)
        return 1
    return resolve_shard_count(
        owner=owner,
        layout=TokenLayout.SHARDED,
        dcp_world_size=dcp_world_size,
        dcp_kv_shard_count=override.value,
    )


def target_geometry(
    layer_name: str,
    override: LayerOverride,
    kind: LayerKind,
    *,
    dcp_world_size: int,
    pcp_world_size: int = 1,
) -> SpecGeometry | None:
    """The DCP fields a layer gets from ``override`` (None: leave it as is).

    Raises ``DcpGeometryError`` naming the layer for any rule the module
    docstring lists.
    """
    k = override_shard_count(layer_name, override, dcp_world_size)
    owner = f"layer {layer_name!r} (dcp_geometry override {override.describe()})"
    if kind is LayerKind.UNSUPPORTED:
        raise DcpGeometryError(
            f"{owner}: its KV-cache spec type has no DCP geometry an override "
            "can set (only attention and Mamba layers can be overridden)"
        )
    if kind is LayerKind.RECURRENT:
        if override.value == SHARDED or k != 1:
            raise DcpGeometryError(
                f"{owner}: recurrent (Mamba) state is indexed by global position "
                "and is never token-sharded; only 'replicated' (K=1) applies"
            )
        return None
    if kind is LayerKind.OTHER_ATTENTION and k > 1:
        raise DcpGeometryError(
            f"{owner}: only full attention can be token-sharded under DCP "
            f"(K={k}, D={dcp_world_size}); use 'replicated' for this layer"
        )
    check_prefill_context_parallel(owner, k, dcp_world_size, pcp_world_size)
    if dcp_world_size == 1:
        return None
    if k == 1:
        return SpecGeometry(dcp_sharded=False, dcp_kv_shard_count=None)
    if k == dcp_world_size:
        return SpecGeometry(dcp_sharded=True, dcp_kv_shard_count=None)
    return SpecGeometry(dcp_sharded=True, dcp_kv_shard_count=k)


def layer_geometry(
    layer_name: str,
    overrides: Sequence[LayerOverride],
    kind: LayerKind,
    *,
    dcp_world_size: int,
    pcp_world_size: int = 1,
) -> SpecGeometry | None:
    """The DCP fields ``overrides`` (every pattern matching one layer) give it.

    Each is checked by ``target_geometry``; patterns giving the layer the same
    geometry agree whatever they write (``1`` and ``"replicated"``), patterns
    giving different geometries conflict.
    """
    chosen: tuple[LayerOverride, SpecGeometry | None] | None = None
    for override in overrides:
        geometry = target_geometry(
            layer_name,
            override,
            kind,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
        )
        if chosen is None:
            chosen = (override, geometry)
        elif geometry != chosen[1]:
            raise DcpGeometryError(
                f"layer {layer_name!r}: dcp_geometry overrides conflict: "
                f"{chosen[0].describe()} and {override.describe()} both match "
                f"and give it different shard counts (D={dcp_world_size}); make "
                "the patterns disjoint or give them the same value"
            )
    return None if chosen is None else chosen[1]


def indexer_cache_pairs(layer_names: Iterable[str]) -> list[tuple[str, str]]:
    """(indexer cache, its latent cache) for every DSA indexer cache whose
    latent layer is among ``layer_names``."""
    names = set(layer_names)
    pairs = []
    for name in sorted(names):
        latent = indexer_latent_name(name)
        if latent is not None and latent in names:
            pairs.append((name, latent))
    return pairs


def with_indexer_caches(
    matches: Mapping[str, tuple[LayerOverride, ...]], layer_names: Iterable[str]
) -> dict[str, tuple[LayerOverride, ...]]:
    """``matches`` with every unmatched indexer cache taking its latent
    cache's overrides (the two are one layer to an operator)."""
    result = dict(matches)
    for indexer, latent in indexer_cache_pairs(layer_names):
        if indexer not in result and latent in result:
            result[indexer] = result[latent]
    return result


def check_indexer_caches(shard_counts: Mapping[str, int], dcp_world_size: int) -> None:
    """An indexer cache and its latent cache must have the same K (rule A5);
    ``shard_counts`` gives each layer's K."""
    for indexer, latent in indexer_cache_pairs(shard_counts):
        k_indexer, k_latent = shard_counts[indexer], shard_counts[latent]
        if k_indexer != k_latent:
            raise DcpGeometryError(
                f"layer {indexer!r} (indexer cache, K={k_indexer}) and its latent "
                f"cache {latent!r} (K={k_latent}) must share one K (D="
                f"{dcp_world_size}): caches of different K form separate KV-cache "
                "groups, whose MLA page sizes vLLM's planner cannot unify; give "
                "both the same dcp_geometry override"
            )
