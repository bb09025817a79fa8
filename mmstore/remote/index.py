"""The remote index (``_remote.json``): sizes, etags and block digests of a
store's objects, as format.py specifies under "A store in object storage".

:class:`BlockHasher` computes a file's digests in one sequential pass (the
push reads each file once: the bytes it uploads are the bytes it hashes);
:func:`parse_index` reads an index from a bucket, trusting none of it.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .._os.io import fmt_bytes
from ..errors import ClaimedSizeError, FormatError, VersionError
from ..format.layout import (
    CHECKSUMS_FILE,
    ERRORS_FILE,
    INDEX_FILE,
    KEY_DTYPE,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    MAX_STORE_BYTES,
    PART_TABLE_FILE,
    REMOTE_FORMAT_NAME,
    REMOTE_FORMAT_VERSION,
    REMOTE_INDEX_FILE,
    REMOTE_INDEX_MAX_BYTES,
    field_file,
    lmdb_file,
    npy_header,
    segment_ids,
    variable_files,
)

__all__ = ["DEFAULT_BLOCK_BYTES", "DIGEST_BYTES", "BlockHasher", "FileEntry", "RemoteIndex", "block_digest",
           "check_block_bytes", "check_claimed_sizes", "disagreeing_index", "expected_sizes", "index_max_bytes",
           "index_max_bytes_of", "most_sizes", "parse_index"]

DEFAULT_BLOCK_BYTES = 1 << 20
DIGEST_BYTES = 16
_MIN_BLOCK, _MAX_BLOCK = 64 << 10, 1 << 30
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
# a store file's name, or a part's (format.py, "Parts": parts/<part id>/<name>)
_NAME = re.compile(r"^(parts/[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}/)?[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


# what an index holds besides its files' entries (format, version, store_id, block_bytes, digest), with room
_INDEX_FIXED_BYTES = 4096
# one file's entry besides its name and block digests: the keys, the size's digits, the whole digest and the
# layout (json.dumps with indent=1), and an etag of the most characters parse_index takes, each escaped as
# JSON escapes the widest (a character outside the BMP: two \uXXXX escapes)
_ENTRY_FIXED_BYTES = 256 + 1024 * 12


def index_max_bytes(manifest: dict[str, Any], raw_manifest: bytes) -> int:
    """The most bytes a ``_remote.json`` can hold for the store of this
    manifest (``raw_manifest``, its bytes, parsed): each file's entry with
    the most blocks its size allows (blocks of 64 KiB, the smallest
    ``block_bytes``), plus the index's own keys; never more than
    ``REMOTE_INDEX_MAX_BYTES``. A reader reads at most this many bytes (plus
    one) of an index (format.py, "A store in object storage"), so a padded
    index in someone else's bucket costs no more than a real one."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        return REMOTE_INDEX_MAX_BYTES
    sizes = dict(files)
    sizes[MANIFEST_FILE] = len(raw_manifest)
    return index_max_bytes_of(sizes)


def index_max_bytes_of(sizes: Mapping[str, object]) -> int:
    """The most bytes a ``_remote.json`` listing the files ``sizes`` (name
    -> bytes, the manifest's own entry among them) can hold; never more
    than ``REMOTE_INDEX_MAX_BYTES`` (:func:`index_max_bytes`)."""
    total = _INDEX_FIXED_BYTES
    for name, size in sizes.items():
        if type(size) is not int or size < 0 or not isinstance(name, str):
            return REMOTE_INDEX_MAX_BYTES  # refused by the checks after the index is read
        digests = math.ceil(size / _MIN_BLOCK) * DIGEST_BYTES
        total += _ENTRY_FIXED_BYTES + 6 * len(name) + 4 * math.ceil(digests / 3)
        if total >= REMOTE_INDEX_MAX_BYTES:
            return REMOTE_INDEX_MAX_BYTES
    return total


def disagreeing_index(url: str, then: str) -> str:
    """What repairs a bucket whose index disagrees with itself (a file whose
    every block matches its digest while the whole file does not): a push
    compares the objects with that index and finds nothing to do, so the
    index goes first. ``then``: what to do once the bucket is repaired."""
    return (f"delete {url}/{REMOTE_INDEX_FILE}, then push the store again from a good copy (`mmstore push STORE "
            f"{url}` uploads it whole and writes a new index); then {then}")


