"""The part table (``_parts.bin``, format 2.4, see "The part table" in
:mod:`mmstore.format`): a store's parts as a few flat arrays in one binary
file instead of JSON entries per part.

:func:`encode_part_table` builds its bytes; :func:`check_part_table_head`
checks its 32-byte head and size against the manifest in O(1) (what an open
does); :func:`decode_part_table` checks the whole file (digest first, then
every rule) and returns a :class:`PartTable` of numpy arrays. Every byte is
untrusted: each check raises ``FormatError`` saying what was expected, what
was found, and what to do."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import FormatError
from .layout import (
    MAX_STORE_BYTES,
    PART_ID_MAX,
    PART_ID_RE,
    PART_TABLE_MAGIC,
    field_file,
    lmdb_file,
    variable_files,
)

__all__ = ["PART_TABLE_HEAD_BYTES", "PartTable", "check_part_table_head", "decode_part_table", "encode_part_table",
           "check_unique_ids", "part_data_names", "part_table_bytes", "part_table_max_bytes"]

PART_TABLE_HEAD_BYTES = 32
_U8 = np.dtype("<u8")
# the bytes a part id may hold (PART_ID_RE): letters, digits, '_', '.', '-'; its first a letter or digit
_ID_FIRST_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_ID_CHARS = _ID_FIRST_CHARS + b"_.-"
_ID_BYTE = np.zeros(256, bool)
_ID_BYTE[list(_ID_CHARS)] = True
_ID_FIRST = np.zeros(256, bool)
_ID_FIRST[list(_ID_FIRST_CHARS)] = True
_REDO = "; the part table is damaged or not this store's: restore the store from a copy or write it again"


def part_data_names(backend: str, schema: Sequence[tuple[str, object, tuple[object, ...], object]]) -> list[str]:
    """The data files of one part, in the order of the table's columns: the
    names an unsegmented store of that backend and (parsed) schema has,
    schema order (memmap: ``<field>.npy``, or ``<field>.bin`` then
    ``<field>.offsets.npy`` for a variable-size field; lmdb: ``records.mdb``)."""
    if backend != "memmap":
        return [lmdb_file()]
    out: list[str] = []
    for name, _, shape, codec in schema:
        variable = shape[:1] == (None,) or not getattr(codec, "raw", True)
        out += list(variable_files(name)) if variable else [field_file(name)]
    return out


def part_table_bytes(parts: int, files_per_part: int, id_bytes: int) -> int:
    """The exact size of a part table of ``parts`` parts of ``files_per_part``
    data files whose ids take ``id_bytes`` bytes in all (unbounded ints)."""
    return PART_TABLE_HEAD_BYTES + 8 * parts * (2 + files_per_part) + id_bytes


def part_table_max_bytes(parts: int, files_per_part: int) -> int:
    """The most bytes the part table of ``parts`` parts can have (every id of
    the longest length): what a reader reads of it at most."""
    return part_table_bytes(parts, files_per_part, PART_ID_MAX * parts)


class PartTable:
    """A decoded, checked part table: ``ends[k]`` the end (exclusive) of part
    ``k``'s slots, ``sizes[k]`` the sizes of its data files (in the order of
    the backend's ``data_file_names``), its id :meth:`id`."""

    __slots__ = ("count", "ends", "files_per_part", "firsts", "id_blob", "id_ends", "sizes")

    def __init__(self, ends: np.ndarray, sizes: np.ndarray, id_ends: np.ndarray, id_blob: bytes) -> None:
        self.count = len(ends)
        self.files_per_part = sizes.shape[1]
        self.ends = ends
        self.sizes = sizes
        self.id_ends = id_ends
        self.id_blob = id_blob
        # each part's first slot, then the slot count (int64: slots fit, MAX_STORE_BYTES)
        self.firsts = np.concatenate([np.zeros(1, np.int64), ends.astype(np.int64)])

    def id(self, k: int) -> str:
        """Part ``k``'s id (its bytes were checked against ``PART_ID_RE`` on decode)."""
        a = int(self.id_ends[k - 1]) if k else 0
        return self.id_blob[a : int(self.id_ends[k])].decode("ascii")

    def ids(self) -> list[str]:
        """Every part id, in order (O(parts) strings: for whole-store tools)."""
        text = self.id_blob.decode("ascii")
        cuts = [0, *self.id_ends.tolist()]
        return [text[a:b] for a, b in zip(cuts, cuts[1:])]

    def counts(self) -> list[int]:
        """Each part's slot count, in order."""
        return np.diff(self.firsts).tolist()


