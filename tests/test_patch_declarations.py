# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Each patch module's declaration (``PATCH``) is what it does: after
``register()`` the symbols it wrapped in its upstream module are exactly its
``replaces``, the attributes it defined exactly its ``adds``, nothing it only
``relies_on`` was touched, and its ``remove_with`` partners name it back. A walk over every
patched upstream module finds no wrapper the ledger does not account for.
Each check is shown to catch a deliberately wrong declaration."""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any

import pytest

from vllm_dcp_geometry.patches import PATCH_MODULES, declarations
from vllm_dcp_geometry.runtime import patching
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap
from vllm_dcp_geometry.runtime.releases import active_release

pytestmark = pytest.mark.patches(
    "worker.gpu_model_runner", "worker.gpu_model_runner_v2"
)

PREFIX = "vllm_dcp_geometry.patches."
RUNTIME = "vllm_dcp_geometry.runtime"


def _patches() -> list[Patch]:
    """The patches declared for the installed vLLM release."""
    release = active_release()
    return [p for p in declarations().values() if p.declared_for(release)]


def _relative(owner: str, name: str, module: str) -> str | None:
    """``Class.attr`` / ``attr`` of a change inside ``module``, else None."""
    if owner == module:
        return name
    if owner.startswith(module + "."):
        return f"{owner[len(module) + 1 :]}.{name}"
    return None


def declaration_mismatches(
    patch: Patch, changes: tuple[patching.Change, ...]
) -> list[str]:
    """How ``patch``'s declaration differs from the ``changes`` it made."""
    module = patch.upstream_module
    done: dict[str, set[str]] = {"wrap": set(), "add": set()}
    for change in changes:
        where = _relative(change.owner, change.name, module)
        if where is not None and change.kind in done:
            done[change.kind].add(where)
    release = active_release()
    declared = {entry.qualname for entry in patch.replaces_on(release)}
    relied = {entry.qualname for entry in patch.relies_on_on(release)}
    added = set(patch.adds)
    problems = [
        f"wrapped, not in replaces: {q}" for q in sorted(done["wrap"] - declared)
    ]
    problems += [
        f"in replaces, not wrapped: {q}" for q in sorted(declared - done["wrap"])
    ]
    problems += [f"added, not in adds: {q}" for q in sorted(done["add"] - added)]
    problems += [f"in adds, not added: {q}" for q in sorted(added - done["add"])]
    touched = done["wrap"] | done["add"]
    problems += [f"relied on and changed: {q}" for q in sorted(relied & touched)]
    return problems


@pytest.mark.parametrize("name", PATCH_MODULES)
def test_a_patch_replaces_exactly_what_it_declares(name: str) -> None:
    patch = declarations([name])[name]
    if not patch.declared_for(active_release()):
        pytest.skip(f"{name} is not declared for vLLM {active_release()}")
    importlib.import_module(patch.upstream_module)  # applies the patch
    assert name in _applied(), name
    assert declaration_mismatches(patch, patching.changes_made_by(name)) == []


def _applied() -> dict[str, str]:
    from vllm_dcp_geometry.plugin import applied_patches

    return applied_patches()


def test_partners_are_declared_both_ways() -> None:
    declared = declarations()
    for name, patch in declared.items():
        own = name.removeprefix(PREFIX)
        for partner in patch.remove_with:
            assert PREFIX + partner in declared, (own, partner)
            assert own in declared[PREFIX + partner].remove_with, (own, partner)


def _wrappers_in(module: types.ModuleType) -> set[str]:
    found = set()

    def scan(namespace: dict[str, Any], prefix: str) -> None:
        for attr, value in list(namespace.items()):
            if hasattr(patching.callable_of(value), patching.ORIGINAL_ATTR):
                found.add(prefix + attr)

    scan(vars(module), "")
    for value in list(vars(module).values()):
        if inspect.isclass(value) and value.__module__ == module.__name__:
            scan(vars(value), f"{value.__qualname__}.")
    return found


def test_every_wrapper_in_a_patched_module_is_in_a_ledger() -> None:
    """The walk: a wrapper found in an upstream module was put there by a
    patch's ledger entry (its own wrap, or another patch's rebind of a
    ``from x import f`` copy), or is such a copy taken after the patch
    applied (the same object as a wrapper a ledger accounts for)."""
    accounted: dict[str, set[str]] = {}
    for name in PATCH_MODULES:
        for change in patching.changes_made_by(name):  # empty where not declared
            accounted.setdefault(change.owner, set()).add(change.name)
    accounted_objects = {
        id(vars(module)[attr])
        for patch in _patches()
        for module in [importlib.import_module(patch.upstream_module)]
        for attr in accounted.get(module.__name__, set())
        if attr in vars(module)
    }
    for patch in _patches():
        module = importlib.import_module(patch.upstream_module)
        for qualname in sorted(_wrappers_in(module)):
            owner, _, attr = f"{module.__name__}.{qualname}".rpartition(".")
            copy = "." not in qualname and id(vars(module)[attr]) in accounted_objects
            assert attr in accounted.get(owner, set()) or copy, qualname


