"""Skipped-record accounting: :class:`DataError` for strict mode, :class:`SkipReport` for lenient mode.

Every part of the data pipeline that meets bad input (a reader that cannot finish a file, a
decoder that meets malformed JSON, a formatter that finds a missing field) calls
``report.add(reason, location, detail, n)``. In strict mode that raises a :class:`DataError`
naming the location (``file:line``, ``file!member:line`` inside a tar) and the reason; in lenient
mode the skip is counted under its reason and the first ``keep`` locations are kept as examples.

Counts are of *records*. ``n`` is how many records one skip lost: 1 for a bad record, the number
of records a refused tar member holds, the rows a corrupt Parquet file still owed (its footer
says how many it has). Where it cannot be known — a gzip or tar stream cut short loses whatever
followed the cut — ``n=None`` counts the event under ``unknown[reason]``, and the text says so;
such a report is never mistaken for "no records skipped". ``n=0`` is a problem that cost no
record (an empty data file): it is counted per occurrence under ``notes[reason]``, and a report
holding only notes still does not read "no records skipped". Reports merge (per chunk -> per
shard -> per cache) and serialise to JSON (:meth:`to_dict`), which is how the token cache keeps
them with each shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DataError", "SkipReport"]


class DataError(ValueError):
    """A bad record or file; the message names the location (file:line) and the reason."""


@dataclass
class SkipReport:
    """Records skipped per reason (``counts``), losses of unknown size (``unknown``), examples.

    ``strict=True`` turns the first :meth:`add` into a :class:`DataError`.
    """

    strict: bool = True
    keep: int = 5
    counts: dict[str, int] = field(default_factory=dict)
    unknown: dict[str, int] = field(default_factory=dict)  # reason -> events that lost an unknown number
    notes: dict[str, int] = field(default_factory=dict)  # reason -> events that lost no record (empty files)
    examples: dict[str, list[str]] = field(default_factory=dict)
    unread: dict[str, list] = field(default_factory=dict)  # field -> [records, first location]

    def add(self, reason: str, location: str, detail: str = "", n: int | None = 1) -> None:
        """Record one skip that lost ``n`` records (``None``: an unknown number; 0: none, a note)."""
        msg = f"{location}: {reason}" + (f": {detail}" if detail else "")
        if self.strict:
            raise DataError(msg + " (use lenient mode to skip and count such records)")
        if n == 0:
            self.notes[reason] = self.notes.get(reason, 0) + 1
        else:
            self.counts[reason] = self.counts.get(reason, 0) + (n or 0)
        if n is None:
            self.unknown[reason] = self.unknown.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < self.keep:
            ex.append(msg)

    def add_unread(self, location: str, fields) -> None:
        """Count record fields the format did not read (never raises; see the module docstring)."""
        for f in fields:
            u = self.unread.setdefault(f, [0, location])
            u[0] += 1

    def unread_text(self) -> str:
        """One line naming the unread fields, or ''."""
        if not self.unread:
            return ""
        names = sorted(self.unread)
        parts = [f"{f!r} in {self.unread[f][0]} record(s), first at {self.unread[f][1]}" for f in names]
        return (f"fields the format does not read, left out of training: {'; '.join(parts)} (map them into the "
                f"record's layout, or --ignore-fields {','.join(names)} to silence this)")

    @property
    def total(self) -> int:
        """Records known to be skipped (see ``unknown`` for losses that could not be counted)."""
        return sum(self.counts.values())

    @property
    def n_unknown(self) -> int:
        return sum(self.unknown.values())

    def __bool__(self) -> bool:  # anything skipped or noted at all, counted or not
        return bool(self.counts or self.unknown or self.notes)

    def merge(self, other: SkipReport | dict) -> None:
        d = other.to_dict() if isinstance(other, SkipReport) else other
        for reason, n in d.get("counts", {}).items():
            self.counts[reason] = self.counts.get(reason, 0) + n
        for reason, n in d.get("unknown", {}).items():
            self.unknown[reason] = self.unknown.get(reason, 0) + n
        for reason, n in d.get("notes", {}).items():
            self.notes[reason] = self.notes.get(reason, 0) + n
        for reason, ex in d.get("examples", {}).items():
            mine = self.examples.setdefault(reason, [])
            mine.extend(ex[: max(0, self.keep - len(mine))])
        for f, (n, where) in d.get("unread", {}).items():
            u = self.unread.setdefault(f, [0, where])
            u[0] += n

    def to_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "unknown": dict(self.unknown), "notes": dict(self.notes),
                "examples": {k: list(v) for k, v in self.examples.items()},
                "unread": {k: list(v) for k, v in self.unread.items()}}

    def __str__(self) -> str:
        unread = self.unread_text()
        if unread:
            return self._skips() + "\n" + unread
        return self._skips()

    def _skips(self) -> str:
        if not self:
            return "no records skipped"
        head = f"{self.total} records skipped"
        if self.unknown:
            head += f", and an unknown number more in {self.n_unknown} place(s) that could not be read to the end"
        if self.notes:
            head += f"; {sum(self.notes.values())} problem(s) that lost no record"
        lines = [head + ":"]
        for reason in sorted(set(self.counts) | set(self.unknown)):
            n, u = self.counts.get(reason, 0), self.unknown.get(reason, 0)
            unknown = f"an unknown number ({u} place{'s' if u > 1 else ''})"
            lines.append(f"  {reason}: " + (f"{n} + {unknown}" if n and u else unknown if u else f"{n}"))
            lines.extend(f"    {e}" for e in self.examples.get(reason, []))
        for reason in sorted(self.notes):
            k = self.notes[reason]
            lines.append(f"  {reason}: {k} (no records lost)")
            lines.extend(f"    {e}" for e in self.examples.get(reason, []))
        return "\n".join(lines)
