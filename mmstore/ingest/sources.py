"""Ingest sources: what SOURCE is, its sorted listing, and how one input is read.

A *source* turns into a :class:`Listing` in the parent process: the inputs in
slot order, kept in numpy arrays only (an offsets array and a bytes blob of
keys, an ``int64`` label array), never a Python list of paths, so memory stays
small for millions of inputs. The listing also carries a fingerprint: a hash
over every key, file size, mtime and label, which resume compares.

Worker processes get the source object by ``fork`` (nothing is pickled) and
call :meth:`Source.reader` once; the reader's ``load(i)`` returns the encoded
bytes (or an array) of input ``i`` or raises a decode error with a reason.

Folder scan rule (``FolderSource``)
-----------------------------------
* Walked depth-first, each directory's entries sorted by their *byte* names
  (``os.scandir`` on a bytes path), so the order never depends on the locale
  or on the order the file system returns.
* Names starting with ``.`` (``.DS_Store``, ``.git``, ``._x.jpg``) are skipped,
  files and directories alike.
* A directory (or a symlink to one) is always walked, even when it is named
  like an image (``x.jpg/``); a directory symlink that points back to one of
  its own ancestors (a loop) is not followed and is counted in ``warnings``.
* A file whose name ends in a known image extension (:data:`IMAGE_EXTENSIONS`,
  case-insensitive) is always an input: if it turns out broken, empty, not an
  image, a broken symlink, a symlink loop or unreadable, it becomes a hole
  with its reason in ``errors.jsonl``.
* Any other regular file is sniffed (its first 64 bytes); it is an input only
  if the content is an image (a PNG saved without an extension is kept, a
  ``README.txt`` or ``labels.csv`` is ignored and counted as ``ignored``).
* ImageFolder layout: when the root holds no image directly and at least one
  sub-directory, each top-level directory is a class (names sorted by bytes,
  label = position, names saved as ``label_names``). Otherwise the folder is
  flat and has no labels. ``labels="folders"`` / ``"none"`` force either.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import stat as _stat
import struct
from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from ..decode import read_bytes, sniff_image
from ..errors import DecodeError as _CoreDecodeError
from ..errors import IngestError, LabelMappingError, SchemaError
from ..format import decode_key, encode_key
from .classes import class_options, map_classes

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArraySource",
    "DatasetSource",
    "FolderSource",
    "InputError",
    "LmdbSource",
    "ListSource",
    "Listing",
    "Source",
    "detect_source",
]

IMAGE_EXTENSIONS = frozenset(
    b".jpg .jpeg .jpe .jfif .png .webp .bmp .dib .tif .tiff .gif .ppm .pgm .pbm .pnm .jp2 .j2k .avif "
    b".heic .heif .ras .sr .exr .hdr .pfm .psd".split()
)
MAX_FILE_BYTES = 2 << 30  # a "photo" larger than this is refused before reading it


class InputError(_CoreDecodeError):
    """An input that becomes a hole (reason's first word is its category)."""


def reason_of(exc: BaseException) -> str | None:
    """The hole reason of a per-input error, or None for a fatal error."""
    r = getattr(exc, "reason", None)
    if isinstance(r, str) and isinstance(exc, ValueError):
        return r
    return None


class _Hash:
    """Streaming fingerprint of a listing."""

    def __init__(self, kind: str) -> None:
        self.h = xxhash.xxh3_128()
        self.h.update(kind.encode() + b"\0")

    def add(self, key: bytes, size: int, mtime: int, label: int) -> None:
        self.h.update(struct.pack("<Iqqq", len(key), size, mtime, label))
        self.h.update(key)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class Listing:
    """Inputs in slot order: keys (offsets + blob), labels, a fingerprint."""

    def __init__(
        self,
        offsets: np.ndarray,
        blob: np.ndarray,
        labels: np.ndarray | None,
        label_names: list[str] | None,
        fingerprint: str,
        warnings: dict[str, int] | None = None,
    ) -> None:
        self.offsets = offsets  # <u8, n + 1
        self.blob = blob  # uint8
        self.labels = labels  # int64 (n,) or None
        self.label_names = label_names
        self.fingerprint = fingerprint
        self.warnings = dict(warnings or {})
        # input index -> hole reason for inputs whose label is missing or not
        # valid (a list's blank or non-integer cells); sparse
        self.label_errors: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def key(self, i: int) -> bytes:
        return self.blob[int(self.offsets[i]) : int(self.offsets[i + 1])].tobytes()

    def sub(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys of slots ``lo..hi`` rebased: (offsets, blob) for ``set_keys``."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        return (self.offsets[lo : hi + 1] - np.uint64(a)).astype(np.uint64), self.blob[a:b]


class _Builder:
    def __init__(self, kind: str, with_labels: bool) -> None:
        self.offsets = array("Q", [0])
        self.blob = bytearray()
        self.labels = array("q") if with_labels else None
        self.hash = _Hash(kind)

    def add(self, key: bytes, size: int = -1, mtime: int = -1, label: int = -1) -> None:
        self.blob += key
        self.offsets.append(len(self.blob))
        if self.labels is not None:
            self.labels.append(label)
        self.hash.add(key, size, mtime, label)

    def finish(self, label_names: list[str] | None, extra: str = "", warnings: dict | None = None) -> Listing:
        if extra:
            self.hash.h.update(extra.encode("utf-8", "surrogateescape"))
        offsets = np.frombuffer(self.offsets, dtype=np.uint64).copy()
        blob = np.frombuffer(bytes(self.blob), dtype=np.uint8) if self.blob else np.zeros(0, np.uint8)
        labels = np.frombuffer(self.labels, dtype=np.int64).copy() if self.labels is not None else None
        return Listing(offsets, blob, labels, label_names, self.hash.hexdigest(), warnings)


def _stat_key(path: bytes) -> tuple[int, int]:
    try:
        st = os.stat(path)
        return int(st.st_size), int(st.st_mtime_ns)
    except (OSError, ValueError):
        return -1, -1


def read_file(path: bytes | str) -> np.ndarray:
    """Read one input file, or raise a decode error with a reason."""
    return read_bytes(path, max_bytes=MAX_FILE_BYTES)


# --------------------------------------------------------------------------
# sources


class Source:
    """Base class. ``kind``, ``path`` and ``listing`` are set by ``scan``."""

    kind = "?"
    decoded = False  # True: load() returns arrays (no decode step)
    listing: Listing

    def __init__(self, path: str) -> None:
        self.path = path

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": os.path.abspath(self.path) if self.path else None}

    def scan(self) -> Listing:
        raise NotImplementedError

    def reader(self) -> Any:
        """A per-process object with ``load(i)`` (called after fork)."""
        return self

    def load(self, i: int) -> Any:
        raise NotImplementedError


def _is_hidden(name: bytes) -> bool:
    return name.startswith(b".")


def _ext(name: bytes) -> bytes:
    i = name.rfind(b".")
    return name[i:].lower() if i > 0 else b""


def _sniff_path(path: bytes) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.pread(fd, 64, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return sniff_image(head) is not None


class FolderSource(Source):
    """A directory of images, flat or ImageFolder (see the module docstring)."""

    kind = "folder"

    def __init__(
        self,
        path: str,
        labels: str = "auto",
        classes: list[str] | None = None,
        new_classes: str | None = None,
        classes_from: str | None = None,
    ) -> None:
        super().__init__(path)
        if labels not in ("auto", "folders", "none"):
            raise ValueError(f"labels must be auto, folders or none, got {labels!r}")
        if classes is not None and labels == "none":
            raise ValueError("a class mapping (classes_from= / label_names=) needs class folders, not labels='none'")
        self.labels_mode = "folders" if classes is not None and labels == "auto" else labels
        self.classes, self.new_classes = class_options(classes, new_classes, classes_from)
        self.classes_from = classes_from
        self.root = os.fsencode(path)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["labels"] = self.labels_mode
        if self.classes is not None:
            # the mapping itself is the manifest's label_names (and enters the fingerprint there)
            d["classes_from"] = self.classes_from
            d["new_classes"] = self.new_classes
        return d

    def _label_map(self, dirs: list[bytes], warnings: dict[str, int]) -> tuple[list[str], list[int]]:
        """label_names and each class folder's label, from the given mapping (see ``map_classes``)."""
        names = [os.fsdecode(n) for n in dirs]
        if self.classes is None:
            return names, list(range(len(names)))
        return map_classes(names, self.classes, self.new_classes, self.classes_from or "the label names", self.path,
                           warnings)

    def _entries(self, d: bytes) -> list[tuple[bytes, bool]]:
        """Sorted (name, is_dir) of a directory, hidden names dropped."""
        out = []
        with os.scandir(d) as it:
            for e in it:
                if _is_hidden(e.name):
                    continue
                try:
                    isdir = e.is_dir()  # follows symlinks
                except OSError:
                    isdir = False
                out.append((e.name, isdir))
        out.sort()
        return out

    def _candidate(self, path: bytes, name: bytes, warnings: dict[str, int]) -> bool:
        if _ext(name) in IMAGE_EXTENSIONS:
            return True
        if _sniff_path(path):
            return True
        warnings["ignored (not an image by content)"] = warnings.get("ignored (not an image by content)", 0) + 1
        return False

    def scan(self) -> Listing:
        root = self.root
        if not os.path.isdir(root):
            raise IngestError(f"{self.path}: not a directory")
        warnings: dict[str, int] = {}
        top = self._entries(root)
        dirs = [n for n, isdir in top if isdir]
        top_images = [n for n, isdir in top if not isdir and self._candidate(os.path.join(root, n), n, {})]
        mode = self.labels_mode
        if mode == "auto":
            mode = "folders" if dirs and not top_images else "none"
        if mode == "folders" and top_images:
            raise IngestError(
                f"{self.path}: --labels folders, but {len(top_images)} image(s) lie directly in the root "
                f"(e.g. {os.fsdecode(top_images[0])!r}); move them into class folders or use --labels none"
            )
        b = _Builder("folder", mode == "folders")
        label_names = None
        root_id = os.stat(root)
        ancestors = {(root_id.st_dev, root_id.st_ino)}
        if mode == "folders":
            label_names, ids = self._label_map(dirs, warnings)
            for k, name in zip(ids, dirs):
                self._walk(os.path.join(root, name), name + b"/", k, b, warnings, ancestors)
        else:
            self._walk(root, b"", -1, b, warnings, ancestors, entries=top)
        extra = mode if self.classes is None else repr((mode, label_names))
        self.listing = b.finish(label_names, extra=extra, warnings=warnings)
        return self.listing

    def _walk(
        self,
        d: bytes,
        prefix: bytes,
        label: int,
        b: _Builder,
        warnings: dict[str, int],
        ancestors: set[tuple[int, int]],
        entries: list[tuple[bytes, bool]] | None = None,
    ) -> None:
        # explicit stack: (dir path, key prefix, sorted entries, position, dir id)
        try:
            st = os.stat(d)
        except OSError:
            warnings["unreadable directories"] = warnings.get("unreadable directories", 0) + 1
            return
        try:
            ents = entries if entries is not None else self._entries(d)
        except OSError:
            warnings["unreadable directories"] = warnings.get("unreadable directories", 0) + 1
            return
        stack: list[list[Any]] = [[d, prefix, ents, 0, (st.st_dev, st.st_ino)]]
        ancestors = set(ancestors)
        ancestors.add((st.st_dev, st.st_ino))
        while stack:
            top = stack[-1]
            dpath, pre, ents, pos, _ = top
            if pos >= len(ents):
                stack.pop()
                ancestors.discard(top[4])
                continue
            top[3] = pos + 1
            name, isdir = ents[pos]
            path = os.path.join(dpath, name)
            if isdir:
                try:
                    sst = os.stat(path)
                    ident = (sst.st_dev, sst.st_ino)
                    if ident in ancestors:
                        warnings["directory symlink loops not followed"] = (
                            warnings.get("directory symlink loops not followed", 0) + 1
                        )
                        continue
                    sub = self._entries(path)
                except OSError:
                    warnings["unreadable directories"] = warnings.get("unreadable directories", 0) + 1
                    continue
                ancestors.add(ident)
                stack.append([path, pre + name + b"/", sub, 0, ident])
                continue
            if not self._candidate(path, name, warnings):
                continue
            size, mtime = _stat_key(path)
            b.add(pre + name, size, mtime, label)

    def load(self, i: int) -> Any:
        return read_file(os.path.join(self.root, self.listing.key(i)))


_BLANK = frozenset({"", "nan", "na", "<na>", "null", "none"})  # what a blank cell of an integer column may read
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _int_cell(s: str) -> int | None:
    """The integer a label cell holds (``7``, ``-3``, ``7.0``, ``7.``), else None."""
    t = s.strip()
    head, dot, tail = t.partition(".")
    if not head.lstrip("+-").isdigit() or head.count("-") + head.count("+") > 1 or (dot and tail.strip("0")):
        return None
    if not head.isascii():
        return None
    return int(head)


def _label_values(
    ids: dict[str, int], label_type: str, missing: str, column: str, path: str
) -> tuple[np.ndarray, list[str] | None, dict[int, str]]:
    """Stored label of each distinct cell (``remap[cell]``), the label names
    (None for an integer column) and the cells that make their rows holes."""
    ints = {c: _int_cell(c) for c in ids}
    is_int = {c for c, v in ints.items() if v is not None}
    blank_int = {c for c in ids if c.lower() in _BLANK and c not in is_int}
    other = [c for c in ids if c not in is_int and c not in blank_int and c != ""]
    kind = label_type
    if kind == "auto":
        if is_int and other:
            ex_i, ex_o = sorted(is_int)[:3], sorted(other)[:3]
            raise IngestError(
                f"{path}: label column {column!r} mixes integers ({len(is_int)} distinct, e.g. {ex_i}) and other "
                f"values ({len(other)} distinct, e.g. {ex_o}); nothing is renumbered silently: pass --label-type int "
                "(values that are not integers become holes listed in errors.jsonl) or --label-type names (every "
                "distinct value becomes a named class)"
            )
        kind = "int" if is_int else "names"
    remap = np.full(max(len(ids), 1), -1, np.int64)
    bad: dict[int, str] = {}
    names: list[str] | None = None
    blank = blank_int if kind == "int" else {""}
    if kind == "int" and missing == "class" and blank and any(ints[c] == -1 for c in is_int):
        raise IngestError(
            f"{path}: label column {column!r} already uses -1 as a label, and --missing-label class would give the "
            "blank cells that label too, merging them with it: pass --missing-label error (blank rows become "
            "holes listed in errors.jsonl), or give the blank rows a label of their own in the list"
        )
    if kind == "int":
        for c, k in ids.items():
            v = ints[c]
            if v is not None and _INT64[0] <= v <= _INT64[1]:
                remap[k] = v
            elif c in blank or c == "":
                if missing == "error":
                    bad[k] = f"bad-label: blank label cell ({c!r}) in integer column {column!r}"
            elif v is not None:
                bad[k] = f"bad-label: label {c!r} in column {column!r} does not fit a 64-bit integer"
            else:
                bad[k] = f"bad-label: label {c!r} in integer column {column!r} is not an integer"
    else:
        keep = sorted(c for c in ids if c not in blank or missing == "class")
        pos = {c: i for i, c in enumerate(keep)}
        names = keep
        for c, k in ids.items():
            if c in pos:
                remap[k] = pos[c]
            else:
                bad[k] = f"bad-label: blank label cell in column {column!r}"
    return remap, names, bad


def _label_notes(ids: dict[str, int], cells: np.ndarray, bad: dict[int, str], missing: str, is_int: bool) -> dict[str, int]:
    """Summary lines (``note: N ...``) saying what happened to odd label cells."""
    notes: dict[str, int] = {}
    if bad:
        n = int(np.isin(cells, np.fromiter(bad, np.int64, len(bad))).sum())
        notes["inputs skipped for a blank or invalid label (reason bad-label in errors.jsonl; "
              "--missing-label class keeps blank ones as a class)"] = n
    if missing == "class":
        blank = [k for c, k in ids.items() if (c.lower() in _BLANK if is_int else c == "") and _int_cell(c) is None]
        n = int(np.isin(cells, np.array(blank, np.int64)).sum()) if blank else 0
        if n:
            notes["inputs with a blank label kept as a class of their own (--missing-label class: "
                  + ("label -1)" if is_int else "the class named '')")] = n
    return notes


def _csv_rows(reader: Any, path: str) -> Iterator[list[str]]:
    """The rows of ``reader``; a row the csv module cannot parse (a field over
    its 128 KiB limit, a NUL byte, a quote left open to the end of the file)
    is an ``IngestError`` naming its line."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise IngestError(
                f"{path}:{reader.line_num}: not a CSV row the reader can parse ({e}); a field over 128 KiB "
                "usually means a quote (\") opened and never closed: fix the list"
            ) from None
        yield row


class ListSource(Source):
    """A CSV/TSV list of paths or ids, with an optional label column.

    Parameters
    ----------
    path
        The list file (``.tsv`` and ``.tab`` are tab-separated, anything else
        comma-separated unless ``delimiter`` is given).
    header
        Whether the first row is a header. ``None`` (default): yes, unless the
        path column is not named and the first row's path cell is an existing
        file (a plain list of paths, e.g. a ``.txt``), in which case columns
        are numbered from 0 and there are no labels unless ``label_column``
        names one by index.
    root
        Directory relative paths are resolved against (default: the list
        file's directory).
    path_column
        Column name or 0-based index of the path/id (default: the first of
        ``path, file, filename, filepath, image, image_path, id, image_id``
        present, else column 0).
    label_column
        Column name or index of the label; default ``label`` if present, else
        none. ``""`` means no labels.
    label_type
        ``"auto"`` (default): a column whose every non-blank cell is an
        integer (``7``, ``-3``, or a pandas float export such as ``7.0``) is
        an *integer* column and its labels stay the integers they are (no
        names); a column with no integer cell is a *named* column: its
        distinct values are sorted (by code point) and numbered from 0, and
        the names saved as ``label_names``. A column that mixes both is
        refused with counts and examples (no guessing): choose ``"int"``
        (cells that are not integers become holes, reason ``bad-label``) or
        ``"names"`` (every distinct value is a named class).
    missing_label
        What a blank cell (empty; in an integer column also ``nan``, ``NA``,
        ``<NA>``, ``null``, ``None``) means: ``"error"`` (default): that
        input becomes a hole with reason ``bad-label``, listed in
        ``errors.jsonl`` and counted in the summary; ``"class"``: a class of
        its own: label ``-1`` in an integer column, the class named ``""``
        in a named column.
    path_template
        ``str.format`` template turning the id into a relative path, with the
        id as ``{id}`` (``{id[0]}`` is its first character), e.g.
        ``"{id[0]}/{id[1]}/{id[2]}/{id}.jpg"`` for Google Landmarks 2020.

    The key of each record is the path column's value as written in the list.
    """

    kind = "list"
    _PATH_NAMES = ("path", "file", "filename", "filepath", "image", "image_path", "id", "image_id")

    def __init__(
        self,
        path: str,
        root: str | None = None,
        path_column: str | int | None = None,
        label_column: str | int | None = None,
        path_template: str | None = None,
        delimiter: str | None = None,
        header: bool | None = None,
        label_type: str = "auto",
        missing_label: str = "error",
        classes: list[str] | None = None,
        new_classes: str | None = None,
        classes_from: str | None = None,
    ) -> None:
        super().__init__(path)
        self.classes, self.new_classes = class_options(classes, new_classes, classes_from)
        self.classes_from = classes_from
        if label_type not in ("auto", "int", "names"):
            raise ValueError(f"label_type must be auto, int or names, got {label_type!r}")
        if missing_label not in ("error", "class"):
            raise ValueError(f"missing_label must be error or class, got {missing_label!r}")
        self.label_type = label_type
        self.missing_label = missing_label
        self.header = header
        self.root = os.path.abspath(root if root is not None else (os.path.dirname(path) or "."))
        self.path_column = path_column
        self.label_column = label_column
        self.path_template = path_template
        if delimiter is None:
            delimiter = "\t" if path.lower().endswith((".tsv", ".tab")) else ","
        self.delimiter = delimiter
        if path_template is not None:
            try:
                path_template.format("x" * 64, id="x" * 64)
            except (KeyError, IndexError, ValueError, AttributeError) as exc:
                raise ValueError(f"--path-template {path_template!r}: {exc!r}; use {{id}}, {{id[0]}}, ...") from None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(
            root=self.root,
            path_column=self.path_column,
            label_column=self.label_column,
            path_template=self.path_template,
            delimiter=self.delimiter,
            header=self.header,
            label_type=self.label_type,
            missing_label=self.missing_label,
        )
        if self.classes is not None:
            d.update(classes_from=self.classes_from, new_classes=self.new_classes)
        return d

    def _mapped(
        self, names: list[str] | None, remap: np.ndarray, column: str, notes: dict[str, int]
    ) -> tuple[list[str], np.ndarray]:
        """The named classes of the label column relabelled by the given mapping (``map_classes``)."""
        if names is None:
            raise LabelMappingError(
                f"{self.path}: label column {column!r} holds integer labels, which stay as they are; a class mapping "
                "(--classes-from/--label-names) applies to named classes: pass --label-type names"
            )
        names, ids = map_classes(names, self.classes or [], self.new_classes, self.classes_from or "the label names",
                                 self.path, notes, what="class name(s) in the list")
        ids_a = np.asarray(ids, np.int64)
        return names, np.where(remap >= 0, ids_a[np.maximum(remap, 0)] if len(ids_a) else -1, -1)

    @staticmethod
    def _col(header: list[str], want: str | int | None, what: str) -> int:
        if isinstance(want, int) or (isinstance(want, str) and want.isdigit() and want not in header):
            k = int(want)
            if not 0 <= k < len(header):
                raise IngestError(f"{what} {k} is out of range: the header has {len(header)} columns")
            return k
        if want not in header:
            raise IngestError(f"{what} {want!r} not found; the header is {header}")
        return header.index(want)

    def _has_header(self, row: list[str]) -> bool:
        """Header rule: a row is data (no header) when ``header=False``, or, with
        ``header=None`` (auto), when the path column is not given by name and
        the first row's path cell names an existing file."""
        if self.header is not None:
            return bool(self.header)
        pc = self.path_column
        if isinstance(pc, str) and not pc.isdigit():
            return True
        k = int(pc) if pc is not None else 0
        if k >= len(row) or not row[k]:
            return True
        try:
            return not os.path.exists(self._resolve(encode_key(row[k])))
        except (ValueError, KeyError, IndexError):
            return True

    def scan(self) -> Listing:
        try:
            fh = open(self.path, encoding="utf-8", errors="surrogateescape", newline="")
        except OSError as e:
            raise IngestError(f"{self.path}: cannot read the list ({e.strerror})") from None
        with fh:
            reader = _csv_rows(csv.reader(fh, delimiter=self.delimiter), self.path)
            header = next(reader, None)
            if header is None:
                raise IngestError(f"{self.path}: the list is empty (no header row)")
            header = [h.strip().lstrip("\ufeff") for h in header]
            first_data: list[list[str]] = []
            if not self._has_header(header):
                # a plain list of paths: the first row is data; columns are numbered
                first_data = [header]
                header = [str(k) for k in range(len(header))]
                if self.label_column is None:
                    self.label_column = ""
            if self.path_column is None:
                pc = next((header.index(n) for n in self._PATH_NAMES if n in header), 0)
            else:
                pc = self._col(header, self.path_column, "--path-column")
            if self.label_column is None:
                lc = header.index("label") if "label" in header else None
            elif self.label_column == "":
                lc = None
            else:
                lc = self._col(header, self.label_column, "--label-column")
            self.path_column_name = header[pc]
            b = _Builder("list", lc is not None)
            ids: dict[str, int] = {}
            for lineno, row in enumerate(itertools.chain(first_data, reader), 1 if first_data else 2):
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if pc >= len(row) or (lc is not None and lc >= len(row)):
                    raise IngestError(f"{self.path}:{lineno}: row has {len(row)} columns, expected {len(header)}")
                key = row[pc]
                lab = -1
                if lc is not None:
                    lab = ids.setdefault(row[lc].strip(), len(ids))
                kb = encode_key(key)
                size, mtime = _stat_key(self._resolve(kb))
                b.add(kb, size, mtime, lab)
        label_names = None
        bad: dict[int, str] = {}  # distinct cell number -> hole reason
        notes: dict[str, int] = {}
        if lc is None and self.classes is not None:
            raise LabelMappingError(f"{self.path}: a class mapping (--classes-from/--label-names) was given but the "
                                    "list has no label column; pass --label-column")
        if lc is not None:
            cells = np.frombuffer(b.labels, dtype=np.int64)  # distinct cell number of each row
            remap, label_names, bad = _label_values(ids, self.label_type, self.missing_label, header[lc], self.path)
            if self.classes is not None:
                label_names, remap = self._mapped(label_names, remap, header[lc], notes)
            labels = remap[cells] if len(cells) else np.zeros(0, np.int64)
            b.labels = array("q", labels.tobytes())
            notes.update(_label_notes(ids, cells, bad, self.missing_label, label_names is None))
        extra = repr((pc, lc, self.path_template, label_names, self.label_type, self.missing_label))
        self.listing = b.finish(label_names, extra=extra, warnings=notes)
        if lc is not None:
            errs = np.flatnonzero(np.isin(cells, np.fromiter(bad, np.int64, len(bad)))) if bad else []
            self.listing.label_errors = {int(i): bad[int(cells[i])] for i in errs}
            # the labels as stored (and which rows are holes) are part of the inputs
            self.listing.fingerprint = xxhash.xxh3_128(
                self.listing.fingerprint.encode() + labels.tobytes() + repr(sorted(bad.items())).encode("utf-8", "surrogateescape")
            ).hexdigest()
        return self.listing

    def _resolve(self, key: bytes) -> bytes:
        k = decode_key(key)
        rel = self.path_template.format(k, id=k) if self.path_template else k
        return os.path.join(os.fsencode(self.root), os.fsencode(rel))

    def load(self, i: int) -> Any:
        return read_file(self._resolve(self.listing.key(i)))


def _lmdb() -> Any:
    try:
        import lmdb  # lazy: only LMDB sources need the package
    except ImportError:  # pragma: no cover
        raise IngestError("reading an LMDB source needs the lmdb package: pip install lmdb") from None
    return lmdb


def is_lmdb(path: str) -> bool:
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "data.mdb"))
    return False


class LmdbSource(Source):
    """An LMDB of encoded images (LSUN layout: key -> image bytes); keys kept."""

    kind = "lmdb"

    def _open(self) -> Any:
        lmdb = _lmdb()
        return lmdb.open(
            self.path, readonly=True, lock=False, readahead=False, subdir=True, max_readers=1024, max_dbs=0
        )

    def scan(self) -> Listing:
        env = self._open()
        try:
            b = _Builder("lmdb", False)
            with env.begin(buffers=True) as txn:
                cur = txn.cursor()
                for k in cur.iternext(keys=True, values=False):
                    b.add(bytes(k))
            st = os.stat(os.path.join(self.path, "data.mdb"))
            self.listing = b.finish(None, extra=f"{st.st_size}:{st.st_mtime_ns}")
        finally:
            env.close()
        return self.listing

    def reader(self) -> Any:
        return _LmdbReader(self)


class _LmdbReader:
    def __init__(self, src: LmdbSource) -> None:
        self.src = src
        self.env = src._open()

    def load(self, i: int) -> Any:
        key = self.src.listing.key(i)
        with self.env.begin() as txn:
            val = txn.get(key)
        if val is None:
            raise InputError("unreadable: key vanished from the LMDB")
        return np.frombuffer(val, np.uint8)


_IMAGE_ARRAY_NAMES = ("image", "images", "x", "data", "arr_0")
_LABEL_ARRAY_NAMES = ("label", "labels", "y", "target", "targets", "arr_1")


class ArraySource(Source):
    """A ``.npy`` file (N, ...) or a ``.npz`` with an image array (``image``,
    ``images``, ``x``, ``data`` or ``arr_0``) and an optional label array
    (``label``, ``labels``, ``y``, ``target(s)`` or ``arr_1``) of length N.

    Items are stored as they are (no decode); with a target size, 2-D/3-D
    image items are fitted with ``decode.fit_array``.
    """

    kind = "arrays"
    decoded = True

    def __init__(self, path: str, image_key: str | None = None, label_key: str | None = None) -> None:
        super().__init__(path)
        self.image_key = image_key
        self.label_key = label_key
        self.arr: np.ndarray | None = None

    def scan(self) -> Listing:
        st = os.stat(self.path)
        labels = None
        warnings: dict[str, int] = {}
        if self.path.lower().endswith(".npz"):
            z = np.load(self.path, allow_pickle=False)
            names = list(z.files)
            ik = self.image_key or next((n for n in _IMAGE_ARRAY_NAMES if n in names), None)
            if ik is None:
                raise IngestError(f"{self.path}: no image array (looked for {_IMAGE_ARRAY_NAMES}); found {names}")
            arr = z[ik]
            lk = self.label_key or next((n for n in _LABEL_ARRAY_NAMES if n in names and n != ik), None)
            if lk is not None:
                lab = np.asarray(z[lk])
                if lab.shape != (len(arr),) or lab.dtype.kind not in "iub":
                    raise IngestError(f"{self.path}: label array {lk!r} must be ints of shape ({len(arr)},), found {lab.dtype} {lab.shape}")
                if lab.dtype.kind == "u" and lab.dtype.itemsize == 8 and len(lab) and int(lab.max()) > (1 << 63) - 1:
                    raise IngestError(f"{self.path}: label array {lk!r} holds {int(lab.max())}, which does not fit "
                                      "the store's int64 labels (it would wrap around); relabel it first")
                labels = lab.astype(np.int64)
            rest = [n for n in names if n not in (ik, lk)]
            if rest:  # said, not silently dropped
                read = f"{ik!r}" + (f" and {lk!r}" if lk is not None else "")
                warnings[f"array(s) of the .npz not stored (only {read} are read): "
                         + ", ".join(repr(n) for n in rest)] = len(rest)
        else:
            try:
                arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
            except ValueError as e:
                raise IngestError(f"{self.path}: not a loadable .npy array ({e})") from None
        if arr.ndim < 1:
            raise IngestError(f"{self.path}: a 0-d array has no items")
        if arr.dtype.kind not in "biuf":
            raise IngestError(f"{self.path}: dtype {arr.dtype} is not numeric")
        self.arr = arr
        n = len(arr)
        b = _Builder("arrays", False)
        for i in range(n):
            b.add(str(i).encode())
        self.listing = b.finish(None, extra=f"{st.st_size}:{st.st_mtime_ns}:{arr.shape}:{arr.dtype.str}",
                                warnings=warnings)
        if labels is not None:
            self.listing.labels = labels
            self.listing.fingerprint = xxhash.xxh3_128(self.listing.fingerprint.encode() + labels.tobytes()).hexdigest()
        return self.listing

    def load(self, i: int) -> Any:
        return np.asarray(self.arr[i])


class DatasetSource(Source):
    """Any map-style dataset (``len`` and ``ds[i]``) from Python.

    Items may be numpy arrays, torch tensors, PIL images, or ``(image,
    label)`` tuples/lists; ``dict`` items use their ``image`` and ``label``
    entries, and the entries named by ``fields`` (a schema of more fields,
    e.g. ragged ``{"boxes": ("<f4", (None, 4)), "caption": "str"}``). Keys
    are the dataset indices (``"0"``, ``"1"`` ...).
    """

    kind = "dataset"
    decoded = True

    def __init__(self, ds: Any, label_names: list[str] | None = None, fields: Any = None) -> None:
        super().__init__("")
        self.ds = ds
        self.fields = None
        if fields:
            from ..schema import Schema

            self.fields = fields if isinstance(fields, Schema) else Schema(fields)
            taken = [n for n in self.fields.names if n in ("image", "label", "orig_size", "box")]
            if taken:
                raise SchemaError(f"fields={list(self.fields.names)}: {taken} are the ingest's own fields; "
                                  "name the extra fields otherwise")
        self.has_labels: bool | None = None
        names = label_names if label_names is not None else getattr(ds, "classes", None)
        self.label_names = [str(c) for c in names] if names is not None else None

    def describe(self) -> dict[str, Any]:
        out = {"kind": self.kind, "type": f"{type(self.ds).__module__}.{type(self.ds).__qualname__}",
               "len": len(self.ds)}
        if self.fields is not None:
            out["fields"] = self.fields.to_json()
        return out

    def scan(self) -> Listing:
        n = len(self.ds)
        b = _Builder("dataset", False)
        for i in range(n):
            b.add(str(i).encode())
        self.listing = b.finish(self.label_names, extra=repr(self.describe()))
        return self.listing

    def extras(self, item: Any) -> dict[str, Any]:
        """The values of ``fields`` in a dict item (``InputError`` when one is missing)."""
        if self.fields is None:
            return {}
        if not isinstance(item, dict):
            raise InputError(f"wrong-shape: dataset item is a {type(item).__name__}; fields "
                             f"{list(self.fields.names)} need dict items")
        missing = [n for n in self.fields.names if n not in item]
        if missing:
            raise InputError(f"wrong-shape: dataset item has no field(s) {missing}")
        return {n: item[n] for n in self.fields.names}

    def split(self, item: Any) -> tuple[Any, Any]:
        if isinstance(item, dict):
            return item.get("image", item.get("img")), item.get("label", item.get("target"))
        if isinstance(item, (tuple, list)):
            if len(item) == 2:
                return item[0], item[1]
            if len(item) == 1:
                return item[0], None
            raise InputError(f"wrong-shape: dataset item is a {len(item)}-tuple; expected (image, label)")
        return item, None

    def load(self, i: int) -> Any:
        return self.ds[i]


def to_array(img: Any) -> np.ndarray:
    """numpy array of a dataset image: ndarray, tensor (CHW -> HWC), PIL image."""
    if hasattr(img, "detach") and hasattr(img, "cpu"):
        arr = img.detach().cpu().numpy()
        if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[2] not in (1, 3, 4):
            arr = np.ascontiguousarray(arr.transpose(1, 2, 0))
        return arr
    if hasattr(img, "getbands") and hasattr(img, "mode"):  # PIL.Image
        if img.mode == "P":
            img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        elif img.mode in ("CMYK", "YCbCr", "LAB", "HSV"):
            img = img.convert("RGB")
        elif img.mode in ("I;16", "I;16B", "I;16L"):
            return np.asarray(img).astype(np.uint16)
        elif img.mode in ("1",):
            img = img.convert("L")
        return np.asarray(img)
    return np.asarray(img)


def detect_source(path: str, **opts: Any) -> Source:
    """Recognise SOURCE from what it is.

    A directory with ``data.mdb`` is an LMDB; another directory an image
    folder; ``.csv``/``.tsv``/``.tab``/``.txt`` a list; ``.npy``/``.npz``
    arrays. Unknown options for the kind found are an error.
    """
    mapping = {"classes", "new_classes", "classes_from"}
    folder_opts = {"labels", *mapping}
    list_opts = {"root", "path_column", "label_column", "path_template", "delimiter", "header", "label_type",
                 "missing_label", *mapping}
    array_opts = {"image_key", "label_key"}
    given = {k for k, v in opts.items() if v is not None}

    def only(kind: str, allowed: set[str]) -> dict[str, Any]:
        bad = given - allowed
        if bad:
            flags = ", ".join("--" + b.replace("_", "-") for b in sorted(bad))
            raise IngestError(f"{path}: is {kind}; {flags} do(es) not apply to it")
        return {k: opts[k] for k in given}

    if os.path.isdir(path):
        if is_lmdb(path):
            return LmdbSource(path, **only("an LMDB", set()))
        return FolderSource(path, **only("an image folder", folder_opts))
    if not os.path.exists(path):
        raise IngestError(f"{path}: no such file or directory")
    low = path.lower()
    if low.endswith((".csv", ".tsv", ".tab", ".txt")):
        return ListSource(path, **only("a list", list_opts))
    if low.endswith((".npy", ".npz")):
        return ArraySource(path, **only("an array file", array_opts))
    with io.open(path, "rb") as fh:
        head = fh.read(8)
    if head.startswith(b"\x93NUMPY"):
        return ArraySource(path, **only("an array file", array_opts))
    raise IngestError(
        f"{path}: cannot tell what kind of source this is; expected a directory of images, an LMDB "
        "directory (with data.mdb), a .csv/.tsv list, or a .npy/.npz file"
    )