def test_the_check_catches_a_wrong_declaration() -> None:
    """A fake patch that wraps one symbol, adds one and declares otherwise."""
    upstream = types.ModuleType("fake_upstream")
    upstream.f = lambda: 1  # type: ignore[attr-defined]
    upstream.g = lambda: 2  # type: ignore[attr-defined]

    def apply(module: types.ModuleType) -> None:
        patching.wrap(module, "f", lambda original: lambda: original() + 1)
        patching.add_attribute(module, "h", lambda: 3)

    with patching.applying("fake_patch"):
        apply(upstream)
    says = {"why": "-", "remove_when": "-", "related": "-"}
    wrong = Patch(
        upstream_module="fake_upstream",
        replaces=(Wrap("g"),),
        relies_on=(Pin("f"), Pin("h")),
        **says,
    )
    assert declaration_mismatches(wrong, patching.changes_made_by("fake_patch")) == [
        "wrapped, not in replaces: f",
        "in replaces, not wrapped: g",
        "added, not in adds: h",
        "relied on and changed: f",
        "relied on and changed: h",
    ]
    right = Patch(
        upstream_module="fake_upstream",
        replaces=(Wrap("f"),),
        relies_on=(Pin("g"),),
        adds=("h",),
        **says,
    )
    assert declaration_mismatches(right, patching.changes_made_by("fake_patch")) == []
    assert _wrappers_in(upstream) == {"f"}


