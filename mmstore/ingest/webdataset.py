"""WebDataset tar shards as an ingest source (img2dataset's layout).

``mmstore ingest 'shards/{00000..00099}.tar' DEST --size 256x256 --json-keys width,height``

Shards
------
SOURCE is a pattern of ``.tar`` files or of objects in object storage
(``s3://``, ``gs://``, ``az://``, ``http(s)://``, below): brace ranges
``{0..9}`` (a range whose ends are written with leading zeros,
``{00000..00099}``, keeps that width, as bash does), brace lists ``{a,b}``,
and then glob characters (``*``, ``?``, ``[...]``). Shards are taken in the
order the braces expand (ranges in numeric order), each glob's matches
sorted by their byte names; a shard named twice is read once. A brace-named
shard that does not exist, or a glob that matches nothing, is refused before
any work (``SourceError``).

Index (in the parent, once)
---------------------------
Each shard is indexed by walking its 512-byte tar headers with ``pread``;
no member data is read (except the ``.json`` of the first samples, below).
ustar names with a prefix, GNU long names (``L``) and pax extended headers
(``x``: ``path`` and ``size``) are understood; directories, links, devices and
global pax headers are skipped. Every header is bounds-checked: a header
whose checksum is wrong, whose size field is not a number (octal or GNU
base-256) or is negative, whose long name or pax block is over 1 MiB, or a
member that runs past the end of the file ends the walk of that shard: the
samples before it are kept, the sample it belongs to becomes a hole whose
reason (``truncated: ...`` or ``bad-tar: ...``) names the shard and offset,
and a note counts such shards (what follows cannot be found without trusting
the broken header).

Samples
-------
Members are grouped by *key*: the member name up to the first ``.`` after
its last ``/`` (``00001/000010042.jpg`` has key ``00001/000010042``,
extension ``jpg``, compared lower-case). Consecutive members with one key are
one sample; a key that comes back later in a shard is another sample (with a
note). The record's key is ``SHARD/KEY``, SHARD the shard's path relative to
the folder all shards share (usually its file name), so every hole names its
shard and key. A sample holds:

* the image: its ``jpg``, ``jpeg``, ``png`` or ``webp`` member (the first of
  these extensions present, in that order); none is a hole (``missing-field``);
* ``txt``: a caption, stored exactly as written (UTF-8) in the ``str`` field
  ``text`` (as a list's ``text_column``); the store has the field when any
  sample has a ``.txt``;
* ``cls``: an integer label (the member's text, e.g. ``7``), stored in
  ``label`` (``<i8``) when any sample has a ``.cls``;
* ``json``: with ``json_keys`` (CLI ``--json-keys width,height``) each named
  key becomes a field of that name: a JSON integer ``<i8``, a number with a
  fraction ``<f8``, ``true``/``false`` ``|u1``, a string ``str``. A key's
  type is that of its first non-null value in the ``.json`` members of the
  first samples, read in the parent (at most :data:`JSON_PROBE` samples); a
  key with no value there, or whose value is a list or an object, is
  refused before any work. A float value for an integer key is accepted
  when whole.

Missing values rule: a sample that lacks a member the store has a field for
(no ``.txt`` when others have one, no ``.cls``, no ``.json``), whose ``.json``
lacks a chosen key or holds ``null`` for it, or whose value does not fit the
key's type, becomes a hole with reason ``missing-field: ...`` or
``bad-field: ...`` naming the member; nothing is filled in.

Records (in the workers)
------------------------
A worker reads the members of sample ``i`` with ``pread`` at the offsets of
the index (the GIL is released; shards are read in parallel by the workers,
each keeping a few shards open) and decodes the image with the ingest's
rules (fixed size, ``max_side``, ``buckets``). Records do not depend on the
worker count. The inputs fingerprint covers every shard's name, size, mtime
and member table, so ``--resume`` refuses shards that changed.

Shards in object storage
------------------------
NOTE [tar shards by URL]: the ingest pipeline gives every input its slot
before any work (slot ``s`` is input ``lo + s`` of the listing), which is
what makes a store independent of the worker count and of interruptions. A
shard's sample count is known only once its headers are read, so the parent
reads them first, as for local shards: it walks every shard's headers over
ranged GETs of :data:`~.remote_shards.WINDOW` bytes (eight shards at once;
the walk needs every byte, as headers sit between the members), through the
project's client (:class:`~mmstore.remote.client.Remote`: its credentials,
endpoint, retries and typed errors). The index is the local one (members at
offsets), so slots, keys, holes and records are those of a local ingest of
the same shards: the store equals, file for file but the manifest, an ingest
of a local copy (the keys' SHARD is the object's name under the folder the
shards share). The cost is one extra read of the shards' bytes, by the
parent, before the first decode (the benchmark page measures it). Naming
the shards looks each one up first (one listing of their folder, or a HEAD
each over ``http(s)://``, where globs are refused), so a missing shard or
bucket is a typed error before any work. The fingerprint takes the objects'
sizes and etags in place of mtimes.

The work ranges are cut at the shards' boundaries (``read_units``), and a
worker reads its slot range (told by ``prepare_range``) in windows: the
members of consecutive samples of one shard, at most ``WINDOW`` bytes (one
larger sample alone), in one ranged GET checked against the shard's etag,
never past the range. So a worker holds one window, and makes about one
request per range, not one per member. A read fails only after the client's
retries; that failure (a ``RemoteError``, or a shard replaced during the run)
stops the run with ``DEST.partial`` kept: the samples are not bad, so none
becomes a hole (a truncated or bad shard is found by the index walk and
listed, as for a local one). The index is saved in ``DEST.partial``
(:func:`~.remote_shards.save_index`), so a resume looks the shards up again,
takes the saved index when their sizes and etags match, and reads only the
ranges not yet committed. Forked workers read ``s3://`` through the
standard-library reader of :mod:`mmstore.remote.forked`; other schemes need
``workers=0``.

On Ray, :class:`WebDatasetRows` maps the rows of
``ray.data.read_webdataset(paths, decoder=None)`` to the columns
:func:`mmstore.ray.write` takes, for the same records and keys.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct
import threading
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from .._os.proc import current_pid
from ..errors import RemoteError, SourceError
from ..format.schema import Schema
from ._listing import MAX_FILE_BYTES, InputError, Listing, Source, _Builder
from .remote_shards import INDEX_FILE, IndexLog, RangeReader, ShardObjects, Windows, expand_urls, load_index
from .remote_shards import save_index as write_index

Reader = Callable[[int, int], bytes]  # read(size, offset) -> bytes

__all__ = ["IMAGE_EXTS", "JSON_PROBE", "TarIndexError", "WebDatasetRows", "WebDatasetSource", "expand_pattern",
           "is_tar_pattern", "scan_tar", "split_name"]

BLOCK = 512
IMAGE_EXTS = (b"jpg", b"jpeg", b"png", b"webp")  # in this order of preference
JSON_PROBE = 256  # samples whose .json the parent reads to type the chosen keys
MAX_META_BYTES = 1 << 20  # a GNU long name or a pax block larger than this is refused
MAX_SMALL_MEMBER = 64 << 20  # a .txt/.json/.cls member larger than this is a hole
MAX_BRACE_NAMES = 10_000_000
OPEN_SHARDS = 32  # shards one process keeps open
INDEX_THREADS = 8  # shards in object storage indexed at once by the parent
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_KINDS = ("image", "txt", "json", "cls")
_RESERVED = ("image", "label", "orig_size", "box", "dst", "image_hw", "text")


class TarIndexError(ValueError):
    """A header that ends the walk of a shard: ``reason`` (its category first), ``offset``, ``name`` (or None)."""

    def __init__(self, reason: str, offset: int, name: bytes | None = None) -> None:
        super().__init__(reason)
        self.reason, self.offset, self.name = reason, offset, name


# -- the pattern ------------------------------------------------------------------------------


def is_tar_pattern(path: str) -> bool:
    """SOURCE names WebDataset tar shards: it ends in ``.tar`` (a file, a brace pattern, a glob or a URL)."""
    return path.lower().endswith(".tar")


_BRACE = re.compile(r"\{([^{}]*)\}")


def _brace_items(body: str) -> list[str] | None:
    m = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if m:
        a, b = m.group(1), m.group(2)
        lo, hi = int(a), int(b)
        pad = max(len(a), len(b)) if (a.lstrip("-").startswith("0") and len(a.lstrip("-")) > 1) or \
            (b.lstrip("-").startswith("0") and len(b.lstrip("-")) > 1) else 0
        step = 1 if hi >= lo else -1
        if abs(hi - lo) + 1 > MAX_BRACE_NAMES:
            raise SourceError(f"brace range {{{body}}} names {abs(hi - lo) + 1:,} shards (limit "
                              f"{MAX_BRACE_NAMES:,}); split the ingest (--shard K/N) or use a glob")
        return [str(v).zfill(pad) if v >= 0 else "-" + str(-v).zfill(pad - 1) for v in range(lo, hi + step, step)]
    if "," in body:
        return body.split(",")
    return None  # not a brace expression: kept as written


def _expand_braces(text: str) -> list[str]:
    out = [""]
    pos = 0
    for m in _BRACE.finditer(text):
        items = _brace_items(m.group(1))
        if items is None:
            continue
        lit = text[pos:m.start()]
        if len(out) * len(items) > MAX_BRACE_NAMES:
            raise SourceError(f"{text}: the braces name over {MAX_BRACE_NAMES:,} shards; split the ingest")
        out = [o + lit + it for o in out for it in items]
        pos = m.end()
    tail = text[pos:]
    return [o + tail for o in out]


def expand_pattern(pattern: str) -> list[str]:
    """The shard paths ``pattern`` names, in order (see the module docstring).

    Raises
    ------
    SourceError
        A brace-named shard that does not exist, a glob that matches nothing,
        a glob over ``http(s)://`` (no listing there).
    RemoteError
        For URLs: no such bucket, refused credentials, an unreachable server.
    """
    if _URL.match(pattern):
        objects = expand_urls(pattern, _expand_braces(pattern))
        return [objects.url(k) for k in range(len(objects.names))]
    out: list[str] = []
    seen: set[str] = set()
    missing: list[str] = []
    for name in _expand_braces(pattern):
        if glob.has_magic(name):
            hits = sorted(glob.glob(name), key=os.fsencode)
            if not hits:
                raise SourceError(f"{pattern}: the glob {name!r} matches no file; check the pattern (quote it so "
                                  "that the shell does not expand it)")
        else:
            hits = [name]
            if not os.path.isfile(name):
                missing.append(name)
                continue
        for h in hits:
            if h not in seen:
                seen.add(h)
                out.append(h)
    if missing:
        raise SourceError(f"{pattern}: {len(missing):,} shard(s) it names do not exist (the first: {missing[0]!r}); "
                          "nothing was created: fix the pattern's range or fetch the missing shards")
    if not out:
        raise SourceError(f"{pattern}: names no shard")
    return out


# -- the tar walk -----------------------------------------------------------------------------


def _number(field: bytes, what: str, offset: int, name: bytes | None) -> int:
    """A tar numeric field: octal ASCII (NUL/space padded) or GNU base-256 (first byte 0x80 / 0xff)."""
    if field and field[0] & 0x80:
        if field[0] == 0xFF:
            raise TarIndexError(f"bad-tar: header at offset {offset}: negative {what} (base-256)", offset, name)
        v = field[0] & 0x3F
        for c in field[1:]:
            v = (v << 8) | c
        return v
    text = field.replace(b"\0", b" ").strip()
    if not text:
        return 0
    if text.strip(b"01234567"):
        raise TarIndexError(f"bad-tar: header at offset {offset}: {what} field is not an octal number "
                            f"({field!r})", offset, name)
    return int(text, 8)


def _checksum_ok(hdr: bytes) -> bool:
    want = hdr[148:156].replace(b"\0", b" ").strip()
    if not want or want.strip(b"01234567"):
        return False
    blanked = hdr[:148] + b" " * 8 + hdr[156:]
    unsigned = sum(blanked)
    if int(want, 8) == unsigned:
        return True
    # some old writers summed signed chars
    return int(want, 8) == int(np.frombuffer(blanked, np.int8).sum(dtype=np.int64))


def _pax(data: bytes, offset: int) -> dict[bytes, bytes]:
    """The records ``LEN key=value\\n`` of a pax extended header."""
    out: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos:].strip(b"\0") == b"":
            break
        sp = data.find(b" ", pos, pos + 24)
        if sp < 0 or not data[pos:sp].isdigit():
            raise TarIndexError(f"bad-tar: pax header at offset {offset}: a record without its length", offset)
        n = int(data[pos:sp])
        rec = data[sp + 1:pos + n]
        if n <= sp - pos or pos + n > len(data) or not rec.endswith(b"\n") or b"=" not in rec:
            raise TarIndexError(f"bad-tar: pax header at offset {offset}: a malformed record", offset)
        k, _, v = rec[:-1].partition(b"=")
        out[k] = v
        pos += n
    return out


def _read_meta(read: Reader, at: int, size: int, end: int, offset: int, what: str) -> bytes:
    if size > MAX_META_BYTES:
        raise TarIndexError(f"bad-tar: {what} at offset {offset} of {size:,} bytes (limit {MAX_META_BYTES:,})",
                            offset)
    if at + size > end:
        raise TarIndexError(f"truncated: {what} at offset {offset} runs past the end of the file ({end:,} bytes)",
                            offset)
    data = read(size, at)
    if len(data) != size:
        raise TarIndexError(f"truncated: {what} at offset {offset}: the file ended while reading it", offset)
    return data


def scan_tar(fd: int | Reader, end: int) -> tuple[list[tuple[bytes, int, int]], TarIndexError | None, int]:
    """Walk the headers of the tar open at ``fd`` (``end`` bytes long).

    ``fd`` is a file descriptor, or a callable ``read(size, offset) -> bytes``
    (a shard in object storage: :class:`RangeReader`).

    Returns ``(members, problem, skipped)``: ``(name, data offset, size)`` of
    every regular file in order, the :class:`TarIndexError` that ended the
    walk early (None when the archive ended cleanly) and the number of other
    entries skipped (directories, links, devices). Only headers are read.
    """
    read: Reader
    if isinstance(fd, int):
        fdn = fd

        def read_fd(size: int, offset: int) -> bytes:
            return os.pread(fdn, size, offset)

        read = read_fd
    else:
        read = fd
    members: list[tuple[bytes, int, int]] = []
    skipped = 0
    pos = 0
    long_name: bytes | None = None
    pax: dict[bytes, bytes] = {}
    try:
        while pos + BLOCK <= end:
            hdr = read(BLOCK, pos)
            if len(hdr) != BLOCK:
                raise TarIndexError(f"truncated: header at offset {pos}: the file ended while reading it", pos)
            if hdr == b"\0" * BLOCK:
                return members, None, skipped  # end-of-archive marker
            if not _checksum_ok(hdr):
                raise TarIndexError(f"bad-tar: header at offset {pos}: checksum mismatch (not a tar header)", pos)
            kind = hdr[156:157]
            name = hdr[0:100].split(b"\0", 1)[0]
            if hdr[257:262] == b"ustar":
                prefix = hdr[345:500].split(b"\0", 1)[0]
                if prefix and hdr[257:265] != b"ustar  \0":  # GNU tar uses those bytes for times
                    name = prefix + b"/" + name
            if kind not in (b"L", b"x", b"X", b"K", b"g"):
                name = long_name if long_name is not None else name
                name = pax.get(b"path", name)
            size = _number(hdr[124:136], "size", pos, name)
            data = pos + BLOCK
            nxt = data + (size + BLOCK - 1) // BLOCK * BLOCK
            if kind == b"L":
                long_name = _read_meta(read, data, size, end, pos, "GNU long name").split(b"\0", 1)[0]
            elif kind in (b"x", b"X"):
                pax = _pax(_read_meta(read, data, size, end, pos, "pax header"), pos)
            elif kind in (b"K", b"g"):  # a long link target, global pax records: nothing the samples use
                if data + size > end:
                    raise TarIndexError(f"truncated: tar extension at offset {pos} runs past the end of the file",
                                        pos)
            else:
                if b"size" in pax:
                    if not pax[b"size"].isdigit():
                        raise TarIndexError(f"bad-tar: pax header before offset {pos}: size {pax[b'size']!r} is not "
                                            "a number", pos, name)
                    size = int(pax[b"size"])
                    nxt = data + (size + BLOCK - 1) // BLOCK * BLOCK
                long_name, pax = None, {}
                if data + size > end:  # any entry's data, so that a huge size hides nothing silently
                    raise TarIndexError(
                        f"truncated: member {os.fsdecode(name)!r} at offset {pos} needs {size:,} bytes, the "
                        f"file ends {max(0, end - data):,} bytes after its header", pos, name)
                if kind in (b"0", b"\0", b"7"):
                    members.append((name, data, size))
                else:
                    skipped += 1
            pos = nxt
    except TarIndexError as exc:
        return members, exc, skipped
    if pos < end:
        return members, TarIndexError(f"truncated: {end - pos} bytes at offset {pos} are less than a header", pos), \
            skipped
    return members, None, skipped


def split_name(name: bytes) -> tuple[bytes, bytes]:
    """``(key, extension)`` of a member name: the key ends at the first ``.`` after the last ``/``."""
    slash = name.rfind(b"/") + 1
    dot = name.find(b".", slash)
    if dot < 0:
        return name, b""
    return name[:dot], name[dot + 1:].lower()


# -- the source -------------------------------------------------------------------------------


def _note(notes: dict[str, int], text: str, n: int = 1) -> None:
    notes[text] = notes.get(text, 0) + n


class _Open:
    """A shard's descriptor, closed when the object goes (no ``open()`` file object: a worker's or a
    thread's shards are simply dropped, which must not warn)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


