# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""The drift report of the installed vLLM against known releases."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_dcp_geometry._version import SUPPORTED_VLLM_RELEASES, installed_vllm_version
from vllm_dcp_geometry.runtime.patching import PATCH_PACKAGE
from vllm_dcp_geometry.runtime.releases import lock_file
from vllm_dcp_geometry.tooling.drift.pins import (
    compare,
    every_pinned_symbol,
    moved_to,
    observe,
    write_lock_file,
)
from vllm_dcp_geometry.tooling.drift.sites import (
    installed_sites,
    recorded_sites,
    site_changes,
    write_sites_file,
)

MISSING = ("missing", "module missing")


def vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parent


def symbol_rows(against: tuple[str, ...]) -> list[dict[str, Any]]:
    """One row per pinned symbol: its status against each release."""
    rows = []
    for patch_module, module, qualname in every_pinned_symbol():
        seen = observe(module, qualname)
        statuses = {release: compare(seen, release) for release in against}
        identical = [r for r, s in statuses.items() if s == "identical"]
        pinned = {r: s for r, s in statuses.items() if s != "not pinned"}
        if identical:
            status = f"identical to {identical[-1]}"
        elif not pinned:
            status = "not pinned on " + ", ".join(against)
        else:
            status = list(pinned.values())[-1]
        row: dict[str, Any] = {
            "patch": patch_module.removeprefix(PATCH_PACKAGE + "."),
            "symbol": f"{module}.{qualname}",
            "status": status,
            "against": statuses,
        }
        if status.startswith(MISSING):
            row["moved_to"] = moved_to(qualname, vllm_root())
            if row["moved_to"]:
                row["status"] = "moved to " + ", ".join(row["moved_to"])
        rows.append(row)
    return rows


def drift(against: tuple[str, ...]) -> dict[str, Any]:
    rows = symbol_rows(against)
    known = {release: recorded_sites(release) for release in against}
    changes = site_changes(installed_sites(vllm_root()), known)
    return {
        "vllm": installed_vllm_version(),
        "against": list(against),
        "symbols": rows,
        "sites": [{"status": s, "file": f, "site": n} for s, f, n in changes],
    }


def format_drift(report: dict[str, Any]) -> str:
    rows = report["symbols"]
    differ = [
        r for r in rows if not r["status"].startswith(("identical", "not pinned"))
    ]
    lines = [
        f"vLLM {report['vllm']} against {', '.join(report['against'])}: "
        f"{len(rows)} pinned symbols, {len(differ)} differ; "
        f"{len(report['sites'])} DCP sites outside the patched modules are new "
        "or changed",
        "",
    ]
    lines += [f"  {r['status']:<22} {r['symbol']}  [{r['patch']}]" for r in differ]
    if report["sites"]:
        lines += ["", "DCP sites (vllm/FILE: function):"]
        lines += [
            f"  {s['status']:<8} {s['file']}: {s['site']}" for s in report["sites"]
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="drift_report.py",
        description="How the installed vLLM differs from the releases "
        "vllm-dcp-geometry knows: every pinned symbol and every DCP site.",
    )
    parser.add_argument(
        "--against",
        action="append",
        choices=SUPPORTED_VLLM_RELEASES,
        help="compare with these known releases only (default: every one "
        "with a lock file)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--write",
        action="store_true",
        help="record the installed release's pins and DCP sites (its lock files)",
    )
    args = parser.parse_args(argv)
    if args.write:
        release = installed_vllm_version() or ""
        if release not in SUPPORTED_VLLM_RELEASES:
            parser.error(f"vLLM {release} is not a known release; add it first")
        print(write_lock_file(release))
        print(write_sites_file(release, vllm_root()))
        return 0
    recorded = tuple(r for r in SUPPORTED_VLLM_RELEASES if lock_file(r).is_file())
    against = tuple(args.against or recorded)
    missing = [r for r in against if not lock_file(r).is_file()]
    if missing:
        parser.error(f"no lock file for vLLM {', '.join(missing)}")
    report = drift(against)
    print(json.dumps(report, indent=1) if args.json else format_drift(report))
    differ = any(
        not r["status"].startswith(("identical", "not pinned"))
        for r in report["symbols"]
    )
    return 1 if differ or report["sites"] else 0


if __name__ == "__main__":
    sys.exit(main())
