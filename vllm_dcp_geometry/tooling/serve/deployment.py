# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The KV-cache groups of the operator's model, as a ``Topology`` every
command takes.

``model_topology(argv)`` runs the planning build in a fresh process (it
changes vLLM's platform and process groups, and needs the CPU switches a
command's own process never sets) and reads back the groups as a topology
mapping. In that process, ``deployment_mapping`` turns each of vLLM's
KV-cache groups into topology groups (one per distinct spec: a uniform-type
group holds, e.g., a latent and an indexer cache), each with
``"source": "model"``, and checks that the spec the topology rebuilds is the
spec vLLM built, field for field: a schema that cannot say a spec fails
here, naming the layer, instead of planning another spec.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_dcp_geometry.tooling.topology import MODEL_SOURCE, TopologyError

BUILD_TIMEOUT_S = 900


def _spec_kind(spec: Any, layer: str) -> str:
    import vllm.v1.kv_cache_interface as kvi

    kinds = (
        (kvi.MambaSpec, "mamba"),
        (kvi.MLAAttentionSpec, "mla"),
        (kvi.SlidingWindowSpec, "sliding_window"),
        (kvi.FullAttentionSpec, "full_attention"),
    )
    for cls, kind in kinds:
        if type(spec) is cls:
            return kind
    raise TopologyError(
        f"layer {layer!r}: vLLM builds a {type(spec).__name__}, which plan's "
        "topology schema cannot describe (mla, full_attention, sliding_window, "
        "mamba)"
    )


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _set_fields(spec: Any, names: Sequence[str]) -> dict[str, Any]:
    """The optional spec fields ``names`` that the spec sets."""
    values = {name: getattr(spec, name, None) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def _block_stride(spec: Any) -> dict[str, Any]:
    alignment = spec.block_stride_alignment
    if alignment is None:
        return {}
    if isinstance(alignment, int):
        return {"block_stride_alignment": alignment}
    return {"block_stride_multiple_of": alignment.base}


def _spec_fields(spec: Any, kind: str) -> dict[str, Any]:
    if kind == "mamba":
        return {
            **_block_stride(spec),
            "shapes": [list(shape) for shape in spec.shapes],
            "dtypes": [_dtype_name(d) for d in spec.dtypes],
            "mamba_type": spec.mamba_type.name,
            "num_speculative_blocks": spec.num_speculative_blocks,
            "num_prefill_checkpoint_blocks": spec.num_prefill_checkpoint_blocks,
            **_set_fields(spec, ("page_size_padded", "prefill_checkpoint_alignment")),
        }
    fields: dict[str, Any] = {
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": _dtype_name(spec.dtype),
        "dcp_sharded": spec.dcp_sharded,
        **_block_stride(spec),
    }
    if spec.head_size_v not in (0, spec.head_size):
        fields["head_size_v"] = spec.head_size_v
    fields.update(
        _set_fields(spec, ("dcp_kv_shard_count", "page_size_padded", "max_tp_shards"))
    )
    if spec.kv_quant_mode.name != "NONE":
        fields["kv_quant_mode"] = spec.kv_quant_mode.name
    if kind == "mla":
        if spec.cache_dtype_str is not None:
            fields["cache_dtype_str"] = spec.cache_dtype_str
        fields["non_causal_multi_token_decode"] = spec.non_causal_multi_token_decode
        fields["cache_role"] = spec.cache_role.value
        fields.update(_set_fields(spec, ("state_content_bytes", "topk_buffer_width")))
        if spec.is_index_group_leader:
            fields["is_index_group_leader"] = True
    elif spec.sliding_window is not None:
        fields["sliding_window"] = spec.sliding_window
    return fields


def _cost_fields(
    module: Any, kind: str, tp: int, activation_dtype: Any
) -> dict[str, Any]:
    """The query heads (across TP), latent rank and activation dtype of the
    layer vLLM built: a rank's heads as its attention impl holds them (a
    layer's own ``num_heads`` is per rank in some classes, across TP in
    others); the dtype its model was built in, which its queries and outputs
    travel in whatever the cache stores."""
    impl = getattr(module, "impl", None)
    heads = getattr(impl, "num_heads", None)
    fields: dict[str, Any] = {}
    if isinstance(heads, int) and kind != "mamba":
        fields["query_heads"] = heads * tp
        fields["activation_dtype"] = _dtype_name(activation_dtype)
    rank = getattr(module, "kv_lora_rank", None)
    if kind == "mla" and isinstance(rank, int) and "query_heads" in fields:
        fields["kv_lora_rank"] = rank
    return fields


def _activation_dtype(vllm_config: Any, draft: bool) -> Any:
    """The dtype vLLM's loader builds the layer's model in
    (``set_default_torch_dtype(model_config.dtype)``; a draft through its
    own ``draft_model_config``): what ``MLAAttention`` takes as the dtype
    of its queries and outputs (``torch.get_default_dtype()``)."""
    if draft:
        return vllm_config.speculative_config.draft_model_config.dtype
    return vllm_config.model_config.dtype


def check_indexer_topk(context: Mapping[str, Any], layer_names: Sequence[str]) -> None:
    """Every DSA indexer among ``layer_names`` (the latent layers of
    ``context``, the static forward context) merges as many candidates per
    rank as its latent cache's ``topk_buffer_width``: ``plan`` sizes the
    top-k merge from that spec field, and vLLM's indexer passes its own
    ``topk_tokens`` (the model's ``index_topk``) to the merge. A layer whose
    two differ would be planned wrong, so it fails here, naming the layer."""
    for name in layer_names:
        module = context.get(name)
        indexer = getattr(module, "indexer", None)
        topk = getattr(indexer, "topk_tokens", None)
        width = getattr(module, "topk_buffer_width", None)
        if topk is not None and topk != width:
            raise TopologyError(
                f"layer {name!r}: its DSA indexer merges the top-{topk} of each "
                f"rank but the latent cache's topk_buffer_width is {width}; plan "
                "sizes the top-k merge from topk_buffer_width and cannot describe "
                "this layer"
            )


def _group_entries(vllm_config: Any, layers: Sequence[Any], groups: Sequence[Any]):
    from vllm_dcp_geometry.runtime.worker_admission import (
        group_layer_facts,
        model_attention_features,
    )

    by_name = {layer.name: layer for layer in layers}
    context = vllm_config.compilation_config.static_forward_context
    tp = vllm_config.parallel_config.tensor_parallel_size
    model_features = model_attention_features(vllm_config)
    for index, group in enumerate(groups):
        split: dict[Any, list[Any]] = {}
        for name in group.layer_names:
            layer = by_name[name]
            # ``is_draft`` does not take part in a spec's equality.
            key = (layer.spec, layer.layer_class, layer.draft)
            split.setdefault(key, []).append(layer)
        for part, members in enumerate(split.values()):
            first = members[0]
            kind = _spec_kind(first.spec, first.name)
            names = [m.name for m in members]
            # What the layers use, whatever this backend keeps: the topology
            # must answer for any backend it is planned on.
            features: set[str] = set()
            if kind != "mamba":
                features |= model_features
                for facts in group_layer_facts(vllm_config, names, first.backend):
                    features |= facts.features
                impls = [getattr(context[n], "impl", None) for n in names]
                if any(getattr(impl, "sinks", None) is not None for impl in impls):
                    features.add("sinks")
            entry: dict[str, Any] = {
                "name": f"g{index}" if len(split) == 1 else f"g{index}.{part}",
                "kind": kind,
                "layers": names,
                "block_size": first.spec.block_size,
                "draft": first.draft,
                "source": MODEL_SOURCE,
                **_spec_fields(first.spec, kind),
                **_cost_fields(
                    context[first.name],
                    kind,
                    tp,
                    _activation_dtype(vllm_config, first.draft),
                ),
            }
            if kind != "mamba":
                entry["layer_class"] = first.layer_class
                entry["attention_backend"] = first.backend
            if features:
                entry["attention_features"] = sorted(features)
            yield entry, members


def _check_rebuilt(topology: Any, members_by_group: dict[str, list[Any]]) -> None:
    """The spec each topology group rebuilds is the one vLLM built."""
    from vllm_dcp_geometry.tooling import vllm_objects

    for group in topology.groups:
        rebuilt = vllm_objects.build_spec(group, topology, patched=True)
        for member in members_by_group[group.name]:
            if rebuilt != member.spec:
                raise TopologyError(
                    f"layer {member.name!r}: the topology schema rebuilds "
                    f"{rebuilt} but vLLM built {member.spec}; plan cannot "
                    "describe this layer's cache"
                )


def deployment_mapping(
    argv: Sequence[str],
) -> tuple[dict[str, Any], int, tuple[str, ...]]:
    """In a planning process: the topology mapping of the model and serve
    flags ``argv``, checked against the specs vLLM built, the built models'
    parameter bytes per rank, and start-up's warnings of a near-miss
    ``additional_config`` section."""
    from vllm_dcp_geometry.contract.overrides import near_miss_sections
    from vllm_dcp_geometry.tooling.serve import prepare_planning

    prepare_planning()
    import vllm_dcp_geometry
    from vllm_dcp_geometry.tooling.serve.model_build import (
        collect_kv_cache_specs,
        kv_cache_groups,
    )
    from vllm_dcp_geometry.tooling.serve.serve_line import engine_config
    from vllm_dcp_geometry.tooling.topology import topology_from_mapping

    vllm_dcp_geometry.register()
    config = engine_config(argv)
    layers, weight_bytes = collect_kv_cache_specs(config)
    try:
        groups = kv_cache_groups(config, layers)
    except (ValueError, AssertionError, NotImplementedError) as exc:
        message = " ".join(str(exc).split())
        raise TopologyError(
            f"model {config.model_config.architecture}: vLLM's KV-cache planner "
            f"refuses these layers, as start-up would ({message})"
        ) from exc
    check_indexer_topk(
        config.compilation_config.static_forward_context,
        [layer.name for layer in layers],
    )
    entries = list(_group_entries(config, layers, groups))
    mapping = _topology_mapping(config, [entry for entry, _ in entries])
    topology = topology_from_mapping(mapping, source=MODEL_SOURCE)
    _check_rebuilt(topology, {e["name"]: m for e, m in entries})
    return mapping, weight_bytes, near_miss_sections(config.additional_config)


def _topology_mapping(config: Any, groups: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm_dcp_geometry.contract.overrides import partial_collectives

    parallel = config.parallel_config
    cache = config.cache_config
    model = config.model_config
    return {
        "name": f"{model.architecture} ({model.model})",
        "description": f"built from vLLM's model code for {model.model}",
        "parallel": {
            "tensor_parallel_size": parallel.tensor_parallel_size,
            "decode_context_parallel_size": parallel.decode_context_parallel_size,
            "cp_kv_cache_interleave_size": parallel.cp_kv_cache_interleave_size,
            "partial_collectives": partial_collectives(config.additional_config),
        },
        "limits": {
            "max_model_len": model.max_model_len,
            "max_num_seqs": config.scheduler_config.max_num_seqs,
        },
        "cache": {
            "block_size": cache.block_size,
            "mamba_cache_mode": cache.mamba_cache_mode,
        },
        "groups": groups,
    }


def model_topology(argv: Sequence[str]) -> Any:
    """The ``Topology`` of the operator's model and serve flags, built from
    vLLM's model code in a fresh planning process."""
    from vllm_dcp_geometry.tooling.cpu_stand_ins import child_environment
    from vllm_dcp_geometry.tooling.fresh_process import (
        FreshProcessError,
        run_fresh_python,
    )
    from vllm_dcp_geometry.tooling.topology import topology_from_mapping

    code = (
        "import json, sys\n"
        "from vllm_dcp_geometry.tooling.serve.deployment import planning_main\n"
        "sys.exit(planning_main(json.loads(sys.argv[1])))\n"
    )
    try:
        result = run_fresh_python(
            ["-c", code, json.dumps(list(argv))],
            patched=True,
            env=child_environment(),
            timeout=BUILD_TIMEOUT_S,
        )
    except FreshProcessError as exc:
        raise TopologyError(
            f"the planning build of {list(argv)[:1]} failed: {exc.stderr[-600:]}"
        ) from exc
    if "error" in result:
        raise TopologyError(result["error"])
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    topology = topology_from_mapping(result["topology"], source=MODEL_SOURCE)
    return dataclasses.replace(
        topology, weight_bytes_per_rank=result["weight_bytes_per_rank"]
    )


def planning_main(argv: Sequence[str]) -> int:
    """The planning process: one JSON line, the topology or the error."""
    try:
        mapping, weight_bytes, warnings = deployment_mapping(argv)
        document: dict[str, Any] = {
            "topology": mapping,
            "weight_bytes_per_rank": weight_bytes,
            "warnings": list(warnings),
        }
    except TopologyError as exc:
        document = {"error": str(exc)}
    sys.stdout.flush()
    print(json.dumps(document))
    return 0
