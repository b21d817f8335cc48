# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""KV-cache topologies: the cache groups of a model and its parallel layout.

A topology is what the ``vllm-dcp-geometry`` commands plan and replay: one
entry per KV-cache group (kind, layer names, block size and spec fields such
as ``dcp_kv_shard_count`` or Mamba state shapes; optionally ``query_heads``,
``kv_lora_rank`` and ``activation_dtype``, which only size ``plan``'s decode
collectives) plus the parallel layout (``partial_collectives`` among it) and
limits it is sized for.
Topologies come from the built-in profiles
(``vllm_dcp_geometry/tooling/profiles/*.toml``) or from a user's TOML or JSON file.

- ``model``: ``CacheGroup`` and ``Topology``, validated against the contract;
- ``parsing``: a parsed TOML/JSON document to a ``Topology``;
- ``files``: topology files and the built-in profiles, with the model each
  model profile stands for (``model_configs/profiles.toml``);
- ``limits``: the ranges values may take, bounded by what vLLM can represent;
- ``overrides``: ``--additional-config``'s ``dcp_geometry`` section applied to
  the groups, by the contract functions start-up applies;
- ``writing``: a topology written back as a TOML or JSON topology file.

Nothing here imports vLLM: a layout the contract forbids fails before any vLLM
object is built, with a message naming the group.
"""

from vllm_dcp_geometry.tooling.topology.files import (
    DEFAULT_PROFILE,
    ProfileModel,
    load_profile,
    load_topology_file,
    model_configs_dir,
    profile_models,
    profile_names,
)
from vllm_dcp_geometry.tooling.topology.limits import TopologyError
from vllm_dcp_geometry.tooling.topology.model import (
    ACTIVATION_DTYPE_BYTES,
    ATTENTION_KINDS,
    KINDS,
    MAMBA_CACHE_MODES,
    MODEL_SOURCE,
    RECURRENT_KINDS,
    CacheGroup,
    Topology,
)
from vllm_dcp_geometry.tooling.topology.overrides import apply_additional_config
from vllm_dcp_geometry.tooling.topology.parsing import topology_from_mapping
from vllm_dcp_geometry.tooling.topology.writing import write_topology_file

__all__ = [
    "ACTIVATION_DTYPE_BYTES",
    "ATTENTION_KINDS",
    "DEFAULT_PROFILE",
    "KINDS",
    "MAMBA_CACHE_MODES",
    "MODEL_SOURCE",
    "RECURRENT_KINDS",
    "CacheGroup",
    "ProfileModel",
    "Topology",
    "TopologyError",
    "apply_additional_config",
    "load_profile",
    "load_topology_file",
    "model_configs_dir",
    "profile_models",
    "profile_names",
    "topology_from_mapping",
    "write_topology_file",
]
