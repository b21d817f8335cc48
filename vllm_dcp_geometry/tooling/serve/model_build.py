# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The operator's model, built from vLLM's own model code without weights,
and the KV-cache specs and groups start-up would make of it.

``collect_kv_cache_specs`` builds the target (and the draft of a
``--speculative-config``) on the meta device in this one process, under the
planning platform (``planning_platform``), with the TP, DCP and other group
sizes of the configuration answered by ``SizingGroup``s, then asks each
attention layer for its spec through the model runner's own
``get_kv_cache_spec`` (so the plugin's overrides apply as they do in a
worker). ``kv_cache_groups`` groups them with vLLM's planner, as the engine
core does at start-up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_dcp_geometry.contract.layer_classes import layer_class_path
from vllm_dcp_geometry.tooling.cpu_stand_ins import KernelNotHere
from vllm_dcp_geometry.tooling.planning_stand_ins import ops_bound_not_run
from vllm_dcp_geometry.tooling.topology import TopologyError
from vllm_dcp_geometry.tooling.vllm_release import has_model_runner_v1

GROUP_SIZES = ("tp", "pp", "dcp", "pcp", "dp", "ep", "world")


class SizingGroup:
    """Stands for one of vLLM's process groups in a planning build: it
    answers the group's size and this process's rank (0, as the first rank of
    every group); its torch groups are ``fake``-backend groups of that size.
    An all-gather (0.34.0's MLA gathers ``W_UV`` over DCP for its a2a
    combine while post-processing weights) answers the gathered shape from
    this rank's copies; anything else raises: a planning build never talks."""

    def __init__(self, name: str, world_size: int, device_group: Any) -> None:
        self.unique_name = name
        self.world_size = world_size
        self.rank = self.rank_in_group = self.local_rank = 0
        self.ranks = list(range(world_size))
        self.first_rank, self.last_rank = 0, world_size - 1
        self.is_first_rank, self.is_last_rank = True, world_size == 1
        self.use_device_communicator = False
        self.device_communicator = None
        self.device_group = self.cpu_group = device_group

    def all_gather(self, input_: Any, dim: int = -1) -> Any:
        import torch

        # The gathered shape, from this rank's copies: no other rank exists.
        return torch.cat([input_] * self.world_size, dim=dim)

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(
            f"planning build: the {self.unique_name} group only answers its size "
            f"and rank; {name!r} was asked for"
        )


def _group_sizes(parallel_config: Any) -> dict[str, int]:
    tp = parallel_config.tensor_parallel_size
    dp = parallel_config.data_parallel_size
    pcp = parallel_config.prefill_context_parallel_size
    return {
        "tp": tp,
        "pp": parallel_config.pipeline_parallel_size,
        "dcp": parallel_config.decode_context_parallel_size,
        "pcp": pcp,
        "dp": dp,
        "ep": tp * dp * pcp,
        "world": parallel_config.world_size,
    }


def install_sizing_groups(parallel_config: Any) -> None:
    """vLLM's group getters answer the configuration's sizes (rank 0 of
    each), over a ``fake``-backend torch world of the configuration's size."""
    import torch.distributed as dist
    import vllm.distributed.parallel_state as state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sizes = _group_sizes(parallel_config)
    if not dist.is_initialized():
        dist.init_process_group(
            "fake", store=FakeStore(), rank=0, world_size=sizes["world"]
        )
    for name, size in sizes.items():
        group = dist.new_group(list(range(size)), backend="fake")
        setattr(state, f"_{name.upper()}", SizingGroup(name, size, group))


@dataclass(frozen=True)
class CollectedLayer:
    """One attention layer start-up meets: its spec and the class that owns
    its cache."""

    name: str
    spec: Any
    layer_class: str
    backend: str
    draft: bool


def _attention_layers(vllm_config: Any) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    return dict(get_layers_from_vllm_config(vllm_config, AttentionLayerBase))  # type: ignore[type-abstract]


