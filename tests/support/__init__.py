# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the tests share, one module per subject: ``attention`` (a tiny model,
real attention layers and the DCP group stand-in), ``gpu`` (the GPU scripts'
marks, runner and sizes), ``kimi_k3`` (Kimi-K3's MLA layer over simulated
ranks), ``mla`` (vLLM's MLA attention over simulated ranks and its float64
reference), ``processes`` (fresh patched or unpatched interpreters),
``scheduler`` (a mixed topology through vLLM's ``KVCacheManager``),
``simulate`` (the ``simulate`` tests' hooks and topologies), ``slot_mapping``
(the slot-mapping cases and checks, CPU and GPU), ``sparse_mla`` (sparse MLA's
top-k merge, owned-token filter and attention over simulated ranks),
``specs`` (every KV-cache spec type and what it answers), ``sweeps`` (the K grids), ``vllm_configs``
(the one way tests build a vLLM config) and ``worker`` (vLLM's worker block
tables and runners on CPU). No test module imports another: what two share
lives here (``tests/test_test_layout.py`` checks it).
"""
