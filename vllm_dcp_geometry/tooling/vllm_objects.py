# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Real vLLM objects for a topology: specs, sizing config, KV-cache config,
vLLM's own ``KVCacheManager``.

Library code, not the command line's: the commands (``vllm_dcp_geometry.tooling.cli``),
the benchmarks and the tests build vLLM's objects for a topology here.
Everything here imports vLLM lazily, so importing this module (or the CLI)
stays cheap. ``patched=True`` callers must have called
``vllm_dcp_geometry.register()`` first; ``patched=False`` builds what vLLM
0.33.0 itself can express (no ``dcp_kv_shard_count``), for unpatched
baselines in a fresh process.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.runtime.patching import original_of
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology, TopologyError


def is_vllm_patched() -> bool:
    """Whether this process's vLLM specs carry the plugin's contract."""
    import vllm.v1.kv_cache_interface as kvi

    return hasattr(kvi, "get_kv_cache_dcp_shard_count")


def _torch_dtype(name: str, where: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TopologyError(f"{where}: unknown torch dtype {name!r}")
    return dtype


def _block_stride(f: Any) -> dict[str, Any]:
    """``block_stride_alignment`` as the spec takes it: an exact stride or
    (``block_stride_multiple_of``) vLLM's ``MultipleOf``."""
    from vllm.v1.attention.backend import MultipleOf

    if "block_stride_multiple_of" in f:
        return {"block_stride_alignment": MultipleOf(f["block_stride_multiple_of"])}
    if "block_stride_alignment" in f:
        return {"block_stride_alignment": f["block_stride_alignment"]}
    return {}


def _named_member(enum: Any, name: str, where: str, *, field: str = "") -> Any:
    try:
        return enum[name]
    except KeyError as exc:
        names = [member.name for member in enum]
        raise TopologyError(
            f"{where}: unknown {field or enum.__name__} {name!r}; one of {names}"
        ) from exc


def _mamba_spec(group: CacheGroup, topology: Topology, where: str) -> Any:
    import vllm.v1.kv_cache_interface as kvi
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    f = group.spec_fields
    kwargs: dict[str, Any] = {
        "block_size": group.block_size,
        "shapes": tuple(tuple(s) for s in f["shapes"]),
        "dtypes": tuple(_torch_dtype(d, where) for d in f["dtypes"]),
        "mamba_cache_mode": topology.mamba_cache_mode,
        "num_speculative_blocks": f.get("num_speculative_blocks", 0),
        "num_prefill_checkpoint_blocks": f.get("num_prefill_checkpoint_blocks", 0),
    }
    for key in ("page_size_padded", "prefill_checkpoint_alignment"):
        if key in f:
            kwargs[key] = f[key]
    kwargs.update(_block_stride(f))
    if "mamba_type" in f:
        kwargs["mamba_type"] = _named_member(
            MambaAttentionBackendEnum, f["mamba_type"], where, field="mamba_type"
        )
    return kvi.MambaSpec(**kwargs)


def _mla_fields(fields: Mapping[str, Any], where: str) -> dict[str, Any]:
    import vllm.v1.kv_cache_interface as kvi

    kwargs: dict[str, Any] = {
        key: fields[key]
        for key in (
            "cache_dtype_str",
            "non_causal_multi_token_decode",
            "state_content_bytes",
            "topk_buffer_width",
            "is_index_group_leader",
        )
        if key in fields
    }
    if "cache_role" in fields:
        try:
            kwargs["cache_role"] = kvi.SparseCacheRole(fields["cache_role"])
        except ValueError as exc:
            roles = [role.value for role in kvi.SparseCacheRole]
            raise TopologyError(
                f"{where}: unknown cache_role {fields['cache_role']!r}; one of {roles}"
            ) from exc
    return kwargs


def build_spec(group: CacheGroup, topology: Topology, *, patched: bool) -> Any:
    """The vLLM ``KVCacheSpec`` of one group.

    Unpatched vLLM cannot express a partial shard count, so ``patched=False``
    drops ``dcp_kv_shard_count`` and the spec reads as upstream sees it (a
    sharded spec, K = D).
    """
    import vllm.v1.kv_cache_interface as kvi

    where = f"group {group.name!r}"
    if group.kind == "mamba":
        return _mamba_spec(group, topology, where)
    f = group.spec_fields
    kwargs: dict[str, Any] = {
        "block_size": group.block_size,
        "num_kv_heads": f.get("num_kv_heads", 1),
        "head_size": f["head_size"],
        "dtype": _torch_dtype(f["dtype"], where),
        "dcp_sharded": group.dcp_sharded,
        "is_draft": group.draft,
    }
    for key in ("head_size_v", "page_size_padded", "max_tp_shards"):
        if key in f:
            kwargs[key] = f[key]
    kwargs.update(_block_stride(f))
    if "kv_quant_mode" in f:
        kwargs["kv_quant_mode"] = _named_member(
            kvi.KVQuantMode, f["kv_quant_mode"], where
        )
    if patched and group.dcp_kv_shard_count is not None:
        kwargs["dcp_kv_shard_count"] = group.dcp_kv_shard_count
    if group.kind == "mla":
        cls: Any = kvi.MLAAttentionSpec
        kwargs.update(_mla_fields(f, where))
    elif group.kind == "sliding_window":
        cls = kvi.SlidingWindowSpec
        kwargs["sliding_window"] = f["sliding_window"]
    else:
        cls = kvi.FullAttentionSpec
        if "sliding_window" in f:
            kwargs["sliding_window"] = f["sliding_window"]
    try:
        return cls(**kwargs)
    except TypeError as exc:
        if "dcp_kv_shard_count" in str(exc):
            raise TopologyError(
                f"{where}: dcp_kv_shard_count needs the vllm-dcp-geometry plugin "
                "registered (vllm_dcp_geometry.register())"
            ) from exc
        raise TopologyError(f"{where}: cannot build {cls.__name__}: {exc}") from exc


@dataclass
class SizingConfig:
    """The parts of ``VllmConfig`` that KV-cache sizing reads.

    ``parallel_config`` and ``cache_config`` are vLLM's own (so their
    validation applies); a full ``VllmConfig`` would need a model and a device.
    """

    parallel_config: Any
    cache_config: Any
    model_config: Any
    max_in_flight_tokens: int
    """``VllmConfig.max_in_flight_tokens``: one batch of scheduled tokens (no
    pipeline parallelism or async scheduling here). Sliding-window and
    chunked-local specs reserve pages for it."""
    kv_transfer_config: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def layout_configs(
    topology: Topology, *, enable_prefix_caching: bool = False
) -> tuple[Any, Any]:
    """vLLM's own ``ParallelConfig`` and ``CacheConfig`` for the topology's
    layout (so their validation applies)."""
    from vllm.config import CacheConfig, ParallelConfig

    try:
        parallel = ParallelConfig(
            tensor_parallel_size=topology.tensor_parallel_size,
            decode_context_parallel_size=topology.decode_context_parallel_size,
            cp_kv_cache_interleave_size=topology.interleave_size,
        )
        cache = CacheConfig(
            block_size=topology.scheduler_cache_block_size,
            mamba_cache_mode=topology.mamba_cache_mode,
            enable_prefix_caching=enable_prefix_caching,
        )
    except (ValueError, AssertionError) as exc:  # pydantic errors are ValueErrors
        raise TopologyError(
            f"topology {topology.name!r}: vLLM rejects this layout: {exc}"
        ) from exc
    return parallel, cache


def sizing_config(
    topology: Topology,
    *,
    enable_prefix_caching: bool = False,
    max_num_batched_tokens: int | None = None,
) -> Any:
    """Real ``ParallelConfig``/``CacheConfig`` for the topology's layout;
    ``max_num_batched_tokens`` (default: vLLM's scheduler default) sizes the
    tokens in flight."""
    from vllm.config import SchedulerConfig

    parallel, cache = layout_configs(
        topology, enable_prefix_caching=enable_prefix_caching
    )
    if max_num_batched_tokens is None:
        max_num_batched_tokens = SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS
    return SizingConfig(
        parallel_config=parallel,
        cache_config=cache,
        model_config=SimpleNamespace(max_model_len=topology.max_model_len),
        max_in_flight_tokens=max_num_batched_tokens,
    )


def without_dcp(config: SizingConfig) -> SizingConfig:
    """``config`` as the same layout would be without DCP (D = 1, the same
    TP): what a group costs when every rank holds every position."""
    from vllm.config import ParallelConfig

    parallel = config.parallel_config
    return dataclasses.replace(
        config,
        parallel_config=ParallelConfig(
            tensor_parallel_size=parallel.tensor_parallel_size,
            decode_context_parallel_size=1,
        ),
    )


def upstream_method(spec: Any, name: str) -> Any:
    """``spec.name`` as vLLM 0.33.0 defines it, bound to ``spec``.

    Finds the attribute on the spec's class (or the nearest base) and unwraps
    any patch, so the caller sees upstream's boolean ``dcp_sharded`` rule.
    """
    for klass in type(spec).__mro__:
        if name in klass.__dict__:
            return original_of(klass.__dict__[name]).__get__(spec, type(spec))
    raise AttributeError(f"{type(spec).__name__} has no {name!r}")


def pages_per_request(spec: Any, config: Any, *, upstream: bool = False) -> int:
    """Pages one max-length request takes from the pool for this group, by
    vLLM's own rule (``cdiv(max_memory_usage_bytes, page_size_bytes)``)."""
    usage = (
        upstream_method(spec, "max_memory_usage_bytes")
        if upstream
        else spec.max_memory_usage_bytes
    )
    return cdiv(usage(config), spec.page_size_bytes)


def with_max_model_len(config: Any, max_model_len: int) -> Any:
    """``config`` (a ``VllmConfig`` or ``SizingConfig``) as if its model's
    ``max_model_len`` were ``max_model_len``: a shallow copy with a copied
    model config, so vLLM's sizing rules can be asked about another length
    without touching ``config``."""
    model_config = copy.copy(config.model_config)
    model_config.max_model_len = max_model_len
    sized = copy.copy(config)
    sized.model_config = model_config
    return sized


def build_kv_cache_config(topology: Topology, specs: list[Any], num_blocks: int) -> Any:
    """A scheduler-side ``KVCacheConfig``: groups and a pool, no tensors."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=list(group.layers),
                kv_cache_spec=spec,
                is_eagle_group=group.draft,
            )
            for group, spec in zip(topology.groups, specs, strict=True)
        ],
    )


def resolve_block_sizes(kv_cache_config: Any, config: Any) -> tuple[int, int]:
    """vLLM's own ``(scheduler_block_size, hash_block_size)`` for the groups
    (``resolve_kv_cache_block_sizes``, as ``EngineCore`` resolves them)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    try:
        return resolve_kv_cache_block_sizes(kv_cache_config, config)
    except (ValueError, AssertionError) as exc:
        raise TopologyError(f"vLLM cannot resolve block sizes: {exc}") from exc


@dataclass
class ManagerSetup:
    """vLLM's ``KVCacheManager`` for a topology and what it was built from."""

    manager: Any
    kv_cache_config: Any
    scheduler_block_size: int
    hash_block_size: int
    num_pages: int


def build_kv_cache_manager(
    topology: Topology,
    specs: list[Any],
    config: Any,
    num_pages: int,
    *,
    enable_caching: bool,
) -> ManagerSetup:
    """vLLM's real ``KVCacheManager`` over the topology's groups with a pool
    of ``num_pages`` pages (the null page included), block sizes resolved by
    vLLM: what ``replay`` drives and the scheduler benchmark times."""
    kv_cache_config = build_kv_cache_config(topology, specs, num_pages)
    return manager_for(topology, kv_cache_config, config, enable_caching=enable_caching)


def manager_for(
    topology: Topology, kv_cache_config: Any, config: Any, *, enable_caching: bool
) -> ManagerSetup:
    """vLLM's real ``KVCacheManager`` over ``kv_cache_config``'s groups and
    pool, block sizes resolved by vLLM."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    sched_block, hash_block = resolve_block_sizes(kv_cache_config, config)
    try:
        manager = KVCacheManager(
            kv_cache_config,
            max_model_len=topology.max_model_len,
            scheduler_block_size=sched_block,
            hash_block_size=hash_block,
            enable_caching=enable_caching,
            dcp_world_size=topology.decode_context_parallel_size,
            pcp_world_size=1,
        )
    except (ValueError, AssertionError) as exc:
        raise TopologyError(
            f"vLLM's KVCacheManager rejects this layout: {exc}"
        ) from exc
    return ManagerSetup(
        manager, kv_cache_config, sched_block, hash_block, kv_cache_config.num_blocks
    )