def check_block_bytes(block_bytes: object) -> int:
    """``block_bytes`` if a remote index may have it (what a reader accepts),
    else ``ValueError`` saying what is allowed."""
    if type(block_bytes) is not int or block_bytes % 4096 or not _MIN_BLOCK <= block_bytes <= _MAX_BLOCK:
        raise ValueError(f"block_bytes must be a multiple of 4096 in [{_MIN_BLOCK:,}, {_MAX_BLOCK:,}] "
                         f"(64 KiB to 1 GiB), got {block_bytes!r}")
    return block_bytes


def block_digest(data: Any) -> bytes:
    """The 16-byte digest of one block."""
    return xxhash.xxh3_128(data).digest()


class BlockHasher:
    """Digests of a file fed in order: the whole file's and each block's."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._whole = xxhash.xxh3_128()
        self._block = xxhash.xxh3_128()
        self._in_block = 0
        self._digests: list[bytes] = []
        self.size = 0

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        self._whole.update(view)
        self.size += len(view)
        B = self.block_bytes
        while len(view):
            take = min(len(view), B - self._in_block)
            self._block.update(view[:take])
            self._in_block += take
            view = view[take:]
            if self._in_block == B:
                self._digests.append(self._block.digest())
                self._block = xxhash.xxh3_128()
                self._in_block = 0

    def finish(self) -> tuple[str, bytes]:
        """``(hex digest of the whole file, the block digests concatenated)``."""
        if self._in_block:
            self._digests.append(self._block.digest())
            self._block = xxhash.xxh3_128()
            self._in_block = 0
        return self._whole.hexdigest(), b"".join(self._digests)


@dataclass
class FileEntry:
    """One file of a store in object storage."""

    size: int
    digest: str
    blocks: bytes  # DIGEST_BYTES per block
    etag: str | None

    def nblocks(self, block_bytes: int) -> int:
        return math.ceil(self.size / block_bytes)

    def block(self, k: int) -> bytes:
        return self.blocks[k * DIGEST_BYTES : (k + 1) * DIGEST_BYTES]


@dataclass
class RemoteIndex:
    """A parsed ``_remote.json``."""

    store_id: str
    block_bytes: int
    files: dict[str, FileEntry]
    raw: bytes = b""

    @property
    def identity(self) -> str:
        """A digest of the whole index: which push of which store this is."""
        return xxhash.xxh3_128(self.raw or self.to_json()).hexdigest()

    def to_json(self) -> bytes:
        files = {
            name: {"size": e.size, "digest": e.digest, "blocks": base64.b64encode(e.blocks).decode("ascii"),
                   "etag": e.etag}
            for name, e in sorted(self.files.items())
        }
        obj = {"format": REMOTE_FORMAT_NAME, "version": list(REMOTE_FORMAT_VERSION), "store_id": self.store_id,
               "block_bytes": self.block_bytes, "digest": "xxh3_128", "files": files}
        return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")

    def check_manifest(self, manifest: dict[str, Any], raw_manifest: bytes, where: str) -> None:
        """The index describes exactly this manifest's store (format.py)."""
        fail = lambda what: FormatError(  # noqa: E731
            f"{where}: {REMOTE_INDEX_FILE} does not match {MANIFEST_FILE}: {what}; the store at this URL is "
            "being pushed (or was pushed by two writers at once): push it again, then open it")
        if manifest.get("store_id") != self.store_id:
            raise fail(f"store_id {self.store_id} against {manifest.get('store_id')}")
        entry = self.files.get(MANIFEST_FILE)
        if entry is None:
            raise fail(f"no entry for {MANIFEST_FILE}")
        if entry.size != len(raw_manifest) or entry.digest != xxhash.xxh3_128(raw_manifest).hexdigest():
            raise fail(f"the manifest's size or digest differs ({len(raw_manifest)} bytes, index says {entry.size})")
        want = dict(manifest.get("files") or {})
        have = {n: e.size for n, e in self.files.items() if n != MANIFEST_FILE}
        if want != have:
            extra = sorted(set(have) - set(want))
            missing = sorted(set(want) - set(have))
            sizes = sorted(n for n in set(want) & set(have) if want[n] != have[n])
            raise fail(f"files only in the index {extra}, only in the manifest {missing}, sizes differ {sizes}")
        check_claimed_sizes(manifest, where)


