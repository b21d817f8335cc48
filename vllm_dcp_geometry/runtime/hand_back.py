# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""When a patched function may hand back to vLLM before reading anything.

Where every group's shard count K is vLLM 0.33.0's own default for its spec
(``D`` if ``dcp_sharded`` else 1), a patched function takes upstream's path
exactly: no extra read of config or runner state, no extra work, no changed
exception. Deciding that must not itself read the config, so it is decided
from the specs alone: a spec whose K follows its ``dcp_sharded`` flag at
every D needs no D to be handed back. Only a spec that carries an explicit
``dcp_kv_shard_count`` (or whose type the contract does not know, or a
recurrent spec flagged sharded) makes a wrapper read D and decide. An
object that is not a vLLM ``KVCacheSpec`` at all (vLLM's own unit tests pass
such doubles) carries nothing the plugin gives a K to: upstream's path.
Where upstream code reads D from the config itself, ``config_with_dcp_size``
lets it run unchanged with a group's K instead.
vLLM is imported inside the functions.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from vllm_dcp_geometry.runtime.geometry import explicit_shard_count


def follows_vllm_default(spec: Any) -> bool:
    """Whether ``spec``'s K is vLLM's own default at every DCP world size."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        HiSparseHotSpec,
        HiSparseResidentSpec,
        KVCacheSpec,
        MambaSpec,
        UniformTypeKVCacheSpecs,
    )

    if not isinstance(spec, KVCacheSpec):
        return True
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return all(follows_vllm_default(s) for s in spec.kv_cache_specs.values())
    if isinstance(spec, (AttentionSpec, HiSparseHotSpec, HiSparseResidentSpec)):
        return explicit_shard_count(spec) is None
    if isinstance(spec, MambaSpec):
        # Recurrent state is never token-sharded: K = 1, the default unless
        # the spec is flagged sharded.
        return not spec.dcp_sharded
    return False


def groups_follow_vllm_default(groups: Iterable[Any]) -> bool:
    """Whether every ``KVCacheGroupSpec``'s spec follows vLLM's default."""
    return all(follows_vllm_default(group.kv_cache_spec) for group in groups)


def config_with_dcp_size(vllm_config: Any, dcp_world_size: int) -> Any:
    """A shallow copy of ``vllm_config`` whose parallel config says
    ``dcp_world_size`` is the DCP size; everything else (the forward context
    included) is shared, so upstream code that reads D from the config runs
    with a group's K."""
    parallel_config = copy.copy(vllm_config.parallel_config)
    object.__setattr__(parallel_config, "decode_context_parallel_size", dcp_world_size)
    view = copy.copy(vllm_config)
    object.__setattr__(view, "parallel_config", parallel_config)
    return view
