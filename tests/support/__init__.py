# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the tests share, one module per subject:

- ``attention``: a tiny model, real attention layers and the DCP group
  stand-in;
- ``deepseek_v32_layers``: DeepSeek-V3.2's two groups per layer for ``ranks``
  and ``plan`` topologies;
- ``gpt_oss_groups``: gpt-oss-shaped attention groups for ``ranks``;
- ``gpu``: the GPU scripts' marks, runner and sizes;
- ``hand_back``: strict doubles that record what a patched function reads;
- ``kimi_k3``: Kimi-K3's MLA layer over simulated ranks;
- ``mla``: vLLM's MLA attention layers, builders and caches per simulated
  rank;
- ``mla_forward``: one MLA forward over those ranks, and a case against its
  float64 reference;
- ``processes``: fresh patched or unpatched interpreters;
- ``ranks``: ``ranks`` runs from the tests;
- ``scheduler``: a mixed topology through vLLM's ``KVCacheManager``;
- ``simulate``: the ``simulate`` tests' hooks and topologies;
- ``sinks``: attention sinks over simulated ranks;
- ``simulated_collectives``: D simulated DCP ranks in one process and their
  collectives;
- ``slot_mapping``: the slot-mapping cases and checks, CPU and GPU;
- ``sources``: Python sources written for the source and layout checks;
- ``sparse_builders``: DeepSeek-V3.2's indexer and sparse latent builders
  per simulated rank;
- ``sparse_collective_bytes``: DeepSeek-V3.2's decode-collective bytes,
  restated;
- ``sparse_mla``: sparse MLA's layers, builders and a case's inputs over
  simulated ranks;
- ``sparse_mla_case``: one end-to-end sparse MLA case over those ranks;
- ``sparse_selection``: the top-k merge's selection over simulated ranks;
- ``specs``: every KV-cache spec type and what it answers;
- ``suite_layout``: the rules of this package's and ``tests/``'s layout;
- ``sweeps``: the K grids;
- ``traffic_worker``: a rank of the collective-traffic check;
- ``unpatched_slots``: the slot mappings unpatched vLLM computes for the
  slot-mapping cases;
- ``vllm_configs``: the one way tests build a vLLM config;
- ``worker``: vLLM's worker block tables and runners on CPU.

No test module imports another: what two share lives here
(``tests/test_test_layout.py`` checks it, by the rules of ``suite_layout``).
"""
