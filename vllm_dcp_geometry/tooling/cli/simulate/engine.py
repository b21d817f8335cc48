# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The engine side of ``simulate``: vLLM's real ``Scheduler`` with no model.

``build_engine`` gives the installed vLLM's own ``Scheduler`` a ``VllmConfig`` built
from vLLM's config classes (the ``ModelConfig`` reads a tiny generated HF
config: no weights, no tokenizer, no GPU) and the topology's scheduler-side
``KVCacheConfig``, exactly as ``EngineCore.__init__`` does: block sizes from
``resolve_kv_cache_block_sizes``, the prefix-cache block hasher from the cache
config. Chunked prefill is on; prefix caching and speculative decoding (vLLM's
``ngram`` method: drafts come from outside the model) follow the workload.

``StandInModel`` is what the simulation has instead of a model: it returns a
real ``ModelRunnerOutput`` each step (no token for a prefill chunk, as the
runner's discard mask does; a seeded share of the scheduled drafts accepted
plus one bonus token otherwise) and proposes draft token ids for the next
step through ``Scheduler.update_draft_token_ids``, as ``EngineCore.post_step``
hands them over.

The workloads are in ``workloads``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_dcp_geometry.tooling import vllm_objects
from vllm_dcp_geometry.tooling.cli.simulate.workloads import (
    RUNNERS,
    VOCAB_SIZE,
    RequestPlan,
    Workload,
)
from vllm_dcp_geometry.tooling.topology import Topology, TopologyError
from vllm_dcp_geometry.tooling.vllm_release import (
    has_model_runner_v1,
    require_model_runner_v1,
)

# Engine ----------------------------------------------------------------------------


@contextlib.contextmanager
def model_runner_choice(runner: str) -> Iterator[None]:
    """Tell vLLM's config which model runner the workers run, through vLLM's own
    ``VLLM_USE_V2_MODEL_RUNNER`` switch (the scheduler reads it: Model Runner V2
    gets resumed requests as new ones); restored afterwards. A release without
    Model Runner V1 has no switch (V2 is all it runs; ``0`` raises there)."""
    if runner not in RUNNERS:
        raise TopologyError(f"unknown runner {runner!r}; one of {list(RUNNERS)}")
    if runner == "v1":
        require_model_runner_v1("--runner v1")
    if not has_model_runner_v1():
        yield
        return
    name = "VLLM_USE_V2_MODEL_RUNNER"
    saved = os.environ.get(name)
    os.environ[name] = "1" if runner == "v2" else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _write_model_config(topology: Topology, directory: str) -> None:
    """A minimal HF ``config.json``: what ``ModelConfig`` reads, no weights.

    The head count equals the TP size (it must divide by it) and there is one
    KV head (vLLM's DCP needs TP > KV heads); the cache layout itself comes
    from the topology, not from this model.
    """
    heads = topology.tensor_parallel_size
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64 * heads,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": topology.max_model_len,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(config, fh)


def build_vllm_config(topology: Topology, workload: Workload, model_dir: str) -> Any:
    """A real ``VllmConfig`` for the topology and workload (device: CPU)."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )

    _write_model_config(topology, model_dir)
    parallel, cache = vllm_objects.layout_configs(
        topology, enable_prefix_caching=workload.enable_prefix_caching
    )
    try:
        model = ModelConfig(
            model=model_dir,
            skip_tokenizer_init=True,
            max_model_len=topology.max_model_len,
            dtype="bfloat16",
            seed=workload.seed,
        )
        speculative = None
        if workload.num_speculative_tokens:
            speculative = SpeculativeConfig(
                method="ngram",
                num_speculative_tokens=workload.num_speculative_tokens,
                prompt_lookup_max=2,
                prompt_lookup_min=1,
            )
        return VllmConfig(
            model_config=model,
            parallel_config=parallel,
            cache_config=cache,
            scheduler_config=SchedulerConfig(
                max_num_seqs=workload.max_num_seqs,
                max_num_batched_tokens=workload.step_tokens,
                max_model_len=topology.max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            speculative_config=speculative,
            device_config=DeviceConfig(device="cpu"),
        )
    except (ValueError, AssertionError) as exc:  # pydantic errors are ValueErrors
        raise TopologyError(
            f"topology {topology.name!r}: vLLM rejects this engine configuration: {exc}"
        ) from exc


@dataclass
class Engine:
    """vLLM's scheduler and what it was built from."""

    scheduler: Any
    vllm_config: Any
    kv_cache_config: Any
    specs: list[Any]
    scheduler_block_size: int
    hash_block_size: int
    num_pages: int
    block_hasher: Any = None
    pages_per_request: int = 0


