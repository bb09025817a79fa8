"""Writing stores: ``StoreWriter`` (one process) and ``SlotWriter`` (workers).

A writer fills ``PATH.partial/``: preallocated slot files written with
``pwrite`` at each slot's offset (never through a memory map: a full disk
then gives a clean ``ENOSPC``/``EFBIG`` error instead of SIGBUS), plus
``_checksums.npy``. On a clean close it writes keys, index and errors, the
manifest last, and renames the directory to ``PATH`` (see ``format.py``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from .._os.crash import crash_point
from .._os.io import (
    atomic_write,
    check_space,
    copy_range,
    fallocate,
    fsync_dir,
    fsync_file,
    hasher,
    pwrite_all,
    record_checksum,
)
from .._os.lock import acquire_lock, release_lock
from .._version import __version__
from ..errors import DestinationError, SchemaError, StoreExistsError
from ..format import layout as _layout  # PART_TABLE_MIN_PARTS read at call time
from ..format.codecs import library_versions
from ..format.layout import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_FILE,
    ERRORS_FILE,
    FORMAT_NAME,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PART_TABLE_FEATURE,
    PART_TABLE_FILE,
    PARTIAL_SUFFIX,
    PARTS_FEATURE,
    RAGGED_FEATURE,
    REPLACED_INFIX,
    SHAPES_FEATURE,
    SUPPORTED_BACKENDS,
    decode_key,
    encode_key,
    manifest_version,
    npy_header,
    part_file,
)
from ..format.manifest import read_manifest
from ..format.names import json_bytes, json_text
from ..format.schema import Schema, coerce_rows
from .backends import SlotFile, backend_class
from .backends.base import check_npy, checksum_parts
from .dest import check_dest, is_own_partial, is_store, make_partial, remove_replaced
from .spill import Spill, sync_spills

__all__ = ["SlotWriter", "StoreWriter", "WRITER_STATE_FILE", "acquire_lock", "file_digest", "publish", "release_lock"]

WRITER_STATE_FILE = "_writer.json"
_UNSET, _WRITTEN, _HOLE = 0, 1, 2
_GROW_MIN_SLOTS = 1024
# Inside ``SlotWriter.combined``: slot files of at most this many bytes a slot (labels, boxes, sizes, the
# checksums) are gathered and written in one call per run of consecutive slots, of at most _COMBINE_BYTES.
_COMBINE_STRIDE = 4096
_COMBINE_BYTES = 1 << 20


class SlotWriter:
    """Writes records at their slots into an existing ``.partial`` directory.

    This is what ingest worker processes use: pixels go straight from the
    decoder to the file at the slot's offset, never through a pipe. Each
    ``write`` also stores the record's checksum. Not thread-safe per instance;
    any number of instances (processes) may write disjoint slots at once.

    Parameters
    ----------
    partial_dir
        A directory created by :class:`StoreWriter`.
    """

    def __init__(self, partial_dir: str, _state: dict[str, Any] | None = None) -> None:
        self.partial_dir = partial_dir
        if _state is None:
            with open(os.path.join(partial_dir, WRITER_STATE_FILE), "rb") as fh:
                _state = json.loads(fh.read())
        self.schema = Schema.from_json(_state["schema"], os.path.join(partial_dir, WRITER_STATE_FILE))
        self.backend = _state["backend"]
        self.capacity = int(_state["capacity"])
        self.layout: list[SlotFile] = backend_class(self.backend).write_layout(self.schema)
        self.layout.append(SlotFile(CHECKSUMS_FILE, KEY_DTYPE, (), 8, {}))
        self._fds: list[int] = []
        self._offsets: list[int] = []
        self._where: dict[str, tuple[int, int, int]] = {}
        for i, sf in enumerate(self.layout):
            path = os.path.join(partial_dir, sf.name)
            self._fds.append(os.open(path, os.O_RDWR))
            self._offsets.append(len(npy_header(sf.dtype, (0, *sf.entry_shape))))
            for name, inner in sf.fields.items():
                self._where[name] = (i, inner, self.schema[name].nbytes)
        self._zeros = b""
        self._spill = Spill(partial_dir)  # encoded entries (see mmstore/store/spill.py)
        self._runs: dict[int, tuple[int, bytearray]] | None = None  # file -> (offset, bytes) in combined()

    @contextmanager
    def combined(self) -> Iterator[SlotWriter]:
        """Gather the writes of small slot files (at most 4 KiB a slot) and
        of the encoded entries made inside the block, and write them in one
        call per file when it ends (or a run reaches 1 MiB): a range of
        records costs a few system calls beside its large fields instead of
        several a record. The data is in the files when the block ends, not
        before; a block left by an exception writes nothing more (its range
        is written again when the run resumes)."""
        if self._runs is not None:
            raise RuntimeError("SlotWriter.combined() is already active")
        self._runs = {}
        self._spill.hold()
        try:
            yield self
            self._flush_runs()
            self._spill.flush()
        finally:
            self._runs = None
            self._spill.release()

    def _put(self, i: int, data: Any, offset: int) -> None:
        """Write ``data`` (a buffer) to slot file ``i`` at ``offset``, now or
        in its file's run (see :meth:`combined`)."""
        runs = self._runs
        if runs is None or self.layout[i].stride > _COMBINE_STRIDE:
            pwrite_all(self._fds[i], data, offset)
            return
        run = runs.get(i)
        if run is not None and run[0] + len(run[1]) == offset:
            run[1].extend(memoryview(data).cast("B"))
            if len(run[1]) >= _COMBINE_BYTES:
                del runs[i]
                pwrite_all(self._fds[i], run[1], run[0])
            return
        if run is not None:
            pwrite_all(self._fds[i], run[1], run[0])
        runs[i] = (offset, bytearray(memoryview(data).cast("B")))

    def _flush_runs(self) -> None:
        runs = self._runs or {}
        while runs:
            i, (offset, data) = runs.popitem()
            pwrite_all(self._fds[i], data, offset)

    def write(self, slot: int, sample: Mapping[str, Any]) -> int:
        """Validate ``sample`` and write it at ``slot``; return its checksum."""
        try:
            arrays = self.schema.validate(sample)
        except SchemaError as exc:
            raise SchemaError(f"record at slot {slot}: {exc}") from None
        return self.write_arrays(slot, arrays)

    def write_arrays(self, slot: int, arrays: Mapping[str, np.ndarray]) -> int:
        """Write already validated C-contiguous arrays (see ``Schema.validate``);
        variable-size fields are encoded here, with their field's codec."""
        for f in self.schema.shaped_fields:
            hw = tuple(int(v) for v in np.asarray(arrays[f.hw_name]).reshape(-1))
            if hw != tuple(arrays[f.name].shape[:2]):
                raise SchemaError(f"record at slot {slot}: field {f.hw_name!r} says {list(hw)}, but the image of "
                                  f"field {f.name!r} is {list(arrays[f.name].shape[:2])} (h, w); leave "
                                  f"{f.hw_name!r} out, it is filled from the image")
        entries = {f.name: f.codec.encode(arrays[f.name]) for f in self.schema.variable_fields}
        return self.write_encoded(slot, arrays, entries)

    def write_encoded(self, slot: int, arrays: Mapping[str, Any], entries: Mapping[str, Any]) -> int:
        """Write ``slot`` from validated arrays of its fixed fields and the
        stored (encoded) bytes of its variable-size fields, as they are (a
        convert or a repair that keeps the encoded bytes); return its checksum
        (format.py, "Checksums")."""
        self._check_slot(slot)
        for f in self.schema.fixed_fields:
            i, inner, nb = self._where[f.name]
            if nb:
                self._put(i, arrays[f.name], self._offsets[i] + slot * self.layout[i].stride + inner)
        for v, f in enumerate(self.schema.variable_fields):
            self._spill.add(slot, v, entries[f.name])
        ck = record_checksum(checksum_parts(self.schema, arrays, entries))
        self._put(len(self._fds) - 1, int(ck).to_bytes(8, "little"), self._offsets[-1] + 8 * slot)
        return ck

    def write_batch(self, start: int, arrays: Mapping[str, Any]) -> np.ndarray:
        """Write ``len`` consecutive records from ``start``; ``arrays[field]``
        has shape ``(n, *shape)``. Returns the n checksums (uint64).

        Values are validated per field as a whole (same rules as ``write``).
        Data goes out in blocks of about 64 MiB, so memory stays bounded.
        """
        names = self.schema.names
        extra = [k for k in arrays if k not in self.schema]
        if extra:
            raise SchemaError(f"unknown field(s) {extra}; the schema has {list(names)}")
        arrays = dict(arrays)
        for f in self.schema.shaped_fields:  # the companion (h, w) field is filled from the images
            if f.hw_name not in arrays and f.name in arrays:
                arrays[f.hw_name] = [np.asarray(a).shape[:2] for a in arrays[f.name]]
        missing = [k for k in names if k not in arrays]
        if missing:
            raise SchemaError(f"batch lacks field(s) {missing}")
        cols = {k: list(arrays[k]) if self.schema[k].ragged else np.asarray(arrays[k]) for k in names}
        first = cols[names[0]]
        n = len(first) if isinstance(first, list) or first.ndim else -1
        for f in self.schema:
            c = cols[f.name]  # a list for a ragged field
            if (not isinstance(c, list) and c.ndim == 0) or len(c) != n:
                raise SchemaError(f"field {f.name!r}: every field needs the same number of rows ({n})")
        if n == 0:
            return np.zeros(0, np.uint64)
        self._check_slot(start)
        self._check_slot(start + n - 1)
        if self.schema.has_variable:
            return self._write_rows(start, n, cols)
        rb = self.schema.record_bytes
        step = max(1, (64 << 20) // max(rb, 1))
        sums = np.zeros(n, np.uint64)
        import xxhash

        h = xxhash.xxh3_64_intdigest
        for a in range(0, n, step):
            b = min(n, a + step)
            packed = np.empty((b - a, rb), np.uint8)
            for f, off in zip(self.schema, self.schema.offsets):
                col = coerce_rows(f, cols[f.name][a:b])
                if f.nbytes:
                    packed[:, off : off + f.nbytes] = col.reshape(b - a, -1).view(np.uint8)
                    i, inner, nb = self._where[f.name]
                    if self.layout[i].stride == nb:  # one file per field: one block write
                        pwrite_all(self._fds[i], col, self._offsets[i] + (start + a) * nb)
            if len(self.layout[0].fields) > 1:  # packed records (lmdb staging)
                pwrite_all(self._fds[0], packed, self._offsets[0] + (start + a) * rb)
            for j in range(b - a):
                sums[a + j] = h(packed[j].data)
            pwrite_all(self._fds[-1], sums[a:b].astype("<u8"), self._offsets[-1] + 8 * (start + a))
        return sums

    def _write_rows(self, start: int, n: int, cols: Mapping[str, Any]) -> np.ndarray:
        """``write_batch`` of a schema with variable-size fields: validated a
        block of rows at a time, encoded and written row by row."""
        sums = np.zeros(n, np.uint64)
        step = max(1, (64 << 20) // max(1, sum(f.nbytes for f in self.schema)))
        for a in range(0, n, step):
            b = min(n, a + step)
            try:
                block = {f.name: coerce_rows(f, cols[f.name][a:b]) for f in self.schema}
            except SchemaError as exc:
                raise SchemaError(f"records at slots {start + a}..{start + b - 1}: {exc}") from None
            for j in range(b - a):
                sums[a + j] = self.write_arrays(start + a + j, {k: v[j] for k, v in block.items()})
        return sums

    def zero(self, slot: int) -> None:
        """Make ``slot`` a hole: zero bytes, checksum 0."""
        self._check_slot(slot)
        for i, sf in enumerate(self.layout):
            if len(self._zeros) < sf.stride:
                self._zeros = bytes(sf.stride)
            if sf.stride:
                self._put(i, memoryview(self._zeros)[: sf.stride], self._offsets[i] + slot * sf.stride)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"slot {slot} is outside 0..{self.capacity - 1}")

    def grow(self, capacity: int) -> None:
        """Preallocate every slot file for ``capacity`` slots (refused before
        any block is taken when the file system lacks the space)."""
        more = sum(max(0, capacity - self.capacity) * sf.stride for sf in self.layout)
        if more:
            check_space(self.partial_dir, more, self.partial_dir)
        for i, sf in enumerate(self.layout):
            path = os.path.join(self.partial_dir, sf.name)
            old = self._offsets[i] + self.capacity * sf.stride
            new = self._offsets[i] + capacity * sf.stride
            if new > old:
                fallocate(self._fds[i], old, new - old, path)
        self.capacity = max(self.capacity, capacity)

    def sync(self) -> None:
        """fsync every slot file, and every writer's spill of encoded entries
        (a chunk's data is durable after this, whichever process wrote it)."""
        for fd in self._fds:
            fsync_file(fd)
        if self.schema.has_variable:
            self._spill.sync()
            sync_spills(self.partial_dir)

    def close(self) -> None:
        """Close the files (does not sync)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._spill.close()

    def __enter__(self) -> SlotWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StoreWriter:
    """Write a store; a context manager.

    Parameters
    ----------
    path
        Destination directory; work happens in ``PATH.partial``.
    schema
        A :class:`Schema` or ``{name: (dtype, shape)}``; ``(dtype, (None,
        *row))`` for a ragged field (each record its own number of rows),
        ``"str"`` / ``"bytes"`` for text / bytes (format.py, "Ragged fields").
    slots
        Number of slots, or ``None`` to grow with :meth:`append`.
    backend
        ``"memmap"`` or ``"lmdb"``.
    overwrite
        Replace an existing store (and discard a left-over ``.partial``).
        Only an mmstore store is ever replaced, and only a ``.partial`` an
        mmstore writer made is discarded (see ``mmstore/store/dest.py``);
        anything else raises :class:`~mmstore.errors.DestinationError`.
    resume
        Continue in an existing ``PATH.partial`` (same schema, slots and
        backend); slots already written keep their bytes.
    label_names, provenance
        Stored in the manifest (may also be set as attributes before close).
    inputs
        Paths of the inputs: ``path`` may not be, contain or lie inside one
        (``DestinationError``).

    Examples
    --------
    >>> with StoreWriter("out", {"x": ("<f4", (3,))}, slots=2) as w:   # doctest: +SKIP
    ...     w.write(1, {"x": [1, 2, 3]}, key="b")
    ...     w.write(0, {"x": [0, 0, 0]}, key="a")

    Raises
    ------
    StoreExistsError
        ``PATH`` exists (or a ``.partial`` does, without ``resume``).
    DestinationError
        ``PATH`` may not be written or replaced (see ``overwrite``).
    LockedError
        Another process is writing ``PATH``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        schema: Schema | Mapping[str, Any],
        slots: int | None = None,
        backend: str = "memmap",
        *,
        overwrite: bool = False,
        resume: bool = False,
        label_names: list[str] | None = None,
        provenance: dict[str, Any] | None = None,
        inputs: Any = (),
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.partial = self.path + PARTIAL_SUFFIX
        self.schema = schema if isinstance(schema, Schema) else Schema(schema)
        if backend not in SUPPORTED_BACKENDS:
            raise ValueError(f"backend must be one of {SUPPORTED_BACKENDS}, got {backend!r}")
        if slots is not None and (isinstance(slots, bool) or int(slots) != slots or slots < 0):
            raise ValueError(f"slots must be an integer >= 0 or None, got {slots!r}")
        backend_class(backend).check_available()  # fail now, not after hours of writing (lmdb missing)
        self.backend = backend
        self.fixed = slots is not None
        self.label_names = list(label_names) if label_names is not None else None
        self.provenance = dict(provenance or {})
        self._keys: dict[int, bytes] = {}
        self._bulk_keys: tuple[np.ndarray, bytes | np.ndarray] | None = None
        self._skips: dict[int, tuple[bytes, str]] = {}
        # skipped annotations of an annotated source (COCO): errors.jsonl lines after the holes' (format.py)
        self.annotation_errors: list[dict[str, Any]] = []
        self._next = 0
        self._closed = False
        check_dest(self.path, overwrite=overwrite, sources=inputs)  # fail fast, before the lock
        self._lock = acquire_lock(self.path)
        try:
            # under the lock: what DEST is now is what this writer will replace
            check_dest(self.path, overwrite=overwrite, sources=inputs)
            if os.path.lexists(self.path) and not overwrite:
                raise StoreExistsError(f"{self.path}: already exists; pass overwrite=True (--overwrite) to replace it")
            self._open(int(slots) if slots is not None else 0, overwrite, resume)
        except BaseException:
            release_lock(self.path, self._lock)
            raise

    # -- setup ------------------------------------------------------------------
    def _state_dict(self, capacity: int) -> dict[str, Any]:
        return {
            "schema": self.schema.to_json(),
            "backend": self.backend,
            "fixed": self.fixed,
            "capacity": capacity,
        }

    def _open(self, slots: int, overwrite: bool, resume: bool) -> None:
        state_path = os.path.join(self.partial, WRITER_STATE_FILE)
        if os.path.lexists(self.partial):
            if not is_own_partial(self.partial):  # never write into (or delete) a stranger's directory
                raise DestinationError(f"{self.partial}: exists and was not made by mmstore; it is never written "
                                       "to or discarded: move it away yourself, or choose another destination")
            if resume and os.path.exists(state_path):
                with open(state_path, "rb") as fh:
                    old = json.loads(fh.read())
                same = (old.get("schema"), old.get("backend"), old.get("fixed")) == (
                    self.schema.to_json(), self.backend, self.fixed
                ) and (not self.fixed or old.get("capacity") == slots)
                if not same:
                    raise StoreExistsError(
                        f"{self.partial}: holds an unfinished write with another schema, slot count "
                        "or backend; remove it (or pass overwrite=True) to start over"
                    )
                self._slots_writer = SlotWriter(self.partial)
                self._state = np.zeros(self._slots_writer.capacity, np.uint8)
                return
            if not overwrite:
                raise StoreExistsError(
                    f"{self.partial}: an unfinished write is here; pass resume=True to continue it "
                    "or overwrite=True to discard it"
                )
            shutil.rmtree(self.partial)
        capacity = slots if self.fixed else 0
        layout = backend_class(self.backend).write_layout(self.schema)
        layout.append(SlotFile(CHECKSUMS_FILE, KEY_DTYPE, (), 8, {}))
        largest = max((len(npy_header(sf.dtype, (capacity, *sf.entry_shape))) + capacity * sf.stride, sf.name)
                      for sf in layout)[::-1]
        reserve = _reserve_bytes(layout, capacity) + backend_class(self.backend).finalize_bytes(self.schema, capacity)
        check_space(os.path.dirname(self.partial), reserve, self.path, largest)
        make_partial(self.partial)
        try:
            for sf in layout:
                path = os.path.join(self.partial, sf.name)
                header = npy_header(sf.dtype, (capacity, *sf.entry_shape))
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    pwrite_all(fd, header, 0)
                    fallocate(fd, len(header), capacity * sf.stride, path)
                    # the headers must be durable before the state file says the
                    # .partial can be resumed (a power cut found this)
                    fsync_file(fd)
                finally:
                    os.close(fd)
            fsync_dir(self.partial)
        except OSError:
            # nothing is written yet: give back every block the reservation took
            # (a .partial that holds the space but no work helps no one)
            shutil.rmtree(self.partial, ignore_errors=True)
            raise
        atomic_write(state_path, json.dumps(self._state_dict(capacity)).encode())
        self._slots_writer = SlotWriter(self.partial)
        self._state = np.zeros(capacity, np.uint8)

    # -- writing ------------------------------------------------------------------
    def _need(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        if slot < 0:
            raise IndexError(f"slot {slot} is negative")
        cap = self._slots_writer.capacity
        if slot < cap:
            return
        if self.fixed:
            raise IndexError(f"slot {slot} is outside this store's {cap} slots")
        new = max(slot + 1, 2 * cap, _GROW_MIN_SLOTS)
        self._slots_writer.grow(new)
        state = np.zeros(new, np.uint8)
        state[: len(self._state)] = self._state
        self._state = state

    def write(self, slot: int, sample: Mapping[str, Any], key: Any = None) -> None:
        """Write ``sample`` (``{field: array}``) at ``slot``, in any order."""
        self._need(slot)
        self._slots_writer.write(int(slot), sample)
        self._state[slot] = _WRITTEN
        self._skips.pop(int(slot), None)
        if key is not None:
            self.set_key(slot, key)
        self._next = max(self._next, int(slot) + 1)

    def write_batch(self, start: int, arrays: Mapping[str, Any], keys: Any = None) -> None:
        """Write ``n`` consecutive records at slots ``start .. start+n-1`` in
        one go (``arrays[field]`` of shape ``(n, *shape)``; optional ``keys``,
        a sequence of n keys). Much faster than ``write`` per record for
        small records."""
        first = next(iter(arrays.values()))
        # a list of entries of their own shapes (ragged or shaped fields) is not one array
        n = len(first) if isinstance(first, (list, tuple)) else len(np.asarray(first))
        if n == 0:
            return
        self._need(start + n - 1)
        self._slots_writer.write_batch(int(start), arrays)
        self._state[start : start + n] = _WRITTEN
        if self._skips:
            for s in range(start, start + n):
                self._skips.pop(s, None)
        if keys is not None:
            for s, k in zip(range(start, start + n), keys):
                self.set_key(s, k)
        self._next = max(self._next, int(start) + n)

    def append(self, sample: Mapping[str, Any], key: Any = None) -> int:
        """Write ``sample`` at the next slot; return the slot."""
        slot = self._next
        self.write(slot, sample, key)
        return slot

    def skip(self, slot: int, key: Any, reason: str) -> None:
        """Leave ``slot`` as a hole (its input failed), remembering why."""
        self._need(slot)
        self._slots_writer.zero(int(slot))
        self._state[slot] = _HOLE
        kb = encode_key(key) if key is not None else b""
        self._skips[int(slot)] = (kb, str(reason))
        self.set_key(slot, kb)
        self._next = max(self._next, int(slot) + 1)

    def set_key(self, slot: int, key: Any) -> None:
        """Set the source key of ``slot`` (str or bytes; see format.py)."""
        self._keys[int(slot)] = encode_key(key)

    def set_keys(self, offsets: np.ndarray, blob: bytes | np.ndarray) -> None:
        """Set all keys at once: ``offsets`` (slots + 1) into ``blob``.

        Keys given with ``set_key``/``write(key=)`` take precedence.
        """
        offsets = np.asarray(offsets, dtype=np.uint64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or np.any(np.diff(offsets.astype(np.int64)) < 0):
            raise ValueError("offsets must start at 0 and never decrease")
        if int(offsets[-1]) != len(blob):
            raise ValueError(f"offsets end at {int(offsets[-1])} but the blob has {len(blob)} bytes")
        self._bulk_keys = (offsets, blob)

    def mark_written(self, slots: Any) -> None:
        """Record that ``slots`` were written by :class:`SlotWriter` workers."""
        s = np.asarray(slots, dtype=np.int64)
        if s.size:
            self._need(int(s.max()))
            self._state[s] = _WRITTEN
            if self._skips:
                for x in np.intersect1d(s, np.fromiter(self._skips, np.int64)).tolist():
                    self._skips.pop(x, None)
            self._next = max(self._next, int(s.max()) + 1)

    def sync(self) -> None:
        """fsync the data written so far (commit points of a resumable ingest)."""
        self._slots_writer.sync()

    @property
    def slot_writer(self) -> SlotWriter:
        """The writer's own :class:`SlotWriter` (data files of ``.partial``)."""
        return self._slots_writer

    # -- closing ------------------------------------------------------------------
    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Stop without publishing; ``PATH.partial`` stays for a resume."""
        if self._closed:
            return
        self._closed = True
        self._slots_writer.close()
        release_lock(self.path, self._lock)

    def close(self) -> str:
        """Finish: write everything, publish ``PATH`` atomically; return it."""
        if self._closed:
            return self.path
        try:
            self._finish()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        release_lock(self.path, self._lock)
        return self.path

    def _finish(self) -> None:
        sw = self._slots_writer
        slots = sw.capacity if self.fixed else self._next
        state = self._state[:slots]
        missing = np.flatnonzero(state == _UNSET)
        if len(missing):
            raise SchemaError(
                f"{self.path}: {len(missing)} of {slots} slots were never written or skipped "
                f"(first: {missing[:5].tolist()}); write or skip every slot before closing"
            )
        if not self.fixed:
            self._shrink_to(slots)
        sw.sync()
        sw.close()
        holes = state == _HOLE
        backend_class(self.backend).finalize(self.partial, self.schema, slots, holes)
        self._write_keys(slots)
        names = backend_class(self.backend).data_file_names(self.schema)
        names += [CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE]
        records = int(slots - holes.sum())
        if records < slots:
            index = np.flatnonzero(~holes).astype(KEY_DTYPE)
            self._write_npy(INDEX_FILE, index)
            names += [INDEX_FILE]
        if records < slots or self.annotation_errors:
            skips = [(s, k, r) for s, (k, r) in sorted(self._skips.items()) if s < slots]
            self._write_file(ERRORS_FILE, errors_jsonl(skips, self.annotation_errors))
            names += [ERRORS_FILE]
        prov = dict(self.provenance)
        prov.setdefault("tool", f"mmstore {__version__}")
        prov.setdefault("time", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if self.schema.has_variable and "codec_libraries" not in prov:  # repair checks the encoders against it
            prov["codec_libraries"] = library_versions(f.codec for f in self.schema.variable_fields)
        write_manifest(self.partial, names, backend=self.backend, records=records, slots=slots,
                       schema=self.schema, label_names=self.label_names, provenance=prov)
        publish(self.path)

    def _shrink_to(self, slots: int) -> None:
        sw = self._slots_writer
        for i, sf in enumerate(sw.layout):
            header = npy_header(sf.dtype, (slots, *sf.entry_shape))
            pwrite_all(sw._fds[i], header, 0)
            os.ftruncate(sw._fds[i], len(header) + slots * sf.stride)

    def _write_keys(self, slots: int) -> None:
        # O(keys given one by one), never a Python loop over every slot: an
        # ingest hands all keys in bulk and only the holes' keys one by one
        over = sorted((s, k) for s, k in self._keys.items() if s < slots)
        lens = np.zeros(slots, np.int64)
        parts: list[Any] = []
        if self._bulk_keys is not None:
            offs = self._bulk_keys[0].astype(np.int64)
            raw = self._bulk_keys[1]
            mv = (np.ascontiguousarray(raw).view(np.uint8).data if isinstance(raw, np.ndarray)
                  else memoryview(raw)).cast("B")
            n_bulk = max(0, min(slots, len(offs) - 1))
            lens[:n_bulk] = np.diff(offs[: n_bulk + 1])
            prev = 0  # bulk keys of slots [prev, ...) are not emitted yet
            for s, k in over:
                if s < n_bulk and mv[offs[s] : offs[s + 1]] == k:
                    continue
                a, b = min(prev, n_bulk), min(s, n_bulk)
                if b > a:
                    parts.append(mv[offs[a] : offs[b]])
                parts.append(k)
                lens[s] = len(k)
                prev = s + 1
            a = min(prev, n_bulk)
            if n_bulk > a:
                parts.append(mv[offs[a] : offs[n_bulk]])
        else:
            for s, k in over:
                lens[s] = len(k)
                parts.append(k)
        offsets = np.zeros(slots + 1, KEY_DTYPE)
        offsets[1:] = np.cumsum(lens)
        blob = b"".join(parts)
        self._write_npy(KEYS_OFFSETS_FILE, offsets)
        self._write_file(KEYS_BLOB_FILE, blob)

    def _write_npy(self, name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        self._write_file(name, npy_header(arr.dtype, arr.shape), arr)

    def _write_file(self, name: str, head: Any, body: Any = None) -> None:
        write_durable(os.path.join(self.partial, name), head, body)


def _reserve_bytes(layout: list[SlotFile], capacity: int) -> int:
    """Bytes the slot files of a fresh ``.partial`` take for ``capacity`` slots
    (what the backend's ``finalize`` needs at close comes on top)."""
    return sum(len(npy_header(sf.dtype, (capacity, *sf.entry_shape))) + capacity * sf.stride for sf in layout)


def write_durable(path: str, head: Any, body: Any = None) -> None:
    """Create ``path`` holding ``head`` then ``body``, fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, head, 0)
        if body is not None and len(body):
            pwrite_all(fd, body, len(head))
        fsync_file(fd)
    finally:
        os.close(fd)


class FileAppender:
    """New files of a store being built in ``directory``, each written by
    appending at its own end: the bookkeeping files a merge concatenates
    from its parts, or a data file it copies. Created empty (truncated);
    :meth:`close` fsyncs them (``sync``) and closes them."""

    def __init__(self, directory: str, names: list[str]) -> None:
        self.fds: dict[str, int] = {}
        try:
            for n in names:
                self.fds[n] = os.open(os.path.join(directory, n), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except BaseException:
            self.close(sync=False)
            raise
        self.pos = {n: 0 for n in names}

    def put(self, name: str, data: Any) -> None:
        """Append ``data`` (any buffer) to file ``name``."""
        pwrite_all(self.fds[name], data, self.pos[name])
        self.pos[name] += len(memoryview(data).cast("B"))

    def copy(self, name: str, src_fd: int, offset: int, n: int) -> int:
        """Append ``n`` bytes of descriptor ``src_fd`` from ``offset`` to file
        ``name`` (kernel-side where possible, ``_os.io.copy_range``); returns
        the bytes copied, fewer than ``n`` when the source ended first (the
        caller says what that means)."""
        done = copy_range(src_fd, self.fds[name], offset, self.pos[name], n)
        self.pos[name] += done
        return done

    def close(self, sync: bool) -> None:
        try:
            for fd in self.fds.values():
                if sync:
                    fsync_file(fd)
        finally:
            for fd in self.fds.values():
                os.close(fd)
            self.fds = {}


def errors_jsonl(skips: Any, annotations: Any = ()) -> bytes:
    """The ``errors.jsonl`` bytes of ``(slot, key bytes, reason)`` sorted by slot
    (UTF-8; a key byte that is not UTF-8 is a ``\\udcXX`` escape, see ``mmstore.format.names``),
    then the skipped ``annotations`` (dicts ``slot``, ``key`` bytes or None,
    ``annotation``, ``id``, ``reason``) in their order, see ``format.py``."""
    lines = [json_text({"slot": s, "key": decode_key(k), "reason": r}) for s, k, r in skips]
    lines += [json_text({"slot": a["slot"], "key": None if a["key"] is None else decode_key(a["key"]),
                         "annotation": a["annotation"], "id": a["id"], "reason": a["reason"]}) for a in annotations]
    return ("\n".join(lines) + "\n").encode("utf-8")


def file_digest(path: str, offset: int = 0) -> str:
    """xxh3_64 (hex) of a file's bytes from ``offset`` on."""
    h = hasher()
    with open(path, "rb") as fh:
        fh.seek(offset)
        while True:
            b = fh.read(1 << 22)
            if not b:
                break
            h.update(b)
    return str(h.hexdigest())


def write_manifest(
    partial: str, names: list[str], *, backend: str, records: int, slots: int, schema: Schema,
    label_names: list[str] | None, provenance: dict[str, Any], segments: list[int] | None = None,
    parts: list[str] | None = None, sizes: dict[str, int] | None = None,
) -> None:
    """Write ``partial/manifest.json`` for the finished files ``names`` (sizes
    and digests measured here, but for data files whose size ``sizes``
    gives: a part's, in object storage), atomically: the last step before
    publish. ``parts``: the part id of each segment (format.py, "Parts"); a
    store of ``PART_TABLE_MIN_PARTS`` parts or more lists them in a part
    table (``_parts.bin``, written here; format.py, "The part table")."""
    known = sizes or {}
    files = {n: known[n] if n in known else os.stat(os.path.join(partial, n)).st_size for n in names}
    table = parts is not None and segments is not None and len(parts) >= _layout.PART_TABLE_MIN_PARTS
    if parts is not None and segments is not None and table:
        files = _write_part_table(partial, files, backend, schema, parts, segments)
    digests = {
        n: file_digest(os.path.join(partial, n))
        for n in (KEYS_OFFSETS_FILE, KEYS_BLOB_FILE, INDEX_FILE, ERRORS_FILE, PART_TABLE_FILE)
        if n in files
    }
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": list(manifest_version(schema.has_variable, segments is not None, schema.has_ragged,
                                         parts is not None, schema.has_shaped, table)),
        "store_id": uuid.uuid4().hex,
        "backend": backend,
        "records": records,
        "slots": slots,
        "schema": schema.to_json(),
        "checksum": {
            "algorithm": CHECKSUM_ALGORITHM,
            "digest": _checksums_digest(os.path.join(partial, CHECKSUMS_FILE), slots),
        },
        "files": files,
        "digests": digests,
        "label_names": label_names,
        "provenance": provenance,
    }
    if table:
        manifest["part_table"] = {"file": PART_TABLE_FILE, "parts": len(parts or ())}
    else:
        if segments is not None:
            manifest["segments"] = list(segments)
        if parts is not None:
            manifest["parts"] = list(parts)
    requires = (([RAGGED_FEATURE] if any(not f.shaped for f in schema.ragged_fields) else [])
                + ([PARTS_FEATURE] if parts is not None else []) + ([SHAPES_FEATURE] if schema.has_shaped else [])
                + ([PART_TABLE_FEATURE] if table else []))
    if requires:
        manifest["requires"] = requires
    atomic_write(
        os.path.join(partial, MANIFEST_FILE),
        json_bytes(manifest, indent=1) + b"\n",
    )


def _write_part_table(partial: str, files: dict[str, int], backend: str, schema: Schema, parts: list[str],
                      segments: list[int]) -> dict[str, int]:
    """Write ``partial/_parts.bin`` for ``parts`` (their data files' sizes
    taken from ``files``) and return ``files`` with the table in place of
    the parts' data files."""
    from ..format.parttable import encode_part_table

    names = backend_class(backend).data_file_names(schema)
    rows = [[files[part_file(pid, n)] for n in names] for pid in parts]
    raw = encode_part_table(parts, segments, rows)
    atomic_write(os.path.join(partial, PART_TABLE_FILE), raw)
    own = {n: s for n, s in files.items() if "/" not in n}
    own[PART_TABLE_FILE] = len(raw)
    return own


def _checksums_digest(path: str, slots: int) -> str:
    return file_digest(path, check_npy(path, KEY_DTYPE, (slots,)))


def publish(path: str) -> None:
    """Rename a finished ``PATH.partial`` (manifest written) to ``PATH``.

    Bookkeeping files that are not part of the store (writer and ingest
    state) are removed first; an existing ``PATH`` is replaced by an atomic
    exchange, so ``PATH`` always names one complete store (format.py,
    "Replacing a store"). Called under the writer lock.
    """
    partial = path + PARTIAL_SUFFIX
    man = read_manifest(partial)
    replace = os.path.lexists(path)
    if replace and (os.path.islink(path) or not is_store(path)):  # the last line of defence
        raise DestinationError(f"{path}: exists and is not an mmstore store; it is never replaced: move it "
                               f"away yourself, then rerun to publish {partial}")
    remove_replaced(path)  # what a killed publish left aside
    keep = set(man["files"]) | {MANIFEST_FILE}
    keep |= {n.split("/", 1)[0] for n in keep}  # a store with parts: its parts/ directory (format.py)
    for name in os.listdir(partial):
        if name not in keep:
            p = os.path.join(partial, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
    fsync_dir(partial)
    old = _swap_in(partial, path) if replace else None
    if old is None:
        crash_point("rename")
        try:
            os.rename(partial, path)
        except OSError as exc:
            raise OSError(exc.errno or errno.EIO, f"{partial} -> {path}: rename failed ({exc.strerror})") from None
    fsync_dir(os.path.dirname(path) or ".")
    if old is not None:
        crash_point("rename")  # (a kill while the old store is deleted: the next publish finishes it)
        shutil.rmtree(old, ignore_errors=True)


def _swap_in(partial: str, path: str) -> str:
    """Replace the store at ``path`` by the finished ``partial`` with no
    moment where ``path`` names no store or a mix (format.py, "Replacing a
    store"); return where the old store now is (to delete). On a file
    system that cannot exchange two names: two renames, the old way."""
    aside = f"{path}{REPLACED_INFIX}{uuid.uuid4().hex[:8]}"
    crash_point("rename")
    os.rename(partial, aside)  # PATH is untouched; a kill now leaves the new store aside, for cleaning
    crash_point("rename")
    try:
        swapped = _exchange(aside, path)
    except OSError as exc:
        os.rename(aside, partial)  # back to a finished .partial, published by a rerun (--resume)
        raise OSError(exc.errno or errno.EIO, f"{aside} <-> {path}: exchange failed ({exc.strerror})") from None
    if swapped:
        return aside
    os.rename(aside, partial)
    old = f"{path}{REPLACED_INFIX}{uuid.uuid4().hex[:8]}"
    os.rename(path, old)
    crash_point("rename")
    try:
        os.rename(partial, path)
    except OSError as exc:
        os.rename(old, path)
        raise OSError(exc.errno or errno.EIO, f"{partial} -> {path}: rename failed ({exc.strerror})") from None
    return old


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_renameat2: Any = None


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2`` with
    ``RENAME_EXCHANGE``); False where the system or file system cannot."""
    import ctypes

    global _renameat2
    if _renameat2 is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (AttributeError, OSError):  # not glibc >= 2.28 (or not Linux)
            _renameat2 = False
    if _renameat2 is False:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
        return False  # a kernel or file system without RENAME_EXCHANGE
    raise OSError(err, os.strerror(err), a, None, b)
