# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The tables of patched vLLM symbols and side channels, generated from the
patch modules' declarations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_dcp_geometry.patches import declarations
from vllm_dcp_geometry.runtime.patching import Patch, Pin, Wrap

RUNS_IN = {
    "common": "all",
    "engine_core": "engine_core",
    "worker": "worker",
    "benchmarks": "benchmark",
}
"""The process a patch's upstream code runs in, by the folder of the patch
module (the folders group the patches by process)."""


def runs_in(patch_module: str) -> str:
    """Where the patch module ``patch_module`` (a full name) runs."""
    return RUNS_IN[patch_module.split(".")[-2]]


def shared_modules_sentence() -> str:
    """The README's sentence on what patch modules may import."""
    return (
        "Patch modules never import each other; they import only "
        "`vllm_dcp_geometry/contract/` (the rules, pure Python) and "
        "`vllm_dcp_geometry/runtime/` (the code they share inside vLLM), and "
        "neither of those imports a patch or the tooling; "
        "`tools/check_sources.py` enforces it."
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


def _per_release_note(patch: Patch, entries: Sequence[Pin | Wrap]) -> str:
    """Which entries exist on some of the patch's releases only, and which
    have parameters of their own per release."""
    notes = []
    for entry in entries:
        parameters = entry.parameters
        if not isinstance(parameters, Mapping):
            continue
        on = [r for r in patch.releases if r in parameters]
        if len(on) < len(patch.releases):
            notes.append(f"`{entry.qualname}` on {', '.join(on)} only")
        elif len(set(parameters.values())) > 1:
            notes.append(f"`{entry.qualname}` parameters per release")
    return f" ({'; '.join(notes)})" if notes else ""


def patch_table_markdown() -> str:
    """The README's tables of patched vLLM symbols and side channels,
    generated from the modules' declarations."""
    from vllm_dcp_geometry.runtime.group_context import CHANNELS

    rows = [
        shared_modules_sentence(),
        "",
        "| runs in | vLLM releases | vLLM module | replaces | relies on | adds "
        "| remove with | why | remove when | related |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, patch in declarations().items():
        replaces = _symbol_list([entry.qualname for entry in patch.replaces])
        relies = _symbol_list([entry.qualname for entry in patch.relies_on])
        replaces += _per_release_note(patch, patch.replaces)
        relies += _per_release_note(patch, patch.relies_on)
        adds = _symbol_list(list(patch.adds))
        partners = ", ".join(f"`{p}`" for p in patch.remove_with) or "-"
        releases = ", ".join(patch.releases)
        rows.append(
            f"| {runs_in(name)} | {releases} | `{patch.upstream_module}` | {replaces} "
            f"| {relies} "
            f"| {adds} | {partners} | {patch.why} | {patch.remove_when} "
            f"| {patch.related} |"
        )
    rows += [
        "",
        "Side channels (`vllm_dcp_geometry/runtime/group_context.py`): where a wrapper "
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