def encode_part_table(ids: Sequence[str], counts: Sequence[int], sizes: Sequence[Sequence[int]]) -> bytes:
    """The bytes of the part table of parts ``ids`` with slot ``counts`` and
    data file ``sizes`` (one row per part, the same number of files each)."""
    n = len(ids)
    if n == 0 or len(counts) != n or len(sizes) != n:
        raise ValueError(f"a part table needs one count and one row of sizes per part: {n} ids, {len(counts)} "
                         f"counts, {len(sizes)} rows")
    width = len(sizes[0])
    if any(len(r) != width for r in sizes):
        raise ValueError("every part has the same data files: the rows of sizes differ in length")
    raw_ids = [p.encode("ascii") for p in ids]
    for p in ids:
        if not PART_ID_RE.match(p):
            raise ValueError(f"part id {p!r} does not match {PART_ID_RE.pattern}")
    ends = np.cumsum(np.asarray(counts, np.int64), dtype=np.int64).astype(_U8)
    blob = b"".join(raw_ids)
    id_ends = np.cumsum([len(b) for b in raw_ids], dtype=np.int64).astype(_U8)
    head = PART_TABLE_MAGIC + np.array([n, width, len(blob)], _U8).tobytes()
    return b"".join([head, ends.tobytes(), np.asarray(sizes, _U8).reshape(n, width).tobytes(), id_ends.tobytes(),
                     blob])


def check_part_table_head(head: bytes, size: int, parts: int, files_per_part: int, path: str) -> int:
    """Check the first ``PART_TABLE_HEAD_BYTES`` of a part table whose file
    has ``size`` bytes against the manifest's count of ``parts`` and the
    ``files_per_part`` the backend and schema give; return the bytes of its
    ids. O(1): what an open checks."""
    if len(head) < PART_TABLE_HEAD_BYTES or head[:8] != PART_TABLE_MAGIC:
        raise FormatError(f"{path}: expected a part table starting with {PART_TABLE_MAGIC!r} and at least "
                          f"{PART_TABLE_HEAD_BYTES} bytes, found {bytes(head[:8])!r} in {len(head)} bytes" + _REDO)
    n, width, id_bytes = (int(v) for v in np.frombuffer(head, _U8, 3, 8))
    if n != parts:
        raise FormatError(f"{path}: the table holds {n} parts, the manifest says {parts}" + _REDO)
    if width != files_per_part:
        raise FormatError(f"{path}: the table lists {width} data files per part, a store of this backend and "
                          f"schema has {files_per_part}" + _REDO)
    if id_bytes > PART_ID_MAX * parts or id_bytes < parts:
        raise FormatError(f"{path}: the table claims {id_bytes} bytes of part ids, but {parts} ids of 1 to "
                          f"{PART_ID_MAX} characters take {parts} to {PART_ID_MAX * parts}" + _REDO)
    want = part_table_bytes(parts, files_per_part, id_bytes)
    if size != want:
        what = "truncated" if size < want else "longer than its contents"
        raise FormatError(f"{path}: expected {want} bytes for {parts} parts of {files_per_part} files with "
                          f"{id_bytes} bytes of ids, found {size}: the file is {what}" + _REDO)
    return id_bytes


