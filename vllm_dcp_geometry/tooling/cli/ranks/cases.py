# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What ``ranks`` runs, before any process starts: each MLA group's shapes
(``Shape``), its batches, and which groups run on this machine
(``plan_groups``).

Every group runs at its own shapes, what the operator's model runs: query
heads per TP rank (``Topology.heads_per_rank``), latent rank L and rope dim
R (``CacheGroup.kv_lora_rank`` and ``rope_dim``), the spec's dtype, the
group's block size and K, and the topology's interleave. A group whose
topology gives no ``query_heads`` or ``kv_lora_rank`` is not run (no shape
is made up for it), nor one whose latent row L + R vLLM's MLA metadata does
not admit (``MLACommonBackend.supports_head_size``: 320, 512 or 576). Only
where the operator asks (``--scale N``) are the query heads per rank divided
by N (rounded up, never below two: one head per rank takes another decode
kernel): they are what a worker's memory and time grow with; L and R stay,
since vLLM admits no smaller row than 320, and so do the dtype, block size,
K and interleave. The nope and value head dims are not in a topology: they
size only ``kv_b_proj``'s up-projection (absorbed into the latent query on
decode), never the cache or a collective, and are ``NOPE_DIM`` here.
Contexts are a few rounds over the group's K shards (a few times B * K
tokens).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_dcp_geometry.contract import cdiv
from vllm_dcp_geometry.contract.attention_backends import collectives_within_replica
from vllm_dcp_geometry.contract.collectives import (
    NCCL,
    REPLICA,
    collective_world_size,
    mla_decode_step_bytes,
)
from vllm_dcp_geometry.contract.layer_classes import (
    DEEPSEEK_V32_ATTENTION,
    DEEPSEEK_V32_INDEXER_CACHE,
    GENERIC_LAYERS,
    INDEXER_CACHE_SUFFIX,
    KIMI_K3_MLA,
    LATENT_CACHE_SUFFIX,
    indexer_latent_name,
)
from vllm_dcp_geometry.tooling.topology import CacheGroup, Topology

BACKEND = "TRITON_MLA"
"""The MLA backend a group runs on without a GPU (its impl and builder; vLLM's
Triton kernels under the interpreter)."""

CUDA_MLA_BACKENDS = ("FLASH_ATTN_MLA", "FLASHINFER_MLA", "FLASHMLA", "CUTLASS_MLA")
"""The compiled dense MLA backends ``ranks --device cuda`` runs (their impls
and builders, as a ``vllm serve`` worker on the GPU makes them)."""

RUN_BACKENDS = (BACKEND, *CUDA_MLA_BACKENDS)
"""What ``--attention-backend`` may name for the dense MLA runners (``auto``:
the runner's CPU backend on a CPU, the group's SM90 choice on a GPU, as
``plan`` reports it)."""

LSE_IN_QUERY_DTYPE = frozenset({BACKEND})
"""Backends whose decode hands its LSEs on in the query's dtype
(``TritonMLAImpl.forward_mqa``); the others' are float32. The combine's LSE
all-gather moves that many bytes per LSE (``Shape.lse_bytes``)."""

NOPE_DIM = 16
"""The nope and value head dims (not in a topology; see the module doc)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""The cache dtypes a group runs in, and their element sizes."""

SPARSE_BACKEND = "FLASHMLA_SPARSE"
"""DeepSeek-V3.2's sparse latent groups' backend (vLLM 0.33.0's one sparse
backend with DCP on SM90). Its builder runs on any device; on a CPU its
impl's FlashMLA kernels are stood in for (``sparse_mla``)."""
INDEXER_BACKEND = "DEEPSEEK_V32_INDEXER"
"""The DSA indexer cache's backend (the layer fixes it)."""

SPARSE_TOPKS = (512, 1024, 2048)
"""The top-k widths vLLM 0.33.0's DCP top-k merge takes
(``_assert_cutedsl_dcp_merge_supported``)."""


