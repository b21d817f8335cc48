# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-dcp-geometry project
"""What a ``replay`` or ``simulate`` run found: one ``Violations`` for both.

A violation has a kind (``replay``'s categories, ``simulate``'s kinds), the
step, a message, and where it was found as far as known: the group, the
request, the position and the rank. ``Violations`` counts them by kind and by
(group, kind), keeps the first of each (kind, group) in detail (at most
``MAX_REPORTED``) and the earliest of all (by step, then position).

Each command writes the detailed ones into its JSON report with its own keys,
in its own order, as it always has (``ItemSchema``): ``replay``'s items are
``category, group, step, position, message``; ``simulate``'s are ``kind,
step, group, request, position, rank, message``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

MAX_REPORTED = 50
"""Violations kept in detail per run; the rest are only counted."""


@dataclass(frozen=True)
class Violation:
    """One violation found."""

    kind: str
    message: str
    step: int
    group: str | None = None
    request: str | None = None
    position: int | None = None
    rank: int | None = None


@dataclass(frozen=True)
class ItemSchema:
    """How one command writes a violation into its JSON report."""

    kind_key: str
    """The JSON key of the violation's kind."""
    fields: tuple[str, ...]
    """The ``Violation`` fields written, in order (``kind`` under
    ``kind_key``)."""

    def record(self, violation: Violation) -> dict[str, Any]:
        return {
            (self.kind_key if name == "kind" else name): getattr(violation, name)
            for name in self.fields
        }


@dataclass
class Violations:
    """Counts by kind and by (group, kind), the earliest violation (by step,
    then position), and the first of each (kind, group) in detail."""

    schema: ItemSchema
    counts: Counter = field(default_factory=Counter)
    by_group: Counter = field(default_factory=Counter)
    found: list[Violation] = field(default_factory=list)
    """The first of each (kind, group), at most ``MAX_REPORTED``."""
    earliest: Violation | None = None
    _seen: set[tuple[str, str | None]] = field(default_factory=set)

    def add(
        self,
        kind: str,
        message: str,
        *,
        step: int,
        count: int = 1,
        group: str | None = None,
        position: int | None = None,
        request: str | None = None,
        rank: int | None = None,
    ) -> None:
        """Record ``count`` violations of ``kind`` (one in detail)."""
        self.counts[kind] += count
        self.by_group[(group, kind)] += count
        violation = Violation(kind, message, step, group, request, position, rank)
        if self.earliest is None or _order(violation) < _order(self.earliest):
            self.earliest = violation
        if (kind, group) in self._seen or len(self.found) >= MAX_REPORTED:
            return
        self._seen.add((kind, group))
        self.found.append(violation)

    @property
    def items(self) -> list[dict[str, Any]]:
        """The detailed violations, as the command's report writes them."""
        return [self.schema.record(v) for v in self.found]

    @property
    def first(self) -> dict[str, Any] | None:
        """The earliest violation, as the command's report writes it."""
        return None if self.earliest is None else self.schema.record(self.earliest)


def _order(violation: Violation) -> tuple[int, int]:
    position = violation.position
    return (violation.step, -1 if position is None else position)
