# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Sizes a topology needs, checked against what vLLM and a rank can hold.

``topology.limits`` bounds each value on its own; this module bounds what the
values make together, as vLLM's own specs compute it: a pool's block ids and
slots must fit int32, and a rank's block tables and the KV cache of one
max-length request must fit the largest accelerator. ``replay`` adds bounds of
its own so that it ends in minutes. Each refusal names the limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.runtime.geometry import (
    BLOCK_TABLE_ENTRY_BYTES,
    runner_table_width,
)
from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError
from vllm_dcp_geometry.tooling.topology.limits import (
    LARGEST_DEVICE_MEMORY_BYTES,
    MAX_POOL_PAGES,
    MAX_POOL_SLOTS,
    REPLAY_MAX_CHECKED_COLUMNS,
    REPLAY_MAX_POOL_PAGES,
    REPLAY_MAX_TOKENS,
)


@dataclass(frozen=True)
class GroupSize:
    """What one group needs on one rank, from its vLLM spec."""

    group: CacheGroup
    block_size: int
    width: int
    """Block-table columns (``spec.max_num_blocks_per_req``)."""
    aligned_width: int
    """Columns after the runner's alignment (vLLM's ``get_block_table_width``)."""
    pages_per_request: int
    page_size_bytes: int

    @property
    def kv_bytes_per_request(self) -> int:
        return len(self.group.layers) * self.pages_per_request * self.page_size_bytes


def check_cache_dtypes(topology: Topology) -> None:
    """An MLA group's ``cache_dtype_str`` must be one vLLM knows: the spec
    takes any string and would size its pages as if it were ``auto``."""
    import typing

    from vllm.config.cache import CacheDType

    known = typing.get_args(CacheDType)
    for group in topology.groups:
        value = group.spec_fields.get("cache_dtype_str")
        if value is not None and value not in known:
            raise TopologyError(
                f"group {group.name!r}: cache_dtype_str must be one of "
                f"{list(known)} (vLLM's CacheDType), got {value!r}"
            )


def group_sizes(topology: Topology) -> list[GroupSize]:
    """Each group's sizes from the specs of this process's vLLM (patched after
    ``register()``, else upstream's)."""
    check_cache_dtypes(topology)
    patched = vllm_objects.is_vllm_patched()
    config = vllm_objects.sizing_config(topology)
    sizes = []
    for group in topology.groups:
        spec = vllm_objects.build_spec(group, topology, patched=patched)
        width = spec.max_num_blocks_per_req(config, topology.max_model_len)
        sizes.append(
            GroupSize(
                group=group,
                block_size=spec.block_size,
                width=width,
                aligned_width=runner_table_width(spec, width),
                pages_per_request=vllm_objects.pages_per_request(spec, config),
                page_size_bytes=spec.page_size_bytes,
            )
        )
    return sizes


def _check_pool(sizes: list[GroupSize], pool_pages: int, what: str) -> None:
    if pool_pages > MAX_POOL_PAGES:
        raise TopologyError(
            f"{what} is {pool_pages} pages, beyond MAX_POOL_PAGES={MAX_POOL_PAGES} "
            "(vLLM's block tables hold int32 block ids); lower max_model_len"
        )
    widest = max(sizes, key=lambda s: s.block_size)
    if pool_pages * widest.block_size > MAX_POOL_SLOTS:
        raise TopologyError(
            f"{what} is {pool_pages} pages; at block size {widest.block_size} "
            f"(group {widest.group.name!r}) that is "
            f"{pool_pages * widest.block_size} slots, beyond MAX_POOL_SLOTS="
            f"{MAX_POOL_SLOTS} (Model Runner V2 computes slots in int32); lower "
            "max_model_len or the block size"
        )


def check_topology_capacity(topology: Topology) -> list[GroupSize]:
    """Refuse a topology vLLM cannot represent or no rank can hold; return
    the group sizes it was checked with."""
    sizes = group_sizes(topology)
    pages = sum(s.pages_per_request for s in sizes)
    # vLLM's pool reserves one page as the null block.
    _check_pool(sizes, pages + 1, "the KV pool for one max-length request")
    columns = sum(s.aligned_width for s in sizes)
    table_bytes = topology.max_num_seqs * BLOCK_TABLE_ENTRY_BYTES * columns
    if table_bytes > LARGEST_DEVICE_MEMORY_BYTES:
        raise TopologyError(
            f"the block tables of one rank need {table_bytes} bytes (max_num_seqs="
            f"{topology.max_num_seqs} x {columns} "
            f"columns x {BLOCK_TABLE_ENTRY_BYTES}), beyond LARGEST_DEVICE_MEMORY_BYTES="
            f"{LARGEST_DEVICE_MEMORY_BYTES}; lower max_num_seqs or max_model_len"
        )
    kv_bytes = sum(s.kv_bytes_per_request for s in sizes)
    if kv_bytes > LARGEST_DEVICE_MEMORY_BYTES:
        largest = max(sizes, key=lambda s: s.kv_bytes_per_request)
        raise TopologyError(
            f"one max-length request needs {kv_bytes} bytes of KV cache per rank "
            f"(group {largest.group.name!r}: {largest.kv_bytes_per_request}), "
            f"beyond LARGEST_DEVICE_MEMORY_BYTES={LARGEST_DEVICE_MEMORY_BYTES}; "
            "lower max_model_len or the spec sizes"
        )
    return sizes


def check_replay_capacity(
    topology: Topology, *, tokens: int, step_tokens: int, num_pages: int | None
) -> None:
    """Refuse a replay vLLM could not represent or that would not end in
    minutes, before the pool is built."""
    sizes = check_topology_capacity(topology)
    if tokens > REPLAY_MAX_TOKENS:
        raise TopologyError(
            f"a replay of {tokens} tokens is beyond REPLAY_MAX_TOKENS="
            f"{REPLAY_MAX_TOKENS} (the replay holds the request's token ids in "
            "memory); pass a smaller --tokens"
        )
    pool_pages = (
        num_pages
        if num_pages is not None
        else sum(s.pages_per_request for s in sizes) + 1
    )
    _check_pool(sizes, pool_pages, "the replay's pool")
    if pool_pages > REPLAY_MAX_POOL_PAGES:
        raise TopologyError(
            f"the replay's pool is {pool_pages} pages, beyond REPLAY_MAX_POOL_PAGES="
            f"{REPLAY_MAX_POOL_PAGES} (vLLM's BlockPool makes one host object per "
            "page); lower --max-model-len or --num-pages"
        )
    steps = cdiv(tokens, step_tokens)
    columns = sum(s.width for s in sizes)
    if steps * columns > REPLAY_MAX_CHECKED_COLUMNS:
        raise TopologyError(
            f"a replay of {steps} steps over {columns} block-table columns checks "
            f"{steps * columns} columns, beyond REPLAY_MAX_CHECKED_COLUMNS="
            f"{REPLAY_MAX_CHECKED_COLUMNS} (so that a replay ends in minutes); raise "
            "--step-tokens or lower --tokens"
        )
