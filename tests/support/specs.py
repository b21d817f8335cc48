# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One real instance of every vLLM 0.33.0 KV-cache spec type (``build_specs``,
``mamba_align``) and what they answer (``answers``: widths, memory, page
sizes, merge, repr, pickled bytes), imported both in the patched test process
and in unpatched subprocesses so the two can be compared field by field;
and ``full_attention_spec``, the GQA layer's spec the worker-table tests
vary.
"""

from __future__ import annotations

import pickle
from fractions import Fraction
from typing import Any

from tests.support.vllm_configs import make_vllm_config


def full_attention_spec(block_size: int = 64, **kw: Any) -> Any:
    """vLLM's ``FullAttentionSpec`` of a GQA layer: 2 KV heads of 64,
    bfloat16; ``kw`` as the spec takes it (``dcp_kv_shard_count`` and the
    like)."""
    import torch
    from vllm.v1 import kv_cache_interface as k

    return k.FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.bfloat16,
        **kw,
    )


def mamba_align() -> Any:
    """A recurrent spec in align mode: block 768, 7 speculative blocks."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=768,
        shapes=((4, 2048),),
        dtypes=(torch.bfloat16,),
        mamba_cache_mode="align",
        num_speculative_blocks=7,
    )


def build_specs() -> dict[str, Any]:
    """Every spec type, with non-default fields where that matters."""
    import torch
    from vllm.v1 import kv_cache_interface as k

    common = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    mla = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    specs: dict[str, Any] = {
        "full": k.FullAttentionSpec(block_size=64, **common),
        "full_replicated": k.FullAttentionSpec(
            block_size=16, dcp_sharded=False, **common
        ),
        "full_sliding_recorded": k.FullAttentionSpec(
            block_size=32, sliding_window=4096, **common
        ),
        "mla": k.MLAAttentionSpec(block_size=64, cache_dtype_str="auto", **mla),
        "mla_aligned": k.MLAAttentionSpec(block_size=64, alignment=1024, **mla),
        "hidden_state": k.HiddenStateCacheSpec(block_size=64, **mla),
        "rswa": k.RSWASpec(block_size=16, rswa_window=512, **common),
        "sink": k.SinkFullAttentionSpec(block_size=16, sink_len=4, **common),
        "chunked_local": k.ChunkedLocalAttentionSpec(
            block_size=16, attention_chunk_size=8192, dcp_sharded=False, **common
        ),
        "sliding": k.SlidingWindowSpec(
            block_size=16, sliding_window=1024, dcp_sharded=False, **common
        ),
        "sliding_mla": k.SlidingWindowMLASpec(
            block_size=64, sliding_window=128, dcp_sharded=False, **mla
        ),
        "circular": k.CircularBufferSpec(block_size=8, **common),
        "encoder_only": k.EncoderOnlyAttentionSpec(block_size=16, **common),
        "cross": k.CrossAttentionSpec(block_size=16, **common),
        "whisper_pooled": k.FullAttentionSpec(
            block_size=16, tokens_per_state=Fraction(1, 2), **common
        ),
        "mamba_align": k.MambaSpec(
            block_size=768,
            shapes=((4, 2048), (32, 128, 128)),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_cache_mode="align",
            num_speculative_blocks=7,
        ),
        "mamba_none": k.MambaSpec(
            block_size=1024,
            shapes=((8, 64),),
            dtypes=(torch.float16,),
            num_speculative_blocks=2,
        ),
        "hisparse_hot": k.HiSparseHotSpec(
            block_size=64, page_size=4096, blocks_per_request=3
        ),
        "hisparse_resident": k.HiSparseResidentSpec(block_size=64, page_size=4096),
    }
    specs["uniform_full"] = k.UniformTypeKVCacheSpecs(
        block_size=64,
        kv_cache_specs={"layers.0.attn": specs["full"], "layers.1.attn": specs["full"]},
    )
    return specs


def _maybe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # recorded, so both sides must fail the same way
        return f"raises {type(exc).__name__}"


def answers(dcp: int, lengths: tuple[int, ...] = (1, 777, 65_536, 1_000_000)) -> Any:
    """What every spec answers for DCP world size ``dcp``, as JSON-able data."""
    from vllm.v1 import kv_cache_interface as k

    specs = build_specs()
    out: dict[str, Any] = {}
    for name, spec in specs.items():
        row: dict[str, Any] = {"repr": repr(spec), "pickle": pickle.dumps(spec).hex()}
        row["page_size_bytes"] = _maybe(lambda spec=spec: spec.page_size_bytes)
        for length in lengths:
            config = make_vllm_config(dcp, max_model_len=length)
            row[f"width@{length}"] = _maybe(
                lambda spec=spec, config=config, length=length: (
                    spec.max_num_blocks_per_req(config, length)
                )
            )
            row[f"memory@{length}"] = _maybe(
                lambda spec=spec, config=config: spec.max_memory_usage_bytes(config)
            )
        row["merge"] = _maybe(lambda spec=spec: repr(type(spec).merge([spec, spec])))
        row["uniform"] = _maybe(
            lambda spec=spec: k.UniformTypeKVCacheSpecs.is_uniform_type(
                {"a": spec, "b": spec}
            )
        )
        out[name] = row
    return out