def decode_part_table(raw: bytes | bytearray | memoryview, *, parts: int, files_per_part: int, slots: int,
                      digest: str, path: str) -> PartTable:
    """Check the whole part table ``raw`` (its head and size, its xxh3_64
    ``digest`` from the manifest, then every rule of the format) and return
    it decoded (its arrays are views of ``raw``). ``FormatError`` names the
    first rule broken."""
    import xxhash  # at call time: ``import mmstore`` needs numpy alone

    mv = memoryview(raw).cast("B")
    id_bytes = check_part_table_head(bytes(mv[:PART_TABLE_HEAD_BYTES]), len(mv), parts, files_per_part, path)
    got = xxhash.xxh3_64(mv).hexdigest()
    if got != digest:
        raise FormatError(f"{path}: its digest is {got}, the manifest says {digest}: the table was changed or "
                          "damaged after the store was written" + _REDO)
    n, w = parts, files_per_part
    at = PART_TABLE_HEAD_BYTES
    ends = np.frombuffer(mv, _U8, n, at)
    sizes = np.frombuffer(mv, _U8, n * w, at + 8 * n).reshape(n, w)
    id_ends = np.frombuffer(mv, _U8, n, at + 8 * n * (1 + w))
    blob = mv[at + 8 * n * (2 + w) :]
    if int(ends[-1]) != slots:
        raise FormatError(f"{path}: the parts end at slot {int(ends[-1])}, the manifest says {slots} slots" + _REDO)
    # unsigned compares: a value past the last (slots) is above it, so below a later one
    if n > 1 and bool(np.any(ends[1:] < ends[:-1])):
        k = int(np.flatnonzero(ends[1:] < ends[:-1])[0]) + 1
        raise FormatError(f"{path}: part {k} ends at slot {int(ends[k])}, before part {k - 1} (slot "
                          f"{int(ends[k - 1])}): the parts' slots must be consecutive, in order" + _REDO)
    if w and int(sizes.max()) > MAX_STORE_BYTES:
        k = int(np.argmax(sizes.max(axis=1)))
        raise FormatError(f"{path}: part {k} claims a data file of {int(sizes[k].max())} bytes, more than any store "
                          f"file may have ({MAX_STORE_BYTES})" + _REDO)
    # each id 1 to PART_ID_MAX bytes: the ends rise by that much (unsigned: a fall wraps to a huge step)
    steps = np.diff(id_ends, prepend=np.zeros(1, _U8))
    if int(id_ends[-1]) != id_bytes or bool(np.any(steps - np.uint64(1) >= np.uint64(PART_ID_MAX))):
        raise FormatError(f"{path}: the part ids' ends must rise by 1 to {PART_ID_MAX} each and end at the {id_bytes} "
                          "bytes of ids the table claims" + _REDO)
    ids = bytes(blob)
    arr = np.frombuffer(ids, np.uint8)
    firsts = arr[id_ends[:-1]] if n > 1 else arr[:0]
    # bytes.translate deletes the allowed bytes at C speed: what is left is not allowed
    if ids.translate(None, _ID_CHARS) or not bool(_ID_FIRST[arr[0]]) or not bool(_ID_FIRST[firsts].all()):
        bad = np.flatnonzero(~_ID_BYTE[arr])
        k = (int(np.searchsorted(id_ends, int(bad[0]), side="right")) if len(bad)
             else 0 if not _ID_FIRST[arr[0]] else int(np.flatnonzero(~_ID_FIRST[firsts])[0]) + 1)
        a = int(id_ends[k - 1]) if k else 0
        raise FormatError(f"{path}: part {k}'s id {ids[a : int(id_ends[k])]!r} is not a part id (letters, "
                          f"digits, '_', '.', '-'; up to {PART_ID_MAX} characters, starting with a letter or digit)"
                          + _REDO)
    return PartTable(ends, sizes, id_ends, ids)


def check_unique_ids(table: PartTable, path: str) -> list[str]:
    """Every id of ``table``, checked to appear once (O(parts) strings: what
    whole-store tools and the expansion into a manifest check)."""
    ids = table.ids()
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(p for p in ids if p in seen or seen.add(p))  # type: ignore[func-returns-value]
        raise FormatError(f"{path}: part id {dup!r} appears twice; each part appears once" + _REDO)
    return ids

