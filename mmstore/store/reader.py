"""Reading stores: ``mmstore.open(path) -> Store``.

NOTE [fork safety]: a ``Store`` holds only plain data (paths, the parsed
manifest, small numpy arrays) plus per-process handles that it creates on
first use and tags with the pid that created them. After ``fork`` the child
sees a different pid and opens its own mappings/environment (an LMDB
environment must never be used across fork); pickling keeps the path and
options only, so DataLoader workers under fork, forkserver and spawn all
work, including when the parent read from the store first.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from .._os.proc import current_pid
from ..errors import EntryDecodeError, FormatError, MmstoreError, StoreChangedError
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PART_TABLE_FILE,
    PARTIAL_SUFFIX,
    decode_key,
    note_identity,
    open_store_file,
)
from ..format.manifest import expand_with_table, read_manifest, read_part_table
from ..format.parttable import PART_TABLE_HEAD_BYTES, PartTable, check_part_table_head, decode_part_table
from ..format.ragged import read_ragged
from ..format.schema import Schema
from ..format.shaped import decode_shaped, read_shaped
from ..remote.url import is_url, local_path
from .backends import BackendReader, data_file_names, open_backend
from .backends.base import check_npy
from .bookkeeping import check_index, check_key_offsets
from .slots import SlotView
from .spans import RecordSpans

if TYPE_CHECKING:
    from ..remote.replica import Pin, Replica

__all__ = ["Store", "open_store"]

_OPEN_TRIES = 8  # tries of an open whose store is replaced under it (NOTE [open during an overwrite])
_PUBLISH_WAIT_S = 0.002  # x the try number: the wait for a publish by two renames to finish
_DIR_FLAGS = os.O_DIRECTORY | os.O_CLOEXEC | getattr(os, "O_PATH", os.O_RDONLY)


def _pin_dir(path: str) -> int | None:
    """A descriptor of the directory ``path`` names now (``O_PATH``: no
    permission on it is needed), or None when it names none."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError:
        return None


