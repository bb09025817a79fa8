"""The report objects of ``verify``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_LISTED", "BadRecord", "Problem", "VerifyReport"]

MAX_LISTED = 100_000  # bad records kept in a report (all are counted)


@dataclass
class Problem:
    """One structural finding. ``kind``: manifest, missing, stray, size,
    header, digest, keys, index, errors, hole, lmdb, lmdb-keys (the
    number of LMDB keys differs from the records), lmdb-damaged (reading an
    LMDB file failed or killed the reader), symlink (a symbolic link in the
    store), not-regular (a store file that is a FIFO, directory, device ...),
    backend (the backend cannot work here), read, offsets (an encoded
    field's offsets index: each problem names the field, and the slot and
    key of each bad entry), part-table (the part table of a store of many
    parts: its size, digest or a rule it breaks; nothing of the parts is
    checked then)."""

    kind: str
    message: str
    file: str | None = None


@dataclass
class BadRecord:
    """A slot whose bytes are wrong. ``index`` is the dataset index (None for
    a hole); ``what``: ``checksum``, ``missing`` (lmdb: no key), ``size``
    (lmdb value of the wrong length), ``hole-not-zero``, ``hole-has-record``,
    ``extra-key`` (lmdb key outside the slots; ``slot`` may then be -1),
    ``unreadable`` (lmdb: reading the record failed or killed the reader),
    ``offsets`` (an encoded entry's offsets are out of order or past the end
    of its ``.bin``), ``decode`` (``--decode``: an encoded entry does not
    decode with its field's codec; ``found`` is the codec's reason)."""

    slot: int
    index: int | None
    key: str
    what: str
    expected: str = ""
    found: str = ""


@dataclass
class VerifyReport:
    path: str
    store_id: str | None = None
    backend: str | None = None
    records: int = 0
    slots: int = 0
    quick: bool = False
    content_checked: bool = False
    problems: list[Problem] = field(default_factory=list)
    bad_records: list[BadRecord] = field(default_factory=list)
    bad_count: int = 0
    checked_slots: int = 0
    checked_bytes: int = 0
    seconds: float = 0.0
    threads: int = 0
    note: str | None = None
    repair: Any = None  # a RepairReport when --repair ran
    remote: Any = None  # a store URL's objects against its index (check.verify_remote.RemoteVerifyReport)

    _json_extra = ("ok", "mb_per_s")

    @property
    def ok(self) -> bool:
        return not self.problems and self.bad_count == 0

    @property
    def mb_per_s(self) -> float:
        return self.checked_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def summary(self) -> str:
        if self.ok:
            what = "structure" if not self.content_checked else f"structure and {self.checked_slots:,} slots"
            return f"OK: {what} verified"
        parts = []
        if self.problems:
            parts.append(f"{len(self.problems)} structural problem(s)")
        if self.bad_count:
            parts.append(f"{self.bad_count:,} bad record(s)")
        return "FAILED: " + ", ".join(parts)
