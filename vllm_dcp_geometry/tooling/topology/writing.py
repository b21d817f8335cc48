# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""A topology written as a topology file (``--emit-topology FILE``).

``Topology.to_dict`` in TOML or JSON, by the file's extension, so that
``load_topology_file`` reads back an equal topology. The TOML is written here
(the standard library only reads TOML): the schema's values are strings,
booleans, integers and lists of them, in tables and one array of tables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.topology.limits import TopologyError, show
from vllm_dcp_geometry.tooling.topology.model import Topology

TOPOLOGY_SUFFIXES = (".toml", ".json")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _string(key)


def _string(text: str) -> str:
    # JSON's escapes are TOML basic-string escapes; TOML also refuses a raw
    # DEL, which JSON leaves as is.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(item, where) for item in value) + "]"
    raise TopologyError(f"{where}: cannot write {show(value)} as TOML")


def _pairs(table: Mapping[str, Any], where: str) -> list[str]:
    return [
        f"{_key(key)} = {_value(value, f'{where}.{key}')}"
        for key, value in table.items()
    ]


def topology_toml(data: Mapping[str, Any]) -> str:
    """``data`` (a ``Topology.to_dict``) as a TOML document: its values,
    then its tables, then its arrays of tables."""
    scalars = {k: v for k, v in data.items() if not _is_table(v) and not _is_array(v)}
    lines = _pairs(scalars, "topology")
    for key, value in data.items():
        if _is_table(value):
            lines += ["", f"[{_key(key)}]", *_pairs(value, key)]
    for key, value in data.items():
        if _is_array(value):
            for index, item in enumerate(value):
                where = f"{key}[{index}]"
                lines += ["", f"[[{_key(key)}]]", *_pairs(item, where)]
    return "\n".join(lines) + "\n"


def _is_table(value: Any) -> bool:
    return isinstance(value, Mapping)


def _is_array(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, Mapping) for item in value)
    )


def check_topology_path(path: str) -> str:
    """``path`` if it names a topology file (``.toml`` or ``.json``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in TOPOLOGY_SUFFIXES:
        raise TopologyError(
            f"{show(path)}: a topology file must end in .toml or .json, got "
            f"{suffix or 'no suffix'!r}"
        )
    return path


def write_topology_file(topology: Topology, path: str | Path) -> None:
    """Write ``topology`` to ``path`` (TOML or JSON by its extension)."""
    data = topology.to_dict()
    if check_topology_path(str(path)).lower().endswith(".json"):
        text = json.dumps(data, indent=2) + "\n"
    else:
        text = topology_toml(data)
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise TopologyError(f"cannot write topology file {path}: {exc}") from exc