@dataclass(frozen=True)
class Shape:
    """One group's sizes, the same on every rank."""

    heads_per_rank: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    max_model_len: int
    """Long enough for the group's batches (``group_model_len``)."""
    nope_dim: int = NOPE_DIM
    v_head_dim: int = NOPE_DIM
    max_num_seqs: int = 8
    backend: str = BACKEND
    """The attention backend the group runs on."""

    @property
    def scale(self) -> float:
        return float((self.nope_dim + self.rope_dim) ** -0.5)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def lse_bytes(self) -> int:
        """Bytes of one LSE as the group's backend hands it on."""
        return self.dtype_bytes if self.backend in LSE_IN_QUERY_DTYPE else 4

    def decode_step_bytes(
        self, world_size: int, tokens: int, backend: str = NCCL
    ) -> int:
        """What one rank moves decoding ``tokens`` in one layer of this shape
        over ``world_size`` ranks on ``backend``
        (``collectives.mla_decode_step_bytes``)."""
        return mla_decode_step_bytes(
            world_size,
            tokens=tokens,
            heads_per_rank=self.heads_per_rank,
            kv_lora_rank=self.kv_lora_rank,
            rope_dim=self.rope_dim,
            dtype_bytes=self.dtype_bytes,
            lse_bytes=self.lse_bytes,
            backend=backend,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


NON_CAUSAL_DECODE_TOKENS = 4
"""New tokens per request in a non-causal multi-token decode step (a DSpark
draft's query block: every one of them attends every position of its
request, the block's own included); a uniform block, as vLLM's builder
requires."""


def decode_requests(
    block_size: int, shard_count: int, new_tokens: int = 1
) -> list[tuple[int, int]]:
    """One decode step: ``(context, new_tokens)`` over a long context (two
    rounds over the K shards and a partial block), one of a single round and
    one so short that some shards hold nothing."""
    round_ = block_size * shard_count
    return [
        (2 * round_ + block_size // 2 + 3, new_tokens),
        (round_ + 1, new_tokens),
        (3, new_tokens),
    ]


def prefill_requests(block_size: int, shard_count: int) -> list[tuple[int, int]]:
    """Chunked prefill over a context: a continuation past an unaligned
    context, a block-aligned context (a prefix-cache hit) and a prefill with
    no context."""
    round_ = block_size * shard_count
    return [(round_ + 5, 4), (2 * round_, 3), (0, 5)]


def phase_requests(
    block_size: int, shard_count: int, non_causal: bool = False
) -> dict[str, list[tuple[int, int]]]:
    """The batches a group runs, by phase: a decode step (a non-causal
    multi-token one for a group that decodes so) and a chunked prefill."""
    new = NON_CAUSAL_DECODE_TOKENS if non_causal else 1
    return {
        "decode": decode_requests(block_size, shard_count, new),
        "prefill": prefill_requests(block_size, shard_count),
    }


def group_model_len(block_size: int, shard_count: int, non_causal: bool = False) -> int:
    """``max_model_len`` of a group's run: its longest request, rounded up to
    a multiple of 64."""
    longest = max(
        c + n
        for requests in phase_requests(block_size, shard_count, non_causal).values()
        for c, n in requests
    )
    return cdiv(longest, 64) * 64


def topology_shape(topology: Topology, group: CacheGroup) -> dict[str, Any]:
    """The group's shapes as the topology gives them (None where not given)."""
    return {
        "heads_per_rank": topology.heads_per_rank(group),
        "kv_lora_rank": group.kv_lora_rank,
        "rope_dim": group.rope_dim,
        "dtype": str(group.spec_fields.get("dtype")),
    }


def scaled_heads(heads_per_rank: int, scale: int) -> int:
    """Query heads per rank divided by ``scale``, rounded up, and never
    scaled below two: one head per rank takes another decode kernel
    (``single_head_refused``), so scaling keeps the group's kernel."""
    return max(cdiv(heads_per_rank, scale), min(heads_per_rank, 2))


INTERPRETED_DTYPES = ("bfloat16",)
"""Dtypes the Triton interpreter holds as raw bits (it widens them only in
``tl.dot``, where ``cpu_stand_ins`` makes it read their values)."""


def single_head_refused(
    shape: Shape, world: int, *, gpu: bool, backend: str = "TRITON_MLA"
) -> str | None:
    """Why a local group (collective world 1) with one query head per rank
    cannot run its decode here (None: it can): TRITON_MLA decodes one head
    per KV head with its non-grouped kernel, whose bfloat16 arithmetic the
    Triton interpreter cannot run (no bfloat16 constants; sums of raw
    bits). On a GPU it runs."""
    if gpu or backend != BACKEND or world != 1 or shape.heads_per_rank != 1:
        return None
    if shape.dtype not in INTERPRETED_DTYPES:
        return None
    return (
        f"not run on this machine: one {shape.dtype} query head per rank takes "
        f"{backend}'s non-grouped decode kernel, whose {shape.dtype} arithmetic "
        "the Triton interpreter cannot run (a GPU runs it)"
    )


def group_shape(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = BACKEND,
    dtype: str | None = None,
) -> Shape | str:
    """The shapes an MLA group runs at (its own, its heads per rank divided
    by ``scale``), or why it cannot run: a shape the topology does not give."""
    given = topology_shape(topology, group)
    missing = [
        field
        for field, value in (
            ("query_heads", group.query_heads),
            ("kv_lora_rank", group.kv_lora_rank),
        )
        if value is None
    ]
    if missing:
        return (
            f"not run: the topology gives no {' or '.join(missing)} (ranks runs "
            "each group at its own shapes)"
        )
    if given["dtype"] not in DTYPE_BYTES:
        return f"not run: dtype {given['dtype']} (ranks runs {', '.join(DTYPE_BYTES)})"
    k = group.shard_count(topology.decode_context_parallel_size)
    non_causal = bool(group.spec_fields.get("non_causal_multi_token_decode", False))
    return Shape(
        heads_per_rank=scaled_heads(given["heads_per_rank"], scale),
        kv_lora_rank=given["kv_lora_rank"],
        rope_dim=given["rope_dim"],
        dtype=dtype or given["dtype"],
        max_model_len=group_model_len(group.block_size, k, non_causal),
        backend=backend,
    )


# DeepSeek-V3.2's sparse layer ------------------------------------------------------

SPARSE_LATENT_DIM = 576
"""``kv_lora_rank + rope``: the one latent row the sparse kernels take."""
SPARSE_NOPE_DIM = 128
"""DeepSeek-V3.2's ``qk_nope_head_dim`` and ``v_head_dim`` (not in a
topology: they size only ``kv_b_proj``, never a cache or a collective)."""


@dataclass(frozen=True)
class SparsePair:
    """The two groups one DeepSeek-V3.2 layer reads (its latent and indexer
    caches, of one K by rule A5) and the top-k its indexer selects."""

    latent: CacheGroup
    indexer: CacheGroup
    topk: int


def latent_indexer_name(name: str) -> str | None:
    """The indexer cache's layer name for a sparse latent cache's (None:
    ``name`` is not a latent cache's ``P.attn``)."""
    if not name.endswith(LATENT_CACHE_SUFFIX):
        return None
    return name.removesuffix(LATENT_CACHE_SUFFIX) + INDEXER_CACHE_SUFFIX


def sparse_pair(topology: Topology, group: CacheGroup) -> SparsePair | str:
    """The latent and indexer groups of the DeepSeek-V3.2 layers ``group``
    holds a cache of, and the top-k (``plan``'s ``indexer_topk``: the latent
    caches' ``topk_buffer_width``), or why ``ranks`` cannot run them: its
    layers' other caches are not exactly one group, or a top-k the DCP merge
    does not take."""
    from vllm_dcp_geometry.tooling.cli.plan.cost import indexer_topk

    indexer = group.spec_fields.get("cache_role") == "indexer"
    partner_of = indexer_latent_name if indexer else latent_indexer_name
    wanted = {partner_of(layer) for layer in group.layers}
    other = "latent" if indexer else "indexer"
    holders = [g for g in topology.groups if wanted & set(g.layers)]
    if None in wanted or len(holders) != 1 or set(holders[0].layers) != wanted:
        return (
            f"not run: its layers' {other} caches are not one group of the "
            "topology (ranks runs each DeepSeek-V3.2 layer with both caches)"
        )
    # One K for both (rule A5): a topology refuses a layer whose caches differ.
    latent, index = (holders[0], group) if indexer else (group, holders[0])
    topk = indexer_topk(index, topology)
    if isinstance(topk, str):
        return f"not run: {topk}"
    if topk not in SPARSE_TOPKS:
        return (
            f"not run: top-k {topk} (vLLM's DCP top-k merge takes "
            f"{', '.join(map(str, SPARSE_TOPKS))})"
        )
    return SparsePair(latent, index, topk)


def sparse_decode_requests(
    block_size: int, shard_count: int, topk: int
) -> list[tuple[int, int]]:
    """One sparse decode step, ``(context, 1)`` per request: a context
    longer than the top-k by two rounds over the K shards and a partial
    block (the selection selects), one of exactly top-k + 1 positions (it
    drops one), one round (it keeps all) and one so short that some shards
    hold nothing."""
    round_ = block_size * shard_count
    return [
        (topk + 2 * round_ + block_size // 2 + 2, 1),
        (topk, 1),
        (round_, 1),
        (2, 1),
    ]


def sparse_model_len(block_size: int, shard_count: int, topk: int) -> int:
    """``max_model_len`` of a sparse run: its longest request, rounded up to
    a multiple of 64."""
    longest = max(
        c + n for c, n in sparse_decode_requests(block_size, shard_count, topk)
    )
    return cdiv(longest, 64) * 64


def sparse_shape(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = SPARSE_BACKEND,
    dtype: str | None = None,
) -> tuple[Shape, SparsePair] | str:
    """The shapes a DeepSeek-V3.2 layer runs at for either of its groups
    (its latent group's: query heads per rank divided by ``scale``, L + R,
    the model's ``activation_dtype`` the queries and outputs are in; the
    cache's own format is ``fp8_ds_mla``), with its pair, or why not."""
    pair = sparse_pair(topology, group)
    if isinstance(pair, str):
        return pair
    latent = pair.latent
    heads = topology.heads_per_rank(latent)
    if heads is None or latent.kv_lora_rank is None or latent.rope_dim is None:
        return (
            f"not run: the topology gives no query_heads or kv_lora_rank for the "
            f"latent group {latent.name!r} (ranks runs each group at its own shapes)"
        )
    if latent.kv_lora_rank + latent.rope_dim != SPARSE_LATENT_DIM:
        return (
            f"not run: latent rows of {latent.kv_lora_rank + latent.rope_dim} "
            f"(the sparse kernels take {SPARSE_LATENT_DIM})"
        )
    run_dtype = dtype or latent.activation_dtype
    if run_dtype not in DTYPE_BYTES:
        return (
            f"not run: the topology gives no activation_dtype for "
            f"{latent.name!r} (the model's dtype, which the queries and outputs "
            f"are in; ranks runs {', '.join(DTYPE_BYTES)})"
        )
    k = latent.shard_count(topology.decode_context_parallel_size)
    shape = Shape(
        heads_per_rank=scaled_heads(heads, scale),
        kv_lora_rank=latent.kv_lora_rank,
        rope_dim=latent.rope_dim,
        dtype=run_dtype,
        max_model_len=sparse_model_len(latent.block_size, k, pair.topk),
        nope_dim=SPARSE_NOPE_DIM,
        v_head_dim=SPARSE_NOPE_DIM,
        backend=backend,
    )
    return shape, pair


def run_shape(
    topology: Topology,
    group: CacheGroup,
    scale: int,
    backend: str = BACKEND,
    dtype: str | None = None,
) -> tuple[Shape, SparsePair | None] | str:
    """The shapes ``group`` runs at by its runner (``sparse_shape`` for
    DeepSeek-V3.2's groups, with their pair; else ``group_shape``), or why
    not."""
    runner = layer_runner(group)
    if runner is not None and runner.name in SPARSE_RUNNERS:
        return sparse_shape(topology, group, scale, backend, dtype)
    found = group_shape(topology, group, scale, backend, dtype)
    return found if isinstance(found, str) else (found, None)


CUDA_BACKENDS = {
    "full_attention": "FlashAttention/FlashInfer",
    "sliding_window": "FlashAttention/FlashInfer",
}
"""The backends a non-MLA attention group runs on, which need CUDA."""


@dataclass(frozen=True)
class LayerRunner:
    """How ``ranks`` runs the groups of one layer class: ``worker_module``'s
    ``run_group`` builds that class on each worker and runs it, and
    ``spec_values`` are the values it runs of each spec field whose value
    changes the attention (beyond the dense ones every runner runs)."""

    name: str
    worker_module: str
    spec_values: dict[str, tuple[Any, ...]]
    cpu_backend: str = BACKEND
    """The backend the runner runs without a GPU (Triton kernels, interpreted)."""
    cuda_backends: tuple[str, ...] = CUDA_MLA_BACKENDS
    """The compiled backends it runs on a GPU."""
    fixed_backend: bool = False
    """The layer fixes its backend (``--attention-backend`` does not reach
    it): ``cpu_backend``, on any device."""

    @property
    def backends(self) -> tuple[str, ...]:
        return (self.cpu_backend, *self.cuda_backends)


MLA_ATTENTION_CLASS = GENERIC_LAYERS[True]

DENSE_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("sparse",),
    "cache_dtype_str": (None, "auto"),
    "kv_quant_mode": (None,),
    "state_content_bytes": (None,),
    "non_causal_multi_token_decode": (False,),
}
"""The values of the spec fields that change how a cache is read which the
dense latent path runs (an ``MLAAttentionSpec``'s ``cache_role`` defaults to
``"sparse"``, the role of every latent cache that is not an indexer's)."""

LAYOUT_ONLY_SPEC_FIELDS = frozenset(
    {
        "num_kv_heads",
        "head_size",
        "dtype",
        "dcp_sharded",
        "dcp_kv_shard_count",
        "max_tp_shards",
        "block_stride_multiple_of",
    }
)
"""Spec fields every runner takes as they are: the shapes and K it runs at,
and how pages are laid out in memory (not how a position is attended)."""

SPARSE_RUNNER = "vllm_dcp_geometry.tooling.cli.ranks.sparse_mla"

SPARSE_LATENT_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("sparse",),
    "cache_dtype_str": ("fp8_ds_mla",),
    "kv_quant_mode": ("FP8_PER_TENSOR",),
    "state_content_bytes": (656,),
    "non_causal_multi_token_decode": (False,),
    "is_index_group_leader": (True,),
    "topk_buffer_width": SPARSE_TOPKS,
}
"""A DeepSeek-V3.2 sparse latent cache as ``ranks`` runs it: FlashMLA's
656-byte ``fp8_ds_mla`` format (vLLM 0.33.0 refuses the bfloat16 sparse path
under DCP), its layer leading its index group with a top-k buffer the DCP
merge takes."""

INDEXER_SPEC_VALUES: dict[str, tuple[Any, ...]] = {
    "cache_role": ("indexer",),
    "non_causal_multi_token_decode": (False,),
}

RUNNERS: dict[str | None, LayerRunner] = {
    None: LayerRunner(
        "mla", "vllm_dcp_geometry.tooling.cli.ranks.group", DENSE_SPEC_VALUES
    ),
    KIMI_K3_MLA: LayerRunner(
        "kimi_k3",
        "vllm_dcp_geometry.tooling.cli.ranks.kimi_k3",
        {**DENSE_SPEC_VALUES, "non_causal_multi_token_decode": (False, True)},
    ),
    # One DeepSeek-V3.2 layer reads both groups: the runner runs them together.
    DEEPSEEK_V32_ATTENTION: LayerRunner(
        "sparse_mla",
        SPARSE_RUNNER,
        SPARSE_LATENT_SPEC_VALUES,
        cpu_backend=SPARSE_BACKEND,
        cuda_backends=(),
    ),
    DEEPSEEK_V32_INDEXER_CACHE: LayerRunner(
        "sparse_indexer",
        SPARSE_RUNNER,
        INDEXER_SPEC_VALUES,
        cpu_backend=INDEXER_BACKEND,
        cuda_backends=(),
        fixed_backend=True,
    ),
}
"""The layer classes ``ranks`` builds (None: a topology naming no class, vLLM's
generic ``MLAAttention``), by the class a group's layers are."""

RUNNERS_BY_NAME = {runner.name: runner for runner in RUNNERS.values()}

SPARSE_RUNNERS = frozenset({"sparse_mla", "sparse_indexer"})
"""The runners of DeepSeek-V3.2's two groups (one layer, run together)."""


def layer_runner(group: CacheGroup) -> LayerRunner | None:
    """The runner of the group's layer class (None: ``ranks`` builds none)."""
    name = group.layer_class
    return RUNNERS.get(None if name == MLA_ATTENTION_CLASS else name)


def _spec_refusal(group: CacheGroup, runner: LayerRunner) -> str | None:
    """Why the runner cannot run the group's spec (None: it can): a field
    whose value it does not run, or one it does not know."""
    for field_name, value in sorted(group.spec_fields.items()):
        if field_name in LAYOUT_ONLY_SPEC_FIELDS:
            continue
        allowed = runner.spec_values.get(field_name)
        if allowed is None:
            return (
                f"not run: spec field {field_name} needs a kernel or layer not "
                "built here"
            )
        if value not in allowed:
            return (
                f"not run: {field_name} = {value!r} needs a kernel or layer not "
                "built here"
            )
    return None


NON_CAUSAL_DCP_REASON = (
    "not run on {backend}: a non-causal multi-token draft under DCP needs a "
    "backend with DSpark DCP support (FLASHINFER_MLA, CUDA); {backend}'s builder "
    "refuses it"
)


def why_not_run(group: CacheGroup, *, gpu: bool, dcp: int) -> str | None:
    """Why ``group`` is not run by ``ranks`` here for what it is (None: its
    kind, layer class and spec run; ``group_shape`` checks its shapes)."""
    if not group.is_attention:
        return "no attention (recurrent state, not token-sharded)"
    if group.kind != "mla":
        backends = CUDA_BACKENDS.get(group.kind, group.kind)
        if not gpu:
            return f"not run on this machine: {backends} backends need CUDA"
        return f"not run: {backends} groups are not built by this command yet"
    runner = layer_runner(group)
    if runner is None:
        name = (group.layer_class or "").rsplit(".", 1)[-1]
        taught = ", ".join(
            (cls or MLA_ATTENTION_CLASS).rsplit(".", 1)[-1] for cls in RUNNERS
        )
        return f"not run: layer class {name} (ranks builds {taught})"
    return _spec_refusal(group, runner)


def head_size_refused(head_size: int) -> str | None:
    """Why vLLM's MLA path refuses a latent row of ``head_size`` (None: it
    admits it), asked of vLLM's own ``MLACommonBackend``."""
    from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend

    if MLACommonBackend.supports_head_size(head_size):
        return None
    sizes = ", ".join(map(str, MLACommonBackend.get_supported_head_sizes()))
    return (
        f"not run: head_size {head_size} (kv_lora_rank + rope dim) is not one "
        f"vLLM's MLA metadata admits ({sizes})"
    )


def planned_world_size(
    k: int, dcp: int, partial_collectives: str, backend: str = BACKEND
) -> int:
    """What a group's collectives span with K shards, as ``plan`` says for
    the same input: rule A6 where ``partial_collectives`` is ``replica`` and
    the backend binds the replica group, else D-wide."""
    replica = partial_collectives == REPLICA and collectives_within_replica(backend)
    return collective_world_size(k, dcp, replica_collectives=replica)


def group_backend(group: CacheGroup, dcp: int, *, gpu: bool, named: str) -> str:
    """The backend a group runs on: ``named`` (``--attention-backend``), or
    for ``auto`` its runner's CPU backend on a CPU and on a GPU the backend
    vLLM 0.33.0 selects for the group on SM90 (``plan``'s)."""
    runner = layer_runner(group)
    if runner is not None and runner.fixed_backend:
        return runner.cpu_backend
    if named != "auto":
        return named
    if not gpu:
        return BACKEND if runner is None else runner.cpu_backend
    from vllm_dcp_geometry.tooling.cli.plan.attention import (
        default_attention_backend,
    )

    return default_attention_backend(group, dcp)


def backend_refused(
    group: CacheGroup, backend: str, dcp: int, *, gpu: bool
) -> str | None:
    """Why the group cannot run on ``backend`` here (None: it can): a
    backend ``ranks`` does not build, a compiled one without a GPU, or a
    non-causal multi-token draft under DCP on a backend whose builder
    refuses it (vLLM's ``supports_non_causal_multi_token_dcp``)."""
    from vllm_dcp_geometry.tooling.cli.plan.attention import (
        NON_CAUSAL_DCP_MLA_BACKENDS,
    )

    runner = layer_runner(group)
    backends = RUN_BACKENDS if runner is None else runner.backends
    if backend not in backends:
        return (
            f"not run: backend {backend} (ranks runs this layer class on "
            f"{', '.join(backends)})"
        )
    if backend not in backends[:1] and not gpu:
        return f"not run on this machine: {backend} needs CUDA"
    non_causal = group.spec_fields.get("non_causal_multi_token_decode", False)
    under_dcp = group.shard_count(dcp) > 1
    if non_causal and under_dcp and backend not in NON_CAUSAL_DCP_MLA_BACKENDS:
        return NON_CAUSAL_DCP_REASON.format(backend=backend)
    return None


def plan_groups(
    topology: Topology,
    *,
    gpu: bool,
    scale: int,
    partial_collectives: str,
    backend: str = "auto",
    dtype: str | None = None,
) -> list[dict[str, Any]]:
    """Every group of the topology: what the workers run, on which backend
    (``group_backend``), at which shapes, or why not."""
    dcp = topology.decode_context_parallel_size
    planned = []
    for index, group in enumerate(topology.groups):
        k = group.shard_count(dcp) if group.is_attention else None
        reason = why_not_run(group, gpu=gpu, dcp=dcp)
        runner = layer_runner(group) if group.is_attention else None
        run_on = (
            group_backend(group, dcp, gpu=gpu, named=backend)
            if group.is_attention and group.kind == "mla"
            else None
        )
        if reason is None and run_on is not None:
            reason = backend_refused(group, run_on, dcp, gpu=gpu)
        shape, pair = None, None
        if reason is None:
            found = run_shape(topology, group, scale, run_on or BACKEND, dtype)
            if isinstance(found, str):
                reason = found
            else:
                shape, pair = found
        world = (
            None
            if k is None
            else planned_world_size(k, dcp, partial_collectives, run_on or BACKEND)
        )
        if shape is not None:
            reason = head_size_refused(
                shape.kv_lora_rank + shape.rope_dim
            ) or single_head_refused(shape, world or 1, gpu=gpu, backend=shape.backend)
            shape = None if reason else shape
        planned.append(
            {
                "index": index,
                "name": group.name,
                "kind": group.kind + (" (draft)" if group.draft else ""),
                "layer_class": group.layer_class,
                "runner": None if runner is None else runner.name,
                "backend": run_on,
                "non_causal": bool(
                    group.spec_fields.get("non_causal_multi_token_decode", False)
                ),
                "block_size": group.block_size,
                "shard_count": k,
                "dcp_kv_shard_count": group.dcp_kv_shard_count,
                "dcp_sharded": group.dcp_sharded,
                "draft": group.draft,
                "interleave": topology.interleave_size,
                "collective_world_size": world,
                "topology_shape": topology_shape(topology, group)
                if group.kind == "mla"
                else None,
                "shape": None if shape is None else shape.to_dict(),
                # A DeepSeek-V3.2 layer's two groups, run together (None: a
                # group of another class).
                "sparse_latent": None if pair is None else pair.latent.name,
                "sparse_indexer": None if pair is None else pair.indexer.name,
                "indexer_topk": None if pair is None else pair.topk,
                "run": reason is None,
                "reason": reason,
            }
        )
    return planned


def nothing_to_run(topology: Topology, groups: list[dict[str, Any]]) -> str:
    """The one line ``ranks`` refuses a topology with no group it can run:
    the groups, by why each cannot."""
    by_reason: dict[str, list[str]] = {}
    for g in groups:
        by_reason.setdefault(g["reason"], []).append(g["name"])
    why = "; ".join(
        f"{', '.join(names)}: {reason}" for reason, names in by_reason.items()
    )
    return (
        f"ranks: no group of {topology.name} can run here "
        f"(D={topology.decode_context_parallel_size}): {why}"
    )
