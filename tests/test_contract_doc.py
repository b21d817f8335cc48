# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""``docs/contract.md`` stays true: its worked slot table is what the
contract computes, and every rule it numbers is labelled in the code that
applies it (and no code cites a rule the page does not have)."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_dcp_geometry.contract import (
    GroupGeometry,
    reference_slot_mapping,
)

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "contract.md"
RULE = re.compile(r"\b(R[1-7]|W[1-3]|M1|S1|L[1-3]|A[1-7]|DR1|P1|C1)\b")


def _doc_rules() -> set[str]:
    rules = set()
    for line in DOC.read_text().splitlines():
        cell = re.match(r"\| (\w+) \|", line)
        if cell and RULE.fullmatch(cell.group(1)):
            rules.add(cell.group(1))
    return rules


def _worked_table() -> list[list[str]]:
    text = DOC.read_text()
    table = text.split("<!-- worked-table:start -->", 1)[1]
    table = table.split("<!-- worked-table:end -->", 1)[0]
    rows = [line for line in table.strip().splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def worked_table_mismatches(rows: list[list[str]]) -> list[int]:
    """Ranks whose row differs from the contract (D=4, K=2, B=4, I=1)."""
    wrong = []
    for rank, row in enumerate(rows):
        geometry = GroupGeometry("worked example", 2, 4, rank)
        slots = reference_slot_mapping(
            range(16),
            [10, 11],
            block_size=4,
            shard_count=2,
            interleave_size=1,
            shard=geometry.shard,
        )
        expected = [
            str(rank),
            str(geometry.shard),
            str(geometry.replica),
            "kept" if geometry.replica == 0 else "masked",
            *("PAD" if s < 0 else str(s) for s in slots),
        ]
        if row != expected:
            wrong.append(rank)
    return wrong


def test_the_worked_table_is_the_contracts_slot_mapping() -> None:
    rows = _worked_table()
    assert len(rows) == 4
    assert worked_table_mismatches(rows) == []


def test_a_wrong_worked_table_is_caught() -> None:
    rows = _worked_table()
    rows[0][5] = "41"
    rows[3][3] = "kept"
    assert worked_table_mismatches(rows) == [0, 3]


def cited_rules(text: str) -> set[str]:
    """Rule labels a source cites: ``rule R6``, ``rules W1, S1``, ``rules
    R1-R6`` (a range cites every label in it)."""
    cited: set[str] = set()
    for match in re.finditer(
        r"[Rr]ules? ((?:[A-Z]+\d)(?:(?:, | and |-)[A-Z]+\d)*)", text
    ):
        cited |= set(re.findall(r"[A-Z]+\d", match.group(1)))
        for prefix, lo, hi in re.findall(r"([A-Z]+)(\d)-[A-Z]+(\d)", match.group(1)):
            cited |= {f"{prefix}{n}" for n in range(int(lo), int(hi) + 1)}
    return cited


def test_every_rule_is_labelled_where_the_code_applies_it() -> None:
    rules = _doc_rules()
    assert len(rules) >= 20, rules
    cited: set[str] = set()
    for path in (ROOT / "vllm_dcp_geometry").rglob("*.py"):
        cited |= cited_rules(path.read_text())
    assert sorted(rules - cited) == []
    assert sorted(cited - rules) == []


def test_the_label_check_reads_ranges_and_catches_a_missing_rule() -> None:
    assert cited_rules("rules R1-R3 and rule W2; rules A1, A3") == {
        "R1",
        "R2",
        "R3",
        "W2",
        "A1",
        "A3",
    }
    assert "C1" in _doc_rules()
    assert "C1" not in cited_rules("contract rule R7 only")