def default_num_pages(workload: Workload, specs: list[Any], config: Any) -> int:
    """Pool pages, by vLLM's own pages-per-request rule, plus the null page:
    the replay holds one max-length request; the mixed workload its longest
    request (at full length, with its drafts' slots) and its wave's prompts
    (an upper bound, which ``build_engine`` narrows to what vLLM's scheduler
    allocates the wave, ``held_pages``)."""
    per_request = sum(vllm_objects.pages_per_request(s, config) for s in specs)
    if workload.name == "replay":
        return per_request + 1
    wave = sum(
        _pages_for(specs, config, r.prompt_len)
        for r in workload.requests[: workload.wave]
    )
    return max(wave, longest_pages(workload, specs, config)) + 1


def longest_pages(workload: Workload, specs: list[Any], config: Any) -> int:
    """Pages the rule gives the workload's longest request at full length
    (with its drafts' slots): the pool holds at least that, so every request
    can finish."""
    longest = max(
        r.prompt_len + r.max_tokens + workload.num_speculative_tokens + 1
        for r in workload.requests
    )
    return _pages_for(specs, config, longest)


def held_pages(engine: Engine, plans: Iterable[RequestPlan]) -> int:
    """Pages ``engine``'s scheduler holds for ``plans`` once it has admitted
    and prefilled them all (a stand-in model that samples nothing keeps them
    at their prompts)."""
    scheduler = engine.scheduler
    for plan in plans:
        scheduler.add_request(make_request(plan, engine))
    model = StandInModel(0, 0, 0.0, hold_prefilled=True)
    while True:
        output = scheduler.schedule()
        if not output.total_num_scheduled_tokens:
            break
        scheduler.update_from_output(output, model.output(output, scheduler))
    free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return engine.num_pages - 1 - free


def _pages_for(specs: list[Any], config: Any, length: int) -> int:
    """Pages one request of ``length`` tokens takes, by vLLM's own rule (asked
    of a copy of ``config`` whose model is ``length`` tokens long)."""
    sized = vllm_objects.with_max_model_len(config, length)
    return sum(vllm_objects.pages_per_request(s, sized) for s in specs)


def build_engine(
    topology: Topology, workload: Workload, *, num_pages: int | None, **build: Any
) -> Engine:
    """``_build_engine`` (``build``: its other keywords); a mixed workload's
    default pool is what vLLM's scheduler allocates its wave's prompts, asked
    of engines over the rule's pool (``held_pages``)."""
    engine = _build_engine(topology, workload, num_pages=num_pages, **build)
    if num_pages is None and build.get("kv_cache_config") is None and workload.wave:
        # The wave fills the pool (vLLM admits a request only when its whole
        # prompt fits): its first decode step into a new block must preempt.
        # The longest request fits alone (the rule), so every request finishes.
        held = held_pages(engine, workload.requests[: workload.wave])
        floor = longest_pages(workload, engine.specs, engine.vllm_config)
        engine = _build_engine(
            topology, workload, num_pages=max(held, floor) + 1, **build
        )
    return engine