def _load_draft(target: Any, vllm_config: Any) -> Any:
    """The draft model of ``--speculative-config``, loaded by the loader the
    worker's model runner uses for its method (so the draft gets its
    backend, parallel layout and flags exactly as at start-up)."""
    spec = vllm_config.speculative_config
    if spec is None or spec.draft_model_config is None:
        return None
    if _runs_model_runner_v2(vllm_config):
        from vllm.v1.worker.gpu.spec_decode.dflash.utils import load_dflash_model
        from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model
        from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

        loaders = {"dspark": load_dspark_model, "dflash": load_dflash_model}
        loader = loaders.get(spec.method)
        if loader is None and spec.use_eagle():
            loader = load_eagle_model
    else:
        loader = _v1_loader(spec)
    if loader is None:
        raise TopologyError(
            f"--speculative-config method {spec.method!r}: planning builds "
            "EAGLE/MTP, DFlash and DSpark drafts only"
        )
    return loader(target, _draft_vllm_config(vllm_config))


def _runs_model_runner_v2(vllm_config: Any) -> bool:
    """Whether the workers would run Model Runner V2: the config says where
    the release has both runners (0.33.0 falls back to V1 for features V2
    lacks); a release without V1 (0.34.0) has no such attribute and runs V2."""
    if not has_model_runner_v1():
        return True
    return bool(vllm_config.use_v2_model_runner)


def draft_dcp_size(vllm_config: Any) -> int:
    """The DCP size the draft is built at: 0.34.0's
    ``draft_decode_context_parallel_size`` (resolved by vLLM's speculative
    config: 1 or the target's D), else the target's D."""
    target = vllm_config.parallel_config.decode_context_parallel_size
    spec = vllm_config.speculative_config
    dcp = getattr(spec, "draft_decode_context_parallel_size", None)
    return target if dcp is None else int(dcp)


def _draft_vllm_config(vllm_config: Any) -> Any:
    """The config the draft is loaded with: the target's, or where the draft
    runs at its own DCP size a copy whose parallel config says so, as
    Model Runner V2's draft speculator makes it (its layers and impls are
    then built for that world)."""
    import copy

    from vllm.config import replace as replace_config

    dcp = draft_dcp_size(vllm_config)
    parallel_config = vllm_config.parallel_config
    if dcp == parallel_config.decode_context_parallel_size:
        return vllm_config
    draft_config = copy.copy(vllm_config)
    draft_config.parallel_config = replace_config(
        parallel_config, decode_context_parallel_size=dcp
    )
    return draft_config


def _v1_loader(spec: Any) -> Any:
    """Model Runner V1's draft loading (its proposers' ``_get_model``), for
    the EAGLE/MTP family."""
    if not spec.use_eagle():
        return None
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    def load(target: Any, vllm_config: Any) -> Any:
        stand_in = SimpleNamespace(speculative_config=spec, vllm_config=vllm_config)
        return SpecDecodeBaseProposer._get_model(stand_in)  # type: ignore[arg-type]

    return load


def _build(vllm_config: Any) -> list[Any]:
    """Target, then draft; the draft's layers marked as the runner marks
    them (every attention layer the draft added). The models built."""
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    # In the model's dtype, as vLLM's loader builds it (load_model).
    with set_default_torch_dtype(vllm_config.model_config.dtype):
        target = initialize_model(vllm_config=vllm_config)
    target_layers = set(_attention_layers(vllm_config))
    draft = _load_draft(target, vllm_config)
    for name, layer in _attention_layers(vllm_config).items():
        if name not in target_layers:
            layer.is_draft_layer = True
    return [m for m in (target, draft) if isinstance(m, torch.nn.Module)]


def parameter_bytes(models: list[Any]) -> int:
    """Bytes of the models' parameters on one rank, as vLLM shards them
    (meta tensors: shapes and dtypes, no storage); a parameter the draft
    shares with the target counts once."""
    seen: dict[int, int] = {}
    for model in models:
        for parameter in model.parameters():
            seen.setdefault(id(parameter), parameter.numel() * parameter.element_size())
    return sum(seen.values())