def _npy_bytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return len(npy_header(dtype, shape)) + math.prod(shape) * dtype.itemsize


def expected_sizes(manifest: dict[str, Any]) -> dict[str, int | None]:
    """Every file a store with this (parsed) manifest's schema, slots,
    segments and parts has (format.py), and its size where the schema and
    slot count give it: each ``.npy`` file exactly; None for the files of
    entries of any size (a variable-size field's ``.bin``, an LMDB file, the
    keys, ``errors.jsonl``), which the offsets files (exact here) bound."""
    slots, records = int(manifest["slots"]), int(manifest["records"])
    counts = manifest.get("segments") or [slots]
    found = segment_ids(manifest)
    ids: list[int | str | None] = list(found) if found is not None else [None]
    out: dict[str, int | None] = {}
    for seg, count in zip(ids, counts):
        if manifest["backend"] != "memmap":
            out[lmdb_file(seg)] = None
            continue
        for name, dtype, shape, codec in manifest["schema"]:
            if shape[:1] == (None,) or not codec.raw:
                data, offsets = variable_files(name, seg)
                out[data] = None
                out[offsets] = _npy_bytes(KEY_DTYPE, (int(count) + 1,))
            else:
                out[field_file(name, seg)] = _npy_bytes(dtype, (int(count), *shape))
    out[CHECKSUMS_FILE] = _npy_bytes(KEY_DTYPE, (slots,))
    out[KEYS_OFFSETS_FILE] = _npy_bytes(KEY_DTYPE, (slots + 1,))
    out[KEYS_BLOB_FILE] = None
    out[INDEX_FILE] = _npy_bytes(KEY_DTYPE, (records,))
    out[ERRORS_FILE] = None
    if manifest.get("part_table") is not None and found is not None:  # expanded: its ids are known
        from ..format.parttable import part_data_names, part_table_bytes

        width = len(part_data_names(manifest["backend"], manifest["schema"]))
        out[PART_TABLE_FILE] = part_table_bytes(len(found), width, sum(len(str(p)) for p in found))
    return out


# an LMDB file of fixed-size records holds, per record, its value, its key and node, and at most the pages a
# value of that size spills into (LMDB's page is the OS page size: 64 KiB at most), plus its meta, branch and
# free pages: below this however the writer's transactions went
_LMDB_PAGE_MAX = 64 << 10
_LMDB_FIXED_BYTES = 16 << 20


def most_sizes(manifest: dict[str, Any]) -> dict[str, int]:
    """The most bytes each file of a store with this (parsed) manifest can
    have where the schema bounds it but does not give it exactly: an LMDB
    file whose every field is of a fixed size (its records, whatever the
    page size and the transactions that wrote them). A variable-size field's
    ``.bin`` and the keys are given exactly by their offsets files
    (format.py), read before such a file is made."""
    if manifest["backend"] == "memmap":
        return {}
    record = 0
    for _, dtype, shape, codec in manifest["schema"]:
        if shape[:1] == (None,) or not codec.raw:
            return {}  # values of any size
        record += dtype.itemsize * math.prod(shape)
    counts = manifest.get("segments") or [int(manifest["slots"])]
    found = segment_ids(manifest)
    ids: list[int | str | None] = list(found) if found is not None else [None]
    return {lmdb_file(seg): int(count) * (record + 2 * _LMDB_PAGE_MAX) + _LMDB_FIXED_BYTES
            for seg, count in zip(ids, counts)}


