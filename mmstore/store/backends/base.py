"""The interface every backend implements.

``BackendReader`` is the read side, what ``Store.slot_view.backend`` is: one backend or a
merged store's segments (``segmented.py``); its capabilities say what callers
may do beyond reading records. ``Backend`` adds the write side (the slot
files a writer fills, the finished file names, ``finalize``) for one storage
format; see format.py for the formats themselves.
"""

from __future__ import annotations

import functools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import numpy as np

from ..._os.io import fsync_file, pwrite_all
from ...errors import EntryDecodeError, FormatError, StoreChangedError
from ...format.layout import note_identity, npy_header, open_store_file, read_npy_header
from ...format.schema import Schema

__all__ = ["Backend", "BackendReader", "FieldSegment", "PackedRecords", "SlotFile", "check_npy", "checksum_parts",
           "entry_error", "packed_record", "unpack_record"]

# what ``iter_packed`` returns: a generator, so that a caller that stops early
# can close it at once (releasing what it holds: a read transaction)
PackedRecords = Generator[tuple[int, memoryview | None], None, None]


class SlotFile(NamedTuple):
    """A preallocated file of fixed-size slot entries, as writers see it.

    ``fields`` maps a field name to its byte offset inside one entry
    (``stride`` bytes); entry ``s`` starts at ``header_len + s * stride``.
    """

    name: str
    dtype: np.dtype
    entry_shape: tuple[int, ...]
    stride: int
    fields: dict[str, int]


class FieldSegment(NamedTuple):
    """One file of a positional field: global slot ``first + j`` (``0 <= j <
    count``) is at byte ``offset + j * entry_bytes`` of ``path``."""

    path: str
    offset: int
    entry_bytes: int
    first: int
    count: int  # type: ignore[assignment]  # shadows tuple.count: the field's name is public