def _build_error(vllm_config: Any, exc: Exception) -> TopologyError:
    """What stopped the build, said as what it is: this machine lacking a
    GPU (the plan cannot be made here), or vLLM's model code refusing the
    configuration (start-up would refuse it too)."""
    import torch

    architecture = vllm_config.model_config.architecture
    message = " ".join(str(exc).split())
    if isinstance(exc, (KernelNotHere, torch.AcceleratorError)):
        return TopologyError(
            f"model {architecture}: vLLM's model code needs a GPU to be built "
            f"({type(exc).__name__}: {message}); it cannot be planned from its "
            "model code on this machine"
        )
    return TopologyError(
        f"model {architecture}: vLLM's model code refuses this configuration "
        f"while building the model, as start-up would ({type(exc).__name__}: "
        f"{message})"
    )


def collect_kv_cache_specs(vllm_config: Any) -> tuple[list[CollectedLayer], int]:
    """Build the model (and its draft) on the meta device and collect every
    attention layer's KV-cache spec as a worker's runner does; and the
    bytes of the built models' parameters on one rank."""
    import torch
    import vllm.platforms
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.workspace import init_workspace_manager

    install_sizing_groups(vllm_config.parallel_config)
    # Some impls reserve workspace when built, as a worker's device allows.
    init_workspace_manager(torch.device("meta"))
    # The model loader's imports probe vLLM's ops with hasattr (0.34.0's
    # layers.utils -> _cpu_ops registers fakes for the ops it finds), so they
    # run before ops_bound_not_run makes every op look present.
    importlib.import_module("vllm.model_executor.model_loader.utils")
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        try:
            with ops_bound_not_run():
                models = _build(vllm_config)
        except TopologyError:
            raise
        except Exception as exc:
            raise _build_error(vllm_config, exc) from exc
        vllm.platforms.current_platform.update_block_size_for_backend(vllm_config)
        layers = _attention_layers(vllm_config)
        drafts = {name for name, layer in layers.items() if layer.is_draft_layer}
        specs = _runner_kv_cache_spec(vllm_config, drafts)
    collected = [
        CollectedLayer(
            name=name,
            spec=spec,
            layer_class=layer_class_path(layers[name]),
            backend=layers[name].get_attn_backend().get_name(),
            draft=bool(layers[name].is_draft_layer),
        )
        for name, spec in specs.items()
    ]
    return collected, parameter_bytes(models)


def _runner_kv_cache_spec(vllm_config: Any, draft_layers: set[str]) -> dict[str, Any]:
    """The specs a worker's model runner collects, through its own
    ``get_kv_cache_spec`` (patched: the operator's overrides applied): Model
    Runner V1's where the release has it (what 0.33.0 planned with), else
    V2's, whose draft speculator (``draft_layers``, at ``draft_dcp_size``)
    marks a draft at DCP 1 under a DCP target replicated."""
    if has_model_runner_v1():
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = SimpleNamespace(vllm_config=vllm_config, shared_kv_cache_layers={})
        return GPUModelRunner.get_kv_cache_spec(runner)  # type: ignore[arg-type]
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    class PlannedDraft(DraftModelSpeculator):
        """The runner's draft speculator as far as ``get_kv_cache_spec``
        reads it (its DCP size and draft layers); never constructed nor run."""

        capture = init_cudagraph_manager = load_draft_model = propose = None

    speculator = None
    if draft_layers:
        speculator = object.__new__(PlannedDraft)
        speculator.dcp_size = draft_dcp_size(vllm_config)
        speculator.draft_attn_layer_names = set(draft_layers)
    runner = SimpleNamespace(
        vllm_config=vllm_config,
        speculator=speculator,
        dcp_size=vllm_config.parallel_config.decode_context_parallel_size,
    )
    return V2Runner.get_kv_cache_spec(runner)  # type: ignore[arg-type]


def kv_cache_groups(vllm_config: Any, layers: list[CollectedLayer]) -> list[Any]:
    """vLLM's KV-cache groups of the collected specs, made as the engine core
    makes them at start-up: the KV-cache layout resolved from the worker's
    backends, the model's groups, then the DCP interleave adjusted to them."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.worker.worker_base import WorkerBase

    specs = {layer.name: layer.spec for layer in layers}
    worker = SimpleNamespace(vllm_config=vllm_config)
    supported = WorkerBase.get_supported_kv_cache_layouts(worker)  # type: ignore[arg-type]
    resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = list(get_global_kv_cache_groups(vllm_config, [specs]))
    vllm_config.adjust_dcp_kv_cache_interleave_size(groups)
    return groups
