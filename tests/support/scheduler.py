# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A mixed KV-cache topology driven through vLLM's real ``KVCacheManager``
(its specs, configs, manager, requests and the allocation and long-request
scenarios, everything returned JSON-able): ``sharded`` full attention (K = D,
vLLM's DCP sharding), ``partial`` full attention with ``dcp_kv_shard_count =
PARTIAL_K`` (with ``partial=False`` a sharded group, since unpatched vLLM has
no ``dcp_kv_shard_count``), ``draft``, replicated draft attention
(``dcp_sharded=False``, K = 1), and ``mamba`` in align mode (B = 768, 7
speculative blocks), attention blocks of B = 64. Importable in the patched
test process and in unpatched subprocesses, so the same scenario can be
compared on both sides.
"""

from __future__ import annotations

from typing import Any

from tests.support.vllm_configs import make_vllm_config

ATTENTION_BLOCK = 64
MAMBA_BLOCK = 768
SPECULATIVE_BLOCKS = 7
PARTIAL_K = 4
GROUP_NAMES = ("sharded", "partial", "draft", "mamba")


def scheduler_config(dcp: int, **kwargs: Any) -> Any:
    """The shared test config with this topology's cache block size and
    prefix caching on (unless told otherwise)."""
    kwargs.setdefault("enable_prefix_caching", True)
    return make_vllm_config(dcp, cache_block_size=ATTENTION_BLOCK, **kwargs)


def attention_spec(**kwargs: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=ATTENTION_BLOCK,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        **kwargs,
    )


def mamba_spec() -> Any:
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=MAMBA_BLOCK,
        shapes=((4, 256), (4, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
        num_speculative_blocks=SPECULATIVE_BLOCKS,
    )


def topology_specs(*, partial: bool, groups: tuple[str, ...] = GROUP_NAMES) -> dict:
    """One spec per group name."""
    specs = {
        "sharded": attention_spec(),
        "partial": (
            attention_spec(dcp_kv_shard_count=PARTIAL_K)
            if partial
            else attention_spec()
        ),
        "draft": attention_spec(dcp_sharded=False),
        "mamba": mamba_spec(),
    }
    return {name: specs[name] for name in groups}


def make_kv_cache_config(specs: dict[str, Any], num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.{name}.0"], spec) for name, spec in specs.items()
        ],
    )


def make_manager(
    specs: dict[str, Any],
    dcp: int,
    *,
    num_blocks: int,
    enable_caching: bool,
    max_model_len: int = 1_000_000,
) -> tuple[Any, Any, int, int]:
    """(manager, kv_cache_config, scheduler block size, hash block size);
    the block sizes come from vLLM's own ``resolve_kv_cache_block_sizes``."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    config = make_kv_cache_config(specs, num_blocks)
    vllm_config = scheduler_config(
        dcp, max_model_len=max_model_len, enable_prefix_caching=enable_caching
    )
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(config, vllm_config)
    manager = KVCacheManager(
        config,
        max_model_len,
        scheduler_block,
        hash_block,
        enable_caching=enable_caching,
        dcp_world_size=dcp,
    )
    return manager, config, scheduler_block, hash_block


def make_request(request_id: str, tokens: list[int], hash_block: int | None) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hasher = None
    if hash_block is not None:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(hash_block, sha256)
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=16),
        None,
        block_hasher=hasher,
    )


def _ids(manager: Any, request_id: str) -> list[list[int]]:
    return [list(ids) for ids in manager.get_block_ids(request_id)]


def run_prefill(manager: Any, request: Any, step: int) -> None:
    """Allocate a whole prompt in chunked-prefill steps, as the scheduler does."""
    total = request.num_prompt_tokens
    while request.num_computed_tokens < total:
        manager.new_step_starts()
        n = min(step, total - request.num_computed_tokens)
        blocks = manager.allocate_slots(request, n)
        assert blocks is not None, "out of KV blocks"
        request.num_computed_tokens += n


def allocation_scenario(
    dcp: int, *, partial: bool, groups: tuple[str, ...] = GROUP_NAMES
) -> dict[str, Any]:
    """Block ids per group through allocation, prefix-cache hits, free and
    re-admission after preemption; all JSON-able."""
    specs = topology_specs(partial=partial, groups=groups)
    manager, _, scheduler_block, hash_block = make_manager(
        specs, dcp, num_blocks=4096, enable_caching=True
    )
    out: dict[str, Any] = {
        "scheduler_block": scheduler_block,
        "hash_block": hash_block,
        "manager_block_sizes": [
            m.block_size for m in manager.coordinator.single_type_managers
        ],
        "free_at_start": manager.block_pool.get_num_free_blocks(),
    }
    prompt = [(7 * i + 3) % 50_000 for i in range(5 * scheduler_block + 123)]
    first = make_request("first", prompt, hash_block)
    computed, hit, _ = manager.get_computed_blocks(first)
    out["first_hit"] = hit
    run_prefill(manager, first, 512)
    out["first_ids"] = _ids(manager, "first")
    manager.free(first)
    out["free_after_free"] = manager.block_pool.get_num_free_blocks()

    # Same prefix, other tail: hits land on a boundary every group shares.
    second_prompt = prompt[: 3 * scheduler_block + 17] + [1] * 200
    second = make_request("second", second_prompt, hash_block)
    manager.new_step_starts()
    computed, hit, _ = manager.get_computed_blocks(second)
    out["second_hit"] = hit
    out["second_hit_blocks"] = [len(b) for b in computed.blocks]
    blocks = manager.allocate_slots(
        second,
        second.num_tokens - hit,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
    )
    assert blocks is not None
    second.num_computed_tokens = second.num_tokens
    out["second_ids"] = _ids(manager, "second")

    # Preemption: free, reset, admit again (the prefix is cached by then).
    manager.free(second)
    second.num_computed_tokens = 0
    manager.new_step_starts()
    computed, hit, _ = manager.get_computed_blocks(second)
    out["readmit_hit"] = hit
    blocks = manager.allocate_slots(
        second,
        second.num_tokens - hit,
        num_new_computed_tokens=hit,
        new_computed_blocks=computed,
    )
    assert blocks is not None
    out["readmit_ids"] = _ids(manager, "second")
    manager.free(second)
    out["free_at_end"] = manager.block_pool.get_num_free_blocks()
    return out


def long_request_scenario(
    dcp: int,
    *,
    partial: bool,
    length: int = 1_000_000,
    step: int = MAMBA_BLOCK,
) -> dict[str, Any]:
    """A ``length``-token prompt through chunked prefill, caching off; the
    row length every group reaches and what its spec says a row may hold."""
    specs = topology_specs(partial=partial)
    manager, _, scheduler_block, _ = make_manager(
        specs, dcp, num_blocks=40_000, enable_caching=False, max_model_len=length
    )
    request = make_request("long", [1] * length, None)
    widest = [0] * len(specs)
    total = request.num_prompt_tokens
    while request.num_computed_tokens < total:
        manager.new_step_starts()
        n = min(step, total - request.num_computed_tokens)
        assert manager.allocate_slots(request, n) is not None, "out of KV blocks"
        request.num_computed_tokens += n
        for g, ids in enumerate(manager.get_block_ids("long")):
            widest[g] = max(widest[g], len(ids))
    config = scheduler_config(dcp, max_model_len=length)
    return {
        "scheduler_block": scheduler_block,
        "widest": widest,
        "final": [len(ids) for ids in manager.get_block_ids("long")],
        "widths": [
            spec.max_num_blocks_per_req(config, length) for spec in specs.values()
        ],
    }