class BackendReader(ABC):
    """Read access to the record data of one finished store: what
    ``Store.slot_view.backend`` is (one backend, or a merged store's segments).

    Instances are created per process (see ``NOTE [fork safety]`` in
    ``mmstore/store/reader.py``); they map or open their files lazily.

    Capabilities (what callers outside ``backends/`` may ask instead of the
    backend's name):

    Variable-size (encoded) fields (format.py, "Encoded fields") are read
    through :meth:`read_into`, which decodes each entry into the caller's
    array; :meth:`entry_sizes` gives their stored sizes and :meth:`entry_spans`
    the bytes a run of slots occupies (readahead). The capabilities below are
    about the fixed (raw) fields only.

    ``positional``
        Every fixed field's entries sit at fixed positions of its own ``.npy`` file
        per segment (``Backend.field_file``; entry ``j`` at ``offset + j *
        entry_bytes``): :meth:`field_segments` says where, so readers may ``pread`` them, ``evict`` may drop exactly
        their pages, ``verify`` may hash them with large sequential reads and
        ``repair`` may rewrite one entry in place; :meth:`array` maps a field
        of one segment and :meth:`check_mapped` guards a copy out of it.
        Otherwise entries are reached through the backend only
        (:meth:`read_into`, :meth:`iter_packed`), and ``repair`` rebuilds a
        damaged segment's files (``Backend.rebuild``).
    ``crashes_on_damage``
        Reading a damaged data file can kill the reading process (LMDB trusts
        its pages: a flipped byte can make it read outside its mapping), so a
        tool that must survive damage (``verify``) reads such files in child
        processes. Otherwise ``verify`` reads them in its own process: with
        large sequential reads when ``positional``, else through
        :meth:`iter_packed`.
    ``segmented``
        The data is split in segments (a merged store, see format.py,
        "Segments"); :meth:`segment_backends` lists them, each a
        single-segment backend whose ``first`` is its first global slot.
    """

    name: ClassVar[str]
    ragged_lists: ClassVar[bool] = False
    """:meth:`read_into` also takes ragged fields, whose ``out`` is a list
    (it sets item ``rows[j]`` to slot ``slots[j]``'s stored entry, bytes): one
    pass for a backend that looks each record up once (lmdb)."""
    positional: ClassVar[bool] = False
    crashes_on_damage: ClassVar[bool] = False
    segmented: ClassVar[bool] = False

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | str | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None,
    ) -> None:
        self.root = root
        self.schema = schema
        self.slots = slots
        self.files = files
        self.segment = segment  # None: the store's only data files; k: segment k's
        self.first: int | None = None  # a segment's first global slot (set by SegmentedBackend)
        # path -> identity of each data file when the store was opened (shared
        # with the Store): a file opened later must be that file (see format.py)
        self.ident = ident

    # -- read side --------------------------------------------------------
    @abstractmethod
    def check(self) -> None:
        """Validate the data files against the manifest without reading data
        (O(fields)). Raise ``FormatError`` naming the file."""

    @abstractmethod
    def read_into(
        self, slots: np.ndarray, rows: np.ndarray, fields: Sequence[str], out: dict[str, np.ndarray]
    ) -> None:
        """Copy slot ``slots[j]`` of each field into ``out[field][rows[j]]``.

        ``slots`` is sorted ascending (reads in file order); ``rows`` says where
        each goes in the caller's order.
        """

    @abstractmethod
    def iter_packed(self, start: int, stop: int) -> PackedRecords:
        """Yield ``(slot, packed record bytes or None for an absent record)`` for
        slots in ``[start, stop)``; the view is valid until the next item.

        The packed bytes are the ones a slot's checksum covers (format.py,
        "Checksums"; :func:`packed_record`): the fields in schema order, a
        variable-size field as its ``<u8`` length and stored entry. Without
        variable-size fields that is the 1.x packed record (an lmdb value)."""

    @abstractmethod
    def data_paths(self) -> list[str]:
        """Absolute paths of the data files (for warm/evict/verify)."""

    @abstractmethod
    def segment_backends(self) -> Sequence[Backend]:
        """The single-segment backends of this store's data, in slot order
        (of a store whose parts are opened on demand, :meth:`parts_on_demand`:
        a sequence that makes each when it is reached, and may close it
        again once others are used: use each as it comes)."""

    def segment_count(self) -> int:
        """How many segments the data has (:meth:`segment_backends`, counted
        without making them)."""
        return len(self.segment_backends())

    def parts_on_demand(self) -> bool:
        """True when this store's segments are opened when read and closed
        again, at most a bounded number open at once (a store of more parts
        than this process may keep open: NOTE [open parts] in
        ``segmented.py``): a reader then reads through the backend only, never
        holding a segment's descriptors or mappings itself
        (:meth:`field_segments` lists where the records lie, not files to
        keep open). Decided at the first read."""
        return False

    def item_reader(self) -> Callable[[int], dict[str, Any]]:
        """A function ``read(slot) -> {field: array}`` for one record (every
        field, schema order; a field of shape ``()`` as a numpy scalar), made
        once per process and kept by ``Store`` for ``store[i]``.

        NOTE [one-record path]: ``store[i]`` is the call a hand-written
        Dataset makes per sample, so its fixed cost matters as much as the
        copy (a 150 KB image copies in microseconds). What a batch needs (sorting,
        row bookkeeping, arrays of addresses) is left out here; every check
        stays: the slot is proven in range, and the files read are the ones
        the store was opened with. Default: :meth:`read_into` with one slot;
        the caller must drop the function when it closes the backend."""
        names = [f.name for f in self.schema if not f.ragged]
        shapes = [(f.name, (1, *f.shape), f.dtype) for f in self.schema if not f.ragged]
        ragged = self.schema.ragged_fields
        rows = np.zeros(1, np.int64)
        slots = self.slots

        def read(slot: int) -> dict[str, Any]:
            if not 0 <= slot < slots:
                raise IndexError(f"slot {slot} is out of range for {slots} slots")
            out = {name: np.empty(shape, dtype) for name, shape, dtype in shapes}
            at = np.array([slot], np.int64)
            if names:
                self.read_into(at, rows, names, out)
            got = {name: v[0] for name, v in out.items()}
            for f in ragged:
                got[f.name] = self.ragged_entry(f, slot)
            return {name: got[name] for name in self.schema.names}

        return read

    def prepare(self, fields: Sequence[str] | None = None) -> None:  # noqa: B027 - optional hook
        """Open mappings / environments (of ``fields``, default all) now,
        before reader threads start."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release handles (mappings, environments)."""

    # -- variable-size fields ----------------------------------------------
    def gather_entries(self, name: str, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The stored entries of variable-size field ``name`` at ``slots``
        (ascending), back to back: ``(uint8 array, int64 sizes)``, a copy.
        Each entry's offsets are proven in range first (``EntryDecodeError``
        naming the slot otherwise). What a ragged field's batch is read with
        (``mmstore/format/ragged.py``)."""
        raise NotImplementedError(f"gather_entries: not implemented by the {self.name} backend")

    def ragged_entry(self, field: Any, slot: int) -> Any:
        """One decoded entry of ragged ``field`` (``store[i]``); of a shaped
        field, its stored entry (uint8), which the store decodes with the
        record's size (``mmstore/format/shaped.py``)."""
        from ...format.ragged import decode_entry

        flat, _ = self.gather_entries(field.name, np.array([slot], np.int64))
        if field.shaped:
            return flat
        glob = slot if self.first is None else self.first + slot
        return decode_entry(field, flat, glob)

    def entry_sizes(self, name: str, slots: np.ndarray) -> np.ndarray:
        """Stored (encoded) sizes in bytes of variable-size field ``name`` at
        ``slots`` (int64; holes 0). Default: from :meth:`entry_offsets`."""
        offs = self.entry_offsets(name)
        s = np.asarray(slots, np.int64)
        size = self.entry_data_size(name)
        a = np.minimum(offs[s], size).astype(np.int64)
        b = np.minimum(offs[s + 1], size).astype(np.int64)
        return np.maximum(b - a, 0)

    def stored_entry_bytes(self, name: str) -> int | None:
        """The bytes all the stored entries of variable-size field ``name``
        take, when the backend knows it without reading any (from the file
        sizes the manifest lists), else None: the caller measures a sample
        with :meth:`entry_sizes`. Default: None."""
        return None

    def entry_offsets(self, name: str) -> np.ndarray:
        """A single-segment backend's offsets index of variable-size field
        ``name`` (``slots + 1`` ``<u8``; only the first and last are checked)."""
        raise NotImplementedError(f"entry_offsets: the {self.name} backend keeps no offsets index per field")

    def entry_data_size(self, name: str) -> int:
        """Size of the data the offsets of :meth:`entry_offsets` point into."""
        raise NotImplementedError(f"entry_data_size: the {self.name} backend keeps no offsets index per field")

    def entry_spans(self, name: str, start: int, stop: int) -> list[tuple[str, int, int]]:
        """Variable-size field ``name``: the bytes slots ``[start, stop)``
        occupy, ``(path, offset, length)`` per data file, for readahead
        (``posix_fadvise(WILLNEED)``/``readahead``) of a run of slots.
        Default: none known (nothing to read ahead)."""
        return []

    # -- positional backends only (see ``positional``) ---------------------
    def field_segments(self, name: str) -> list[FieldSegment]:
        """Where field ``name`` lives: one :class:`FieldSegment` per segment."""
        raise NotImplementedError(self._not_positional("field_segments"))

    def array(self, name: str) -> np.ndarray:
        """Field ``name`` of a single-segment backend as a read-only array over
        its mapping, shape ``(slots, *shape)``."""
        raise NotImplementedError(self._not_positional("array"))

    def check_mapped(self, name: str) -> None:
        """Raise ``StoreChangedError`` if field ``name``'s mapped file shrank
        (see NOTE [truncated under a mapping] in memmap.py)."""
        raise NotImplementedError(self._not_positional("check_mapped"))

    def field_fd(self, name: str) -> tuple[int, int]:
        """``(descriptor, data offset)`` of fixed field ``name``'s file in a
        single-segment backend, for ``preadv`` of its entries (entry ``j`` at
        ``offset + j * entry_bytes``): this process's descriptor, opened once
        and owned by the backend; each call raises ``StoreChangedError`` if
        the file is shorter than when the store was opened."""
        raise NotImplementedError(self._not_positional("field_fd"))

    def short_read_error(self, name: str, fd: int) -> StoreChangedError:
        """The error for a read of field ``name`` through ``fd`` (from
        :meth:`field_fd`) that met the end of its file: the file was
        truncated while the store was open."""
        raise NotImplementedError(self._not_positional("short_read_error"))

    # -- repair hooks --------------------------------------------------------
    def has_stray_entries(self, holes: np.ndarray) -> bool:
        """True if a single-segment backend holds an entry that is not one of
        its records (``holes``: bool over its slots), which only rebuilding
        its files removes. Positional backends have none by construction."""
        return False

    def rewrite_entries(self, name: str, entries: Mapping[int, Any], open_file: Callable[[str], int]) -> None:
        """Positional backends: write ``entries`` (``{slot: bytes}``) of field
        ``name`` over the stored ones, in place, then fsync each file written:
        a fixed field's entry at its slot's position, a variable-size field's
        over its stored entry, which must have exactly the new entry's length
        (its offsets index is never rewritten). ``open_file(path)`` opens a
        data file for writing and returns the descriptor (the caller's rules
        on which files may be written; ``verify --repair`` proves every entry
        before it writes one). Raises ``ValueError`` for an entry of another
        size, before anything of its segment is written."""
        raise NotImplementedError(self._not_positional("rewrite_entries"))

    def _not_positional(self, what: str) -> str:
        if self.positional:  # a merged store of a positional backend: one mapping per segment
            return (f"{what}: this merged store's fields are split over {len(self.segment_backends())} segment "
                    f"files, so there is no single mapping; use segment_backends()[k].{what}(name), or "
                    "field_segments(name), which lists each file with its slot range")
        return (f"{what}: the {self.name} backend does not keep fields at fixed file positions "
                "(check backend.positional first)")


