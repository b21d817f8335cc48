# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The drift report: how the installed vLLM differs from the releases the
plugin knows, and the lock files of fingerprints for each release.

- ``pins``: every symbol a patch declares, observed in the installed vLLM and
  compared with each release's lock file (identical, parameters changed, body
  changed, moved, missing); ``write_lock_file`` records the installed release.
- ``sites``: every line of vLLM that reads DCP, by function, outside the
  modules the plugin patches, compared with the sites recorded per release.

``tools/drift_report.py`` is the maintainer's command.
"""