def test_admission_refuses_a_taught_backend_whose_patch_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A maintainer who deletes the FlashAttention patch: admission (the
    runtime's, which ``AttentionGroup`` calls first) refuses a replicated
    FLASH_ATTN group, naming the missing patch, instead of letting vLLM's
    D-wide builder read it."""
    from vllm_dcp_geometry import plugin
    from vllm_dcp_geometry.contract import GroupGeometry
    from vllm_dcp_geometry.contract.attention_admission import AttentionMode
    from vllm_dcp_geometry.contract.attention_backends import AttentionKind
    from vllm_dcp_geometry.runtime import worker_admission

    config = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(prefill_context_parallel_size=1),
        compilation_config=types.SimpleNamespace(static_forward_context={}),
        additional_config=None,
        model_config=types.SimpleNamespace(rswa_window=None, is_mm_prefix_lm=False),
    )
    geometry = GroupGeometry("g", 1, 4, 2, default_shard_count=1)

    def admit() -> Any:
        return worker_admission.admit_group(
            geometry,
            kind=AttentionKind.ATTENTION,
            backend="FLASH_ATTN",
            vllm_config=config,
            layer_names=["missing.layer"],
        )

    from vllm_dcp_geometry.runtime import patch_journal

    applied = plugin.applied_patches()
    monkeypatch.setattr(
        patch_journal,
        "applied_patches",
        lambda: {**applied, PREFIX + "worker.flash_attn": "x"},
    )
    assert admit().mode is AttentionMode.LOCAL
    without = {k: v for k, v in applied.items() if not k.endswith("worker.flash_attn")}
    monkeypatch.setattr(patch_journal, "applied_patches", lambda: without)
    refused = admit()
    assert refused.refused
    assert "vllm_dcp_geometry.patches.worker.flash_attn, which is not applied" in (
        refused.reason
    )


def test_a_runner_without_its_block_table_partner_refuses_naming_it() -> None:
    """Delete the V2 block-table patch and keep the V2 runner patch: the
    runner's check finds tables that did not take the shard counts and names
    the partner that should have (likewise V1's layout check)."""
    import torch
    from vllm.v1 import kv_cache_interface as k

    from tests.support import worker as h
    from tests.support.vllm_configs import make_vllm_config
    from vllm_dcp_geometry.contract import DcpGeometryError
    from vllm_dcp_geometry.patches.worker import gpu_model_runner as v1
    from vllm_dcp_geometry.patches.worker import gpu_model_runner_v2 as v2

    attn = {"num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16}
    partial = k.FullAttentionSpec(block_size=16, dcp_kv_shard_count=2, **attn)
    config = h.kv_cache_config([("model.layers.0.attn", partial)])
    runner = types.SimpleNamespace(vllm_config=make_vllm_config(4), dcp_size=4)

    def upstream_without_reader(self: Any, kv_cache_config: Any) -> None:
        self.block_tables = types.SimpleNamespace()  # took nothing

    with pytest.raises(DcpGeometryError, match=r"patches\.worker\.gpu_block_table"):
        v2._make_initialize_kv_cache(upstream_without_reader)(runner, config)
    layout = types.SimpleNamespace(tables=[object()])
    with pytest.raises(DcpGeometryError, match=r"patches\.worker\.block_table"):
        v1.check_input_batch_layout(types.SimpleNamespace(block_tables=[]), layout)


def removal_groups() -> list[tuple[str, ...]]:
    """The patch modules that go together: the connected parts of the
    ``remove_with`` graph (a patch with no partner is a group of one)."""
    partners = {
        name: {PREFIX + p for p in patch.remove_with}
        for name, patch in declarations().items()
    }
    groups, seen = [], set()
    for name in PATCH_MODULES:
        if name in seen:
            continue
        group, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in group:
                group.add(current)
                todo.extend(partners[current])
        seen |= group
        groups.append(tuple(sorted(group)))
    return groups


WITHOUT_EACH_GROUP = """
import importlib, json, sys
import vllm_dcp_geometry.patches as patches
import vllm_dcp_geometry.plugin as plugin
from vllm_dcp_geometry.runtime import patching
from vllm_dcp_geometry.runtime.releases import active_release


class RolledBack(Exception):
    pass


declared = {}
for name in patches.PATCH_MODULES:
    patch = importlib.import_module(name).PATCH
    if patch.declared_for(active_release(name)):
        declared[name] = patch
# vLLM's patched modules imported once, before any patch (register after a
# preload); each group's run applies the rest, then every change is undone.
upstream = {n: importlib.import_module(p.upstream_module) for n, p in declared.items()}


def wrappers_left():
    left = []
    for module in upstream.values():
        owners = [module] + [v for v in vars(module).values() if isinstance(v, type)]
        for owner in owners:
            for key, value in list(vars(owner).items()):
                if hasattr(patching.callable_of(value), patching.ORIGINAL_ATTR):
                    left.append(f"{module.__name__}:{getattr(owner, '__name__', '')}.{key}")
    return left


results = []
for group in json.loads(sys.argv[1]):
    assert not patching.applied_patches(), "a previous group left patches behind"
    assert not wrappers_left(), wrappers_left()
    try:
        with patching.undo_on_error():
            for name, patch in declared.items():
                if name not in group:
                    plugin._apply_patch(name, patch, upstream[name])
            results.append(sorted(patching.applied_patches()))
            raise RolledBack
    except RolledBack:
        pass
print(json.dumps(results))
"""


@pytest.mark.slow
def test_the_rest_applies_without_each_removal_group() -> None:
    """A maintainer deletes one group (a patch with its declared partners):
    every other patch still verifies and applies. What then fails closed
    without a partner is checked above (admission, the runners' checks,
    the Kimi-K3 binder). One fresh unpatched process imports vLLM's patched
    modules once and, group by group, applies the rest and undoes it all
    (the journal's all-or-nothing), checking each run starts clean."""
    import json

    from tests.support.processes import CPU_PRELUDE, REPO_ROOT, run_fresh_python

    groups = removal_groups()
    assert (PREFIX + "worker.block_table", PREFIX + "worker.gpu_model_runner") in groups
    # The replica patches: dense and sparse MLA, their DCP manager, the DSA
    # indexer (its merge and call share the replica), FlashAttention and
    # FlashInfer, with the replica groups they collective within.
    replica = tuple(
        sorted(
            PREFIX + p
            for p in (
                "worker.deepseek_v32_attention",
                "worker.flash_attn",
                "worker.flashinfer",
                "worker.flashmla_sparse",
                "worker.gpu_worker",
                "worker.kimi_k3_mla",
                "worker.mla_attention",
                "worker.mla_dcp_manager",
                "worker.mla_indexer",
                "worker.parallel_state",
                "worker.sparse_attn_indexer",
                "worker.sparse_mla_attention",
            )
        )
    )
    assert replica in groups
    # The two runner pairs and the replica twelve; the rest alone.
    assert len(groups) == len(PATCH_MODULES) - 1 - 1 - 11
    results = run_fresh_python(
        ["-c", CPU_PRELUDE + WITHOUT_EACH_GROUP, json.dumps(groups)],
        patched=False,
        env={"VLLM_LOGGING_LEVEL": "ERROR", "VLLM_PLUGINS": ""},
        cwd=REPO_ROOT,
        timeout=600,
    )
    here = {p.upstream_module for p in _patches()}
    declared_here = {
        name for name, p in declarations().items() if p.upstream_module in here
    }
    assert len(results) == len(groups)
    for group, result in zip(groups, results, strict=True):
        assert result == sorted(declared_here - set(group)), group


def test_a_wrapper_relying_on_a_global_call_refuses_when_it_is_gone() -> None:
    """The indexer patches wrap a function their caller must look up as a
    module global (directly, nested or behind a decorator); a caller that no
    longer does is refused loudly, not left calling the unwrapped one."""
    import functools

    from vllm_dcp_geometry.runtime.upstream_symbols import require_global_call

    module = types.ModuleType("fake_indexer")
    exec(
        "def merge():\n    return 1\n"
        "def caller():\n    def inner():\n        return merge()\n    return inner()\n"
        "def inlined():\n    return 1\n",
        module.__dict__,
    )
    module.decorated = functools.wraps(module.caller)(lambda: module.caller())  # type: ignore[attr-defined]
    require_global_call(module, "caller", "merge")
    require_global_call(module, "decorated", "merge")
    with pytest.raises(patching.UpstreamChangedError, match="no longer calls merge"):
        require_global_call(module, "inlined", "merge")
