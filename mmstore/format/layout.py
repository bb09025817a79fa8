"""What a store is on disk, as code: names, versions and limits, ``.npy``
headers, record keys, and opening a store's files safely. The specification
these follow is :mod:`mmstore.format`'s docstring."""

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

from ..errors import FormatError, ResourceLimitError, StoreAccessError, StoreChangedError

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
    "PARTS_DIR",
    "PARTS_FEATURE",
    "PARTS_VERSION",
    "PART_ID_MAX",
    "PART_ID_RE",
    "PART_TABLE_FEATURE",
    "PART_TABLE_FILE",
    "PART_TABLE_MAGIC",
    "PART_TABLE_MIN_PARTS",
    "PART_TABLE_VERSION",
    "PUSH_MARK_FILE",
    "RAGGED_FEATURE",
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
    "SHAPED_MAX_BYTES",
    "HW_SUFFIX",
    "VARIABLE_VERSION",
    "SUPPORTED_BACKENDS",
    "decode_key",
    "encode_key",
    "field_file",
    "file_identity",
    "is_store_file_name",
    "note_identity",
    "open_store_file",
    "lmdb_file",
    "manifest_version",
    "lmdb_key",
    "normalize_dtype",
    "npy_header",
    "read_npy_header",
    "part_file",
    "segment_ids",
    "segment_tag",
    "variable_files",
]

FORMAT_NAME = "mmstore"
FORMAT_VERSION = (2, 4)  # this document
PLAIN_VERSION = (1, 0)  # what a store without segments or variable-size fields is written as
SEGMENTED_VERSION = (1, 1)  # ... with segments, without variable-size fields
VARIABLE_VERSION = (2, 0)  # ... with a variable-size field (segmented or not)
RAGGED_VERSION = (2, 1)  # ... with a ragged field (see "Ragged fields")
RAGGED_FEATURE = "ragged"  # what such a store's "requires" lists
PARTS_VERSION = (2, 2)  # ... whose segments are parts (see "Parts")
PARTS_FEATURE = "parts"  # what such a store's "requires" lists
SHAPES_VERSION = (2, 3)  # ... with a field of images of their own shape (see "Images of their own shape")
SHAPES_FEATURE = "shapes"  # what such a store's "requires" lists
PART_TABLE_VERSION = (2, 4)  # ... whose parts are listed in a part table (see "The part table")
PART_TABLE_FEATURE = "part_table"  # what such a store's "requires" lists
PART_TABLE_FILE = "_parts.bin"  # the part table
PART_TABLE_MAGIC = b"MMSPARTS"  # its first 8 bytes
PART_TABLE_MIN_PARTS = 1000  # writers list this many parts or more in a part table (read at call time)
HW_SUFFIX = "_hw"  # the companion field of shaped field F: F_hw, each record's (h, w)
SHAPED_MAX_BYTES = 1 << 31  # a shaped field's record decodes to at most this many bytes
PARTS_DIR = "parts"  # a part's data files: parts/<part id>/<name>
PART_ID_MAX = 128  # characters of a part id at most
PART_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
# the "requires" entries this reader knows
KNOWN_FEATURES = (RAGGED_FEATURE, PARTS_FEATURE, SHAPES_FEATURE, PART_TABLE_FEATURE)
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
REMOTE_INDEX_FILE = "_remote.json"  # a store in object storage: see "A store in object storage"
PUSH_MARK_FILE = "_push.json"  # beside them while a push writes them: the names it writes
REMOTE_INDEX_MAX_BYTES = 1 << 30
REMOTE_FORMAT_NAME = "mmstore-remote"
REMOTE_FORMAT_VERSION = (1, 0)
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


def part_file(part: str, name: str) -> str:
    """Name (in ``files``) of data file ``name`` of the part ``part`` (see "Parts")."""
    return f"{PARTS_DIR}/{part}/{name}"


def _data_name(base: str, ext: str, segment: int | str | None) -> str:
    """A data file's name: ``base + ext`` in one segment, ``base.<k> + ext`` in
    segment ``k``, ``parts/<id>/base + ext`` in the part ``id`` (a ``str``)."""
    if isinstance(segment, str):
        return part_file(segment, base + ext)
    return f"{base}{segment_tag(segment)}{ext}"


def segment_ids(manifest: dict[str, Any]) -> list[int | str] | None:
    """How a (parsed) manifest's segments name their data files: None for a
    store of one segment, else one id per segment: its number ``k``
    ("Segments"), or its part id when the store has ``parts`` ("Parts"). Every
    data-file name function here takes such an id as ``segment``."""
    segments = manifest.get("segments")
    if segments is None:
        return None
    parts = manifest.get("parts")
    return list(parts) if parts is not None else list(range(len(segments)))


def field_file(name: str, segment: int | str | None = None) -> str:
    """File name of field ``name`` in a memmap store (of one segment)."""
    return _data_name(name, ".npy", segment)


