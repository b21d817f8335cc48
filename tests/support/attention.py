# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the attention tests build on CPU: a tiny MQA Llama config (TP16, so
every D in {1, 2, 4, 8, 16} is admitted) as a real ``VllmConfig``, real vLLM
attention layers, full-attention specs and decode batches, a stand-in for the
DCP process group (none exists in a single CPU process), and the fixtures
``cpu_platform`` (a device type for vLLM's unspecified platform) and
``triton_interpreter_constexprs`` (the shim vLLM's kernel launcher needs under
Triton's interpreter)."""

from __future__ import annotations

import functools
import inspect
import json
import tempfile
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# A tiny MQA Llama: 16 query heads and 1 KV head, so TP=16 admits every
# D in {1, 2, 4, 8, 16} (vLLM requires TP > KV heads under DCP).
TINY_MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 128,
    "num_attention_heads": 16,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "rms_norm_eps": 1e-6,
}
TENSOR_PARALLEL_SIZE = 16
HEAD_SIZE = TINY_MODEL_CONFIG["hidden_size"] // TINY_MODEL_CONFIG["num_attention_heads"]


@functools.cache
def tiny_model_dir() -> Path:
    """A local Hugging Face config directory for the tiny model (no weights)."""
    path = Path(tempfile.mkdtemp(prefix="vllm_dcp_geometry_tiny_llama_"))
    (path / "config.json").write_text(json.dumps(TINY_MODEL_CONFIG))
    return path


@pytest.fixture
def cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's unspecified platform reports device type ''; configs need one."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu", raising=False)


def tiny_model_config(dcp_world_size: int, interleave_size: int) -> Any:
    """A real ``VllmConfig`` of the tiny model at TP16 with DCP ``D``."""
    from tests.support.vllm_configs import make_vllm_config

    return make_vllm_config(
        dcp_world_size,
        interleave=interleave_size,
        tp=TENSOR_PARALLEL_SIZE,
        model_dir=tiny_model_dir(),
    )


def set_dcp_group(monkeypatch: pytest.MonkeyPatch, world_size: int, rank: int) -> None:
    """Stand in for the DCP process group: vLLM reads only its size and rank
    here (``get_dcp_world_size_and_rank``, impl ``__new__``)."""
    from vllm.distributed import parallel_state

    group = None
    if world_size > 1:
        group = types.SimpleNamespace(world_size=world_size, rank_in_group=rank)
    monkeypatch.setattr(parallel_state, "_DCP", group)


@contextmanager
def replica_groups_for(shard_counts: Sequence[int]) -> Iterator[None]:
    """The plugin's replica groups of the stand-in DCP group's rank (what
    ``Worker.init_device`` makes for every partial K): K ranks, this rank at
    ``r % K``. Builders and impls read only their world, rank and ranks
    here; no collective runs."""
    from vllm.distributed import parallel_state

    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.runtime import replica_groups

    dcp = parallel_state._DCP
    made = replica_groups._REPLICA_GROUPS
    saved = dict(made)
    for k in shard_counts:
        geometry = GroupGeometry("replica", k, dcp.world_size, dcp.rank_in_group)
        group = types.SimpleNamespace(
            world_size=k,
            rank_in_group=geometry.shard,
            ranks=list(geometry.replica_dcp_ranks),
        )
        setattr(group, replica_groups.MADE_FOR_ATTR, dcp)
        made[k] = group
    try:
        yield
    finally:
        made.clear()
        made.update(saved)


def flashinfer_impls_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FlashInferImpl`` asks the GPU for TRTLLM support and sizes a device
    buffer when built: answer as a GPU without TRTLLM does, so real impls
    build on CPU (its builder and kernels still need CUDA)."""
    from vllm.v1.attention.backends import flashinfer

    for name, stand_in in (
        ("can_use_trtllm_attention", lambda *args, **kwargs: False),
        ("get_device_sm_count", lambda device: 1),
        ("get_trtllm_gen_multi_ctas_kv_counter_bytes", lambda *args: 0),
        ("_get_multi_ctas_kv_counter_buffer", lambda *args: None),
    ):
        monkeypatch.setattr(flashinfer, name, stand_in)


def make_attention_layer(vllm_config: Any, name: str, backend: Any) -> Any:
    """A real vLLM ``Attention`` layer registered in the config's forward
    context, with its impl built as the model would build it."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    heads = TINY_MODEL_CONFIG["num_attention_heads"] // TENSOR_PARALLEL_SIZE
    with set_current_vllm_config(vllm_config):
        return Attention(
            heads, HEAD_SIZE, HEAD_SIZE**-0.5, 1, prefix=name, attn_backend=backend
        )


def full_attention_spec(block_size: int, dcp_kv_shard_count: int | None) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    # Unpatched vLLM (subprocess baselines) has no dcp_kv_shard_count field.
    extra = (
        {} if dcp_kv_shard_count is None else {"dcp_kv_shard_count": dcp_kv_shard_count}
    )
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=HEAD_SIZE,
        dtype=torch.float32,
        **extra,
    )


def decode_batch(seq_lens: list[int], max_blocks: int) -> Any:
    """Real ``CommonAttentionMetadata`` for one decode token per request."""
    import torch
    from vllm.v1.attention.backend import CommonAttentionMetadata

    n = len(seq_lens)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.arange(n + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=seq,
        num_reqs=n,
        num_actual_tokens=n,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(n, max_blocks, dtype=torch.int32),
        slot_mapping=torch.zeros(n, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def _interpreted_constexprs(self: Any) -> list[int]:
    import triton.language as tl

    params = inspect.signature(self.fn).parameters.values()
    return [
        i
        for i, p in enumerate(params)
        if p.annotation is tl.constexpr
        or (isinstance(p.annotation, str) and p.annotation.endswith("constexpr"))
    ]


@pytest.fixture
def triton_interpreter_constexprs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's kernel launcher reads ``kernel.constexprs``, which Triton's
    interpreter function object lacks; give it the constexpr indices."""
    from triton.runtime import interpreter

    if not hasattr(interpreter.InterpretedFunction, "constexprs"):
        monkeypatch.setattr(
            interpreter.InterpretedFunction,
            "constexprs",
            property(_interpreted_constexprs),
            raising=False,
        )
    yield


def attention_modes(plan: dict[str, Any]) -> dict[str, tuple[str, str | None]]:
    """Each ``plan`` group's attention mode and backend, by group name."""
    return {
        g["name"]: (g["attention_mode"], g["attention_backend"]) for g in plan["groups"]
    }
