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

import os
import stat as _stat
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from ..decode import sniff_image
from ..errors import IngestError, SchemaError, SourceError
from ._listing import InputError, Listing, Source, _Builder, _stat_key, read_file
from .classes import class_options, map_classes
from .coco import CocoSource, is_coco_json
from .lists import ListSource
from .parquet import ParquetSource, is_parquet
from .webdataset import WebDatasetSource, is_tar_pattern

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArraySource",
    "as_hwc",
    "CocoSource",
    "DatasetSource",
    "FolderSource",
    "InputError",
    "LmdbSource",
    "ListSource",
    "Listing",
    "Source",
    "detect_source",
    "WebDatasetSource",
]

IMAGE_EXTENSIONS = frozenset(
    b".jpg .jpeg .jpe .jfif .png .webp .bmp .dib .tif .tiff .gif .ppm .pgm .pbm .pnm .jp2 .j2k .avif "
    b".heic .heif .ras .sr .exr .hdr .pfm .psd".split()
)

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
            raise SourceError(f"{self.path}: not a directory")
        warnings: dict[str, int] = {}
        top = self._entries(root)
        dirs = [n for n, isdir in top if isdir]
        top_images = [n for n, isdir in top if not isdir and self._candidate(os.path.join(root, n), n, {})]
        mode = self.labels_mode
        if mode == "auto":
            mode = "folders" if dirs and not top_images else "none"
        if mode == "folders" and top_images:
            raise SourceError(
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

    def input_path(self, i: int) -> bytes:
        """The file of input ``i`` (``load`` reads it)."""
        return os.path.join(self.root, self.listing.key(i))


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
    image items are fitted with ``decode.fit_array`` (float items with
    values in ``[0, 1]`` become uint8 ``round(x * 255)``; others are
    refused: the first item before any work, a later one as a hole).
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
                raise SourceError(f"{self.path}: no image array (looked for {_IMAGE_ARRAY_NAMES}); found {names}")
            arr = z[ik]
            lk = self.label_key or next((n for n in _LABEL_ARRAY_NAMES if n in names and n != ik), None)
            if lk is not None:
                lab = np.asarray(z[lk])
                if lab.shape != (len(arr),) or lab.dtype.kind not in "iub":
                    raise SourceError(f"{self.path}: label array {lk!r} must be ints of shape ({len(arr)},), "
                                      f"found {lab.dtype} {lab.shape}")
                if lab.dtype.kind == "u" and lab.dtype.itemsize == 8 and len(lab) and int(lab.max()) > (1 << 63) - 1:
                    raise SourceError(f"{self.path}: label array {lk!r} holds {int(lab.max())}, which does not fit "
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
                raise SourceError(f"{self.path}: not a loadable .npy array ({e})") from None
        if arr.ndim < 1:
            raise SourceError(f"{self.path}: a 0-d array has no items")
        if arr.dtype.kind not in "biuf":
            raise SourceError(f"{self.path}: dtype {arr.dtype} is not numeric")
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
        if self.arr is None:  # set by scan()
            raise IngestError(f"{self.path}: load() called before scan()")
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
        check_map_style(ds)
        self.ds = ds
        self.fields = None
        if fields:
            from ..format.schema import Schema

            self.fields = fields if isinstance(fields, Schema) else Schema(fields)
            taken = [n for n in self.fields.names if n in ("image", "label", "orig_size", "box", "dst")]
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


def check_map_style(ds: Any) -> None:
    """Refuse a dataset that has no ``len(ds)`` and ``ds[i]`` (``SourceError``
    naming what it is and what to pass instead)."""
    cls = type(ds)
    what = f"a {cls.__module__}.{cls.__qualname__}"
    if isinstance(ds, Iterator) or any(c.__name__ == "IterableDataset" for c in cls.__mro__):
        kind = "an iterable dataset" if not isinstance(ds, Iterator) else "an iterator (a generator, map, iter(...))"
        raise SourceError(
            f"from_dataset: {what} is {kind}: its items can only be read in order, once, not by index; "
            "from_dataset needs a map-style dataset (len(ds) and ds[i]: its workers, resume and shards read "
            "items by index). Pass list(ds) when the items fit in memory, or write them one by one with "
            "mmstore.StoreWriter(dest, schema).append(sample)")
    missing = [n for n in ("__len__", "__getitem__") if not hasattr(cls, n)]
    if missing:
        raise SourceError(f"from_dataset: {what} has no {' and no '.join(missing)}; from_dataset needs a map-style "
                          "dataset (len(ds) and ds[i]): pass list(ds) when the items fit in memory, or a "
                          "Sequence of them")


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


def as_hwc(arr: np.ndarray) -> np.ndarray:
    """A dataset image to fit to a target size, as ``(H, W, C)``: a 3-D array
    whose first axis is 1, 3 or 4 and whose last axis cannot be channels (not
    1 to 4) is ``(C, H, W)``, what ``ToTensor()`` gives, and is transposed
    (a C-contiguous copy); any other array is returned as it is."""
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[2] not in (1, 2, 3, 4):
        return np.ascontiguousarray(arr.transpose(1, 2, 0))
    return arr


def detect_source(path: str, **opts: Any) -> Source:
    """Recognise SOURCE from what it is.

    A directory with ``data.mdb`` is an LMDB; another directory an image
    folder; ``.csv``/``.tsv``/``.tab``/``.txt`` a list; ``.npy``/``.npz``
    arrays; ``.json`` a COCO instances file (:mod:`mmstore.ingest.coco`);
    a path ending in ``.tar`` (a brace pattern or glob of shards) WebDataset
    tar shards (:mod:`mmstore.ingest.webdataset`); a path or glob ending in
    ``.parquet`` (or a directory of them, with ``image_column``) Parquet
    files (:mod:`mmstore.ingest.parquet`).
    Unknown options for the kind found are an error.
    """
    mapping = {"classes", "new_classes", "classes_from"}
    folder_opts = {"labels", *mapping}
    list_opts = {"root", "path_column", "label_column", "path_template", "delimiter", "header", "label_type",
                 "missing_label", "tags_column", "tags_sep", "text_column", "tag_names", *mapping}
    array_opts = {"image_key", "label_key"}
    coco_opts = {"root", "min_box_size"}
    wds_opts = {"json_keys"}
    given = {k for k, v in opts.items() if v is not None}

    def only(kind: str, allowed: set[str]) -> dict[str, Any]:
        bad = given - allowed
        if bad:
            flags = ", ".join("--" + b.replace("_", "-") for b in sorted(bad))
            raise SourceError(f"{path}: is {kind}; {flags} do(es) not apply to it")
        return {k: opts[k] for k in given}

    if is_parquet(path, opts.get("image_column")):  # .parquet files, a glob of them (mmstore.ingest.parquet)
        return ParquetSource(path, **only("Parquet files", {"image_column", "caption_column", "label_column",
                                                            "columns", "root"}))
    if is_tar_pattern(path):  # a .tar, a brace pattern or glob of them (mmstore.ingest.webdataset)
        return WebDatasetSource(path, **only("WebDataset tar shards", wds_opts))
    if os.path.isdir(path):
        if is_lmdb(path):
            return LmdbSource(path, **only("an LMDB", set()))
        return FolderSource(path, **only("an image folder", folder_opts))
    if not os.path.exists(path):
        raise SourceError(f"{path}: no such file or directory")
    low = path.lower()
    if low.endswith((".csv", ".tsv", ".tab", ".txt")):
        return ListSource(path, **only("a list", list_opts))
    if low.endswith((".npy", ".npz")):
        return ArraySource(path, **only("an array file", array_opts))
    if is_coco_json(path):
        return CocoSource(path, **only("a COCO annotation file", coco_opts))
    with open(path, "rb") as fh:
        head = fh.read(8)
    if head.startswith(b"\x93NUMPY"):
        return ArraySource(path, **only("an array file", array_opts))
    raise SourceError(
        f"{path}: cannot tell what kind of source this is; expected a directory of images, an LMDB "
        "directory (with data.mdb), a .csv/.tsv list, a .npy/.npz file or a COCO .json annotation file"
    )
