# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s candidates: which groups take one K together (a
choice), which K of each start-up admits, and each admitted K's terms.

Groups that must share one K are one choice: a latent cache and its indexer
cache (start-up hands the indexer its latent's override) and,
conservatively, every sparse latent group (start-up requires one K per
sparse index group, which a topology does not record). A draft keeps its K
(start-up refuses sharding a draft vLLM builds replicated where its impl
runs for fewer than D ranks, which a topology cannot tell), named in the
line all the same; recurrent state has none to choose. For the rest, every
divisor K of D is planned by ``build_plan`` on the topology with that choice
applied through ``apply_additional_config`` (start-up's override rules) and
kept only where start-up's admission rule admits every group of the choice:
a K start-up would refuse is never a candidate.

Terms, per rank and additive over choices: the KV bytes one request of the
target context occupies (vLLM's page rule, ``kv_bytes_per_request_per_rank``)
and the decode collective bytes and ring steps per token over all the
choice's layers (a quantized cache's activation size is unknown to the
topology, so its collective bytes count 0 and are named).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from vllm_dcp_geometry.contract import DcpGeometryError
from vllm_dcp_geometry.contract.overrides import CONFIG_KEY, REPLICATED, SHARDED
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError


@dataclasses.dataclass(frozen=True)
class Choice:
    """Groups that take one K together, and the layers an override names."""

    name: str
    groups: tuple[str, ...]
    layers: tuple[str, ...]
    fixed_k: int | None = None
    """The K a draft keeps (named in the line all the same, so the line
    states every attention layer's K)."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One K of one choice and its additive terms."""

    k: int
    request_bytes: int
    collective_bytes: float
    collective_hops: int
    virtual_blocks: tuple[int, ...]
    unknown_collectives: tuple[str, ...]


def choices(topology: Topology) -> list[Choice]:
    """The topology's attention groups as choices (recurrent state has none)."""
    dcp = topology.decode_context_parallel_size
    by_choice: dict[str, list[CacheGroup]] = {}
    indexers: list[CacheGroup] = []
    for group in topology.groups:
        fields = group.spec_fields
        if not group.is_attention:
            continue
        if fields.get("cache_role") == "indexer":
            indexers.append(group)
        else:
            # A sparse latent cache of an index group (its top-k buffer).
            indexed = "is_index_group_leader" in fields or "topk_buffer_width" in fields
            key = "sparse" if indexed and not group.draft else group.name
            by_choice.setdefault(key, []).append(group)
    result = []
    for name, groups in by_choice.items():
        layers = tuple(layer for g in groups for layer in g.layers)
        ids = {_layer_id(layer) for layer in layers}
        # An indexer cache goes with its latent cache (the same layer).
        tied = [g for g in indexers if {_layer_id(x) for x in g.layers} <= ids]
        result.append(
            Choice(
                name=name,
                groups=tuple(g.name for g in (*groups, *tied)),
                layers=layers,
                fixed_k=groups[0].shard_count(dcp) if groups[0].draft else None,
            )
        )
    return result


def _layer_id(layer: str) -> str:
    # "model.layers.7.self_attn.attn" and its indexer cache
    # "model.layers.7.self_attn.indexer.k_cache" share "model.layers.7".
    parts = layer.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return layer


def override_value(k: int, dcp: int) -> int | str:
    return REPLICATED if k == 1 else SHARDED if k == dcp else k


def additional_config(
    topology: Topology, picked: Sequence[Choice], ks: Sequence[int]
) -> dict[str, Any]:
    """The ``--additional-config`` that gives each choice its K."""
    dcp = topology.decode_context_parallel_size
    layers = {
        layer: override_value(k, dcp)
        for choice, k in zip(picked, ks, strict=True)
        for layer in choice.layers
    }
    return {CONFIG_KEY: {"layers": layers}}


def candidate_shard_counts(dcp: int, wanted: Sequence[int] | None) -> list[int]:
    """Every divisor of D, or the operator's list (each must divide D)."""
    divisors = [k for k in range(1, dcp + 1) if dcp % k == 0]
    if wanted is None:
        return divisors
    bad = sorted({k for k in wanted if k not in divisors})
    if bad or not wanted:
        raise TopologyError(
            f"--shard-counts {','.join(map(str, wanted))}: every K must divide "
            f"the DCP world size {dcp} ({', '.join(map(str, divisors))})"
        )
    return sorted(set(wanted))


def applied(
    topology: Topology, picked: Sequence[Choice], ks: Sequence[int]
) -> Topology:
    """``topology`` as start-up reads it with each choice at its K."""
    from vllm_dcp_geometry.tooling.topology.overrides import apply_additional_config

    return apply_additional_config(topology, additional_config(topology, picked, ks))


def admitted_options(
    topology: Topology,
    choice: Choice,
    plan_of: Any,
    refused: list[str],
) -> list[Option]:
    """The K start-up admits for ``choice``, with their terms (``plan_of``:
    ``build_plan`` for a topology); each K it refuses is appended to
    ``refused`` with start-up's reason."""
    dcp = topology.decode_context_parallel_size
    roles = {g.name: g.spec_fields.get("cache_role") for g in topology.groups}
    options = []
    ks = [choice.fixed_k] if choice.fixed_k else candidate_shard_counts(dcp, None)
    for k in ks:
        try:
            candidate = applied(topology, [choice], [k])
            rows = {row["name"]: row for row in plan_of(candidate)["groups"]}
        except (DcpGeometryError, TopologyError) as exc:  # start-up's rules
            refused.append(f"{choice.name} K={k}: {exc}")
            continue
        mine = [rows[name] for name in choice.groups]
        refusal = next(
            (r["attention_refusal"] for r in mine if r["attention_refusal"]), None
        )
        if refusal:
            refused.append(f"{choice.name} K={k}: {refusal}")
            continue
        options.append(_option(k, mine, roles))
    if not options:
        raise TopologyError(f"--optimize: no K is admitted for {choice.name}")
    return options


def _option(k: int, rows: Sequence[dict[str, Any]], roles: dict[str, Any]) -> Option:
    # ``rows``: the choice's groups in ``build_plan``'s document at this K.
    unknown = tuple(
        r["name"]
        for r in rows
        if r["decode_collective_bytes_per_rank_per_token"] is None
        and r["attention_mode"] not in ("local", "none")
    )
    return Option(
        k=k,
        request_bytes=sum(r["kv_bytes_per_request_per_rank"] for r in rows),
        collective_bytes=sum(
            r["num_layers"] * (r["decode_collective_bytes_per_rank_per_token"] or 0)
            for r in rows
        ),
        collective_hops=sum(
            r["num_layers"] * _hops(r["collective_world_size"], roles.get(r["name"]))
            for r in rows
        ),
        virtual_blocks=tuple(r["virtual_block_size"] for r in rows),
        unknown_collectives=unknown,
    )


def restricted(
    picked: Sequence[Choice],
    per_choice: Sequence[list[Option]],
    dcp: int,
    wanted: Sequence[int] | None,
) -> list[list[Option]]:
    """Each choice's admitted options within ``--shard-counts``. A choice
    start-up admits at one K only (a draft, a sliding window, a backend that
    refuses DCP) keeps that K; a list no choice admits is bad input."""
    if wanted is None:
        return list(per_choice)
    candidates = candidate_shard_counts(dcp, wanted)
    listed = ",".join(map(str, candidates))
    result, matched = [], False
    for choice, options in zip(picked, per_choice, strict=True):
        kept = [o for o in options if o.k in candidates]
        if len(options) > 1 and not kept:
            admitted = ", ".join(str(o.k) for o in options)
            raise TopologyError(
                f"--shard-counts {listed}: start-up admits none of them for "
                f"{choice.name} (it admits K = {admitted})"
            )
        matched |= bool(kept) and choice.fixed_k is None
        result.append(kept or options)
    if not matched:
        admitted = "; ".join(
            f"{c.name}: K = {', '.join(str(o.k) for o in options)}"
            for c, options in zip(picked, per_choice, strict=True)
            if c.fixed_k is None
        )
        raise TopologyError(
            f"--shard-counts {listed}: start-up admits none of them for any "
            f"group ({admitted})"
        )
    return result


COLLECTIVES_PER_LAYER = 3
"""A DCP decode step's collectives per attention layer: the query
all-gather, the LSE all-gather and the output reduce-scatter
(``contract.collectives``); an indexer cache's layer adds one, its top-k
merge's all-gather."""


def _hops(world_size: int | None, cache_role: str | None) -> int:
    # A ring collective over W ranks takes W - 1 steps, each paying latency.
    if not world_size:
        return 0
    collectives = 1 if cache_role == "indexer" else COLLECTIVES_PER_LAYER
    return collectives * (world_size - 1)
