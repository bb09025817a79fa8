"""The mmstore on-disk format, version 2.4: the one place it is specified.

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
      _parts.bin           the part table of a store of many parts (see "The part table")

A *segmented* store (version 1.1, written by ``mmstore merge``) keeps its
record data in several consecutive segments instead: ``<field>.00000.npy``,
``<field>.00001.npy``, ... or ``records.00000.mdb``, ... (see "Segments").
A store joined from *parts* (version 2.2, written by ``mmstore.ray.write``)
keeps each segment's data files in a directory of its own,
``parts/<part id>/<field>.npy`` ... (see "Parts"); a store of many parts
(version 2.4) lists them in ``_parts.bin`` instead of the manifest (see
"The part table").

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
landed in (edges, xyxy; see ``mmstore/decode/__init__.py`` "Box convention" and
``mmstore/decode/geometry.py``); a record that keeps its image's aspect
(a shaped field) has ``box`` the whole source and ``dst`` the whole record,
``(0, 0, w, h)`` of its ``F_hw``. Stores written before ``dst`` was stored lack it;
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
``version``      ``[major, minor]``. This document is ``[2, 4]``. Writers
                 write ``[2, 4]`` for a store with a ``part_table`` (see
                 "The part table"), ``[2, 3]`` for one with a shaped field (see
                 "Images of their own shape"), ``[2, 2]`` for one with
                 ``parts`` (see "Parts"), ``[2, 1]`` for one with a ragged field (see
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
                 ``"dtype": "str"`` / ``"bytes"`` (see "Ragged fields");
                 a shaped field (2.3) ``null`` as its first two (see
                 "Images of their own shape").
                 An integer field may carry ``"classes"`` (see "Class names
                 of a field"), a shaped field ``"buckets"`` (see "Aspect
                 buckets").
``checksum``     ``{"algorithm": "xxh3_64", "digest": HEX16}``: the algorithm of
                 the per-slot checksums and the xxh3_64 (hex, 16 digits) of the
                 data bytes of ``_checksums.npy`` (after its header), so a
                 manifest copied from another store is detected by ``verify``.
``files``        ``{file name: size in bytes}`` of every file of the store but
                 the manifest (with a ``part_table``: but the parts' data
                 files, whose sizes the table holds). Readers MUST check
                 every size on open, but for a part table's parts: a part's
                 files are checked before the first byte of that part is
                 read (see "The part table"); ``verify`` checks them all.
``digests``      ``{file name: HEX16}``: xxh3_64 of the whole content of each
                 bookkeeping file (``_keys_offsets.npy``, ``_keys.bin``, and
                 ``_index.npy`` and ``errors.jsonl`` when present), so a flipped
                 bit in a key or in the index is found by ``verify`` (record
                 data is covered by the per-slot checksums instead).
``segments``     optional (1.1): list of ints >= 0 summing to ``slots``; see
                 "Segments". Absent: the store is one segment.
``parts``        optional (2.2): list of part ids, one per segment; see
                 "Parts". Absent: the segments' files are in the store's
                 own directory, or a ``part_table`` lists the parts.
``part_table``   optional (2.4): ``{"file": "_parts.bin", "parts": N}``,
                 in place of ``parts`` and ``segments`` (both then absent);
                 see "The part table".
``requires``     optional (2.1): list of feature names a reader MUST know to
                 read the store (``["ragged"]``, ``["parts"]``,
                 ``["shapes"]``, ``["part_table"]``), in that order when
                 several; see "Ragged fields", "Parts", "Images of their
                 own shape" and "The part table".
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

Parts (version 2.2)
-------------------

A store may be joined from *parts* written independently, on other machines
or into object storage, with no copy of their record data and without
needing one file system for hard links: ``"parts": [id_0, id_1, ...]`` pairs
with ``segments`` (the same length), and segment ``k``'s data files are
those an unsegmented store of ``c_k`` slots would have, under the directory
``parts/<id_k>/``: ``parts/<id_k>/<field>.npy``, ``parts/<id_k>/<field>.bin``
and ``parts/<id_k>/<field>.offsets.npy``, or ``parts/<id_k>/records.mdb``
(slot numbers local to the segment, as in "Segments"). ``files`` lists them
under those names (``"parts/00003-1f0c/image.npy": 9830464``) beside the
store's own files; the bookkeeping files (checksums, keys, index, errors)
cover all slots in the store's directory, as in any store.

A part id matches ``PART_ID_RE`` (letters, digits, ``_``, ``.``, ``-``; at
most 128 characters; starting with a letter or digit) and appears once.
``files`` names nothing else with a ``/``: no other directory, no ``..``,
no absolute path, so a store from someone else can make a reader open
nothing outside its own directory (or, in object storage, its own prefix).
Readers MUST check every name against this rule. The directory ``parts``
and each part's directory hold nothing but the files listed; ``verify``
reports anything else as stray.

The record data of a part is never rewritten by the join: each part is
written once, complete, by one writer (an engine's task attempt, named by
task and attempt), and the store that joins them (its bookkeeping and
manifest, written last) is the commit: a part that no manifest lists is not
part of any store and is removed by the next write to that destination.
The same inputs in the same order give byte-identical data files per
segment, checksums, keys, index and ``errors.jsonl`` whatever the number of
parts: a store with parts reads exactly like a single-run ingest.

Version: a writer writes ``[2, 2]`` and ``requires`` with ``"parts"`` (after
``"ragged"`` when the store has a ragged field) for a store with parts (of
fewer than ``PART_TABLE_MIN_PARTS``; more are listed in a part table, version
2.4: see "The part table"). A
2.1 reader refuses it because it does not know the feature (``VersionError``);
a 2.0 reader refuses it because its ``files`` name files with a ``/`` and
lack the segments' ``<field>.<k>.npy``; 1.x readers refuse major version 2.

Appending (``mmstore append``, ``mmstore/ingest/append.py``) makes a store
with parts from a store and a new part (or several: an append of a Ray
write, ``mmstore.ray.write(..., append=True)``): the store's parts keep
their ids (a plain or segmented store's segment ``k`` becomes the part
``<k as 5 digits>-<the first 8 digits of its store_id>``), the new parts
come last, and the result is a new store (a new ``store_id``) that replaces
the old one as in "Replacing a store". Its ``provenance`` lists each append
in ``"appended"``: ``{"to_store": store_id, "part": id, "records": int,
...}`` (``part``: the first new part; ``"parts"``: all of them, when there
are several), ``to_store`` the id of the store appended to. A part's data files
are never rewritten, so a store and every store in its ``appended``
``to_store`` ids hold the same bytes under the same part file names:
``push`` of a store to a URL that holds one of those stores keeps the
objects of their shared part files that still match that URL's remote
index, and uploads the rest. A reader that opened a store and opens one
of its files only after an append replaced it (a field it had not read, a
reader in another process, handed the store) may read that store's records
through the new one, whose ``appended`` lists the old store's id as a
``to_store``: its first ``slots`` slots, with the old store's schema,
backend and (first) label names, are that store. Nothing else depends on
``appended``.

The part table (version 2.4)
----------------------------

A store of many parts (``mmstore.ray.write`` makes one part per
``part_rows`` rows: a billion rows, a million parts) would need a manifest
entry per part and per part file, 80 to 130 bytes a part, so that a store of
more than about 500,000 parts could not be written within
``MANIFEST_MAX_BYTES``, and an open would parse them all and look at every
part's files. Such a store lists its parts in one binary file instead,
``_parts.bin`` (``PART_TABLE_FILE``), the *part table*, and its manifest
carries ``"part_table": {"file": "_parts.bin", "parts": N}`` in place of
``parts`` and ``segments``; ``files`` lists ``_parts.bin`` (its size) and
none of the parts' data files, and ``digests`` lists its xxh3_64. The
stores are otherwise those of "Parts": the same directories, data files and
bookkeeping files; only where the list of parts is kept differs, and a
store read through either form reads the same records.

The table, every integer ``<u8`` (little-endian, unsigned 64-bit):

- 32 bytes of head: the 8 bytes ``MMSPARTS`` (``PART_TABLE_MAGIC``), then
  ``N`` (the number of parts, at least 1), ``F`` (the data files per part)
  and ``L`` (the bytes of the part ids, all together);
- ``ends``: ``N`` integers, the end (exclusive) of each part's slots: part
  ``k`` holds slots ``[ends[k-1], ends[k])`` (``ends[-1]`` counting as 0),
  the segment ``c_k = ends[k] - ends[k-1]`` of "Segments";
- ``sizes``: ``N x F`` integers, row ``k`` the sizes of part ``k``'s data
  files in the order an unsegmented store of the backend and schema names
  them (memmap: each field in schema order, ``<field>.npy``, or
  ``<field>.bin`` then ``<field>.offsets.npy`` for a variable-size field;
  lmdb: ``records.mdb``): the sizes ``files`` would list for
  ``parts/<id_k>/<name>``;
- ``id_ends``: ``N`` integers, the end of each part's id in the id bytes;
- the id bytes: the ``N`` part ids, ASCII, back to back (part ``k``'s id is
  ``ids[id_ends[k-1]:id_ends[k]]``).

So the file has exactly ``32 + 8 N (2 + F) + L`` bytes. Rules, each a
``FormatError`` that says what was expected and what was found: the head
starts with the magic; ``N`` equals the manifest's ``parts``; ``F`` equals
the data files a part of this backend and schema has; ``N <= L <= 128 N``;
the size is exactly the one above (checked against ``files`` and the
head before anything else is read); the whole file's xxh3_64 equals
``digests["_parts.bin"]``; ``ends`` is non-decreasing and its last is
``slots``; no size exceeds ``MAX_STORE_BYTES``; each id is 1 to 128 bytes
matching ``PART_ID_RE``; and (checked by ``verify`` and by every tool that
lists the parts, not by a reader reading records) no id appears twice. The
manifest's ``files`` size of ``_parts.bin`` is refused above the most a table
of ``N`` parts can have (``L = 128 N``), so no reader ever reads more of it.

Reading. An open checks the table's size and head against the manifest, in
O(1), and reads nothing else of it nor of any part. Before its first use
(the first read of a record, the first look at the part list), a reader
reads the whole table, once, checks its digest and every rule above, and
keeps it as a few arrays: the part of slot ``s`` is found by a binary search
in ``ends``. A part's data files are checked (the rules of "Reading a store
from someone else": a regular file, its identity noted, its ``.npy`` header
and exact size, the size the table lists) before the first byte of that part
is read, and then kept open for the reads that follow; ``verify`` checks every
part's files, and the table itself, with every rule. So a damaged table is an
error at open or before the first record is returned, never a wrong record.

Writing. A writer writes the table, and version ``[2, 4]`` with ``requires``
listing ``"parts"`` and ``"part_table"`` (last), when a store has at least
``PART_TABLE_MIN_PARTS`` parts (1,000), and the 2.2 form below that. The
threshold keeps the stores of a few parts (an append, a write of a modest
data set) readable by 2.2 and 2.3 readers, which refuse a store that requires
the feature (``VersionError``, naming it); from 1,000 parts the per-part
JSON of the 2.2 form costs an open more than the table and grows towards the
manifest's limit. Readers read both forms. A tool that rewrites a store's
parts (the join of parts, ``append``, ``verify --repair`` rebuilding a part)
writes the table again, with its new size and digest in the manifest.

In object storage the table is one more store file (pushed, pulled and
indexed as any other); a reader fetches it whole after the manifest and
before the remote index, no more than the size the manifest lists, and
checks it as above; the manifest's files with the parts' files from the
table are what the remote index must list.

Encoded fields (version 2.0)
----------------------------

A schema entry may carry ``"codec"``: an object ``{"name": NAME, PARAM: int}``
(``mmstore/format/codecs.py``): ``{"name": "jpeg", "quality": 1-100}``,
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

Images of their own shape (version 2.3)
---------------------------------------

A schema entry may describe a *shaped* field: images that keep their own
height and width (``mmstore ingest --max-side N`` / ``--short-side N``),
``"shape": [null, null, C]`` (``C`` from 1 to 4) or ``[null, null]``, any
dtype its codec stores (``{"name": "image", "dtype": "|u1", "shape": [null,
null, 3], "codec": {"name": "jpeg", "quality": 90}}``). Every shaped field
``F`` comes with its *companion* field ``F_hw`` (``HW_SUFFIX``), a fixed raw
field ``{"name": "F_hw", "dtype": "<u4", "shape": [2]}`` that a writer puts
right after it: record ``s``'s ``(h, w)``, both at least 1 (a hole's is
``[0, 0]``, as any field of a hole). Readers MUST refuse (``FormatError``) a
schema with a shaped field whose companion is missing or of another dtype,
shape or codec. So a record's shape is known in O(1) without reading its
entry (``F_hw.npy`` is a standard ``.npy``: the shapes of all records are
one array), and a store of shaped fields reads as fast as any variable-size
store: two lookups and one copy, then the decode.

A shaped field is variable-size and is stored with the offsets index of
"Encoded fields" (the ``.bin`` + ``.offsets.npy`` pair, the lmdb value
layout, segments and parts, the checksum rule: nothing new). Its entry is,
for the record of size ``h x w`` (``F_hw``):

- ``raw`` (no codec): the C-ordered little-endian bytes of its ``h x w x C``
  (``h x w``) array: exactly ``h * w * C * itemsize`` bytes;
- ``zstd``: one zstd frame with its content size, which decompresses to
  those bytes;
- ``jpeg`` / ``png``: as in "Encoded fields", an image of exactly
  ``h x w`` pixels (the channels, dtype and end rules of those codecs).

A record decodes to at most ``SHAPED_MAX_BYTES`` bytes (2 GiB); readers
refuse a larger ``F_hw`` (``EntryDecodeError``) before they allocate.
Readers MUST check an entry against ``F_hw`` before they allocate or decode:
a raw entry's size, a zstd frame's content size, a JPEG's frame header or a
PNG's ``IHDR`` must give ``h x w`` (``EntryDecodeError`` naming the record
and field otherwise); ``verify`` checks every entry so in its full pass.
A record is read as the array of shape ``(h, w, C)`` (``(h, w)``); a batch
of a shaped field is a list of such arrays.

Version: a writer writes ``[2, 3]`` and ``requires`` with ``"shapes"``
(``SHAPES_FEATURE``, after ``"ragged"`` and ``"parts"`` when the store
has those) for a store with a shaped field. A 2.1 or 2.2 reader refuses it
because it does not know the feature (``VersionError``); a 2.0 reader
because its schema check rejects a ``null`` dimension; 1.x readers refuse
major version 2. A shaped field alone does not make a store list
``"ragged"``.

Aspect buckets
--------------

A shaped field may carry ``"buckets"`` (``mmstore ingest --buckets``): a
non-empty list of ``[h, w]`` pairs, the only sizes its records have
(``{"name": "image", "dtype": "|u1", "shape": [null, null, 3], "buckets":
[[320, 192], [256, 256], [192, 320]]}``). Each pair is two positive ints; no
pair appears twice and no two have one aspect (``h / w``); a bucket of
``h * w * C * itemsize`` bytes above ``SHAPED_MAX_BYTES`` is not allowed; at
most ``MAX_BUCKETS`` (1024) pairs; listed from the tallest to the widest
(``w / h`` ascending, compared exactly). Readers MUST refuse
(``FormatError``) a ``"buckets"`` key on a field that is not shaped or a list
that breaks these rules. Every record's ``F_hw`` MUST equal one of the
pairs (a hole's is ``[0, 0]``): a reader refuses a record whose ``F_hw`` is
none of them (``EntryDecodeError``, as for any size that does not fit its
entry), and ``verify`` reports it (a ``shape`` problem of that record). So
the records of one bucket all have one shape, and the bucket of every record
is known from ``F_hw.npy`` alone.

Version: a bucketed store is a 2.3 store with a shaped field, nothing more:
the same ``[2, 3]`` and ``requires: ["shapes"]``. A 2.3 reader that predates
the key ignores it (an unknown optional key) and still reads every record
correctly, at its own size, since the entries and ``F_hw`` follow the rules
of "Images of their own shape" unchanged; it just does not know that the
sizes form buckets (nor check that each record's is one).

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
``mmstore/format/names.py``.

Reading a store from someone else
---------------------------------

Every file of a store is untrusted input. Readers MUST:

- open only regular files, never through a symbolic link (a store's files are
  never symlinks; hard links, as ``merge`` makes, are regular files), and
  never block on opening (``O_NONBLOCK``: a FIFO or device is refused, not
  read) (``open_store_file``);
- bound every size before reading: the manifest by ``MANIFEST_MAX_BYTES``, the
  other files by the sizes the manifest (or its part table) lists, and those (and
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

A store in object storage
-------------------------

A store at a URL (``s3://BUCKET/PREFIX``, ``gs://``, ``az://``, ``http(s)://``)
is the store's files as objects named ``PREFIX/<file name>``, plus one more,
``_remote.json`` (``REMOTE_INDEX_FILE``), the *remote index*: what a reader
needs to fetch any byte range of any file and verify it before use.
UTF-8 JSON, at most ``REMOTE_INDEX_MAX_BYTES``:

``format``       the string ``"mmstore-remote"`` (``REMOTE_FORMAT_NAME``).
``version``      ``[1, 0]`` (``REMOTE_FORMAT_VERSION``); readers MUST refuse
                 another major version.
``store_id``     the manifest's ``store_id``.
``block_bytes``  the block size B: a multiple of 4096 in ``[64 KiB, 1 GiB]``.
                 File ``f``'s block ``k`` is its bytes ``[k*B, min((k+1)*B, size))``.
``digest``       ``"xxh3_128"``: the algorithm of every digest below.
``files``        ``{file name: {"size": int, "digest": HEX32, "blocks": BASE64,
                 "etag": str | null}}`` for every file of the store, the
                 manifest included: its size, the digest of its whole
                 content, the digests of its blocks (16 bytes each, big-endian
                 as xxh3_128's canonical form, concatenated, then base64: exactly
                 ``ceil(size / B)`` of them) and the object's etag as the server
                 gave it when it was written (null for the manifest, which is
                 written after the index).

Writing (``mmstore push``): upload every file but the manifest, then the
remote index, then ``manifest.json``, last: a prefix without a manifest is
not a store, whatever else it holds. Replacing a store at a URL first
deletes its manifest. While a push writes, ``_push.json``
(``PUSH_MARK_FILE``: ``{"format": "mmstore-push", "store_id": ...,
"files": [names]}``) names the objects it writes; it is deleted once the
manifest is up. A writer MUST NOT delete or overwrite an object under the
prefix that neither the manifest, the remote index nor that mark found
there names (another store under the prefix, anything else), nor one they
name that is not a name a store's file can have (``is_store_file_name``:
the files above, ``<field>.npy``, ``.bin``, ``.offsets.npy``,
``records.mdb``, their segment forms ``<base>.<k><ext>``, and those under
``parts/<part id>/``): they are anyone's to write. A zero-byte key ending
in ``/`` (a "folder") is no store's and is left alone. Readers MUST check that the index's files are the
manifest's ``files`` plus ``manifest.json`` with the same sizes and the
manifest's digest, that every block fetched matches its digest before
any byte of it is used, and SHOULD fetch with the etag as a precondition,
so that a store pushed again meanwhile is refused, never mixed
(``RemoteChangedError``). Everything in the bucket is untrusted input:
readers MUST NOT download more of ``manifest.json`` or ``_remote.json``
than its limit (``MANIFEST_MAX_BYTES``, ``REMOTE_INDEX_MAX_BYTES``) plus one
byte; a reader reads the manifest first and SHOULD read no more of the index
than the largest a store of the manifest's files can have (each file's entry
with ``ceil(size / 64 KiB)`` block digests, an etag of 1024 characters, and
4 KiB for the index's own keys: ``mmstore.remote.index.index_max_bytes``)
plus one byte, and MUST check every file size that the schema and slot count fix
(every ``.npy`` file) against the manifest's ``files`` before they create a
file at that size.
"""