def variable_files(name: str, segment: int | str | None = None) -> tuple[str, str]:
    """``(data, offsets)`` file names of variable-size field ``name`` in a
    memmap store (of one segment): ``<field>.bin``, ``<field>.offsets.npy``."""
    return _data_name(name, ".bin", segment), _data_name(name, ".offsets.npy", segment)


def manifest_version(variable: bool, segmented: bool, ragged: bool = False, parts: bool = False,
                     shaped: bool = False, part_table: bool = False) -> tuple[int, int]:
    """The version a writer writes (see ``version``): 2.4 with a part table,
    2.3 with a shaped field, 2.2 with parts, 2.1 with a ragged field, 2.0
    with another variable-size field, else 1.1 with segments, else 1.0."""
    if part_table:
        return PART_TABLE_VERSION
    if shaped:
        return SHAPES_VERSION
    if parts:
        return PARTS_VERSION
    if ragged:
        return RAGGED_VERSION
    if variable:
        return VARIABLE_VERSION
    return SEGMENTED_VERSION if segmented else PLAIN_VERSION


def lmdb_file(segment: int | str | None = None) -> str:
    """File name of the LMDB environment (of one segment)."""
    return _data_name("records", ".mdb", segment)


_BOOKKEEPING_FILES = frozenset({MANIFEST_FILE, CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE, INDEX_FILE,
                                 ERRORS_FILE, PART_TABLE_FILE})
_DATA_FILE_RE = re.compile(
    rf"^(?:{FIELD_NAME_RE.pattern.strip('^$')}(?:\.[0-9]+)?(?:\.npy|\.bin|\.offsets\.npy)"
    r"|records(?:\.[0-9]+)?\.mdb)$")


def is_store_file_name(name: str) -> bool:
    """Whether ``name`` is a name a store's file can have (relative to the
    store): a bookkeeping file, a data file (``<field>.npy``, ``.bin``,
    ``.offsets.npy``, ``records.mdb``, each also as a segment's
    ``<base>.<k><ext>``), either of those under ``parts/<part id>/``, or the
    remote index and a push's mark. Anything else is no store's, whatever a
    manifest or an index claims."""
    if name in (REMOTE_INDEX_FILE, PUSH_MARK_FILE):
        return True
    head, sep, rest = name.partition("/")
    if sep:
        part, sep, name = rest.partition("/")
        if head != PARTS_DIR or not PART_ID_RE.fullmatch(part) or "/" in name:
            return False
    return name in _BOOKKEEPING_FILES or bool(_DATA_FILE_RE.fullmatch(name))


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
    return f"{{'descr': {dtype.str!r}, 'fortran_order': False, 'shape': {shape_txt}, }}"


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
# opening a store's files: regular files only, their identity noted (the
# manifest is read and checked in manifest.py)


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
    ResourceLimitError
        The process may open no more files.
    StoreChangedError
        ``path`` is in ``ident`` but no longer there.
    """
    if dir_fd is None:
        _check_part_dirs(path)
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
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise ResourceLimitError(
                exc.errno, f"{path}: cannot be opened: {exc.strerror} (this process has as many files open as it "
                "may); raise the limit before starting (`ulimit -n` in the shell, LimitNOFILE= for a systemd "
                "service, --ulimit nofile= for docker) or close other stores") from None
        raise FormatError(f"{path}: cannot be opened ({exc.strerror}); the store is damaged or unreadable") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = next((k for test, k in _FILE_KINDS if test(st.st_mode)), "not a regular file")
        raise FormatError(f"{path}: is {kind}, expected a regular file; this is not a store file")
    return fd


def _check_part_dirs(path: str) -> None:
    """A part's file (``STORE/parts/<id>/<name>``, "Parts") is read only through real directories: a
    ``parts`` or part directory that is a symbolic link could lead reads (and a repair's writes) outside
    the store, as a linked file could."""
    part_dir = os.path.dirname(path)
    parts = os.path.dirname(part_dir)
    if os.path.basename(parts) != PARTS_DIR or not os.path.isfile(os.path.join(os.path.dirname(parts), MANIFEST_FILE)):
        return
    for d in (parts, part_dir):
        if os.path.islink(d):
            raise FormatError(f"{d}: is a symbolic link; a store's part directories must be real directories "
                              "inside the store (copy the part in, or re-create the store)")


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
    # a recorded modification time of -1: a file whose bytes are filled in
    # while it is read (a store's local replica), known by device, inode, size
    if was != now and ((mtime and was[3] != -1) or was[:3] != now[:3]):
        what = [w for w, a, b in zip(("device", "inode", "size", "modification time"), was, now) if a != b]
        raise StoreChangedError(
            f"{path}: changed since the store was opened ({', '.join(what)} differ: {was[2]} bytes, inode "
            f"{was[1]} then; {now[2]} bytes, inode {now[1]} now): the store was replaced or modified while in "
            "use. Reopen it (mmstore.open) to read the new store; an open Store never mixes the two"
        )