def check_claimed_sizes(manifest: dict[str, Any], where: str) -> None:
    """Every file size the (parsed) manifest lists is the one its schema and
    slot count give (:func:`expected_sizes`), or at most what they allow
    (:func:`most_sizes`), before anything is created at that size:
    ``ClaimedSizeError`` naming the file, the size claimed and the size
    expected; ``FormatError`` for a file no such store has."""
    want = expected_sizes(manifest)
    most = most_sizes(manifest)
    for name, claimed in sorted(manifest["files"].items()):
        if name not in want:
            raise FormatError(
                f"{where}: {MANIFEST_FILE} lists {name!r} ({fmt_bytes(int(claimed))}), which is no file of a "
                f"{manifest['backend']} store with this schema; the store at this URL is damaged or was not "
                "written by mmstore: push it again from a good copy")
        expected = want[name]
        if expected is not None and int(claimed) != expected:
            raise ClaimedSizeError(
                f"{where}: {name}: the store claims {fmt_bytes(int(claimed))} ({int(claimed):,} bytes), its schema "
                f"and {manifest['slots']:,} slots give {expected:,} bytes; nothing was created: the store at this "
                "URL is damaged or was not written by mmstore: push it again from a good copy",
                name=name, claimed=int(claimed), expected=expected)
        bound = most.get(name)
        if bound is not None and int(claimed) > bound:
            raise ClaimedSizeError(
                f"{where}: {name}: the store claims {fmt_bytes(int(claimed))} ({int(claimed):,} bytes), its schema "
                f"and {manifest['slots']:,} slots allow at most {bound:,} bytes; nothing was created: the store at "
                "this URL is damaged or was not written by mmstore: push it again from a good copy",
                name=name, claimed=int(claimed), expected=bound)


def parse_index(raw: bytes, where: str) -> RemoteIndex:
    """Parse and check a ``_remote.json`` read from ``where`` (untrusted)."""
    fail = lambda what: FormatError(f"{where}: {REMOTE_INDEX_FILE} is not a valid remote index: {what}; "  # noqa: E731
                                    "push the store again with `mmstore push`")
    if len(raw) > REMOTE_INDEX_MAX_BYTES:
        raise fail(f"{len(raw)} bytes, more than {REMOTE_INDEX_MAX_BYTES}")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise fail(f"not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict) or obj.get("format") != REMOTE_FORMAT_NAME:
        raise fail(f"expected an object with \"format\": \"{REMOTE_FORMAT_NAME}\"")
    ver = obj.get("version")
    if not (isinstance(ver, list) and len(ver) == 2 and all(type(v) is int for v in ver)):
        raise fail(f"version {ver!r}: expected [major, minor]")
    if ver[0] != REMOTE_FORMAT_VERSION[0]:
        raise VersionError(f"{where}: {REMOTE_INDEX_FILE} has version {ver[0]}.{ver[1]}; this mmstore reads "
                           f"{REMOTE_FORMAT_VERSION[0]}.x: upgrade mmstore")
    store_id = obj.get("store_id")
    if not (isinstance(store_id, str) and _HEX32.match(store_id)):
        raise fail(f"store_id {store_id!r}: expected 32 hex digits")
    B = obj.get("block_bytes")
    try:
        B = check_block_bytes(B)
    except ValueError:
        raise fail(f"block_bytes {B!r}: expected a multiple of 4096 in [{_MIN_BLOCK}, {_MAX_BLOCK}]") from None
    if obj.get("digest") != "xxh3_128":
        raise fail(f"digest {obj.get('digest')!r}: expected \"xxh3_128\"")
    files = obj.get("files")
    if not isinstance(files, dict) or MANIFEST_FILE not in files:
        raise fail(f"\"files\" must be an object that lists {MANIFEST_FILE}")
    out: dict[str, FileEntry] = {}
    for name, e in files.items():
        if not (isinstance(name, str) and _NAME.match(name)) or name == REMOTE_INDEX_FILE or ".." in name:
            raise fail(f"file name {name!r} is not a store file name")
        if not isinstance(e, dict):
            raise fail(f"{name}: expected an object")
        size, digest, blocks, etag = e.get("size"), e.get("digest"), e.get("blocks"), e.get("etag")
        if type(size) is not int or not 0 <= size <= MAX_STORE_BYTES:
            raise fail(f"{name}: size {size!r}")
        if not (isinstance(digest, str) and _HEX32.match(digest)):
            raise fail(f"{name}: digest {digest!r}: expected 32 hex digits")
        if etag is not None and not (isinstance(etag, str) and 0 < len(etag) <= 1024):
            raise fail(f"{name}: etag {etag!r}")
        if not isinstance(blocks, str):
            raise fail(f"{name}: blocks must be a base64 string")
        try:
            digests = base64.b64decode(blocks.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, ValueError):
            raise fail(f"{name}: blocks is not base64") from None
        n = math.ceil(size / B)
        if len(digests) != n * DIGEST_BYTES:
            raise fail(f"{name}: {len(digests) // DIGEST_BYTES} block digests for {n} blocks")
        out[name] = FileEntry(size, digest, digests, etag)
    return RemoteIndex(store_id, B, out, raw)