class Backend(BackendReader):
    """One storage backend: the layout writers fill and the reader of one
    segment (``segment`` None: a store's only data files). Registered by
    name in :func:`mmstore.store.backends.backend_class`."""

    def __init__(
        self, root: str, schema: Schema, slots: int, files: dict[str, int], segment: int | str | None = None,
        ident: dict[str, tuple[int, int, int, int]] | None = None, readahead: bool | None = None,
    ) -> None:
        """``readahead``: the kernel readahead of the backend's mappings
        (None: the backend's default); backends without such a setting ignore it."""
        super().__init__(root, schema, slots, files, segment, ident)

    # -- layout -----------------------------------------------------------
    @classmethod
    @abstractmethod
    def write_layout(cls, schema: Schema) -> list[SlotFile]:
        """The slot files a writer fills (in the ``.partial`` directory)."""

    @classmethod
    @abstractmethod
    def data_file_names(cls, schema: Schema, segment: int | str | None = None) -> list[str]:
        """File names holding record data in a finished store (of one segment)."""

    @classmethod
    def finalize(cls, partial_dir: str, schema: Schema, slots: int, holes: np.ndarray) -> None:
        """Turn the written slot files into the finished data files
        (``holes`` is a bool array over slots). Default: nothing to do."""

    @classmethod
    def write_segment(cls, directory: str, schema: Schema, count: int, holes: np.ndarray,
                      packed: Iterable[tuple[int, np.ndarray]]) -> None:
        """Write the finished data files of ``count`` slots into ``directory``
        the way a writer does: the slot files of :meth:`write_layout`, filled
        from the records' checksummed bytes, then :meth:`finalize`.
        ``packed`` yields ``(first slot, array of shape (n, record_bytes))``
        covering every slot (zeros for ``holes``); fixed-shape fields only.
        ``verify --repair`` rebuilds a damaged segment of a backend that is not
        positional this way."""
        layout = cls.write_layout(schema)
        fds = [os.open(os.path.join(directory, sf.name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
               for sf in layout]
        try:
            heads = [npy_header(sf.dtype, (count, *sf.entry_shape)) for sf in layout]
            for fd, sf, head in zip(fds, layout, heads):
                pwrite_all(fd, head, 0)
                os.ftruncate(fd, len(head) + count * sf.stride)
            for a, chunk in packed:
                for fd, sf, head in zip(fds, layout, heads):
                    pwrite_all(fd, _slot_entries(schema, sf, chunk), len(head) + a * sf.stride)
            for fd in fds:
                fsync_file(fd)
        finally:
            for fd in fds:
                os.close(fd)
        cls.finalize(directory, schema, count, holes)

    def rebuild(self, directory: str, holes: np.ndarray, fixes: Mapping[int, bytes]) -> None:
        """Write this single segment's data files again, into ``directory``
        (named as :meth:`data_file_names` names a store's only ones), the way a
        writer builds them: each record as stored, except ``fixes`` (``{local
        slot: the record's checksummed bytes}``, :func:`packed_record`);
        ``holes`` (bool over the segment's slots) hold no record, and a stored
        entry that is not a record (:meth:`has_stray_entries`) is left out.
        ``verify --repair`` rebuilds a damaged segment of a backend that is not
        positional this way. Default: :meth:`write_segment` of the stored
        records (a record of another size than the schema's, unreadable: zeros);
        fixed-shape fields only."""
        if self.schema.has_variable:
            raise NotImplementedError(f"rebuild: the {self.name} backend does not rebuild variable-size fields")
        rb, step = self.schema.record_bytes, 4096

        def chunk(a: int, b: int) -> np.ndarray:
            out = np.zeros((b - a, rb), np.uint8)
            for s, v in self.iter_packed(a, b):
                if holes[s]:
                    continue
                val = fixes.get(s)
                if val is None and v is not None and len(v) == rb:
                    val = bytes(v)
                if val is not None:
                    out[s - a] = np.frombuffer(val, np.uint8)
            return out

        packed = ((a, chunk(a, min(self.slots, a + step))) for a in range(0, self.slots, step))
        self.write_segment(directory, self.schema, self.slots, holes, packed)

    @classmethod
    def field_file(cls, field: str, segment: int | str | None = None) -> str:
        """Positional backends: the ``.npy`` file of ``field`` (of ``segment``),
        shape ``(slots, *field shape)``, the field's dtype."""
        raise NotImplementedError(f"field_file: the {cls.name} backend does not keep fields in files of their own")

    @classmethod
    def finalize_bytes(cls, schema: Schema, slots: int) -> int:
        """Disk space ``finalize`` needs beyond the slot files (checked before
        a write starts). Default: none."""
        return 0

    @classmethod
    def check_available(cls) -> None:
        """Raise ``ImportError`` (saying what to install) if this backend
        cannot work here; called before a write starts, not after hours of it."""

    # -- read side --------------------------------------------------------
    def data_paths(self) -> list[str]:
        return [os.path.join(self.root, n) for n in self.data_file_names(self.schema, self.segment)]

    def segment_backends(self) -> Sequence[Backend]:
        return [self]


def _slot_entries(schema: Schema, sf: SlotFile, packed: np.ndarray) -> np.ndarray:
    """The entries of slot file ``sf`` for packed records ``packed`` (rows of ``record_bytes``)."""
    if sf.stride == packed.shape[1] and all(schema.offset(n) == o for n, o in sf.fields.items()):
        return packed  # a file of packed records (lmdb's staging file)
    out = np.zeros((len(packed), sf.stride), np.uint8)
    for name, inner in sf.fields.items():
        off, nb = schema.offset(name), schema[name].nbytes
        out[:, inner : inner + nb] = packed[:, off : off + nb]
    return out


@functools.lru_cache(maxsize=256)
def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """``npy_header``, remembered: the parts of a store share their headers."""
    return npy_header(dtype, shape)


def check_npy(
    path: str, dtype: np.dtype, shape: tuple[int, ...], size: int | None = None,
    ident: dict[str, tuple[int, int, int, int]] | None = None,
) -> int:
    """Check an ``.npy`` file's header and exact size; return its data offset.

    The file must be a regular file, not a symlink (``open_store_file``);
    ``ident`` records (or, when it holds ``path``, checks) its identity.

    Raises
    ------
    FormatError
        Missing file, not a regular file, another dtype or shape, or a size
        that is not exactly header + data (numpy itself accepts appended junk
        silently).
    StoreChangedError
        ``ident`` says the file was another one when the store was opened,
        or that it was there then and is gone now.
    """
    fd = open_store_file(path, missing=(
        f"{path}: missing, but the store lists it (in its manifest or part table); the store is damaged: "
        "restore the file from a copy or re-create the store"), ident=ident)
    # the header a writer writes is known byte for byte (npy_header): a file
    # that starts with exactly those bytes has that dtype, shape and offset,
    # with no parse (numpy's goes through ast.literal_eval, the bulk of an
    # open of a store of many parts); any other header is parsed and judged
    want_head = _npy_header(dtype, tuple(shape))
    try:
        st = os.fstat(fd)
        note_identity(ident, path, st)
        fast = os.pread(fd, len(want_head), 0) == want_head
    except BaseException:
        os.close(fd)
        raise
    if fast:
        os.close(fd)
        got_dtype, got_shape, offset = dtype, tuple(shape), len(want_head)
    else:
        with os.fdopen(fd, "rb") as fh:
            got_dtype, got_shape, offset = read_npy_header(path, fh)
    actual = st.st_size
    if got_dtype != dtype or got_dtype.str != dtype.str:
        raise FormatError(f"{path}: header says dtype {got_dtype.str!r}, the manifest says {dtype.str!r}")
    if got_shape != shape:
        raise FormatError(
            f"{path}: header says shape {got_shape}, the manifest expects {shape}; "
            "the file was edited or belongs to another store"
        )
    want = offset + math.prod(shape) * dtype.itemsize  # Python ints: no overflow
    if actual != want:
        what = "truncated (a copy or write did not finish?)" if actual < want else "has extra bytes appended"
        raise FormatError(
            f"{path}: expected {want} bytes ({shape[0] if shape else 1} rows), found {actual}: "
            f"the file {what}; run `mmstore verify` and re-create or repair the store"
        )
    if size is not None and size != actual:
        raise FormatError(f"{path}: the store lists {size} bytes (in its manifest or part table), found {actual}")
    return offset


def entry_error(backend: BackendReader, name: str, slot: int, reason: str) -> EntryDecodeError:
    """The error for a bad entry of variable-size field ``name`` at local
    ``slot`` of ``backend``; ``Store`` adds the dataset index and the key."""
    glob = slot if backend.first is None else backend.first + slot
    return EntryDecodeError(
        f"{backend.root}: field {name!r}, slot {glob}: the stored entry cannot be read: {reason}. Run "
        "`mmstore verify --decode STORE` to list every bad entry, then repair or re-create the store",
        field=name, slot=glob, reason=reason,
    )


def checksum_parts(schema: Schema, fixed: Mapping[str, Any], entries: Mapping[str, Any]) -> list[np.ndarray]:
    """The buffers whose concatenation a slot's checksum covers (format.py,
    "Checksums"): in schema order, a fixed field's bytes, or a variable-size
    field's entry length as ``<u8`` followed by the stored entry."""
    parts: list[np.ndarray] = []
    for f in schema:
        if f.variable:
            e = np.frombuffer(entries[f.name], np.uint8)
            parts.append(np.array([e.nbytes], "<u8"))
            parts.append(e)
        else:
            parts.append(np.ascontiguousarray(fixed[f.name]))
    return parts


def packed_record(schema: Schema, fixed: Mapping[str, Any], entries: Mapping[str, Any]) -> memoryview:
    """A record's checksummed bytes, as one buffer (``iter_packed``)."""
    # ndarray has the buffer protocol; numpy's stubs declare __buffer__ only for Python >= 3.12
    return memoryview(b"".join(checksum_parts(schema, fixed, entries)))  # type: ignore[arg-type]


def unpack_record(schema: Schema, packed: Any) -> tuple[dict[str, np.ndarray], dict[str, memoryview]] | None:
    """Split a record's checksummed bytes (format.py, "Checksums") into its
    fixed fields' arrays and its variable-size fields' stored entries (views
    into ``packed``); None when the bytes do not have that layout (every
    length is checked before slicing)."""
    mv = memoryview(packed).cast("B")
    fixed: dict[str, np.ndarray] = {}
    entries: dict[str, memoryview] = {}
    pos = 0
    for f in schema:
        if f.variable:
            if pos + 8 > len(mv):
                return None
            n = int.from_bytes(mv[pos : pos + 8], "little")
            pos += 8
            if n > len(mv) - pos:
                return None
            entries[f.name] = mv[pos : pos + n]
            pos += n
        else:
            if pos + f.nbytes > len(mv):
                return None
            fixed[f.name] = np.frombuffer(mv, f.dtype, count=math.prod(f.shape), offset=pos).reshape(f.shape)
            pos += f.nbytes
    return (fixed, entries) if pos == len(mv) else None
