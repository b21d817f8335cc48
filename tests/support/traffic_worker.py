# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""One of two gloo ranks that issue collectives through every API a forward
could use while ``ranks``' traffic meter counts, for
``test_cli_ranks_worker.test_traffic_is_counted_where_it_happens``.

``python -m tests.support.traffic_worker RANK PORT`` prints one JSON line:
the collectives the meter saw (op, name recorded, group, world, input bytes)
and its total. vLLM's distributed state is the ``ranks`` worker's: TP = DCP
= 2 over gloo.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

CASES = (
    "coordinator all_gather",
    "coordinator reduce_scatter",
    "torch.distributed all_gather_into_tensor",
    "functional all_gather_tensor",
    "torch.distributed broadcast",
    "tp all_reduce",
)
"""What ``main`` issues inside the counted block, in order, on 2 ranks."""

ELEMENTS = 24
"""Elements of the float32 tensor every case starts from."""


def main(rank: int, port: int) -> dict[str, Any]:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    from vllm_dcp_geometry.tooling.cli.ranks import measuring
    from vllm_dcp_geometry.tooling.cli.ranks.shapes import Shape
    from vllm_dcp_geometry.tooling.cli.ranks.vllm_setup import model_dir, vllm_config

    measuring.enable_flight_recorder()
    shape = Shape(2, 512, 64, "bfloat16", max_model_len=128)
    config = vllm_config(model_dir(2, shape), 2, 1, 16, shape, "cpu")
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            2, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo"
        )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=2, decode_context_model_parallel_size=2
        )
    traffic = measuring.install_meters("gloo").traffic
    dcp, tp = parallel_state.get_dcp_group(), parallel_state.get_tp_group()
    x = torch.arange(ELEMENTS, dtype=torch.float32)
    # Not counted: before the block.
    dcp.all_gather(x, dim=0)
    with traffic.counted():
        dcp.all_gather(x, dim=0)
        dcp.reduce_scatter(x, dim=0)
        out = torch.empty(2 * ELEMENTS)
        dist.all_gather_into_tensor(out, x, group=dcp.device_group)
        functional.wait_tensor(functional.all_gather_tensor(x, 0, dcp.device_group))
        dist.broadcast(x.clone(), src=dcp.ranks[0], group=dcp.cpu_group)
        dist.all_reduce(x.clone(), group=tp.device_group)
    seen = [
        {
            "op": c.op,
            "recorded_as": c.recorded_as,
            "group": c.group,
            "world": c.world,
            "input_bytes": c.input_bytes,
            "moved": c.moved,
        }
        for c in traffic.collectives
    ]
    result = {"rank": rank, "collectives": seen, "total": traffic.total}
    result["unmodeled"] = traffic.unmodeled
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
    return result


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
