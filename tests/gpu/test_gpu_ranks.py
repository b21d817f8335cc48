# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``vllm-dcp-geometry ranks --device cuda`` over this machine's GPUs: the
CPU cases of ``ranks`` with NCCL and vLLM's compiled backends, one worker
process per GPU, with and without CUDA-graph capture of the decode step.

Cases (D = the visible GPUs, at most 8, at least 2):

- a generic ``MLAAttention`` topology with K = D, a partial K = D/2 (within
  its replica) and a replicated draft, on every compiled dense MLA backend
  this device runs (FLASH_ATTN_MLA, FLASHINFER_MLA, FLASHMLA, CUTLASS_MLA;
  one it cannot import or run is skipped by name), eager and with
  ``--cuda-graph``;
- the default profile (Kimi-K3's own layer and its DSpark draft) at
  ``--dcp D`` on its SM90 backends (FLASH_ATTN_MLA, FLASHINFER_MLA for the
  non-causal draft);
- the DeepSeek-V3.2 profile (sparse MLA with its indexer, FLASHMLA_SPARSE on
  an ``fp8_ds_mla`` cache) at ``--dcp D``, where ``ranks`` runs that class.

Each run must exit 0: every rank within its dtype's tolerance of the float64
reference, every collective's bytes equal to the formula on NCCL, the world
each impl attended over the plan's, the class each rank ran the plan's, the
graph replay as right as the eager step. Every group of every run goes into
one receipt, ``receipts/gpu-ranks.json`` (or ``$GPU_RANKS_RECEIPT``): per
group its backend, K, W, errors, bytes per rank per step (and the formula's),
decode-step time, graph error, device names.

Run it on a machine with GPUs, from the repository root:

    python tests/gpu/test_gpu_ranks.py

(under a plain ``pytest tests`` it is skipped: ``tests/conftest.py`` hides
every GPU.) Across nodes, ``ranks`` itself runs under torchrun; see
docs/cli.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from tests.support.gpu import gpu_marks, require_backend, run_outside_suite  # noqa: E402

pytestmark = [
    *gpu_marks(),
    pytest.mark.patches("worker.mla_attention", "worker.kimi_k3_mla", "worker.utils"),
]

DENSE_BACKENDS = ("FLASH_ATTN_MLA", "FLASHINFER_MLA", "FLASHMLA", "CUTLASS_MLA")
RECEIPT = Path(
    os.environ.get("GPU_RANKS_RECEIPT", ROOT / "receipts" / "gpu-ranks.json")
)
ROW_FIELDS = (
    "name",
    "backend",
    "layer_class",
    "shard_count",
    "collective_world_size",
    "attention_world_size",
    "max_abs_error",
    "max_lse_error",
    "graph_max_abs_error",
    "collective_bytes_per_rank_per_step",
    "formula_bytes_per_rank_per_step",
    "decode_step_s",
    "ok",
    "reason",
)


def _ranks_on_gpus() -> int:
    import torch

    return min(torch.cuda.device_count(), 8)


def _topology(path: Path, dcp: int) -> Path:
    """K = D, K = D/2 and a replicated draft of vLLM's generic MLA layer at
    DeepSeek-V3's latent row, 16 heads per rank, bfloat16, block 64."""
    groups = [("mla.sharded", {}), ("mla.partial", {"dcp_kv_shard_count": dcp // 2})]
    groups.append(("draft", {"draft": True, "dcp_sharded": False}))
    text = (
        f'name = "gpu-ranks-d{dcp}"\n[parallel]\n'
        f"tensor_parallel_size = {dcp}\ndecode_context_parallel_size = {dcp}\n"
        "[limits]\nmax_model_len = 16384\nmax_num_seqs = 8\n"
    )
    for index, (name, extra) in enumerate(groups):
        fields = {
            "name": name,
            "kind": "mla",
            "block_size": 64,
            "num_kv_heads": 1,
            "layers": [f"model.layers.{index}.self_attn.attn"],
            "query_heads": 16 * dcp,
            "kv_lora_rank": 512,
            "head_size": 576,
            "dtype": "bfloat16",
            **extra,
        }
        text += "[[groups]]\n" + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in fields.items()
        )
    path.write_text(text)
    return path


def _run(case: str, *args: str) -> dict[str, Any]:
    """``ranks --device cuda --json`` in a fresh process; its report, whose
    groups go into the receipt under ``case``."""
    command = [sys.executable, "-m", "vllm_dcp_geometry", "ranks", "--device", "cuda"]
    done = subprocess.run(
        [*command, *args, "--json", "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if not done.stdout.strip():
        raise AssertionError(f"{case}: ranks printed no report: {done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    _record(case, args, done.returncode, report)
    return {"code": done.returncode, **report}


def _record(
    case: str, args: tuple[str, ...], code: int, report: dict[str, Any]
) -> None:
    receipt = json.loads(RECEIPT.read_text()) if RECEIPT.exists() else {"runs": []}
    receipt["runs"].append(
        {
            "case": case,
            "args": list(args),
            "exit": code,
            "device_names": report["processes"].get("device_names"),
            "backend": report["processes"]["backend"],
            "ranks": report["ranks"],
            "groups": [
                {field: g.get(field) for field in ROW_FIELDS} for g in report["groups"]
            ],
        }
    )
    RECEIPT.parent.mkdir(parents=True, exist_ok=True)
    RECEIPT.write_text(json.dumps(receipt, indent=2) + "\n")


def _check(report: dict[str, Any]) -> None:
    failed = [g for g in report["groups"] if g["status"] == "run" and not g["ok"]]
    assert report["code"] == 0 and not failed, failed or report
    assert report["processes"]["backend"] == "nccl"


@pytest.fixture(scope="module", autouse=True)
def fresh_receipt() -> None:
    """One receipt per run of this script."""
    RECEIPT.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def dcp() -> int:
    ranks = _ranks_on_gpus()
    if ranks < 2:
        pytest.skip(f"needs at least 2 GPUs for DCP ranks, {ranks} visible")
    return ranks


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
@pytest.mark.parametrize("backend", DENSE_BACKENDS)
def test_generic_mla_groups_on_a_compiled_backend(
    dcp: int, backend: str, graph: bool, tmp_path: Path
) -> None:
    require_backend(backend)
    path = _topology(tmp_path / "gpu.toml", dcp)
    args = ["-t", str(path), "--attention-backend", backend]
    report = _run(f"mla {backend}", *args, *(["--cuda-graph"] if graph else []))
    _check(report)
    ran = {g["name"]: g for g in report["groups"]}
    assert ran["mla.partial"]["attention_world_size"] == dcp // 2
    if graph:
        assert all(g["graph_max_abs_error"] is not None for g in ran.values())


def test_the_default_profile_on_its_sm90_backends(dcp: int) -> None:
    report = _run("kimi-k3 default profile", "--dcp", str(dcp))
    _check(report)
    assert report["groups_run"] == 6


def test_the_deepseek_v32_profile_sparse_with_its_indexer(dcp: int) -> None:
    if dcp % 4:
        pytest.skip(f"the profile's K = 4 needs D a multiple of 4, {dcp} GPUs")
    report = _run("deepseek-v32", "-p", "deepseek-v32-tp8-dcp8", "--dcp", str(dcp))
    _check(report)
    assert report["groups_run"] >= 1


if __name__ == "__main__":
    sys.exit(run_outside_suite(__file__))
