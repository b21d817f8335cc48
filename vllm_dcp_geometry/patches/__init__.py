# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The patch modules, one per patched vLLM module, grouped by process.

- ``common``: modules every process loads (the KV-cache specs).
- ``engine_core``: the scheduler side (KV-cache managers, planning, hashing).
- ``worker``: model runners, block tables, attention metadata.
- ``benchmarks``: vLLM's benchmark tools (``vllm bench``).

No patch module imports another: what they share lives in the non-patch
modules of ``SHARED_MODULES``, the one list of them (the README's and
``tools/check_sources.py``'s come from it; a test holds it to what the patch
modules import).

``PATCH_MODULES`` is the full list ``register()`` installs; the order is the
order in which patches apply when their upstream modules are already loaded.
"""

PATCH_PACKAGE = __name__

PATCH_MODULES: tuple[str, ...] = (
    "vllm_dcp_geometry.patches.common.kv_cache_interface",
    "vllm_dcp_geometry.patches.worker.block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner",
    "vllm_dcp_geometry.patches.worker.gpu_block_table",
    "vllm_dcp_geometry.patches.worker.gpu_model_runner_v2",
    "vllm_dcp_geometry.patches.worker.dflash_speculator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_utils",
    "vllm_dcp_geometry.patches.engine_core.single_type_kv_cache_manager",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_coordinator",
    "vllm_dcp_geometry.patches.engine_core.kv_cache_planning",
    "vllm_dcp_geometry.patches.engine_core.kv_connector_base",
    "vllm_dcp_geometry.patches.benchmarks.forward_batch",
    "vllm_dcp_geometry.patches.worker.utils",
    "vllm_dcp_geometry.patches.worker.flash_attn",
    "vllm_dcp_geometry.patches.worker.flashinfer",
    "vllm_dcp_geometry.patches.worker.mla_dcp_manager",
    "vllm_dcp_geometry.patches.worker.mla_attention",
    "vllm_dcp_geometry.patches.worker.kimi_k3_mla",
    "vllm_dcp_geometry.patches.worker.flint_model",
    "vllm_dcp_geometry.patches.worker.sparse_mla_attention",
    "vllm_dcp_geometry.patches.worker.flashmla_sparse",
    "vllm_dcp_geometry.patches.worker.mla_indexer",
    "vllm_dcp_geometry.patches.worker.deepseek_v32_attention",
    "vllm_dcp_geometry.patches.worker.sparse_attn_indexer",
    "vllm_dcp_geometry.patches.worker.gpu_worker",
)


SHARED_MODULES: tuple[tuple[str, str], ...] = (
    ("_patching", "applying and verifying patches, their ledger"),
    ("contract", "the rules"),
    ("geometry", "what specs and groups say"),
    ("group_context", "the side channels"),
    ("group_geometry", "a group's geometry on this worker"),
    ("attention_admission", "the admission rule"),
    ("worker_admission", "admission read off vLLM's objects"),
    ("metadata_builders", "how a taught builder is built"),
    ("impl_binding", "attention impls bound to their group"),
    ("mla_geometry", "the MLA side"),
    ("collectives", "which ranks a group's collectives span, and their traffic"),
    ("replica_groups", "the replica process groups of partial MLA groups"),
    ("layer_classes", "the taught layer classes and the binder registry"),
    ("hand_back", "upstream's exact path where nothing changes"),
    ("overrides", "operator overrides"),
)
"""(module under ``vllm_dcp_geometry``, what it holds): every module a patch
module may import apart from this registry."""


def shared_modules_sentence() -> str:
    """The README's sentence naming the shared modules."""
    names = ", ".join(f"`{name}.py` ({role})" for name, role in SHARED_MODULES)
    return (
        "Patch modules never import each other: what they share lives in "
        f"{names}; `tools/check_sources.py` enforces it."
    )


def _symbol_list(qualnames: list[str]) -> str:
    """Qualnames for a table cell; an attribute on three or more classes is
    written once with the count."""
    by_attr: dict[str, list[str]] = {}
    for qualname in qualnames:
        by_attr.setdefault(qualname.rpartition(".")[2], []).append(qualname)
    cells = []
    for qualname in qualnames:
        owners = by_attr[qualname.rpartition(".")[2]]
        if len(owners) < 3:
            cells.append(f"`{qualname}`")
        elif owners[0] == qualname:
            cells.append(f"`{qualname.rpartition('.')[2]}` of {len(owners)} classes")
    return ", ".join(cells) or "-"


def patch_table_markdown() -> str:
    """The README's tables of patched vLLM symbols and side channels,
    generated from the modules."""
    import importlib

    from vllm_dcp_geometry.group_context import CHANNELS

    rows = [
        shared_modules_sentence(),
        "",
        "| runs in | vLLM module | replaces | relies on | adds | remove with | why "
        "| remove when | related |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in PATCH_MODULES:
        patch = importlib.import_module(name)
        replaces = _symbol_list([s.qualname for s in patch.REPLACES])
        relies = _symbol_list([s.qualname for s in patch.RELIES_ON])
        adds = _symbol_list(list(patch.ADDS))
        partners = ", ".join(f"`{p}`" for p in patch.REMOVE_WITH) or "-"
        rows.append(
            f"| {patch.RUNS_IN} | `{patch.UPSTREAM_MODULE}` | {replaces} | {relies} "
            f"| {adds} | {partners} | {patch.WHY} | {patch.REMOVE_WHEN} "
            f"| {patch.RELATED} |"
        )
    rows += [
        "",
        "Side channels (`vllm_dcp_geometry/group_context.py`): where a wrapper "
        "hands a group's geometry to upstream code called deep inside it. "
        "Writer and reader patches are removed together.",
        "",
        "| channel (set / get) | written by | when | read by | for |",
        "| --- | --- | --- | --- | --- |",
    ]
    rows += [
        f"| `{c.setter}` / `{c.getter}` | {', '.join(f'`{w}`' for w in c.writers)} "
        f"| {c.written_when} | {', '.join(f'`{r}`' for r in c.readers)} "
        f"| {c.read_for} |"
        for c in CHANNELS
    ]
    return "\n".join(rows)
