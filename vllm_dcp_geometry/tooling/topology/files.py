# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""Topology files (TOML or JSON) and the built-in profiles.

A file is read only if it is a regular file of at most
``MAX_TOPOLOGY_FILE_BYTES`` holding UTF-8 text; JSON objects with a repeated
key are refused (the last value would silently win).
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_dcp_geometry.tooling.topology.limits import (
    MAX_TOPOLOGY_FILE_BYTES,
    TopologyError,
    show,
)
from vllm_dcp_geometry.tooling.topology.model import Topology
from vllm_dcp_geometry.tooling.topology.parsing import topology_from_mapping

DEFAULT_PROFILE = "kimi-k3-tp16-dcp16"
_SUFFIXES = (".toml", ".json")
MODEL_CONFIGS_PLACEHOLDER = "{model_configs}"


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {}
    for key, value in pairs:
        if key in document:
            raise TopologyError(
                f"duplicate key {show(key)} in one JSON object (keys: "
                f"{show([k for k, _ in pairs])}); give each key once"
            )
        document[key] = value
    return document


def _refuse_constant(name: str) -> Any:
    raise TopologyError(f"{name} is not a valid JSON value")


def _decode(loads: Callable[[str], Any], text: str, source: str, what: str) -> Any:
    """``loads(text)``, every failure a ``TopologyError`` naming ``source``."""
    try:
        return loads(text)
    except TopologyError as exc:  # a refusal of ours, from inside ``loads``
        raise TopologyError(f"{source}: {exc}") from exc
    except RecursionError as exc:
        raise TopologyError(f"{source}: {what} nested too deeply") from exc
    except ValueError as exc:  # the decoder's own error, or an over-long number
        raise TopologyError(f"{source}: not valid {what}: {exc}") from exc


def _parse_json(text: str, source: str) -> Any:
    def loads(text: str) -> Any:
        return json.loads(
            text,
            object_pairs_hook=_refuse_duplicate_keys,
            parse_constant=_refuse_constant,
        )

    return _decode(loads, text, source, "JSON")


def _parse_toml(text: str, source: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError as exc:
            raise TopologyError(
                f"{source}: reading TOML needs Python 3.11+ or the 'tomli' "
                "package; use a JSON topology instead"
            ) from exc
    return _decode(tomllib.loads, text, source, "TOML")


def _read_text(path: Path, source: str) -> str:
    try:
        # Check before opening: opening a FIFO or device would block or
        # never end.
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            raise TopologyError(f"topology file {source} is not a regular file")
        with path.open("rb") as fh:
            data = fh.read(MAX_TOPOLOGY_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise TopologyError(f"cannot read topology file {source}: {exc}") from exc
    if len(data) > MAX_TOPOLOGY_FILE_BYTES:
        raise TopologyError(
            f"topology file {source} is larger than MAX_TOPOLOGY_FILE_BYTES="
            f"{MAX_TOPOLOGY_FILE_BYTES}"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TopologyError(
            f"topology file {source} is not UTF-8 text: byte "
            f"{data[exc.start]:#04x} at offset {exc.start}"
        ) from exc


def load_topology_file(path: str | Path) -> Topology:
    """Load a topology from a ``.toml`` or ``.json`` file."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise TopologyError(
            f"{source}: a topology file must end in .toml or .json, got "
            f"{suffix or 'no suffix'!r}"
        )
    text = _read_text(path, source)
    parse = _parse_json if suffix == ".json" else _parse_toml
    return topology_from_mapping(parse(text, source), source)


def _profiles_dir() -> Any:
    return resources.files("vllm_dcp_geometry.tooling").joinpath("profiles")


def profile_names() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(
        entry.name[: -len(".toml")]
        for entry in _profiles_dir().iterdir()
        if entry.name.endswith(".toml")
    )


def load_profile(name: str) -> Topology:
    """Load a built-in profile by name."""
    names = profile_names()
    if name not in names:
        raise TopologyError(
            f"unknown profile {show(name)}; built-in profiles: {', '.join(names)} "
            "(or pass --topology FILE)"
        )
    entry = _profiles_dir().joinpath(f"{name}.toml")
    data = _parse_toml(entry.read_text(encoding="utf-8"), f"profile {name}")
    return topology_from_mapping(data, f"profile {name}")


def model_configs_dir() -> Path:
    """The reduced model directories shipped with the tooling."""
    return Path(str(resources.files("vllm_dcp_geometry.tooling") / "model_configs"))


@dataclass(frozen=True)
class ProfileModel:
    """The model folder and ``vllm serve`` flags a built-in profile stands
    for (``model_configs/profiles.toml``): the profile must equal what vLLM's
    model code builds for them."""

    profile: str
    model: str
    """A folder of ``model_configs``."""
    serve_flags: tuple[str, ...]

    def serve_argv(self) -> list[str]:
        """The flags as ``--model``'s planning build takes them."""
        root = str(model_configs_dir())
        return [
            "--model",
            f"{root}/{self.model}",
            *(
                flag.replace(MODEL_CONFIGS_PLACEHOLDER, root)
                for flag in self.serve_flags
            ),
        ]


def profile_models() -> dict[str, ProfileModel]:
    """The built-in profiles that stand for a model, by profile name."""
    source = "model_configs/profiles.toml"
    path = model_configs_dir() / "profiles.toml"
    data = _parse_toml(path.read_text(encoding="utf-8"), source)
    names = profile_names()
    models: dict[str, ProfileModel] = {}
    for profile, entry in data.items():
        where = f"{source}: [{profile}]"
        if profile not in names:
            raise TopologyError(f"{where}: no built-in profile of that name")
        if not isinstance(entry, dict) or set(entry) != {"model", "serve_flags"}:
            raise TopologyError(f"{where}: needs exactly 'model' and 'serve_flags'")
        model, flags = entry["model"], entry["serve_flags"]
        if not isinstance(model, str) or not (model_configs_dir() / model).is_dir():
            raise TopologyError(f"{where}: model {show(model)} is not a folder here")
        if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
            raise TopologyError(f"{where}: serve_flags must be a list of strings")
        models[profile] = ProfileModel(profile, model, tuple(flags))
    return models