def _walk_local(path: str) -> tuple[tuple[list[tuple[bytes, int, int]], TarIndexError | None, int], bytes]:
    """The walk of local shard ``path`` (:func:`scan_tar`) and its identity (size, modification time)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SourceError(f"{path}: cannot open the shard ({e.strerror}); nothing was created") from None
    try:
        st = os.fstat(fd)
        walk = scan_tar(fd, st.st_size)
    finally:
        os.close(fd)
    return walk, struct.pack("<qq", st.st_size, st.st_mtime_ns)


class WebDatasetSource(Source):
    """WebDataset tar shards in img2dataset's layout (see the module docstring).

    Parameters
    ----------
    path
        The shards: one ``.tar``, a brace pattern or a glob.
    json_keys
        Keys of each sample's ``.json`` to store as fields: a list of names
        or one comma-separated text (``"width,height,similarity"``).
    """

    kind = "webdataset"

    def __init__(self, path: str, json_keys: Any = None) -> None:
        super().__init__(path)
        if isinstance(json_keys, str):
            json_keys = [k.strip() for k in json_keys.split(",")]
        keys = list(json_keys or [])
        for k in keys:
            if not isinstance(k, str) or not k or not k.isidentifier():
                raise ValueError(f"json_keys: each key must be a name such as 'width' (letters, digits, _), got "
                                 f"{k!r}")
            if k in _RESERVED:
                raise ValueError(f"json_keys: {k!r} is one of the ingest's own fields {list(_RESERVED)}; it "
                                 "cannot also be a .json key's field")
        if len(set(keys)) != len(keys):
            raise ValueError(f"json_keys: a key is named twice in {keys}")
        self.json_keys = keys
        self.objects: ShardObjects | None = None
        if _URL.match(path):
            self.objects = expand_urls(path, _expand_braces(path))
            self.shards = [self.objects.url(k) for k in range(len(self.objects.names))]
        else:
            self.shards = expand_pattern(path)
        self.fields: list[Any] | None = None
        self.partial: str | None = None  # DEST.partial, where the index of shards in object storage is kept
        self.index_log: IndexLog | None = None
        self.cached_types: dict[str, Any] | None = None
        self._local = threading.local()  # each thread (and forked process) its own open shards

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        if self.objects is not None:
            d["path"] = self.path  # a URL stays as written
        d.update(shards=len(self.shards), json_keys=self.json_keys)
        return d

    # -- the index of shards in object storage, across a resume -----------------------------
    def resume_index(self, partial: str) -> None:
        """Where a resumed ingest finds the index a run saved (``DEST.partial``); called before :meth:`scan`."""
        self.partial = partial

    def save_index(self, partial: str) -> None:
        """Keep the index of shards in object storage in ``partial`` (the run's
        ``DEST.partial``, once it exists), so that a resume reads no finished shard."""
        if self.objects is None or self.index_log is None:
            return
        types = {k: "str" if t is str else t[0] for k, t in self.types.items()}
        write_index(os.path.join(partial, INDEX_FILE), self.objects.folder_url, self.index_log,
                   {"json_keys": self.json_keys, "types": types})

    def _walks(self) -> Iterator[tuple[tuple[list[tuple[bytes, int, int]], TarIndexError | None, int], bytes]]:
        """Each shard's walk (:func:`scan_tar`) and identity (what its fingerprint covers), in shard order."""
        if self.objects is None:
            yield from map(_walk_local, self.shards)
            return
        obj = self.objects
        self.index_log = log = IndexLog()
        saved = load_index(os.path.join(self.partial, INDEX_FILE), obj, TarIndexError) if self.partial else None
        if saved is not None and saved[1].get("json_keys") == self.json_keys:
            self.cached_types = {k: str if v == "str" else (v, ()) for k, v in saved[1].get("types", {}).items()}
            walks: Iterator[Any] = iter(saved[0])
        else:
            walks = self._index_objects()
        for k, walk in enumerate(walks):
            log.add(obj.names[k], obj.sizes[k], obj.etags[k], walk)
            yield walk, struct.pack("<qq", obj.sizes[k], 0) + (obj.etags[k] or "").encode()

    def _index_objects(self) -> Iterator[tuple[list[tuple[bytes, int, int]], TarIndexError | None, int]]:
        """Walk the shards in object storage, :data:`INDEX_THREADS` at once, in order (a bounded batch at a time)."""
        obj = self.objects
        assert obj is not None

        def walk(k: int) -> tuple[list[tuple[bytes, int, int]], TarIndexError | None, int]:
            return scan_tar(RangeReader(obj.remote, obj.names[k], obj.sizes[k], obj.etags[k]), obj.sizes[k])

        n = len(obj.names)
        from concurrent.futures import ThreadPoolExecutor  # not at import: `import mmstore` stays light

        with ThreadPoolExecutor(min(INDEX_THREADS, n)) as ex:
            for a in range(0, n, 4 * INDEX_THREADS):
                yield from ex.map(walk, range(a, min(n, a + 4 * INDEX_THREADS)))

    # -- scan --------------------------------------------------------------------------------
    def scan(self) -> Listing:
        if self.objects is not None:
            self.shard_names = [n.encode("utf-8", "surrogateescape") for n in self.objects.names]
        else:
            top = os.path.commonpath([os.path.dirname(os.path.abspath(s)) for s in self.shards])
            self.shard_names = [os.fsencode(os.path.relpath(os.path.abspath(s), top)) for s in self.shards]
        b = _Builder("webdataset", False)
        h = xxhash.xxh3_128()
        shard_of, offs, sizes = array("i"), array("q"), array("q")
        errors: dict[int, str] = {}
        notes: dict[str, int] = {}
        has = dict.fromkeys(_KINDS, False)
        for k, ((members, problem, skipped), ident) in enumerate(self._walks()):
            sname = self.shard_names[k]
            mtime = struct.unpack_from("<q", ident, 8)[0]
            h.update(struct.pack("<q", len(sname)) + ident + sname)
            if skipped:
                _note(notes, "tar entries that are not files (directories, links) skipped", skipped)
            seen: set[bytes] = set()
            last: bytes | None = None
            rank = len(IMAGE_EXTS)
            for name, off, size in members:
                h.update(struct.pack("<qqq", len(name), off, size) + name)
                key, ext = split_name(name)
                if key != last:
                    if key in seen:
                        _note(notes, "samples whose key comes back later in its shard (each kept as its own record)")
                    seen.add(key)
                    last = key
                    rank = len(IMAGE_EXTS)  # the image extension taken so far for this sample
                    b.add(sname + b"/" + key, 0, mtime)
                    shard_of.append(k)
                    offs.extend((-1,) * 4)
                    sizes.extend((-1,) * 4)
                i = len(shard_of) - 1
                kind = "image" if ext in IMAGE_EXTS else ext.decode("ascii", "replace") if ext in (
                    b"txt", b"json", b"cls") else None
                if kind is None:
                    continue
                slot = 4 * i + _KINDS.index(kind)
                if kind == "image" and offs[slot] >= 0:
                    _note(notes, "samples with more than one image member (the first of jpg, jpeg, png, webp taken)")
                    if IMAGE_EXTS.index(ext) >= rank:
                        continue
                if kind == "image":
                    rank = IMAGE_EXTS.index(ext)
                offs[slot], sizes[slot] = off, size
                has[kind] = True
            if problem is not None:
                reason = f"{problem.reason} (shard {os.fsdecode(sname)})"
                pkey = split_name(problem.name)[0] if problem.name is not None else None
                _note(notes, "shards cut short by a truncated or bad tar header (what follows it is not read; "
                      "listed in errors.jsonl)")
                h.update(reason.encode("utf-8", "surrogateescape"))
                if pkey is not None and pkey == last and len(shard_of) and shard_of[-1] == k:
                    errors[len(shard_of) - 1] = reason  # the sample the broken member belongs to
                else:
                    b.add(sname + b"/" + (pkey if pkey is not None else b"@%d" % problem.offset), 0, mtime)
                    shard_of.append(k)
                    offs.extend((-1,) * 4)
                    sizes.extend((-1,) * 4)
                    errors[len(shard_of) - 1] = reason
        self.shard = np.frombuffer(shard_of, np.int32).copy() if len(shard_of) else np.zeros(0, np.int32)
        self.offs = (np.frombuffer(offs, np.int64).copy() if len(offs) else np.zeros(0, np.int64)).reshape(-1, 4)
        self.sizes = (np.frombuffer(sizes, np.int64).copy() if len(sizes) else np.zeros(0, np.int64)).reshape(-1, 4)
        valid = self.offs >= 0
        self.span_lo = np.where(valid, self.offs, np.iinfo(np.int64).max).min(axis=1, initial=np.iinfo(np.int64).max)
        self.span_lo[self.span_lo == np.iinfo(np.int64).max] = -1
        self.span_hi = np.where(valid, self.offs + self.sizes, -1).max(axis=1, initial=-1)
        self.has = {"txt": has["txt"], "cls": has["cls"], "json": bool(self.json_keys)}
        if self.cached_types is not None and set(self.cached_types) == set(self.json_keys):
            self.types = self.cached_types
        else:
            self.types = self._json_types() if self.json_keys else {}
        self._missing_fields(errors)
        extra = repr((h.hexdigest(), self.json_keys, sorted(self.types.items()), self.has))
        listing = b.finish(None, extra=extra, warnings=notes)
        listing.label_errors = errors
        if self.has["cls"]:
            # read in the workers (record_fields overrides it): the schema gets its label field from this
            listing.labels = np.full(len(listing), -1, np.int64)
        self.listing = listing
        spec: dict[str, Any] = {}
        if self.has["txt"]:
            spec["text"] = str
        for k in self.json_keys:
            spec[k] = self.types[k]
        self.fields = list(Schema(spec)) if spec else None
        return listing

    def _missing_fields(self, errors: dict[int, str]) -> None:
        need = [("image", "image member (.jpg, .jpeg, .png or .webp)")]
        need += [(k, f".{k} member") for k in ("txt", "cls", "json") if self.has[k]]
        for kind, what in need:
            lack = np.flatnonzero(self.offs[:, _KINDS.index(kind)] < 0)
            for i in lack.tolist():
                errors.setdefault(i, f"missing-field: the sample has no {what} (shard "
                                     f"{os.fsdecode(self.shard_names[int(self.shard[i])])})")

    def _json_types(self) -> dict[str, Any]:
        """The field type of each chosen key, from its first non-null value (module docstring)."""
        types: dict[str, Any] = {}
        col = _KINDS.index("json")
        looked = 0
        for i in np.flatnonzero(self.offs[:, col] >= 0).tolist():
            if looked >= JSON_PROBE or len(types) == len(self.json_keys):
                break
            looked += 1
            try:
                doc = json.loads(self._member(i, "json", MAX_SMALL_MEMBER).tobytes())
            except (InputError, ValueError, RecursionError):
                continue
            if not isinstance(doc, dict):
                continue
            for k in self.json_keys:
                v = doc.get(k)
                if k in types or v is None:
                    continue
                if isinstance(v, bool):
                    types[k] = ("|u1", ())
                elif isinstance(v, int):
                    types[k] = ("<i8", ())
                elif isinstance(v, float):
                    types[k] = ("<f8", ())
                elif isinstance(v, str):
                    types[k] = str
                else:
                    raise SourceError(f"{self.path}: .json key {k!r} holds a {type(v).__name__} "
                                      f"({json.dumps(v)[:80]}); only numbers, true/false and strings become fields")
        lacking = [k for k in self.json_keys if k not in types]
        if lacking:
            raise SourceError(f"{self.path}: .json key(s) {lacking} have no value in the .json members of the first "
                              f"{looked} sample(s); check --json-keys against a sample's .json; nothing was created")
        self._close_all()
        return types

    # -- reading -----------------------------------------------------------------------------
    def _fd(self, k: int) -> int:
        """A descriptor of shard ``k`` open in this thread: the last :data:`OPEN_SHARDS` used stay open
        (closed when dropped: by a forked worker, which opens its own, at thread end, or with the source)."""
        loc = self._local
        files: dict[int, Any] | None = getattr(loc, "files", None)
        if files is None or loc.pid != current_pid():
            files = loc.files = {}
            loc.pid = current_pid()
        f = files.pop(k, None)
        if f is None:
            if len(files) >= OPEN_SHARDS:
                files.pop(next(iter(files))).close()
            try:
                f = _Open(os.open(self.shards[k], os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                raise InputError(f"unreadable: shard {self.shards[k]}: [Errno {e.errno}] {e.strerror}") from None
        files[k] = f  # most recently used last
        return f.fd

    def _close_all(self) -> None:
        files = getattr(self._local, "files", None) or {}
        for f in files.values():
            f.close()
        self._local.files = None
        self._local.win = None  # a window over a shard in object storage (the parent's .json probe)

    def reader(self) -> Any:
        """This source, checked in a forked worker: shards in object storage other than ``s3://`` cannot
        be read there (NOTE [a client per process] in mmstore/remote/forked.py)."""
        if self.objects is not None:
            try:
                self.objects.remote.forked()
            except RemoteError:
                scheme = self.path.split("://", 1)[0]
                raise RemoteError(f"{self.path}: {scheme}:// shards are read by the ingest's own process only (its "
                                  "worker processes are forked after it used the client, which only s3:// "
                                  "survives): pass workers=0 (CLI: --workers 0)") from None
        return self

    def _windows(self) -> Windows:
        """This thread's (and process's) window over shards in object storage."""
        loc = self._local
        win: Windows | None = getattr(loc, "win", None)
        if win is None or loc.win_pid != current_pid():
            assert self.objects is not None
            win = loc.win = Windows(self.objects, self.shard, self.span_lo, self.span_hi)
            loc.win_pid = current_pid()
        return win

    def read_units(self) -> np.ndarray | None:
        """Shards in object storage: the first input of every shard, where the work ranges are cut
        (``resume.pending_ranges``), so that a range's samples come from one shard, read in one GET
        (small shards are joined whole into a range; a large one is cut as without units)."""
        if self.objects is None:
            return None
        return np.concatenate(([0], np.flatnonzero(np.diff(self.shard)) + 1)).astype(np.int64)

    def prepare_range(self, a: int, b: int) -> None:
        """Inputs ``a..b`` are read next, in order: in object storage one ranged GET covers many of them;
        in local shards the kernel is asked to read each shard's span of them now, in one request
        (``POSIX_FADV_WILLNEED``), so that a shard not in the page cache streams in while the first samples
        are decoded instead of a few pages at a time on demand."""
        if self.objects is not None:
            self._windows().prepare(a, b)
            return
        lo, hi, shard = self.span_lo[a:b], self.span_hi[a:b], self.shard[a:b]
        ok = lo >= 0
        for k in np.unique(shard[ok]).tolist():
            mine = ok & (shard == k)
            start, end = int(lo[mine].min()), int(hi[mine].max())
            try:
                os.posix_fadvise(self._fd(k), start, end - start, os.POSIX_FADV_WILLNEED)
            except (OSError, InputError):
                pass  # a hint only: the reads below report what is wrong with the shard

    def _member(self, i: int, kind: str, limit: int) -> np.ndarray:
        c = _KINDS.index(kind)
        off, size = int(self.offs[i, c]), int(self.sizes[i, c])
        if size > limit:
            raise InputError(f"too-large: .{kind} member of {size:,} bytes (limit {limit:,})")
        if self.objects is not None:
            return np.frombuffer(self._windows().read(i, off, size), np.uint8).copy()
        k = int(self.shard[i])
        fd = self._fd(k)
        buf = np.empty(size, np.uint8)
        view = buf.data
        got = 0
        while got < size:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                raise InputError(f"unreadable: shard {self.shards[k]} ended at byte {off + got:,}, before the end "
                                 "of the member it held when the ingest indexed it (the shard changed)")
            got += n
        return buf

    def load(self, i: int) -> Any:
        if self.offs[i, 0] < 0:  # a hole known at scan (its reason is in listing.label_errors)
            raise InputError(self.listing.label_errors.get(i, "missing-field: no image member"))
        return self._member(i, "image", MAX_FILE_BYTES)

    def record_fields(self, i: int, decoded: Any = None) -> dict[str, Any]:
        """The ``text``, ``label`` and ``.json`` fields of sample ``i`` (read
        here, in the worker); taken by :class:`mmstore.ingest.records.RecordJob`."""
        out: dict[str, Any] = {}
        if self.has["txt"]:
            try:
                out["text"] = self._member(i, "txt", MAX_SMALL_MEMBER).tobytes().decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(f"bad-field: the .txt member is not UTF-8 (byte {e.start})") from None
        if self.has["cls"]:
            raw = self._member(i, "cls", 64).tobytes().strip()
            if not re.fullmatch(rb"[+-]?\d{1,19}", raw) or not -(1 << 63) <= int(raw) < 1 << 63:
                raise InputError(f"bad-field: the .cls member is not an integer label ({raw[:40]!r})")
            out["label"] = np.array(int(raw), "<i8")
        if self.json_keys:
            try:
                doc = json.loads(self._member(i, "json", MAX_SMALL_MEMBER).tobytes())
            except (ValueError, RecursionError) as e:
                raise InputError(f"bad-field: the .json member is not valid JSON ({str(e)[:100]})") from None
            if not isinstance(doc, dict):
                raise InputError(f"bad-field: the .json member is a {type(doc).__name__}, not an object")
            for k in self.json_keys:
                out[k] = self._json_value(k, doc.get(k))
        return out

    def _json_value(self, k: str, v: Any) -> Any:
        t = self.types[k]
        if v is None:
            raise InputError(f"missing-field: the .json has no value for {k!r}")
        if t is str:
            if not isinstance(v, str):
                raise InputError(f"bad-field: .json key {k!r} is {json.dumps(v)[:60]}, the field holds strings")
            return v
        if isinstance(v, bool) != (t[0] == "|u1") or not isinstance(v, (int, float)):
            raise InputError(f"bad-field: .json key {k!r} is {json.dumps(v)[:60]}, the field holds {t[0]} values")
        if t[0] == "<i8":
            if isinstance(v, float) and not (math.isfinite(v) and v.is_integer()):
                raise InputError(f"bad-field: .json key {k!r} is {v!r}, the field holds integers")
            if not -(1 << 63) <= int(v) < 1 << 63:
                raise InputError(f"bad-field: .json key {k!r} is {v}, beyond a 64-bit integer")
            return np.array(int(v), "<i8")
        if t[0] == "<f8":
            return np.array(float(v), "<f8")
        return np.array(int(v), "|u1")



# -- rows of ray.data.read_webdataset -----------------------------------------------------------


class WebDatasetRows:
    """Turns batches of ``ray.data.read_webdataset(paths, decoder=None)`` into
    the columns :func:`mmstore.ray.write` takes, with the records and keys
    that ``mmstore ingest`` gives for the same shards::

        ds = ray.data.read_webdataset(paths, decoder=None).map_batches(
            WebDatasetRows(), batch_format="numpy")
        mmstore.ray.write(ds, DEST, size=256, fields={"text": str})

    The image is the row's ``jpg``, ``jpeg``, ``png`` or ``webp`` bytes (the
    first present, as the source takes it), decoded by the writer with the
    ingest's rules (``decoder=None`` keeps Ray from decoding it first, with
    other rules); ``key`` is ``SHARD/KEY`` as the source's keys (SHARD: the
    row's ``__url__`` relative to ``root``, by default its file name, right
    for shards in one folder); ``cls`` becomes the integer ``label``,
    ``txt`` the ``text`` (UTF-8) and each of ``json_keys`` a column of its
    name. A value that is missing or does not parse is None: the writer makes
    that row a hole, as the ingest does (its reason is worded by the writer).

    Parameters
    ----------
    root
        The folder (or URL prefix) the shards share; None: the file name.
    json_keys
        Keys of each sample's ``.json`` to make columns of.
    """

    def __init__(self, root: str | None = None, json_keys: Any = None) -> None:
        if isinstance(json_keys, str):
            json_keys = [k.strip() for k in json_keys.split(",")]
        self.root = None if root is None else root.rstrip("/") + "/"
        self.json_keys = list(json_keys or [])

    def _shard(self, url: str) -> str:
        u = url.split("://", 1)[-1]
        if self.root is not None:
            r = self.root.split("://", 1)[-1]
            if u.startswith(r):
                return u[len(r):]
        return u.rsplit("/", 1)[-1]

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        keys, urls = batch["__key__"], batch["__url__"]
        n = len(keys)
        image = np.empty(n, object)
        for i in range(n):
            image[i] = next((bytes(batch[e][i]) for e in ("jpg", "jpeg", "png", "webp")
                             if e in batch and batch[e][i] is not None), None)
        out: dict[str, Any] = {"image": image,
                               "key": np.array([f"{self._shard(str(u))}/{k}" for u, k in zip(urls, keys)], object)}
        if "cls" in batch:
            labels = np.empty(n, object)
            for i, raw in enumerate(batch["cls"]):
                text = bytes(raw).strip() if raw is not None else b""
                labels[i] = int(text) if re.fullmatch(rb"[+-]?\d{1,18}", text) else None
            out["label"] = labels
        if "txt" in batch:
            texts = np.empty(n, object)
            for i, raw in enumerate(batch["txt"]):
                try:
                    texts[i] = None if raw is None else bytes(raw).decode("utf-8")
                except UnicodeDecodeError:
                    texts[i] = None
            out["text"] = texts
        if self.json_keys:
            cols = {k: np.empty(n, object) for k in self.json_keys}
            for i in range(n):
                raw = batch["json"][i] if "json" in batch else None
                try:
                    doc = json.loads(bytes(raw)) if raw is not None else None
                except (ValueError, RecursionError):
                    doc = None
                for k in self.json_keys:
                    cols[k][i] = doc.get(k) if isinstance(doc, dict) else None
            out.update(cols)
        return out