def _names_dir(path: str, dir_fd: int) -> bool:
    """``path`` still names the directory ``dir_fd`` holds."""
    try:
        now, pinned = os.stat(path), os.fstat(dir_fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (pinned.st_dev, pinned.st_ino)


_FOLLOW = threading.Lock()  # one Store switches to a grown store at a time (NOTE [a reader of a grown store])


def _new_follow_lock() -> None:
    global _FOLLOW
    _FOLLOW = threading.Lock()  # a child forked while another thread held it


os.register_at_fork(after_in_child=_new_follow_lock)


_FOLLOW_TRIES = 8  # reads of a Store that meets stores replaced by appends again and again


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _View(NamedTuple):
    """What a ``Store`` presents: its slots, records and label names, of a
    store of this schema (its JSON form) and backend (NOTE [a reader of a
    grown store])."""

    slots: int
    records: int
    label_names: list[str] | None
    schema: Any
    backend: str


def _grown(m: dict[str, Any], store_id: str | None, view: _View) -> bool:
    """The store of manifest ``m`` holds the records of ``view`` (the first
    ``view.slots`` slots of a store of the same schema and backend, its label
    names first): it is the store ``store_id`` grown by appends (format.py,
    "Parts": ``provenance.appended``' ``to_store`` ids), or (``store_id``
    None) it is any store that holds them."""
    if store_id is not None:
        prov = m.get("provenance")
        appended = prov.get("appended") if isinstance(prov, dict) else None
        if not isinstance(appended, list) or not any(
                isinstance(e, dict) and e.get("to_store") == store_id for e in appended):
            return False
    names = m.get("label_names")
    old = view.label_names
    return (m["backend"] == view.backend and m["schema"] == view.schema and m["slots"] >= view.slots
            and m["records"] >= view.records
            and (old is None or (isinstance(names, list) and names[: len(old)] == old)))


def _publishing(path: str) -> bool:
    """No ``path``, but a finished ``path.partial``: a publish is between its two renames (or was stopped there)."""
    return not os.path.lexists(path) and os.path.isfile(os.path.join(path + PARTIAL_SUFFIX, MANIFEST_FILE))


class Store:
    """A finished store, opened read-only. Use :func:`mmstore.open`.

    Indexing follows the dataset order (holes excluded): ``store[i]`` is a dict
    ``{field: array}``; ``store[a:b]``, ``store[index_array]`` and
    :meth:`read_batch` return batched arrays in the requested order.

    ``store.slot_view`` (:class:`~mmstore.store.slots.SlotView`) is the
    low-level view for tools: slots, their checksums and keys, the backend.

    A store opened from a URL (``mmstore.open("s3://...")``) is the same
    object over its local replica (``store.replica``, :mod:`mmstore.remote.replica`;
    ``store.path`` is the replica's directory, ``store.url`` the URL): each
    read first makes the blocks it touches present (fetched and verified)
    and pins them until its bytes are copied out.
    """

    replica: Replica | None = None
    follows = 0  # grown stores followed (NOTE [a reader of a grown store])

    def __init__(self, path: str | os.PathLike[str], *, lmdb_readahead: bool | None = None,
                 replica: Replica | None = None) -> None:
        self.replica = replica
        self._open(path, lmdb_readahead, {} if replica is None else replica.identities(), None)

    def _open(
        self, path: str | os.PathLike[str], lmdb_readahead: bool | None,
        ident: dict[str, tuple[int, int, int, int]], store_id: str | None, view: _View | None = None,
    ) -> None:
        """Open (``ident`` and ``store_id`` empty) or reopen in another process
        (they are the opener's: the files must be the ones it opened; ``view``:
        the records the opener reads, NOTE [a reader of a grown store]).

        NOTE [open during an overwrite]: another process may replace the
        store at this path while it is opened (format.py, "Replacing a
        store"). Each try pins the directory the path names, reads the
        manifest inside it and checks the files; it counts only if the path
        still names that directory at the end (then every file it looked at
        by path was that directory's). Otherwise, or if a check failed
        while the path no longer named it, the store was replaced meanwhile:
        try again on the new one, ``_OPEN_TRIES`` times in all."""
        self.path = os.path.abspath(os.fspath(path))
        self._lmdb_readahead = lmdb_readahead
        why: BaseException | None = None
        for attempt in range(1, _OPEN_TRIES + 1):
            pin = _pin_dir(self.path)
            if pin is None:  # nothing there, or not a directory
                if attempt < _OPEN_TRIES and _publishing(self.path):
                    time.sleep(_PUBLISH_WAIT_S * attempt)  # a publish by two renames: STORE is back soon
                    continue
                read_manifest(self.path)  # raises the error that says what is there
                continue  # a store appeared just now: open it
            try:
                try:
                    self._load(pin, dict(ident), store_id, view)
                except Exception as exc:  # noqa: BLE001 - re-raised unless the store was replaced meanwhile
                    if _names_dir(self.path, pin):
                        raise
                    why = exc
                else:
                    if _names_dir(self.path, pin):
                        break
                    why = None
            finally:
                os.close(pin)
        else:
            raise StoreChangedError(
                f"{self.path}: the store kept being replaced while it was being opened ({_OPEN_TRIES} tries): "
                "another process is overwriting it (`mmstore ingest --overwrite` or a StoreWriter with "
                "overwrite=True at this path); open it again once that writer is done"
            ) from why
        self._pid = -1
        self._backend: BackendReader | None = None
        self._maps: dict[str, tuple[mmap.mmap | None, int]] = {}  # bookkeeping file -> (mapping, size)
        self._index: np.ndarray | None = None
        self._key_offsets: np.ndarray | None = None
        self._key_blob: Any = None
        self._item: Callable[[int], dict[str, Any]] | None = None  # this process's one-record reader
        self._spans: dict[tuple[str, ...], RecordSpans] = {}  # a store from a URL: where fields lie, by fields

    def _load(self, dir_fd: int, ident: dict[str, tuple[int, int, int, int]], store_id: str | None,
              view: _View | None) -> None:
        """One try of ``_open``: the manifest of the directory ``dir_fd`` and
        the checks of its files."""
        # as written: a store with a part table lists its parts there, read
        # when first needed (NOTE [lazy parts]); ``manifest`` expands it
        self._m: dict[str, Any] = read_manifest(self.path, dir_fd=dir_fd, expand=False)
        self._full: dict[str, Any] | None = None if self._m["part_table"] is not None else self._m
        self._table: PartTable | None = None
        m = self._m
        if store_id is not None and m["store_id"] != store_id:
            if view is None or self.replica is not None or not _grown(m, store_id, view):
                raise StoreChangedError(
                    f"{self.path}: the store was replaced since it was opened (store id {store_id} -> "
                    f"{m['store_id']}); reopen it"
                )
            ident = {}  # the grown store's files, noted as they are checked below
        # the manifest this Store reads (NOTE [a reader of a grown store]); a directory's inode alone is not
        # enough: a store replaced twice may get the first one's inode number back
        self._manifest_ident = _identity(os.stat(MANIFEST_FILE, dir_fd=dir_fd))
        self.backend_name: str = m["backend"]
        slots, records, names = int(m["slots"]), int(m["records"]), m["label_names"]
        if view is not None and (view.slots, view.records) != (slots, records):
            if not _grown(m, None, view):
                raise StoreChangedError(f"{self.path}: the store has {records} records in {slots} slots, "
                                        f"not the {view.records} in {view.slots} it was opened with; reopen it")
            slots, records, names = view.slots, view.records, view.label_names
        # path -> identity (device, inode, size, mtime) of every file, taken at
        # open: whatever this Store maps later, in any process, must be these
        # files (see format.py, "Reading a store from someone else")
        self._ident = ident
        schema = Schema(m["schema"], classes=m["classes"], buckets=m["buckets"], label_names=names)
        self._check_files(schema)
        # published once the files are checked: a Store read by other threads while it follows a grown store
        # never shows them the grown store's counts (NOTE [a reader of a grown store])
        self.schema, self.slots, self.records, self.label_names = schema, slots, records, names

    def _this_view(self) -> _View:
        """The records this Store presents (what a reopen must present again)."""
        return _View(self.slots, self.records, self.label_names, self._m["schema"], self.backend_name)

    def follow_append(self) -> bool:
        """Read through the store at this Store's path from now on when it is
        the store this Store opened, grown by appends since; True if so.

        NOTE [a reader of a grown store]: an append (format.py, "Parts")
        replaces the store at its path by a new one that holds every slot of
        the old one, the same bytes in the same part files, and more slots
        after them. A reader keeps reading the files it has open; a file it
        opens later by its path (a field it had not read, the keys, the
        list of holes; everything, in a ``Store`` opened but not read yet or
        in a DataLoader worker started after the append, by fork, forkserver
        or spawn) is the new store's, whose identity differs from the one
        noted at open: ``StoreChangedError``. The Store's reads catch that,
        call this, and try once more: the same records through the new
        store, cut to the slots, records and label names it was opened with
        (an append keeps them: old label numbers unchanged, new names after
        the old). It does not see the new records (open the store again for
        them). A store replaced by anything else than an append of the one
        this Store opened is not followed: the error stands. Also checked
        once per process before its first read (a ``stat`` of the
        manifest)."""
        return self._follow(self.follows)

    def _follow(self, seen: int) -> bool:
        """``follow_append`` for a read that failed when this Store had
        followed ``seen`` grown stores: True at once when another thread has
        followed one since (the read is to be tried again)."""
        if self.replica is not None:
            return False
        with _FOLLOW:
            if self.follows != seen:
                return True
            try:
                if _identity(os.stat(os.path.join(self.path, MANIFEST_FILE))) == self._manifest_ident:
                    return False
                if not _grown(read_manifest(self.path, expand=False), self._m["store_id"], self._this_view()):
                    return False
            except (OSError, MmstoreError):
                return False  # moved, deleted, or not a store now: the error that brought us here stands
            # the backend made so far stays with whoever reads through it (its files stay open until then)
            self._open(self.path, self._lmdb_readahead, {}, self._m["store_id"], self._this_view())
            self.follows += 1
            return True

    @property
    def manifest(self) -> dict[str, Any]:
        """The parsed manifest; a store with a part table's with its parts
        listed as in 2.2 (``parts``, ``segments`` and each part's files in
        ``files``; made from the table on first access, O(parts))."""
        if self._full is None:
            self._full = expand_with_table(self._m, self._part_table(), os.path.join(self.path, PART_TABLE_FILE))
        return self._full

    @property
    def segments(self) -> list[int] | None:
        """Slot counts of the data segments (a merged store), or None: one segment."""
        return self._m["segments"] if self._m["part_table"] is None else self._part_table().counts()

    @property
    def parts(self) -> list[str] | None:
        """The segments' part ids (a store joined from parts, see format.py "Parts"), or None."""
        return self._m["parts"] if self._m["part_table"] is None else self.manifest["parts"]

    @property
    def part_count(self) -> int:
        """How many segments (parts) the store's data has, in O(1): 1 for a store of one segment."""
        pt = self._m["part_table"]
        return int(pt["parts"]) if pt is not None else len(self._m["segments"] or [0])

    def _part_table(self) -> PartTable:
        """The store's part table, read and checked whole on first use
        (NOTE [lazy parts]): the file this Store was opened with."""
        if self._table is None:
            raw = read_part_table(self.path, self._m, ident=self._ident)
            self._table = decode_part_table(
                raw, parts=self._m["part_table"]["parts"], files_per_part=self._files_per_part(),
                slots=self._m["slots"], digest=self._m["digests"][PART_TABLE_FILE],
                path=os.path.join(self.path, PART_TABLE_FILE))
        return self._table

    def _files_per_part(self) -> int:
        return len(data_file_names(self.backend_name, self.schema))

    # -- opening ------------------------------------------------------------------
    def _check_files(self, schema: Schema) -> None:
        """NOTE [lazy parts]: a store with a part table is opened in O(1):
        the table's head and size are checked here, the whole table (digest,
        every rule) before its first use, and each part's files (existence,
        sizes, headers) when that part is first read (``SegmentedBackend``);
        ``verify`` checks them all. Any other store's files are all checked
        here."""
        m = self._m
        files = m["files"]
        slots, records, backend_name = int(m["slots"]), int(m["records"]), str(m["backend"])
        lazy = m["part_table"] is not None
        needed = [PART_TABLE_FILE] if lazy else data_file_names(backend_name, schema, m["segments"], m["parts"])
        needed += [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
        holes = records < slots
        if holes:
            needed += [INDEX_FILE, ERRORS_FILE]
        elif ERRORS_FILE in files:  # no holes, but skipped annotations (format.py: errors.jsonl)
            needed += [ERRORS_FILE]
        for name in needed:
            if name not in files:
                raise FormatError(f"{self.path}/manifest.json: 'files' does not list {name}, which a "
                                  f"{backend_name} store needs")
        extra = set(files) - set(needed)
        if extra:
            raise FormatError(f"{self.path}/manifest.json: 'files' lists unexpected file(s) {sorted(extra)}")
        if lazy:
            self._check_table_head(schema)
        else:
            backend = open_backend(backend_name, self.path, schema, slots, files, m["segments"], m["parts"],
                                   ident=self._ident)
            backend.check()
        j = lambda n: os.path.join(self.path, n)  # noqa: E731
        self._ck_offset = self._check_npy(CHECKSUMS_FILE, (slots,))
        self._ko_offset = self._check_npy(KEYS_OFFSETS_FILE, (slots + 1,))
        blob_size = self._stat(KEYS_BLOB_FILE)
        if blob_size != files[KEYS_BLOB_FILE]:
            raise FormatError(
                f"{j(KEYS_BLOB_FILE)}: expected {files[KEYS_BLOB_FILE]} bytes, found {blob_size}; "
                "the file was truncated or extended"
            )
        fd = open_store_file(j(KEYS_OFFSETS_FILE), missing=f"{j(KEYS_OFFSETS_FILE)}: missing, but the manifest "
                             "lists it; the store is damaged", ident=self._ident)
        try:
            last = int.from_bytes(os.pread(fd, 8, self._ko_offset + 8 * slots), "little")
        finally:
            os.close(fd)
        if last != blob_size:
            raise FormatError(
                f"{j(KEYS_OFFSETS_FILE)}: the last offset is {last} but {KEYS_BLOB_FILE} has "
                f"{blob_size} bytes; the key files are from different stores or damaged"
            )
        if holes:
            self._ix_offset = self._check_npy(INDEX_FILE, (records,))
        if ERRORS_FILE in needed and self._stat(ERRORS_FILE) != files[ERRORS_FILE]:
            raise FormatError(f"{j(ERRORS_FILE)}: size differs from the manifest's {files[ERRORS_FILE]} bytes")
        if not holes and os.path.lexists(j(INDEX_FILE)):
            raise FormatError(f"{j(INDEX_FILE)}: present, but the manifest says the store has no holes")

    def _check_table_head(self, schema: Schema) -> None:
        """The part table's size and head against the manifest, in O(1)."""
        path = os.path.join(self.path, PART_TABLE_FILE)
        fd = open_store_file(path, missing=f"{path}: missing, but the manifest lists it; the store is damaged: "
                             "restore the file from a copy or write the store again", ident=self._ident)
        try:
            st = os.fstat(fd)
            note_identity(self._ident, path, st)
            head = os.pread(fd, PART_TABLE_HEAD_BYTES, 0)
        finally:
            os.close(fd)
        if st.st_size != self._m["files"][PART_TABLE_FILE]:
            raise FormatError(f"{path}: expected {self._m['files'][PART_TABLE_FILE]} bytes (the manifest's size), "
                              f"found {st.st_size}: the file was truncated or extended; restore the store from a "
                              "copy or write it again")
        check_part_table_head(head, st.st_size, self._m["part_table"]["parts"],
                              len(data_file_names(self._m["backend"], schema)), path)

    def _check_npy(self, name: str, shape: tuple[int, ...]) -> int:
        path = os.path.join(self.path, name)
        return check_npy(path, KEY_DTYPE, shape, self._m["files"][name], self._ident)

    def _stat(self, name: str) -> int:
        """The size of bookkeeping file ``name`` (a regular file; its identity noted)."""
        path = os.path.join(self.path, name)
        fd = open_store_file(path, missing=f"{path}: missing, but the manifest lists it; the store is damaged",
                             ident=self._ident)
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        note_identity(self._ident, path, st)
        return st.st_size

    def _b(self) -> BackendReader:
        pid = os.getpid()
        if self._backend is None or self._pid != pid:
            self.follow_append()
            m = self._m
            table = self._part_table() if m["part_table"] is not None else None
            self._backend = open_backend(
                self.backend_name, self.path, self.schema, m["slots"], m["files"], m["segments"],
                m["parts"], table=table, ident=self._ident, readahead=self._lmdb_readahead,
            )
            self._pid = pid
            self._maps = {}
            self._item = None
            self._spans = {}
            self._index = None
            self._key_offsets = None
            self._key_blob = None
        return self._backend

    def _map_file(self, name: str) -> mmap.mmap | None:
        """Map bookkeeping file ``name`` (None when empty): the file this
        Store was opened with, or ``StoreChangedError``."""
        path = os.path.join(self.path, name)
        size = int(self._m["files"][name])
        fd = open_store_file(path, missing=f"{path}: missing; the store was moved or deleted while open",
                             ident=self._ident)
        try:
            note_identity(self._ident, path, os.fstat(fd))
            mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        self._maps[name] = (mm, size)
        return mm

    def _check_mapped(self, name: str) -> None:
        """See NOTE [truncated under a mapping] (backends/memmap.py)."""
        mm, size = self._maps.get(name, (None, 0))
        if mm is not None and mm.size() < size:
            raise StoreChangedError(
                f"{self.path}/{name}: truncated to {mm.size()} bytes while the store was open (expected "
                f"{size}); the store was modified in use: reopen it, or run `mmstore verify`"
            )

    def _map_npy(self, name: str, offset: int, count: int) -> np.ndarray:
        mm = self._map_file(name)
        if count == 0 or mm is None:
            return np.zeros(0, KEY_DTYPE)
        return np.frombuffer(mm, dtype=KEY_DTYPE, count=count, offset=offset)

    def _slot_index(self) -> np.ndarray | None:
        """dataset index -> slot (a mapped ``<u8`` array), or None when identity."""
        self._b()
        if self.records == self.slots:
            return None
        ix = self._index
        if ix is None:
            ix = self._map_npy(INDEX_FILE, self._ix_offset, self.records)
            check_index(os.path.join(self.path, INDEX_FILE), ix, self.slots)
            self._index = ix
        return ix

    # -- pickling / lifetime ----------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "lmdb_readahead": self._lmdb_readahead, "store_id": self._m["store_id"],
                "ident": dict(self._ident), "replica": self.replica, "view": self._this_view()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # reopened in the receiving process: the same store, the same files (or, grown by an append
        # since, the same records: NOTE [a reader of a grown store])
        self.replica = state.get("replica")
        self._open(state["path"], state["lmdb_readahead"], dict(state.get("ident", {})), state["store_id"],
                   state.get("view"))

    @property
    def url(self) -> str | None:
        """The URL the store was opened from, or None for a local store."""
        return None if self.replica is None else self.replica.url

    def _pin(self, slots: np.ndarray, names: Sequence[str]) -> Pin | None:
        """A store from a URL: make the blocks that reading ``slots`` of
        ``names`` touches present, and pin them (release after the copy);
        None when this process holds them all pinned already."""
        rep = cast("Replica", self.replica)
        if rep.pinned_whole():
            return None
        backend = self._b()
        key = tuple(names)
        spans = self._spans.get(key)
        if spans is None:
            spans = self._spans[key] = RecordSpans(backend, self.schema, names)
        return rep.acquire(rep.blocks_of(spans(slots)))

    def close(self) -> None:
        """Release this process's mappings and environment."""
        if self._backend is not None and self._pid == os.getpid():
            self._backend.close()
        self._backend = None
        self._maps = {}
        self._item = None
        self._spans = {}
        self._index = self._key_offsets = self._key_blob = None
        if self.replica is not None:
            self.replica.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.path if self.replica is None else self.replica.url
        return f"<mmstore.Store {where!r} {self.backend_name} records={self.records} {self.schema!r}>"

    # -- basic info ------------------------------------------------------------
    def __len__(self) -> int:
        return self.records

    @property
    def fields(self) -> tuple[str, ...]:
        """Field names in schema order."""
        return self.schema.names

    @property
    def store_id(self) -> str:
        return str(self._m["store_id"])

    @property
    def provenance(self) -> dict[str, Any]:
        return dict(self._m["provenance"])

    def data_paths(self) -> list[str]:
        """Every file of the store but the manifest (for warm/evict)."""
        return [os.path.join(self.path, n) for n in self.manifest["files"]]

    # -- indices ------------------------------------------------------------------
    def _as_indices(self, indices: Any) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype == bool:
            raise TypeError("boolean masks are not supported; pass np.flatnonzero(mask)")
        if idx.ndim != 1:
            idx = idx.reshape(-1)
        if idx.size and idx.dtype.kind not in "iu":
            raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
        n = self.records
        if idx.size and idx.dtype.kind == "u" and int(idx.max()) >= n:  # before the cast wraps 2**64-1 to -1
            raise IndexError(f"index {int(idx.max())} is out of range for a store of {n} records")
        idx = idx.astype(np.int64, copy=True)
        neg = idx < 0
        if neg.any():
            idx[neg] += n
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = np.asarray(indices).reshape(-1)[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"index {int(bad)} is out of range for a store of {n} records")
        return idx

    def _slots_of(self, indices: Any) -> np.ndarray:
        """Slots of dataset indices (int64)."""
        idx = self._as_indices(indices)
        ix = self._slot_index()
        if ix is None:
            return idx
        self._check_mapped(INDEX_FILE)
        return ix[idx].astype(np.int64)

    # -- reads --------------------------------------------------------------------
    def __getitem__(self, item: Any) -> dict[str, np.ndarray]:
        if type(item) is int or (isinstance(item, (int, np.integer)) and not isinstance(item, bool)):
            seen = self.follows
            try:
                return self._read_one(int(item))
            except StoreChangedError:  # NOTE [a reader of a grown store]
                if not self._follow(seen):
                    raise
            return self.across_appends(self._read_one, int(item))
        if isinstance(item, slice):
            return self.read_batch(np.arange(*item.indices(self.records)))
        if isinstance(item, str):
            raise TypeError(f"use store.column({item!r}) for a whole field")
        return self.read_batch(item)

    def _read_one(self, i: int) -> dict[str, np.ndarray]:
        """``store[i]``: see NOTE [one-record path] (backends/base.py)."""
        n = self.records
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise IndexError(f"index {i} is out of range for a store of {n} records")
        read = self._item
        if read is None or self._pid != current_pid():  # first use, or a forked child (no system call per sample)
            read = self._item = self._b().item_reader()
        if n != self.slots:
            ix = self._slot_index()
            self._check_mapped(INDEX_FILE)
            j = int(ix[j])  # type: ignore[index]
        pin = self._pin(np.array([j]), self.schema.names) if self.replica is not None else None
        if pin is not None:
            with pin:
                return self._read_slot(read, j)
        return self._read_slot(read, j)

    def _read_slot(self, read: Callable[[int], dict[str, np.ndarray]], j: int) -> dict[str, np.ndarray]:
        try:
            rec = read(j)
            for f in self.schema.shaped_fields:  # the backend gave the stored entry: decoded at its size
                rec[f.name] = decode_shaped(f, rec[f.name], rec[f.hw_name], j)
            return rec
        except EntryDecodeError as exc:
            located = self._located(exc)
            if located is exc:
                raise
            raise located from None

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        step = 256
        for a in range(0, self.records, step):
            batch = self.read_batch(np.arange(a, min(a + step, self.records)))
            for j in range(len(next(iter(batch.values())))):
                yield {k: v[j] for k, v in batch.items()}

    def field_list(self, fields: Sequence[str] | str | None) -> list[str]:
        """The field names ``fields`` selects (None: all, in schema order; a
        name; or a sequence of names), each checked to be in the schema."""
        if fields is None:
            return list(self.schema.names)
        if isinstance(fields, str):
            fields = [fields]
        for f in fields:
            if f not in self.schema:
                raise KeyError(f"no field {f!r}; fields are {list(self.schema.names)}")
        return list(fields)

    def _data_offset(self, name: str) -> int:
        """Where the array of bookkeeping file ``name`` starts in it (the size
        of its ``.npy`` header): ``_checksums.npy``, ``_keys_offsets.npy``, and
        ``_index.npy`` when the store has holes. Checked at open."""
        offsets = {CHECKSUMS_FILE: self._ck_offset, KEYS_OFFSETS_FILE: self._ko_offset,
                   INDEX_FILE: getattr(self, "_ix_offset", None)}
        off = offsets.get(name)
        if off is None:
            raise KeyError(f"{name}: not a bookkeeping array of this store")
        return off

    def read_batch(
        self,
        indices: Any,
        fields: Sequence[str] | str | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Read records ``indices`` (any order, duplicates, negatives).

        Reads happen in ascending slot order (locality); results come back in
        the requested order.

        Parameters
        ----------
        indices
            Integer dataset indices.
        fields
            Field names to read (default: all).
        out
            Optional ``{field: array}`` of shape ``(len(indices), *shape)``,
            the field's dtype, C-contiguous and writable (e.g. a pinned host
            buffer's numpy view); filled in place and returned.

        Returns
        -------
        dict
            ``{field: array of shape (len(indices), *shape)}``; a ragged
            field (variable length, ``str``, ``bytes``) as a
            :class:`~mmstore.format.ragged.Ragged`: one flat array of every record's
            rows plus their offsets (``.split()`` gives the list); a field of
            images of their own shape (shape ``(None, None, C)``) as a list
            of arrays of ``(h, w, C)``, one per record, in the requested order.

        Raises
        ------
        TypeError
            ``out`` names a ragged field or an image field of its own
            shape: such a batch has no one shape to fill.

        Notes
        -----
        Without ``out`` every call returns new arrays, the caller's to keep:
        a batch of 256 images of 224x224x3 is a new 38 MB allocation, which
        the kernel zeroes page by page as the copy first touches it, so that
        path runs well below the rate of ``out=`` into a buffer allocated once
        (``benchmarks/bench_read.py`` compares them). To
        read many batches, allocate the buffers once and pass them as ``out``
        (reuse them only once you are done with the previous batch), or use
        ``mmstore.torch.Loader``, which manages reused (pinned) buffers. For
        one record at a time, ``store[i]`` is cheaper still than a batch of
        one (NOTE [one-record path], backends/base.py).
        """
        return self.across_appends(self._read_batch, indices, fields, out)

    def across_appends(self, read: Callable[..., Any], *args: Any) -> Any:
        """``read(*args)``, and again, each time it met a file of a store that
        an append has replaced, once this Store follows that (``follow_append``,
        or another thread's follow meanwhile: NOTE [a reader of a grown
        store]); ``_FOLLOW_TRIES`` tries at most."""
        for _ in range(_FOLLOW_TRIES - 1):
            seen = self.follows
            try:
                return read(*args)
            except StoreChangedError:
                if not self._follow(seen):
                    raise
        return read(*args)  # appended to again and again meanwhile: the error of this try stands

    def _read_batch(self, indices: Any, fields: Sequence[str] | str | None,
                    out: dict[str, np.ndarray] | None) -> dict[str, Any]:
        names = self.field_list(fields)
        slots = self._slots_of(indices)
        n = len(slots)
        result: dict[str, Any] = {}
        ragged = [name for name in names if self.schema[name].ragged]
        lists: dict[str, list[Any]] = {}
        shaped = [name for name in ragged if self.schema[name].shaped]
        if shaped and out is not None and any(name in out for name in shaped):
            raise TypeError(f"out= takes fixed-shape fields only; field(s) {[r for r in shaped if r in out]} hold "
                            "images of their own shape, returned as a list of arrays (leave them out of out)")
        hw_extra = [self.schema[name].hw_name for name in shaped if self.schema[name].hw_name not in names]
        if ragged:
            if out is not None and any(name in out for name in ragged):
                raise TypeError(f"out= takes fixed-shape fields only; ragged field(s) "
                                f"{[r for r in ragged if r in out]} are returned as Ragged (leave them out of out)")
            names = [name for name in names if name not in ragged] + hw_extra  # sizes of the shaped fields
            if n and self._b().ragged_lists:  # one pass: entries collected with the fixed fields
                lists = {name: [b""] * n for name in ragged}
        for name in names:
            f = self.schema[name]
            if out is not None and name in out:
                buf = out[name]
                if not isinstance(buf, np.ndarray):
                    raise TypeError(f"out[{name!r}] must be a numpy array, got {type(buf).__name__}")
                if buf.shape != (n, *f.shape) or buf.dtype != f.dtype:
                    raise ValueError(
                        f"out[{name!r}] must have shape {(n, *f.shape)} and dtype {f.dtype.str}, "
                        f"got {buf.shape} {buf.dtype.str}"
                    )
                if not buf.flags.c_contiguous or not buf.flags.writeable:
                    raise ValueError(f"out[{name!r}] must be C-contiguous and writable")
                result[name] = buf
            else:
                result[name] = np.empty((n, *f.shape), f.dtype)
        if n:
            if n > 1 and np.any(slots[1:] < slots[:-1]):
                rows = np.argsort(slots, kind="stable")
                sorted_slots = slots[rows]
            else:
                rows = np.arange(n)
                sorted_slots = slots
            pin = self._pin(sorted_slots, [*names, *ragged]) if self.replica is not None else None
            try:
                if names or lists:
                    # a ragged field's list rides along for a backend with ragged_lists (BackendReader.ragged_lists)
                    both = cast("dict[str, np.ndarray]", {**result, **lists})
                    self._read_into(sorted_slots, rows, names + list(lists), both)
                for name in ragged:
                    f = self.schema[name]
                    if f.shaped:
                        result[name] = read_shaped(self, name, slots, sorted_slots, rows, result[f.hw_name],
                                                   lists.get(name))
                    else:
                        result[name] = read_ragged(self, name, slots, sorted_slots, rows, lists.get(name))
            finally:
                if pin is not None:
                    pin.release()
        else:
            for name in ragged:
                result[name] = [] if self.schema[name].shaped else \
                    read_ragged(self, name, slots, slots, slots, lists.get(name))
        return {name: result[name] for name in self.field_list(fields)}

    def _read_into(self, slots: np.ndarray, rows: np.ndarray, names: Sequence[str],
                   out: dict[str, np.ndarray]) -> None:
        """The backend's ``read_into``; a bad encoded entry's error gets the
        record's dataset index and source key."""
        try:
            self._b().read_into(slots, rows, names, out)
        except EntryDecodeError as exc:
            located = self._located(exc)
            if located is exc:
                raise
            raise located from None

    def _located(self, exc: EntryDecodeError) -> EntryDecodeError:
        """``exc`` with the record's dataset index and source key added, when
        it names a slot (else ``exc`` itself)."""
        return exc if exc.slot is None else self._entry_error(exc, exc.slot)

    def _entry_error(self, exc: EntryDecodeError, slot: int) -> EntryDecodeError:
        ix = self._slot_index()
        if ix is None:
            index: int | None = slot
        else:
            at = int(np.searchsorted(ix, slot))
            index = at if at < len(ix) and int(ix[at]) == slot else None
        try:
            key = decode_key(self._slot_key_bytes(slot))
        except (FormatError, IndexError):
            key = "?"
        field = exc.field if exc.field is not None else "?"
        return EntryDecodeError(
            f"{self.path}: record {index} (slot {slot}, key {key!r}): field {field!r} cannot be decoded: "
            f"{exc.reason}. Run `mmstore verify --decode {self.path}` to list every bad entry, then repair "
            "(`mmstore verify --repair`) or re-create the store",
            field=exc.field, slot=slot, index=index, key=key, reason=exc.reason,
        )

    def _entry_sizes(self, name: str, indices: Any = None) -> np.ndarray:
        """Stored (encoded) bytes of variable-size field ``name`` for dataset
        ``indices`` (default: every record), int64, from the offsets index
        (no entry is read). For a raw field every size is its entry's bytes."""
        f = self.schema[name]
        idx = np.arange(self.records) if indices is None else indices
        slots = self._slots_of(idx)
        if not f.variable:
            return np.full(len(slots), f.nbytes, np.int64)
        return self._b().entry_sizes(name, slots)

    def stored_record_bytes(self, fields: Sequence[str] | str | None = None) -> int:
        """Mean bytes one record of ``fields`` (default: all) occupies on disk:
        a raw field's entry size, a variable-size field's stored (encoded) data
        divided by the records. O(1) where the backend knows its entries' total
        from the manifest's file sizes (memmap,
        ``BackendReader.stored_entry_bytes``); otherwise the entries are
        measured on a sample of up to 4,096 records (lmdb). What read-ahead windows and block sizes are sized by;
        the decoded size is ``schema[f].nbytes``."""
        total = 0.0
        for name in self.field_list(fields):
            f = self.schema[name]
            if not f.variable:
                total += f.nbytes
            elif self.records:
                total += self._mean_entry_bytes(name)
        return max(1, round(total))

    def _mean_entry_bytes(self, name: str) -> float:
        total = self._b().stored_entry_bytes(name)
        if total is not None:
            return total / self.records
        n = min(self.records, 4096)
        idx = np.random.default_rng(0).choice(self.records, n, replace=False) if n < self.records else None
        return float(self._entry_sizes(name, idx).mean())

    def column(self, name: str) -> np.ndarray:
        """A whole field in dataset order (a copy; cheap for small fields)."""
        return self.read_batch(np.arange(self.records), fields=[name])[name]

    # -- keys and bookkeeping -------------------------------------------------------
    def _keys(self) -> tuple[np.ndarray, Any]:
        self._b()
        offs, blob = self._key_offsets, self._key_blob
        if offs is None or blob is None:
            offs = self._map_npy(KEYS_OFFSETS_FILE, self._ko_offset, self.slots + 1)
            check_key_offsets(os.path.join(self.path, KEYS_OFFSETS_FILE), offs)
            blob = self._map_file(KEYS_BLOB_FILE) or b""
            self._key_blob, self._key_offsets = blob, offs
        self._check_mapped(KEYS_OFFSETS_FILE)
        self._check_mapped(KEYS_BLOB_FILE)
        return offs, blob

    def _slot_key_bytes(self, slot: int) -> bytes:
        """Raw key bytes of ``slot`` (holes included)."""
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} is out of range for {self.slots} slots")
        offs, blob = self._keys()
        a, b = int(offs[slot]), int(offs[slot + 1])
        if not 0 <= a <= b <= len(blob):
            raise FormatError(f"{self.path}/{KEYS_OFFSETS_FILE}: bad offsets {a}..{b} for slot {slot}")
        return bytes(blob[a:b])

    def key(self, i: int) -> str:
        """The source key (path or id) of dataset index ``i``."""
        return str(self.across_appends(lambda: decode_key(self._slot_key_bytes(int(self._slots_of([i])[0])))))

    def skipped(self) -> list[dict[str, Any]]:
        """The skipped inputs (``errors.jsonl``): slot, key, reason.

        Raises ``FormatError`` for a line that is not such an object (the file
        is read only up to the size the manifest lists)."""
        return list(self.across_appends(self._skipped))

    def _skipped(self) -> list[dict[str, Any]]:
        if self.records == self.slots:
            return []
        mm = self._map_file(ERRORS_FILE)
        self._check_mapped(ERRORS_FILE)
        data = bytes(mm) if mm is not None else b""
        out = []
        for lineno, line in enumerate(data.split(b"\n"), 1):
            if not line.strip():
                continue
            where = f"{self.path}/{ERRORS_FILE}: line {lineno}"
            try:
                ent = json.loads(line.decode("utf-8", "surrogateescape"))
            except (ValueError, RecursionError) as exc:  # ValueError: bad JSON, or a > 4,300-digit integer
                raise FormatError(f"{where} is not JSON ({exc}); the file is damaged") from None
            if isinstance(ent, dict) and "annotation" in ent:
                continue  # a skipped annotation, not a hole (format.py)
            slots = int(self._m["slots"])
            if not (
                isinstance(ent, dict)
                and isinstance(ent.get("slot"), int) and not isinstance(ent["slot"], bool)
                and 0 <= ent["slot"] < slots
                and isinstance(ent.get("key"), str) and isinstance(ent.get("reason"), str)
            ):
                raise FormatError(
                    f"{where}: expected {{\"slot\": 0..{slots - 1}, \"key\": str, \"reason\": str}}, "
                    f"found {line[:200]!r}; the file is damaged"
                )
            if ent["slot"] < self.slots:  # (a grown store's view: its own holes only)
                out.append(ent)
        return out

    def skipped_annotations(self) -> list[dict[str, Any]]:
        """The skipped annotations of an annotated ingest (COCO): the
        ``errors.jsonl`` lines with an ``annotation`` key (format.py), in
        file order; ``[]`` for other stores."""
        return list(self.across_appends(self._skipped_annotations))

    def _skipped_annotations(self) -> list[dict[str, Any]]:
        if ERRORS_FILE not in self._m["files"]:
            return []
        mm = self._map_file(ERRORS_FILE)
        self._check_mapped(ERRORS_FILE)
        out = []
        for lineno, line in enumerate((bytes(mm) if mm is not None else b"").split(b"\n"), 1):
            if b'"annotation"' not in line:
                continue
            try:
                ent = json.loads(line.decode("utf-8", "surrogateescape"))
            except (ValueError, RecursionError) as exc:
                raise FormatError(f"{self.path}/{ERRORS_FILE}: line {lineno} is not JSON ({exc}); the file is "
                                  "damaged") from None
            if isinstance(ent, dict) and "annotation" in ent and not (
                    isinstance(ent.get("slot"), int) and ent["slot"] >= self.slots):  # (a grown store's view)
                out.append(ent)
        return out

    def _checksums(self) -> np.ndarray:
        """The stored per-slot checksums (a mapped ``<u8`` array)."""
        return self._map_npy(CHECKSUMS_FILE, self._ck_offset, self.slots)

    # -- page cache -------------------------------------------------------------
    def warm(
        self,
        *,
        progress: Any = None,
        max_fraction: float | None = 0.9,
        chunk_bytes: int = 16 << 20,
        stop_event: Any = None,
    ) -> Any:
        """Pull the store into the page cache with one sequential pass.

        Files are read smallest first (bookkeeping, then the data files). When
        the store does not fit in ``max_fraction`` of the available memory
        the pass stops where the budget runs out; the returned
        ``mmstore._os.WarmReport`` then says ``complete=False`` and why.
        ``progress(bytes_done, bytes_planned)`` is called after each chunk.

        A store opened from a URL first fetches every block its cache limit
        allows into the replica (in file order, verified), then warms that.
        """
        from .. import _os

        if self.replica is not None:
            self.replica.fill()
        paths = sorted(self.data_paths(), key=lambda p: (os.path.getsize(p), p))
        return _os.warm(paths, chunk_bytes=chunk_bytes, progress=progress,
                         max_fraction=max_fraction, stop_event=stop_event)

    def evict(self, *, sync: bool = False) -> None:
        """Drop the store's files from the page cache (``POSIX_FADV_DONTNEED``;
        a hint: pages mapped by other processes, dirty pages and tmpfs stay)."""
        from .. import _os

        for p in self.data_paths() + [os.path.join(self.path, "manifest.json")]:
            _os.evict(p, sync=sync)

    # -- the slot-level view ------------------------------------------------------
    @property
    def slot_view(self) -> SlotView:
        """The store seen slot by slot, for tools (:class:`~mmstore.store.slots.SlotView`).

        A new small object at each access that refers to this store; the store
        keeps no reference to it, so a store dropped by its last user still
        releases its mappings and environment at once (no reference cycle)."""
        return SlotView(self)


def open_store(path: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
               cache_limit: int | str | None = None, **kw: Any) -> Store:
    """Open the store at ``path`` read-only: a local directory (or a
    ``file://`` URL), or a URL in object storage (``s3://BUCKET/PREFIX``,
    ``gs://``, ``az://``, ``http(s)://``) of a store put there by ``mmstore push``.

    Reads and validates the manifest and checks every file's exact size and
    header; reads no record data, so it costs the same for 1,000 or 10
    million records.

    A URL is read through a local replica under ``cache_dir`` (default
    ``MMSTORE_CACHE_DIR``, else ``~/.cache/mmstore``): the store's own files,
    filled block by block as reads need them, each block verified against the
    digests the push recorded; at most ``cache_limit`` bytes of disk (an int,
    or a size like ``"200GB"``; default: no limit, and a store that is fully
    cached stays so for the next run and other processes). Needs
    ``pip install 'mmstore[remote]'``.

    Raises
    ------
    IncompleteStoreError
        No store there, or an unfinished one (no manifest).
    VersionError
        Written by another major format version.
    FormatError
        Damaged or inconsistent manifest or files.
    RemoteError
        A URL whose bucket, store or credentials are wrong, or whose server
        does not answer (its kinds in :mod:`mmstore.errors`).
    """
    if is_url(path):
        from ..remote.replica import open_replica  # the client is imported only for a URL

        replica = open_replica(os.fspath(path), cache_dir=cache_dir, cache_limit=cache_limit)
        try:
            return Store(replica.store_dir, replica=replica, **kw)
        except BaseException:
            replica.close()
            raise
    if cache_dir is not None or cache_limit is not None:
        raise TypeError(f"{os.fspath(path)!r}: cache_dir and cache_limit are for stores opened from a URL")
    return Store(local_path(path), **kw)
