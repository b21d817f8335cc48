# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What the commands of ``vllm-dcp-geometry`` share, one module per concern.

- ``status``: the exit statuses, ``CliError`` and the one-line report of bad
  input;
- ``flags``: the flags several commands take and the topology they name;
- ``runs``: vLLM's start, the versions every report carries, and what the
  commands that run vLLM (``replay``, ``simulate``) share: their defaults, the
  progress bar, the unpatched baseline and their end;
- ``receipts``: ``--receipt FILE``;
- ``capacity``: the sizes a topology needs, against what vLLM and a rank hold;
- ``violations``: what a ``replay`` or ``simulate`` run found;
- ``text_table``: plain-text tables (also the benchmarks');
- ``noise``: third-party import noise kept out of the output.

The command packages import these at module level; nothing here imports a
command or ``vllm_dcp_geometry.tooling.cli`` itself.
"""
