"""The mmstore on-disk format, version 2.1: the one place it is specified.

This docstring is the contract. Code elsewhere imports the constants and the
``parse_*`` / ``npy_*`` helpers below and never repeats a literal. "MUST" and
"SHOULD" are duties of writers and readers.

A store is a directory
======================

::

    STORE/
      manifest.json        the manifest; written last; its presence means "complete"
      <field>.npy          memmap backend: one standard .npy file per raw field
      <field>.bin          memmap backend, a variable-size field: its entries back to back
      <field>.offsets.npy  ... and where each starts (see "Encoded fields")
      records.mdb          lmdb backend: one LMDB environment in one file
      _checksums.npy       <u8, shape (slots,): one checksum per slot
      _keys_offsets.npy    <u8, shape (slots + 1,): offsets into _keys.bin
      _keys.bin            the source keys, concatenated raw bytes
      _index.npy           <u8, shape (records,): dataset index -> slot (only with holes)
      errors.jsonl         one JSON object per skipped input or skipped annotation
                           (only with holes or skipped annotations)

A *segmented* store (version 1.1, written by ``mmstore merge``) keeps its
record data in several consecutive segments instead: ``<field>.00000.npy``,
``<field>.00001.npy``, ... or ``records.00000.mdb``, ... (see "Segments").

No other file belongs in a finished store. Names starting with ``_`` are
reserved for the store's own bookkeeping, so field names never start with one.

While a writer works, the directory is named ``STORE.partial`` (see
``PARTIAL_SUFFIX``) and may hold extra bookkeeping files; a writer MUST only
rename it to ``STORE`` after everything above is written and fsynced, and
MUST fsync the parent directory after the rename. A finished store's files
are never changed in place; a store at ``STORE`` is replaced as a whole
(see "Replacing a store").

Slots, records, holes
---------------------

Data files are arrays of ``slots`` fixed-size entries. A *slot* is written
once, at its position, by any writer in any order. A slot whose input failed
to decode is a *hole*: its bytes are zero (memmap) or its key is absent
(lmdb), its checksum is 0, and ``errors.jsonl`` says why. The *records* are
the slots that are not holes, in slot order: dataset index ``i`` maps to
``_index.npy[i]`` when the file exists, else to slot ``i`` (then
``records == slots``). ``_index.npy`` MUST be absent when there are no holes
and present (strictly increasing slots) when there are.

``errors.jsonl``: UTF-8, one object per line. First the holes, sorted by
slot, one line each: ``{"slot": int, "key": str, "reason": str}``; ``key``
decoded as described under "Source keys". Then, for an ingest of annotations
(COCO, ``mmstore/ingest/coco.py``), one line per *skipped annotation*, in the
order of the annotation file: ``{"slot": int | null, "key": str | null,
"annotation": int, "id": int | null, "reason": str}``: ``annotation`` is its
position (from 0) in the file's ``annotations`` list, ``id`` its own ``id``
when that is an integer, ``slot``/``key`` the record of its image, both null
when its image is not a record (an ``image_id`` not in ``images``, or a
malformed annotation); the ``reason``'s first word is its category
(``malformed``, ``unknown-image``, ``unknown-category``, ``bad-box``). A line
with an ``annotation`` key never describes a hole: the number of hole lines
is ``slots - records``. Present exactly when ``records < slots`` or an
annotation was skipped (then listed in the manifest's ``files`` with its
digest, as always; ``_index.npy`` still only with holes). A store with
skipped annotations and no holes is refused by readers older than this rule
(they see an unexpected file).

Stored geometry (an ingest that resizes): ``orig_size`` ``<i4 (2,)`` the
source ``(h, w)`` after EXIF orientation, ``box`` ``<i4 (4,)`` the source
region that was resampled and ``dst`` ``<i4 (4,)`` the record rectangle it
landed in (edges, xyxy; see ``mmstore/decode.py`` "Box convention" and
``mmstore/geometry.py``). Stores written before ``dst`` was stored lack it;
it is a function of ``orig_size`` and the decode spec in the provenance.

The same records written in any order, by any number of writers, MUST give
byte-identical data files, checksums, keys and index: nothing time- or
random-dependent lives outside ``manifest.json``.

manifest.json
-------------

UTF-8 JSON object, at most ``MANIFEST_MAX_BYTES`` bytes (readers MUST check
the size before parsing). Keys (readers MUST ignore unknown keys of the same
major version):

``format``       the string ``"mmstore"`` (``FORMAT_NAME``).
``version``      ``[major, minor]``. This document is ``[2, 1]``. Writers
                 write ``[2, 1]`` for a store with a ragged field (see
                 "Ragged fields"), ``[2, 0]`` for one with another
                 variable-size field (see "Encoded fields"), else ``[1, 0]`` for a store
                 without ``segments`` (every 1.x reader reads it) and
                 ``[1, 1]`` for one with them. Readers MUST refuse a major
                 version they do not know (``VersionError``); a new minor
                 version only adds optional keys.
``store_id``     32 lowercase hex digits, random per store (identifies a store
                 in reports; never written inside data files).
``backend``      ``"memmap"`` or ``"lmdb"``.
``records``      int >= 0, number of records (dataset length).
``slots``        int >= records.
``schema``       list of ``{"name": str, "dtype": str, "shape": [int, ...]}``
                 in packing order. ``name`` matches ``FIELD_NAME_RE``;
                 ``dtype`` is numpy's explicit little-endian (or ``|`` for
                 one-byte types) type string of a bool, int, uint, float or
                 complex type, e.g. ``"|u1"``, ``"<i8"``, ``"<f2"``, ``"|b1"``;
                 ``shape`` a list of ints >= 0 (``[]`` for a scalar); and
                 ``"codec"`` for an encoded field (2.0, see "Encoded fields").
                 A ragged field (2.1) has ``null`` as its first dimension, or
                 ``"dtype": "str"`` / ``"bytes"`` (see "Ragged fields").
                 An integer field may carry ``"classes"`` (see "Class names
                 of a field").
``checksum``     ``{"algorithm": "xxh3_64", "digest": HEX16}``: the algorithm of
                 the per-slot checksums and the xxh3_64 (hex, 16 digits) of the
                 data bytes of ``_checksums.npy`` (after its header), so a
                 manifest copied from another store is detected by ``verify``.
``files``        ``{file name: size in bytes}`` of every file of the store but
                 the manifest. Readers MUST check every size on open.
``digests``      ``{file name: HEX16}``: xxh3_64 of the whole content of each
                 bookkeeping file (``_keys_offsets.npy``, ``_keys.bin``, and
                 ``_index.npy`` and ``errors.jsonl`` when present), so a flipped
                 bit in a key or in the index is found by ``verify`` (record
                 data is covered by the per-slot checksums instead).
``segments``     optional (1.1): list of ints >= 0 summing to ``slots``; see
                 "Segments". Absent: the store is one segment.
``requires``     optional (2.1): list of feature names a reader MUST know to
                 read the store (``["ragged"]``); see "Ragged fields".
``label_names``  list of strings (label ``k`` is ``label_names[k]``) or null.
``provenance``   free-form JSON object: source, parameters, tool version,
                 time. Nothing else in the store may depend on it.

Writing it: write ``manifest.json.tmp``, fsync it, ``os.replace`` it to
``manifest.json``, fsync the directory.

memmap backend
--------------

One file ``<name>.npy`` per schema field, a standard NumPy ``.npy`` file,
version 1.0, that ``numpy.load(path, mmap_mode="r")`` opens: the 6 bytes
``\\x93NUMPY``, the bytes ``1 0``, a little-endian ``<u2`` header length, then
the ASCII header ``{'descr': DTYPE, 'fortran_order': False, 'shape': (SLOTS,
*SHAPE), }`` padded with spaces and ended with ``\\n``. The padding makes the
data start at the smallest multiple of 64 bytes that would also fit the header
with a 20-digit row count, so the header length depends on the dtype and the
field shape only, never on the slot count (``npy_header`` builds it byte for
byte). The same rule applies to every ``.npy`` file of the store. The data is
``slots`` C-ordered entries of ``prod(shape) * itemsize`` bytes each; slot
``s`` starts at ``header_len + s * entry_bytes``. The file size MUST be
exactly ``header_len + slots * entry_bytes``.

lmdb backend
------------

One LMDB environment stored as the single file ``records.mdb`` (opened with
``subdir=False``; no lock file is kept in the store). Main (unnamed)
database. Key: the slot as 8-byte big-endian unsigned integer (so key order is
slot order). Value: exactly ``record_bytes`` bytes, the fields packed in
schema order at fixed offsets with no padding: field ``k`` occupies
``[off_k, off_k + entry_bytes_k)`` with ``off_0 = 0`` and
``off_{k+1} = off_k + entry_bytes_k``; each field is its C-ordered
little-endian bytes. Holes have no key. Writers insert keys in ascending
order, ``LMDB_TXN_RECORDS`` records per write transaction, into a fresh
environment, so the same records give the same file.

Segments
--------

With ``segments = [c_0, c_1, ...]`` the slots are cut into consecutive
ranges: segment ``k`` holds slots ``[b_k, b_k + c_k)`` with ``b_0 = 0`` and
``b_{k+1} = b_k + c_k``. Each segment's record data lives in its own data
files, named with the segment number written as at least 5 decimal digits
(``field_file`` / ``lmdb_file``): memmap ``<field>.<k>.npy`` of shape ``(c_k, *shape)``,
lmdb ``records.<k>.mdb``. Each is exactly the data file a store of ``c_k``
slots would have, with slot numbers local to the segment (slot ``b_k + j`` is
row ``j``, or LMDB key ``j``). The plain ``<field>.npy`` / ``records.mdb``
names are then absent. The bookkeeping files (checksums, keys, index,
errors) are not segmented: they cover all ``slots`` as in any store.

This is how ``mmstore merge`` joins the stores of ``ingest --shard K/N``
without copying record data: each part's data files become one segment as
hard links (the same inodes; a store is never modified after it is written,
so sharing them is safe: ``verify --repair`` writes back only bytes proven to
be the original ones, and replaces an LMDB file with a new one), and only the
small bookkeeping files are written anew. A merged store reads exactly like a single-run ingest of the same
inputs, and its bookkeeping files are byte-identical to that store's.
A 1.0 reader refuses a segmented store (its ``files`` lack ``<field>.npy``)
rather than misreading it.

Encoded fields (version 2.0)
----------------------------

A schema entry may carry ``"codec"``: an object ``{"name": NAME, PARAM: int}``
(``mmstore/codecs.py``): ``{"name": "jpeg", "quality": 1-100}``,
``{"name": "png", "level": 0-9}``, ``{"name": "zstd", "level": 1-19}``.
Absent (or ``{"name": "raw"}``) means *raw*: the fixed-size layout above.
A field with any other codec is *variable-size*: each slot holds one
*entry*, a byte string of any length that decodes to exactly one array of the
field's ``dtype`` and ``shape``:

- ``jpeg``: a baseline JFIF JPEG (as libjpeg-turbo writes it: YCbCr 4:2:0 for
  shape ``(H, W, 3)``, one grey component for ``(H, W)`` / ``(H, W, 1)``) of
  exactly ``H x W`` pixels, decoding to RGB channel order; ``|u1`` only.
- ``png``: a PNG image of exactly ``H x W`` pixels, 8 or 16 bits per sample
  (``|u1`` / ``<u2``), grey, RGB or RGBA in the standard PNG channel order
  (channel 0 is red); lossless.
- ``zstd``: one Zstandard frame whose header carries its content size, which
  decompresses to the entry's C-ordered little-endian bytes (exactly
  ``prod(shape) * itemsize`` of them); lossless.

An entry is exactly one such object: nothing follows a PNG's ``IEND`` chunk
or a zstd frame, and a JPEG entry ends with its end-of-image marker
``FF D9``. Readers refuse an entry with trailing bytes (``EntryDecodeError``).

The offsets index, one layout for every variable-size field (the same layout
serves ragged fields, whose entries are their own length):

memmap backend: two files per variable-size field instead of ``<field>.npy``:
``<field>.bin`` holds the entries back to back in slot order, with no header
and no padding; ``<field>.offsets.npy`` (standard .npy, ``<u8``, shape
``(slots + 1,)``) says where each starts: the entry of slot ``s`` is
``<field>.bin[offsets[s]:offsets[s + 1]]``. ``offsets[0] == 0``, offsets are
non-decreasing, and ``offsets[slots]`` MUST equal the size of ``<field>.bin``.
A hole's entry is empty. In a segmented store each segment has its own pair,
``<field>.<k>.bin`` and ``<field>.<k>.offsets.npy`` (``c_k + 1`` offsets local
to the segment's ``.bin``). Readers MUST check at open, in O(1), the offsets
file's header and size, ``offsets[0] == 0`` and ``offsets[-1] ==`` the data
size, and before each use that ``offsets[s] <= offsets[s + 1] <=`` the data
size; ``verify`` checks the whole array.

lmdb backend: a value is the raw fields packed as in 1.x (schema order,
variable-size fields left out), then one ``<u8`` length per variable-size
field in schema order, then those fields' entries back to back in schema
order. Its size MUST equal the raw bytes plus ``8 x`` the number of
variable-size fields plus the sum of the lengths.

Version: a writer writes ``[2, 0]`` for a store with at least one
variable-size field (segmented or not; ``[2, 1]`` when one is ragged, see
"Ragged fields") and 1.x otherwise, so a 1.x reader,
which refuses major version 2, never misreads an encoded store and every
reader still reads the raw stores it could read before. A 2.0 reader reads
1.0, 1.1 and 2.0, and refuses (``FormatError``) a codec name it does not know.

Ragged fields (version 2.1)
---------------------------

A schema entry may describe a *ragged* field, whose entries have their own
lengths: ``"shape"`` starting with ``null`` (one variable leading dimension,
the rest fixed: ``{"name": "boxes", "dtype": "<f4", "shape": [null, 4]}``,
token ids ``{"dtype": "<i8", "shape": [null]}``), or ``"dtype": "str"``
(UTF-8 text) or ``"dtype": "bytes"`` (bytes as they are), both with
``"shape": [null]``. Only the first dimension may be ``null``; a row (``dtype
x shape[1:]``) has at least one byte. A ragged field is variable-size and is
stored with the offsets index of "Encoded fields", one layout for both (the
``.bin`` + ``.offsets.npy`` pair, the lmdb value layout, the checksum rule).
Its entry is, with no ``codec`` (raw): the C-ordered little-endian bytes of
its ``n x shape[1:]`` elements, where ``n`` = entry size / row bytes (the
entry size MUST be a multiple of the row bytes; readers refuse others with
``EntryDecodeError``); for ``str`` the text's UTF-8 bytes (readers MUST refuse
invalid UTF-8, naming the record and field); for ``bytes`` the bytes. An entry
of zero rows (no boxes, empty text) is empty, and valid. A ragged field may
carry the codec ``zstd`` (``{"name": "zstd", "level": L}``): its entry is then
one zstd frame with its content size, which decompresses to those bytes
(content sizes above ``RAGGED_ZSTD_MAX_BYTES`` are refused). Other codecs are
refused for ragged fields. A hole's entry is empty, as for any
variable-size field.

Version: a writer writes ``[2, 1]`` and ``"requires": ["ragged"]`` for a
store with a ragged field. ``requires`` lists the features a reader MUST
know to read the store; a reader refuses (``VersionError``) a store that
requires a feature it does not know (``KNOWN_FEATURES``). A 2.0 reader, which
knows neither, still refuses such a store rather than misread it: its schema
check rejects a ``null`` dimension and the dtypes ``str`` / ``bytes``
(``FormatError``). 1.x readers refuse major version 2.

Class names of a field
----------------------

A schema entry of an integer field (fixed or ragged, ``int`` or ``uint``
dtype) may carry ``"classes"``: a list of ``[id, name]`` pairs, sorted by id,
each id an integer that fits the dtype and appears once, each name a string
(``{"name": "category", "dtype": "<i8", "shape": [null], "classes": [[1,
"person"], [3, "car"]]}``). It says that the field's values are class ids and
what they are called: a detection store's category per box (COCO ids, which
need not be contiguous), a tag list's tags (ids 0, 1, ...). It is
descriptive: values without a name are valid, and the record data does not
depend on it; but two stores whose fields name their classes differently have
different schemas (``merge`` refuses to join them). A reader that does not
know the key ignores it (an optional key, any 1.x or 2.x version). The
top-level ``label_names`` stays the names of the ``label`` field of
classification stores.

Checksums
---------

``_checksums.npy`` (standard .npy, ``<u8``, shape ``(slots,)``): for each
slot, xxh3_64 (seed 0) of the record's packed bytes, i.e. the concatenation of
its fields' bytes in schema order (the same bytes as an lmdb value), so a
store converted between backends keeps its checksums. A variable-size field
contributes, at its place in schema order, its entry's length as ``<u8``
followed by the entry's stored (encoded) bytes, so without variable-size
fields the rule is the 1.x one. Holes hold 0.

Source keys
-----------

``_keys_offsets.npy`` (standard .npy, ``<u8``, shape ``(slots + 1,)``,
``offsets[0] == 0``, non-decreasing, ``offsets[-1] == size of _keys.bin``) and
``_keys.bin``: the key of slot ``s`` is ``_keys.bin[offsets[s]:offsets[s+1]]``
(empty: no key). Keys are bytes. A key given as ``str`` is encoded as UTF-8
with the ``surrogateescape`` error handler, which is how Python represents a
file name that is not valid UTF-8 (``os.fsdecode``): such a name is stored as
its original bytes, losslessly, and readers decode keys as UTF-8 with
``surrogateescape``, so ``os.fsencode(store.key(i))`` gives back the original
file name bytes. Keys are paths relative to the source root, ids, or
``"<source key>"`` forms chosen by the ingest; they are for tracing and repair.

Names that are not UTF-8 (keys, label names, provenance paths): JSON files
(``manifest.json``, ``errors.jsonl``) are valid UTF-8 in which a byte that was
not part of valid UTF-8 (held in Python as the lone surrogate ``U+DC80`` to
``U+DCFF``) is written as the JSON escape ``\\udcXX``; a JSON parser returns
the lone surrogate and ``os.fsencode`` the original bytes. Writers MUST NOT
write raw invalid UTF-8 into a JSON file (stores of 0.2 may hold such raw bytes
in ``errors.jsonl``; readers decode it with ``surrogateescape``). Text for
people shows such a byte as ``\\xXX`` (``caf\\xe9``). Implemented once, in
``mmstore/_names.py``.

Reading a store from someone else
---------------------------------

Every file of a store is untrusted input. Readers MUST:

- open only regular files, never through a symbolic link (a store's files are
  never symlinks; hard links, as ``merge`` makes, are regular files), and
  never block on opening (``O_NONBLOCK``: a FIFO or device is refused, not
  read) (``open_store_file``);
- bound every size before reading: the manifest by ``MANIFEST_MAX_BYTES``, the
  other files by the sizes the manifest lists, and those (and
  ``slots * entry_bytes`` of every field) by ``MAX_STORE_BYTES``, computed
  with unbounded integers so nothing overflows;
- prove every offset in range before it reaches a copy: ``_index.npy``
  strictly increasing and below ``slots`` (checked once, O(records), before
  its first use), key offsets within ``_keys.bin``, and for lmdb both meta
  pages sane (magic, version, page size) with every page they reach inside
  the file, so a damaged page number is LMDB's "page not found", not a read
  past the end of the mapping;
- read the files they opened: a reader records each file's identity (device,
  inode, size, modification time; ``file_identity``) when it opens the store
  and refuses (``StoreChangedError``) a file that differs when it is mapped
  later (in any process), and checks a mapped file's size before each copy
  out of it (a file truncated under a mapping would otherwise kill the
  process with SIGBUS, or read as zeros within its last page); an entry read
  with ``pread`` instead comes from a descriptor whose identity was checked
  the same way, and a short read is the file having changed.

Replacing a store
-----------------

``overwrite`` (``ingest --overwrite``, ``merge``, ``convert``) builds the new
store in ``STORE.partial`` under the writer lock (``STORE.lock``) and, once
its manifest is written, replaces the old one so that ``STORE`` names one
complete store at every moment:

1. rename ``STORE.partial`` to ``STORE.replaced-XXXXXXXX`` (8 random hex
   digits, ``REPLACED_INFIX``);
2. exchange that name and ``STORE`` in one atomic step (``renameat2`` with
   ``RENAME_EXCHANGE``): ``STORE`` is the new store, the other name the old;
3. fsync the parent directory, then delete the old store.

A file system that cannot exchange two names gets two renames instead
(``STORE`` to ``STORE.replaced-XXXXXXXX``, then ``STORE.partial`` to
``STORE``), between which there is no ``STORE``, only a finished
``STORE.partial``. A writer killed at any point leaves a complete store at
``STORE``, the old or the new one (with two renames: or a finished
``STORE.partial``, which ``--resume`` publishes), plus ``STORE.replaced-*``
directories, which the next publish at ``STORE`` deletes first. A published
directory never comes back under ``STORE`` once moved away from it (but for
a publish by two renames whose second one fails: the old store is renamed
back, and an open that ran meanwhile may fail as if files were missing).

An open MUST see one store, never the manifest of one and files of another:
it holds the directory ``STORE`` names open while it reads (so that no other
directory can take its inode), reads the manifest inside it, checks the
files, then checks that ``STORE`` still names that directory. If it does
not, or if a check failed while it did not, the store was replaced during
the open: the open starts over on the new store, a bounded number of times,
then raises ``StoreChangedError`` (the store is being replaced again and
again; retry once the writer is done). A check that fails while ``STORE``
still names the directory it was opened in is the store's own fault, and is
raised as it is. With no ``STORE`` but a finished ``STORE.partial`` (a
publish by two renames, under way), the open waits briefly before it says so.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
import tokenize
import warnings
from typing import Any

import numpy as np

from .errors import FormatError, StoreAccessError, StoreChangedError

__all__ = [
    "CHECKSUMS_FILE",
    "CHECKSUM_ALGORITHM",
    "ERRORS_FILE",
    "FIELD_NAME_RE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "INDEX_FILE",
    "KNOWN_FEATURES",
    "KEYS_BLOB_FILE",
    "KEYS_OFFSETS_FILE",
    "KEY_DTYPE",
    "LMDB_FILE",
    "LMDB_TXN_RECORDS",
    "MANIFEST_FILE",
    "MAX_STORE_BYTES",
    "MANIFEST_MAX_BYTES",
    "PARTIAL_SUFFIX",
    "PLAIN_VERSION",
    "RAGGED_FEATURE",
    "RAGGED_VERSION",
    "RAGGED_ZSTD_MAX_BYTES",
    "READ_MAJORS",
    "REPLACED_INFIX",
    "SEGMENTED_VERSION",
    "VARIABLE_VERSION",
    "SUPPORTED_BACKENDS",
    "decode_key",
    "encode_key",
    "field_file",
    "file_identity",
    "note_identity",
    "open_store_file",
    "lmdb_file",
    "manifest_version",
    "lmdb_key",
    "normalize_dtype",
    "npy_header",
    "parse_manifest",
    "read_manifest",
    "read_npy_header",
    "segment_tag",
    "variable_files",
]

FORMAT_NAME = "mmstore"
FORMAT_VERSION = (2, 1)  # this document
PLAIN_VERSION = (1, 0)  # what a store without segments or variable-size fields is written as
SEGMENTED_VERSION = (1, 1)  # ... with segments, without variable-size fields
VARIABLE_VERSION = (2, 0)  # ... with a variable-size field (segmented or not)
RAGGED_VERSION = (2, 1)  # ... with a ragged field (see "Ragged fields")
RAGGED_FEATURE = "ragged"  # what such a store's "requires" lists
KNOWN_FEATURES = (RAGGED_FEATURE,)  # the "requires" entries this reader knows
RAGGED_ZSTD_MAX_BYTES = 1 << 31  # a zstd entry of a ragged field decompresses to at most this
READ_MAJORS = (1, 2)  # the major versions this reader reads
MANIFEST_FILE = "manifest.json"
MANIFEST_MAX_BYTES = 64 * 1024 * 1024
MAX_STORE_BYTES = 2**62  # no file of a store, and no field's data, is larger (so sizes fit int64)
PARTIAL_SUFFIX = ".partial"
REPLACED_INFIX = ".replaced-"  # STORE.replaced-XXXXXXXX: a store being swapped in or out (see "Replacing a store")
CHECKSUMS_FILE = "_checksums.npy"
KEYS_OFFSETS_FILE = "_keys_offsets.npy"
KEYS_BLOB_FILE = "_keys.bin"
INDEX_FILE = "_index.npy"
ERRORS_FILE = "errors.jsonl"
LMDB_FILE = "records.mdb"
LMDB_TXN_RECORDS = 1024
CHECKSUM_ALGORITHM = "xxh3_64"
SUPPORTED_BACKENDS = ("memmap", "lmdb")
KEY_DTYPE = np.dtype("<u8")
FIELD_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
_NPY_MAGIC = b"\x93NUMPY"
_NPY_HEADER_LOCK = threading.Lock()


def _new_header_lock_after_fork() -> None:
    # a child forked while another thread held the lock would inherit it held
    # forever (regression test: fork readers while verify runs)
    global _NPY_HEADER_LOCK
    _NPY_HEADER_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_header_lock_after_fork)
_NPY_ALIGN = 64
_NPY_WIDEST_ROWS = 10**20 - 1  # header length is the one for a 20-digit row count
_DTYPE_KINDS = "biufc"


def segment_tag(segment: int | None) -> str:
    """``""`` for an unsegmented store, else ``".00042"`` (at least 5 digits)."""
    return "" if segment is None else f".{int(segment):05d}"


def field_file(name: str, segment: int | None = None) -> str:
    """File name of field ``name`` in a memmap store (of one segment)."""
    return f"{name}{segment_tag(segment)}.npy"


def variable_files(name: str, segment: int | None = None) -> tuple[str, str]:
    """``(data, offsets)`` file names of variable-size field ``name`` in a
    memmap store (of one segment): ``<field>.bin``, ``<field>.offsets.npy``."""
    tag = segment_tag(segment)
    return f"{name}{tag}.bin", f"{name}{tag}.offsets.npy"


def manifest_version(variable: bool, segmented: bool, ragged: bool = False) -> tuple[int, int]:
    """The version a writer writes (see ``version``): 2.1 with a ragged
    field, 2.0 with another variable-size field, else 1.1 with segments, else 1.0."""
    if ragged:
        return RAGGED_VERSION
    if variable:
        return VARIABLE_VERSION
    return SEGMENTED_VERSION if segmented else PLAIN_VERSION


def lmdb_file(segment: int | None = None) -> str:
    """File name of the LMDB environment (of one segment)."""
    return LMDB_FILE if segment is None else f"records{segment_tag(segment)}.mdb"


def lmdb_key(slot: int) -> bytes:
    """LMDB key of ``slot``: 8-byte big-endian unsigned."""
    return int(slot).to_bytes(8, "big")


def encode_key(key: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> bytes:
    """Encode a source key for storage (see "Source keys")."""
    if isinstance(key, os.PathLike):
        key = os.fspath(key)
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8", "surrogateescape")
    raise TypeError(f"a source key must be str or bytes, got {type(key).__name__}")


def decode_key(raw: bytes) -> str:
    """Decode a stored key (UTF-8 with ``surrogateescape``)."""
    return bytes(raw).decode("utf-8", "surrogateescape")


def normalize_dtype(dtype: Any, *, where: str = "dtype") -> np.dtype:
    """Return ``dtype`` as an explicit little-endian numpy dtype.

    Raises
    ------
    FormatError
        When it is not a bool, int, uint, float or complex type.
    """
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise FormatError(f"{where}: {dtype!r} is not a numpy dtype ({exc})") from None
    if dt.kind not in _DTYPE_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise FormatError(
            f"{where}: dtype {dt.str!r} is not supported; expected a bool, int, uint, "
            "float or complex type such as '|u1', '<i8', '<f4'"
        )
    if dt.itemsize > 1:
        dt = dt.newbyteorder("<")
    return dt


def _npy_text(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    shape_txt = "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"
    return "{'descr': %r, 'fortran_order': False, 'shape': %s, }" % (dtype.str, shape_txt)


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The exact bytes of a version 1.0 ``.npy`` header for a C-ordered array.

    The header is padded so that its length does not depend on ``shape[0]``
    (the slot count): see "memmap backend".
    """
    text = _npy_text(dtype, shape)
    widest = _npy_text(dtype, (_NPY_WIDEST_ROWS,) + tuple(shape[1:])) if shape else text
    prefix = len(_NPY_MAGIC) + 2 + 2
    total = -(-(prefix + len(widest) + 1) // _NPY_ALIGN) * _NPY_ALIGN
    body = (text + " " * (total - prefix - len(text) - 1) + "\n").encode("latin1")
    if len(body) > 0xFFFF:
        raise FormatError(f"npy header too long ({len(body)} bytes) for shape {shape}")
    return _NPY_MAGIC + b"\x01\x00" + len(body).to_bytes(2, "little") + body


def read_npy_header(path: str, fh: Any) -> tuple[np.dtype, tuple[int, ...], int]:
    """Parse the header of an open ``.npy`` file.

    Returns ``(dtype, shape, data_offset)``.

    Raises
    ------
    FormatError
        Not an .npy file, Fortran order, or an unreadable header.
    """
    try:
        # numpy parses the header with ast.literal_eval, which CPython 3.11 can
        # fail with "SystemError: AST constructor recursion depth mismatch"
        # when threads parse at once (found opening stores from 150 threads)
        with _NPY_HEADER_LOCK, warnings.catch_warnings():
            # a damaged header makes numpy warn ("created on Python 2") and
            # re-parse it: that is a FormatError here, not a warning
            warnings.simplefilter("error")
            major, minor = np.lib.format.read_magic(fh)
            if (major, minor) == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh, max_header_size=65536)
            elif (major, minor) in ((2, 0), (3, 0)):
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh, max_header_size=65536)
            else:
                raise ValueError(f"unknown .npy version {major}.{minor}")
    except (ValueError, OSError, SyntaxError, TypeError, EOFError, Warning, tokenize.TokenError,
            RecursionError) as exc:
        raise FormatError(
            f"{path}: not a readable .npy header ({exc}); the file is damaged: "
            "run `mmstore verify` or re-create the store"
        ) from None
    if fortran:
        raise FormatError(f"{path}: Fortran-ordered .npy is not a store file")
    return dtype, tuple(int(d) for d in shape), fh.tell()