def _build_engine(
    topology: Topology,
    workload: Workload,
    *,
    patched: bool,
    num_pages: int | None,
    model_dir: str,
    kv_cache_config: Any = None,
    as_served: bool = False,
) -> Engine:
    """vLLM's ``Scheduler`` over the topology's KV-cache groups, built the way
    ``EngineCore.__init__`` builds it; ``kv_cache_config`` (groups and pool
    as start-up made them, ``plan --optimize``) replaces the topology's groups
    and ``num_pages``. ``as_served``: the class the engine core picks for the
    config (``AsyncScheduler`` under vLLM's default async scheduling), not
    the synchronous ``Scheduler``."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config = build_vllm_config(topology, workload, model_dir)
    specs = [
        vllm_objects.build_spec(g, topology, patched=patched) for g in topology.groups
    ]
    if kv_cache_config is not None:
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        num_pages = kv_cache_config.num_blocks
    pages = (
        num_pages
        if num_pages is not None
        else default_num_pages(workload, specs, config)
    )
    if pages < 2:
        raise TopologyError(f"--num-pages must be at least 2, got {pages}")
    if kv_cache_config is None:
        kv_cache_config = vllm_objects.build_kv_cache_config(topology, specs, pages)
    config.cache_config.num_gpu_blocks = pages
    sched_block, hash_block = vllm_objects.resolve_block_sizes(kv_cache_config, config)
    scheduler_cls = (
        config.scheduler_config.get_scheduler_cls() if as_served else Scheduler
    )
    try:
        scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=sched_block,
            hash_block_size=hash_block,
        )
    except (ValueError, AssertionError) as exc:
        raise TopologyError(f"vLLM's scheduler rejects this layout: {exc}") from exc
    hasher = None
    if workload.enable_prefix_caching:
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(
            hash_block, hash_fn, config.num_hash_lookahead_tokens
        )
    return Engine(
        scheduler=scheduler,
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        specs=specs,
        scheduler_block_size=sched_block,
        hash_block_size=hash_block,
        num_pages=pages,
        block_hasher=hasher,
        pages_per_request=sum(vllm_objects.pages_per_request(s, config) for s in specs),
    )


@contextlib.contextmanager
def model_directory() -> Iterator[str]:
    """A scratch directory for the generated model config, removed after."""
    path = tempfile.mkdtemp(prefix="vllm-dcp-geometry-simulate-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_request(plan: RequestPlan, engine: Engine) -> Any:
    """A real ``Request`` for ``plan`` (ignoring EOS, so lengths are fixed)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=plan.max_tokens, ignore_eos=True)
    return Request(
        plan.request_id,
        plan.prompt_token_ids(),
        params,
        pooling_params=None,
        block_hasher=engine.block_hasher,
    )


# The stand-in model ---------------------------------------------------------------


def _index_field(req_ids: list[str]) -> dict[str, Any]:
    """``req_id_to_index``, where the release's ``ModelRunnerOutput`` has that
    field (0.33.0; 0.34.0 dropped it: its scheduler goes by ``req_ids``)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    if "req_id_to_index" not in {f.name for f in dataclasses.fields(ModelRunnerOutput)}:
        return {}
    return {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}


@dataclass
class StandInModel:
    """Sampled tokens and draft proposals in place of a model, seeded."""

    seed: int
    num_speculative_tokens: int
    acceptance: float
    draft_tokens: int = 0
    accepted_tokens: int = 0
    hold_prefilled: bool = False
    """Sample nothing after a request's last prefill chunk either: it stays
    running with its whole context in the pool and asks for no more (the
    ``plan --optimize`` capacity check)."""
    _rng: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        import numpy as np

        self._rng = np.random.default_rng(self.seed)

    def _tokens(self, n: int) -> list[int]:
        return self._rng.integers(1, VOCAB_SIZE, n).tolist()

    def output(self, scheduler_output: Any, scheduler: Any) -> Any:
        """The ``ModelRunnerOutput`` of one step: nothing for a request still in
        prefill after this step (the runner discards its sample), else the
        accepted prefix of its drafts plus one token."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            if self.hold_prefilled or request.num_computed_tokens < request.num_tokens:
                sampled.append([])
                continue
            proposed = [t for t in drafts.get(req_id, ()) if t >= 0]
            accepted = 0
            while accepted < len(proposed) and self._rng.random() < self.acceptance:
                accepted += 1
            self.draft_tokens += len(proposed)
            self.accepted_tokens += accepted
            sampled.append(proposed[:accepted] + self._tokens(1))
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, **_index_field(req_ids)
        )

    def propose(self, model_output: Any, scheduler: Any) -> Any:
        """Draft token ids for the requests that sampled and are still running."""
        from vllm.v1.outputs import DraftTokenIds

        if not self.num_speculative_tokens:
            return None
        req_ids = [
            req_id
            for req_id, tokens in zip(
                model_output.req_ids, model_output.sampled_token_ids, strict=True
            )
            if tokens
            and req_id in scheduler.requests
            and not scheduler.requests[req_id].is_finished()
        ]
        if not req_ids:
            return None
        proposals = [self._tokens(self.num_speculative_tokens) for _ in req_ids]
        return DraftTokenIds(req_ids=req_ids, draft_token_ids=proposals)