from __future__ import annotations

from .layout import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_FILE,
    ERRORS_FILE,
    FIELD_NAME_RE,
    FORMAT_NAME,
    FORMAT_VERSION,
    HW_SUFFIX,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    KNOWN_FEATURES,
    LMDB_FILE,
    LMDB_TXN_RECORDS,
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    MAX_STORE_BYTES,
    PART_ID_RE,
    PART_TABLE_FEATURE,
    PART_TABLE_FILE,
    PART_TABLE_MIN_PARTS,
    PART_TABLE_VERSION,
    PARTIAL_SUFFIX,
    PARTS_DIR,
    PARTS_FEATURE,
    PARTS_VERSION,
    PLAIN_VERSION,
    RAGGED_FEATURE,
    RAGGED_VERSION,
    RAGGED_ZSTD_MAX_BYTES,
    READ_MAJORS,
    REMOTE_FORMAT_NAME,
    REMOTE_FORMAT_VERSION,
    REMOTE_INDEX_FILE,
    REMOTE_INDEX_MAX_BYTES,
    REPLACED_INFIX,
    SEGMENTED_VERSION,
    SHAPES_FEATURE,
    SHAPES_VERSION,
    SUPPORTED_BACKENDS,
    VARIABLE_VERSION,
    decode_key,
    encode_key,
    field_file,
    file_identity,
    lmdb_file,
    lmdb_key,
    manifest_version,
    normalize_dtype,
    note_identity,
    npy_header,
    open_store_file,
    part_file,
    read_npy_header,
    segment_ids,
    segment_tag,
    variable_files,
)
from .manifest import parse_manifest, read_manifest