# --------------------------------------------------------------------------
# manifest parsing: untrusted JSON -> typed values, or FormatError naming the key
# (the parser itself is _manifest.py)


def _fail(path: str, what: str) -> FormatError:
    return FormatError(f"{path}: {what}; the manifest is damaged or not an mmstore manifest")


def parse_manifest(raw: bytes, path: str = MANIFEST_FILE) -> dict[str, Any]:
    """Validate manifest bytes and return a normalised dict.

    The result has the keys of the spec with typed values: ``version`` a
    tuple, ``schema`` a list of ``(name, np.dtype, shape tuple)``, and
    ``checksum_digest`` split out of ``checksum``.

    Raises
    ------
    VersionError
        Another major version.
    FormatError
        Anything else that does not match the spec.
    """
    # the parser needs this module's constants, so it is imported here, not at the top
    from ._manifest import parse_manifest as parse

    return parse(raw, path)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def open_store_file(
    path: str, missing: str | None = None, *, dir_fd: int | None = None,
    ident: dict[str, tuple[int, int, int, int]] | None = None,
) -> int:
    """Open a store file for reading (see "Reading a store from someone
    else"); return the descriptor, a regular file's.

    ``missing``: the message of the ``FormatError`` for a file that is not
    there; None lets ``FileNotFoundError`` through (the caller words it).
    ``dir_fd``: a descriptor of the store's directory; the file is then its
    entry ``basename(path)`` (``path`` names it in messages).
    ``ident``: the identities noted when the store was opened (see
    ``note_identity``); a file noted there that is gone now raises
    ``StoreChangedError`` instead (the store was moved, deleted or replaced).

    Raises
    ------
    FormatError
        A symbolic link (dangling or not), a directory, FIFO, device or socket.
    StoreAccessError
        Permission denied.
    StoreChangedError
        ``path`` is in ``ident`` but no longer there.
    """
    try:
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags) if dir_fd is None else os.open(os.path.basename(path), flags, dir_fd=dir_fd)
    except (FileNotFoundError, NotADirectoryError):
        if ident and path in ident:
            raise StoreChangedError(f"{path}: missing; the store was moved, deleted or replaced since it was "
                                    "opened: reopen it (mmstore.open)") from None
        if missing is None:
            raise
        raise FormatError(missing) from None
    except PermissionError:
        raise StoreAccessError(
            errno.EACCES, f"{path}: permission denied; the store's files must be readable by this user "
            "(ask its owner, or copy the store)"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise FormatError(
                f"{path}: is a symbolic link; a store's files must be regular files inside the store "
                "(copy the file in, or re-create the store)"
            ) from None
        raise FormatError(f"{path}: cannot be opened ({exc.strerror}); the store is damaged or unreadable") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise FormatError(f"{path}: is {kind}, expected a regular file; this is not a store file")
    return fd


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What makes a store file the one a reader opened: device, inode, size,
    modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def note_identity(
    ident: dict[str, tuple[int, int, int, int]] | None, path: str, st: os.stat_result, *, mtime: bool = True
) -> None:
    """Record ``path``'s identity in ``ident`` the first time; later, raise
    ``StoreChangedError`` when it differs (the file was replaced or changed).
    ``mtime=False``: only the device, inode and size must match (bytes
    changed in place are damage for ``verify`` to find, not another file)."""
    if ident is None:
        return
    now = file_identity(st)
    was = ident.setdefault(path, now)
    if was != now and (mtime or was[:3] != now[:3]):
        what = [w for w, a, b in zip(("device", "inode", "size", "modification time"), was, now) if a != b]
        raise StoreChangedError(
            f"{path}: changed since the store was opened ({', '.join(what)} differ: {was[2]} bytes, inode "
            f"{was[1]} then; {now[2]} bytes, inode {now[1]} now): the store was replaced or modified while in "
            "use. Reopen it (mmstore.open) to read the new store; an open Store never mixes the two"
        )


def _unfinished(store_dir: str) -> str:
    """Why there is only ``STORE.partial``, and how to finish it: what made
    it (an ingest, a merge or a ``StoreWriter``) says which."""
    partial = store_dir + PARTIAL_SUFFIX
    head = f"{store_dir}: no store here, but {partial} exists: "
    if os.path.isfile(os.path.join(partial, MANIFEST_FILE)):
        return (head + "it holds a finished store waiting to be published (renamed to "
                f"{os.path.basename(store_dir)}): a writer is publishing it right now (open the store again in a "
                "moment) or was stopped just before; to publish it, rerun the same `mmstore ingest ... --resume` "
                "command (Python: ingest(..., resume=True)), or rerun the merge")
    if os.path.isfile(os.path.join(partial, "_ingest.json")):
        return (head + "an ingest into it did not finish; rerun the same `mmstore ingest ... --resume` command "
                "(Python: the same ingest(..., resume=True) call) to complete it")
    if os.path.isfile(os.path.join(partial, "_merging")):
        return head + "a merge into it did not finish; rerun the same `mmstore merge` command (it starts over)"
    return (head + "a StoreWriter writing it was not closed (an error inside its `with` block, or the process "
            "stopped); continue it with StoreWriter(path, <the same schema and slots>, resume=True) (what was "
            "written keeps its bytes: mark_written() the slots you synced, write the others, then close()), or "
            "start over with overwrite=True")


def _no_manifest(store_dir: str) -> str:
    """Why directory ``store_dir`` (no manifest) cannot be opened, and what to
    do: a store that lost its manifest, or a plain folder (of images, say)
    that was never ingested. Looks at no more than 10,000 names."""
    import itertools
    import shlex

    marks = {CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE}
    try:
        with os.scandir(store_dir) as it:
            found = sorted(e.name for e in itertools.islice(it, 10_000) if e.name in marks)
    except OSError:
        found = []
    if found:
        return (f"{store_dir}: no {MANIFEST_FILE}, but store files ({', '.join(found)}): this is not a finished "
                "mmstore store; its manifest was deleted or not copied (copy the store again, or re-create it)")
    return (f"{store_dir}: no {MANIFEST_FILE}: a plain folder, not an mmstore store; to make a store from the "
            f"files in it: mmstore ingest {shlex.quote(store_dir)} DEST.store")


def read_manifest(store_dir: str, *, dir_fd: int | None = None) -> dict[str, Any]:
    """Read and validate ``store_dir/manifest.json`` (size capped first).

    ``dir_fd``: a descriptor of the directory ``store_dir`` named when the
    caller opened it; the manifest is read from that directory even if
    ``store_dir`` names another one by now (see "Replacing a store")."""
    from .errors import IncompleteStoreError

    path = os.path.join(store_dir, MANIFEST_FILE)
    if dir_fd is None and os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise IncompleteStoreError(f"{store_dir}: is a file, not a store (a store is a directory)")
    try:
        fd = open_store_file(path, dir_fd=dir_fd)
    except FileNotFoundError:
        if os.path.isdir(store_dir + PARTIAL_SUFFIX) and not os.path.isdir(store_dir):
            raise IncompleteStoreError(_unfinished(store_dir)) from None
        if os.path.isdir(store_dir):
            raise IncompleteStoreError(_no_manifest(store_dir)) from None
        raise IncompleteStoreError(f"{store_dir}: no such store (directory not found)") from None
    except NotADirectoryError:
        raise IncompleteStoreError(f"{store_dir}: not a store (a path component is a file)") from None
    try:
        size = os.fstat(fd).st_size
        if size > MANIFEST_MAX_BYTES:
            raise _fail(path, f"size {size} bytes exceeds the {MANIFEST_MAX_BYTES}-byte limit")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            if sum(map(len, chunks)) > MANIFEST_MAX_BYTES:
                raise _fail(path, f"larger than the {MANIFEST_MAX_BYTES}-byte limit")
    finally:
        os.close(fd)
    return parse_manifest(b"".join(chunks), path)
