# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``plan --optimize``'s budget: what one rank has for KV (device memory x
utilization - weights) and how fast it moves bytes, from a device's public
figures and/or the operator's flags."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_dcp_geometry.tooling.topology import TopologyError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Device:
    """Public figures for one GPU, per device."""

    name: str
    memory_gib: float
    hbm_gbps: float
    link_gbps: float


DEVICES = {
    d.name: d
    for d in (
        # Vendor datasheets: HBM bandwidth, NVLink bandwidth per direction.
        Device("H100", 80, 3350, 450),
        Device("H200", 141, 4800, 450),
        Device("B200", 180, 8000, 900),
    )
}


BUDGET_FLAGS: tuple[tuple[str, Any, Any, str | None, str], ...] = (
    # flag, type, default, metavar, help: ``make_budget``'s parameters.
    ("--device", str, None, "NAME", f"GPU figures: {', '.join(DEVICES)}"),
    ("--gpu-memory-gib", float, None, "GIB", "memory per GPU"),
    ("--gpu-memory-utilization", float, 0.9, None, "as vLLM reads it (0.9)"),
    (
        "--weight-gib",
        float,
        None,
        "GIB",
        "weights and other non-KV memory per rank (default: --model's "
        "parameters, else 0)",
    ),
    ("--hbm-gbps", float, None, "GB/S", "HBM bandwidth per GPU"),
    ("--link-gbps", float, None, "GB/S", "GPU-to-GPU bandwidth per direction"),
    ("--hop-latency-us", float, 5.0, "US", "latency of one ring step (5)"),
)


@dataclasses.dataclass(frozen=True)
class Budget:
    """What one rank has for KV and how fast it moves bytes."""

    memory_bytes: int
    utilization: float
    weight_bytes: int
    hbm_gbps: float
    link_gbps: float
    hop_latency_us: float
    device: str | None
    weights_from: str = "--weight-gib"

    @property
    def kv_bytes(self) -> int:
        return int(self.memory_bytes * self.utilization) - self.weight_bytes

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "gpu_memory_bytes": self.memory_bytes,
            "gpu_memory_utilization": self.utilization,
            "weight_bytes_per_rank": self.weight_bytes,
            "weights_from": self.weights_from,
            "kv_bytes_per_rank": self.kv_bytes,
            "hbm_gbps": self.hbm_gbps,
            "link_gbps": self.link_gbps,
            "hop_latency_us": self.hop_latency_us,
        }


def make_budget(
    *,
    device: str | None,
    gpu_memory_gib: float | None,
    gpu_memory_utilization: float,
    weight_gib: float | None,
    hbm_gbps: float | None,
    link_gbps: float | None,
    hop_latency_us: float = 5.0,
    model_weight_bytes: int | None = None,
) -> Budget:
    """The budget from a device name and/or explicit figures; bad input
    raises ``TopologyError`` with one line."""
    known = None if device is None else _device(device)
    memory = (
        gpu_memory_gib if gpu_memory_gib is not None else known and known.memory_gib
    )
    hbm = hbm_gbps if hbm_gbps is not None else known and known.hbm_gbps
    link = link_gbps if link_gbps is not None else known and known.link_gbps
    missing = [
        flag
        for flag, value in (
            ("--gpu-memory-gib", memory),
            ("--hbm-gbps", hbm),
            ("--link-gbps", link),
        )
        if not value
    ]
    if missing:
        raise TopologyError(
            f"--optimize needs --device or {', '.join(missing)} (per rank)"
        )
    utilization = gpu_memory_utilization
    if not 0 < utilization <= 1:
        raise TopologyError(
            f"--gpu-memory-utilization must be in (0, 1], got {utilization}"
        )
    budget = Budget(
        memory_bytes=int(float(memory) * GIB),  # type: ignore[arg-type]
        utilization=utilization,
        weight_bytes=(
            int(weight_gib * GIB) if weight_gib is not None else model_weight_bytes or 0
        ),
        weights_from=(
            "--weight-gib"
            if weight_gib is not None
            else "the model's parameters"
            if model_weight_bytes
            else "none given"
        ),
        hbm_gbps=float(hbm),  # type: ignore[arg-type]
        link_gbps=float(link),  # type: ignore[arg-type]
        hop_latency_us=hop_latency_us,
        device=known.name if known else None,
    )
    if budget.kv_bytes <= 0:
        raise TopologyError(
            f"the weights ({budget.weight_bytes / GIB:,.1f} GiB per rank, "
            f"{budget.weights_from}) leave no KV memory in {memory} GiB x "
            f"{utilization}"
        )
    return budget


def _device(name: str) -> Device:
    known = DEVICES.get(name.upper())
    if known is None:
        raise TopologyError(
            f"--device {name!r} is not in the table "
            f"({', '.join(DEVICES)}); give --gpu-memory-gib, --hbm-gbps and "
            "--link-gbps instead"
        )
    return known