__all__ = [
    "CHECKSUMS_FILE",
    "CHECKSUM_ALGORITHM",
    "ERRORS_FILE",
    "FIELD_NAME_RE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HW_SUFFIX",
    "INDEX_FILE",
    "KEYS_BLOB_FILE",
    "KEYS_OFFSETS_FILE",
    "KEY_DTYPE",
    "KNOWN_FEATURES",
    "LMDB_FILE",
    "LMDB_TXN_RECORDS",
    "MANIFEST_FILE",
    "MANIFEST_MAX_BYTES",
    "MAX_STORE_BYTES",
    "PARTIAL_SUFFIX",
    "PLAIN_VERSION",
    "RAGGED_FEATURE",
    "PARTS_DIR",
    "PARTS_FEATURE",
    "PARTS_VERSION",
    "PART_ID_RE",
    "PART_TABLE_FEATURE",
    "PART_TABLE_FILE",
    "PART_TABLE_MIN_PARTS",
    "PART_TABLE_VERSION",
    "RAGGED_VERSION",
    "RAGGED_ZSTD_MAX_BYTES",
    "READ_MAJORS",
    "REMOTE_FORMAT_NAME",
    "REMOTE_FORMAT_VERSION",
    "REMOTE_INDEX_FILE",
    "REMOTE_INDEX_MAX_BYTES",
    "REPLACED_INFIX",
    "SEGMENTED_VERSION",
    "SHAPES_FEATURE",
    "SHAPES_VERSION",
    "SUPPORTED_BACKENDS",
    "VARIABLE_VERSION",
    "decode_key",
    "encode_key",
    "field_file",
    "file_identity",
    "lmdb_file",
    "lmdb_key",
    "manifest_version",
    "normalize_dtype",
    "note_identity",
    "npy_header",
    "open_store_file",
    "parse_manifest",
    "read_manifest",
    "read_npy_header",
    "part_file",
    "segment_ids",
    "segment_tag",
    "variable_files",
]
