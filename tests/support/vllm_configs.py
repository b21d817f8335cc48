# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The one way tests build a vLLM config (``make_vllm_config``): vLLM's real
parallel and cache configs in a light carrier, or a real ``VllmConfig``, with a
model and a scheduler config where asked. Imported in the patched test process
and in unpatched subprocesses alike.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any


def make_vllm_config(
    dcp: int,
    *,
    interleave: int = 1,
    pcp: int = 1,
    pp: int = 1,
    tp: int | None = None,
    max_model_len: int | None = None,
    mamba_cache_mode: str = "align",
    cache_block_size: int | None = None,
    enable_prefix_caching: bool = False,
    additional_config: dict[str, Any] | None = None,
    real: bool = False,
    model_dir: Path | None = None,
    dtype: str = "float32",
    max_num_seqs: int | None = None,
    dcp_comm_backend: str | None = None,
) -> Any:
    """vLLM's real ``ParallelConfig`` and ``CacheConfig`` for DCP ``dcp``.

    By default they sit in a carrier object with the few other fields the
    spec, scheduler and block-table code reads (a real ``VllmConfig`` needs a
    device and, for ``model_config``, a model). ``real=True`` builds a real
    ``VllmConfig`` on the CPU device; ``model_dir`` (a Hugging Face config
    directory, no weights) adds a real ``ModelConfig`` (``dtype``,
    ``max_model_len``, default 4096) and implies ``real``; ``max_num_seqs``
    adds a ``SchedulerConfig`` sized for that many max-length requests.
    ``max_model_len`` defaults to 1,000,000 in the carrier.
    """
    from vllm.config import CacheConfig, ParallelConfig

    parallel_fields: dict[str, Any] = {}
    if dcp_comm_backend is not None:
        parallel_fields["dcp_comm_backend"] = dcp_comm_backend
    parallel = ParallelConfig(
        tensor_parallel_size=tp if tp is not None else max(dcp // pcp, 1),
        decode_context_parallel_size=dcp,
        prefill_context_parallel_size=pcp,
        pipeline_parallel_size=pp,
        cp_kv_cache_interleave_size=interleave,
        **parallel_fields,
    )
    cache_fields: dict[str, Any] = {
        "mamba_cache_mode": mamba_cache_mode,
        "enable_prefix_caching": enable_prefix_caching,
    }
    if cache_block_size is not None:
        cache_fields["block_size"] = cache_block_size
    cache = CacheConfig(**cache_fields)
    if real or model_dir is not None:
        fields: dict[str, Any] = {
            "parallel_config": parallel,
            "cache_config": cache,
            "additional_config": dict(additional_config or {}),
        }
        return _real_config(
            fields, model_dir, max_model_len or 4096, dtype, max_num_seqs
        )
    return SimpleNamespace(
        parallel_config=parallel,
        cache_config=cache,
        model_config=SimpleNamespace(max_model_len=max_model_len or 1_000_000),
        scheduler_config=SimpleNamespace(max_num_encoder_input_tokens=1500),
        max_in_flight_tokens=8192,
        kv_transfer_config=None,
        speculative_config=None,
        additional_config=dict(additional_config or {}),
    )


def _real_config(
    fields: dict[str, Any],
    model_dir: Path | None,
    max_model_len: int,
    dtype: str,
    max_num_seqs: int | None,
) -> Any:
    from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    fields["device_config"] = DeviceConfig(device="cpu")
    if model_dir is not None:
        fields["model_config"] = ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype=dtype,
            max_model_len=max_model_len,
        )
    if max_num_seqs is not None:
        fields["scheduler_config"] = SchedulerConfig(
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_model_len * max_num_seqs,
        )
    return VllmConfig(**fields)
