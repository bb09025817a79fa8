"""Arrow tables as ingest sources: Parquet files (img2dataset's Parquet
output, Hugging Face's Parquet exports) here, and a Hugging Face
``datasets.Dataset`` in :mod:`mmstore.ingest.hf`, both read as Arrow
columns, never through a per-row Python decode.

``mmstore ingest 'data/*.parquet' DEST --size 256x256 --image-column jpg --caption-column caption``

Files and rows
--------------
SOURCE is a ``.parquet`` file, a glob of them (``data/*.parquet``) or, with
``image_column`` given, a directory holding them (its ``*.parquet``, not
its sub-directories). Files are taken in the order of their byte names;
input ``i`` is row ``i`` of the files one after the other. A record's key is
``NAME:ROW``: NAME the file's path relative to the directory all files share
(usually its file name), ROW the row in that file from 0, so every hole
names its file and row.

What the parent reads
---------------------
The footers only: each file's schema, row groups and row counts, and the
footer's bytes, which with each file's name, size and modification time
make the listing's fingerprint (a resume refuses changed files). The one
exception is the label column, when there is one: it is read (that column
alone) in the parent, because numbering named classes needs every name.
Workers read the row group of the row they are asked for (the columns the
store needs, nothing else; Arrow reads release the GIL) and keep it while
its rows come, so memory is bounded by one row group's columns, never by a
file (img2dataset and Hugging Face write row groups of a few hundred rows).
The work ranges are whole row groups (:meth:`ArrowSource.read_units`), so a
row group is read once, by one worker.

Columns
-------
* ``image_column`` (default: the column Hugging Face's metadata calls an
  ``Image``, else the first of ``jpg``, ``png``, ``webp``, ``image``
  present): encoded bytes (``binary``: img2dataset's layout), a struct
  ``{bytes, path}`` (Hugging Face's ``Image``: the bytes when present, else
  the file at ``path``) or a string path. A relative path starts from
  ``root`` (default: the Parquet file's directory). Decoded with the same
  rules as a file of a folder (:mod:`mmstore.decode`).
* ``caption_column``: a string column stored exactly as written in the
  ``str`` field ``text`` (as a list's ``text_column``).
* ``label_column`` (default: the column Hugging Face's metadata calls a
  ``ClassLabel``, else none; ``""``: none): integers are stored as they
  are (with the ``ClassLabel`` names, from the metadata, as
  ``label_names``); strings are named classes, sorted by code point and
  numbered from 0.
* ``columns``: more columns stored as fields of their own name: integers
  and floats keep their dtype (little-endian), booleans are ``|u1``,
  strings ``str``, a list of numbers a ragged field ``(None,)`` and a
  fixed-size list of ``k`` numbers a field ``(k,)``. Other types are
  refused before any work.

Missing values rule: a null image, caption, label or column value makes
the row a hole whose reason names the column, the file and the row
(nothing is made up for it); a corrupt image is a hole as in any ingest.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import MissingExtraError, SchemaError, SourceError
from ._listing import InputError, Listing, Source, read_file

__all__ = ["ArrowSource", "ParquetSource", "is_parquet", "parse_columns", "pyarrow"]

_OWN = ("image", "label", "orig_size", "box", "dst", "image_hw", "text")
IMAGE_NAMES = ("jpg", "png", "webp", "image")
_INSTALL = "pip install 'mmstore[parquet]'"


def pyarrow() -> Any:
    """The ``pyarrow`` module (``MissingExtraError`` saying what to install when it is missing)."""
    try:
        import pyarrow as pa  # lazy: only Parquet and Hugging Face sources need it
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(f"reading Parquet files needs pyarrow: {_INSTALL}") from exc
    return pa


def parse_columns(columns: str | Sequence[str] | None) -> list[str]:
    """``"a,b"`` or ``["a", "b"]`` as a list of column names (none: ``[]``)."""
    if columns is None:
        return []
    names = columns.split(",") if isinstance(columns, str) else [str(c) for c in columns]
    names = [n.strip() for n in names if n.strip()]
    if len(set(names)) != len(names):
        raise SourceError(f"columns={names}: a column is named twice")
    return names


def is_parquet(path: str, image_column: Any = None) -> bool:
    """Whether SOURCE names Parquet files: a path or glob ending in
    ``.parquet``, or (with ``image_column``) a directory holding them."""
    if path.lower().endswith(".parquet"):
        return True
    return image_column is not None and os.path.isdir(path) and bool(glob.glob(os.path.join(glob.escape(path),
                                                                                      "*.parquet")))


def hf_label_names(metadata: dict[bytes, bytes] | None) -> dict[str, list[str]]:
    """Column -> class names of the ``ClassLabel`` columns that Hugging Face's
    schema metadata (``b"huggingface"``) describes; ``{}`` without it."""
    raw = (metadata or {}).get(b"huggingface")
    if not raw:
        return {}
    try:
        feats = json.loads(raw)["info"]["features"]
    except (ValueError, KeyError, TypeError):
        return {}
    out: dict[str, list[str]] = {}
    if isinstance(feats, dict):
        for name, f in feats.items():
            if isinstance(f, dict) and f.get("_type") == "ClassLabel" and isinstance(f.get("names"), list):
                out[str(name)] = [str(n) for n in f["names"]]
    return out


def hf_image_columns(metadata: dict[bytes, bytes] | None) -> list[str]:
    """The columns Hugging Face's schema metadata calls ``Image``."""
    raw = (metadata or {}).get(b"huggingface")
    try:
        feats = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return []
    return [str(n) for n, f in feats.items() if isinstance(f, dict) and f.get("_type") == "Image"] \
        if isinstance(feats, dict) else []


# --------------------------------------------------------------------------
# column kinds


def _image_kind(t: Any) -> str | None:
    pa = pyarrow()
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or \
            str(t) == "binary_view":
        return "bytes"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view":
        return "path"
    if pa.types.is_struct(t) and any(t.field(k).name in ("bytes", "path") for k in range(t.num_fields)):
        return "struct"
    return None


def _is_text(t: Any) -> bool:
    pa = pyarrow()
    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or str(t) == "string_view")


def _numeric(t: Any) -> str | None:
    """The stored dtype of a number or bool type, else None."""
    pa = pyarrow()
    if pa.types.is_boolean(t):
        return "|u1"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return np.dtype(t.to_pandas_dtype()).newbyteorder("<").str
    return None


def _field_spec(name: str, t: Any) -> Any:
    """The schema entry of a stored column (``SourceError`` for a type that has none)."""
    pa = pyarrow()
    if _is_text(t):
        return "str"
    d = _numeric(t)
    if d is not None:
        return (d, ())
    if pa.types.is_fixed_size_list(t) and _numeric(t.value_type) is not None:
        return (_numeric(t.value_type), (t.list_size,))
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _numeric(t.value_type) is not None:
        return (_numeric(t.value_type), (None,))
    raise SourceError(f"column {name!r} is of type {t}; a stored column must hold numbers, booleans, strings or "
                      "lists of numbers: leave it out of columns=")


def valid_mask(arr: Any) -> np.ndarray:
    """Which cells of the Arrow array ``arr`` are not null, from its validity
    bitmap. (Not ``is_valid().to_numpy()``: a boolean array's conversion to
    numpy imports pandas, in every worker, at a cost above that of reading
    the row group.)"""
    n = len(arr)
    if arr.null_count == 0:
        return np.ones(n, bool)
    if arr.null_count == n:
        return np.zeros(n, bool)
    bitmap = arr.buffers()[0]
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + n].astype(bool)


class _Images:
    """The image cells of one block: zero-copy views of the bytes, or paths."""

    def __init__(self, arr: Any, kind: str) -> None:
        pa = pyarrow()
        self.valid = valid_mask(arr)
        self.data: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.paths: list[Any] | None = None
        if kind == "path":
            self.paths = arr.to_pylist()
            return
        if kind == "struct":
            children = dict(zip([arr.type.field(k).name for k in range(arr.type.num_fields)], arr.flatten()))
            if "path" in children:
                self.paths = children["path"].to_pylist()
            b = children.get("bytes")
            if b is None:
                return
            arr = b
        if arr.type == pa.binary():  # read in place: its int32 offsets as they are
            width: Any = np.int32
        else:
            width = np.int64
            if arr.type != pa.large_binary():
                arr = arr.cast(pa.large_binary())
        bufs = arr.buffers()
        offsets = np.frombuffer(bufs[1], width)[arr.offset : arr.offset + len(arr) + 1]
        data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        has = valid_mask(arr)
        self.data = (offsets, data, has)

    def get(self, j: int) -> np.ndarray | str | None:
        """Row ``j``'s encoded bytes (a view), its path, or None (null)."""
        if not self.valid[j]:
            return None
        if self.data is not None:
            offsets, data, has = self.data
            if has[j]:
                return data[int(offsets[j]) : int(offsets[j + 1])]
        if self.paths is not None and self.paths[j] is not None:
            return str(self.paths[j])
        return None


class _Block:
    """What a reader keeps of one block: its images and its stored columns' values."""

    def __init__(self, src: ArrowSource, k: int, table: Any) -> None:
        self.k = k
        self.start, self.end = int(src.block_start[k]), int(src.block_start[k + 1])
        self.images = _Images(_column(table, str(src.image_column)), src.image_kind)
        self.values = {c: _column(table, c).to_pylist() for c in src.value_columns}


def _column(table: Any, name: str) -> Any:
    """Column ``name`` of ``table`` as one Arrow array: its chunk when it has
    one (a row group's column has; a copy of its bytes would cost as much as
    reading them), else the chunks joined."""
    col = table.column(name)
    if not hasattr(col, "combine_chunks"):
        return col
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


class _Reader:
    """A process's (or thread's) reader: the current block, read on demand."""

    def __init__(self, src: ArrowSource) -> None:
        self.src = src
        self.block: _Block | None = None
        self.state = src.open_state()

    def row(self, i: int) -> tuple[_Block, int]:
        b = self.block
        if b is not None and b.start <= i < b.end:  # the rows of a block come one after the other
            return b, i - b.start
        k = int(np.searchsorted(self.src.block_start, i, side="right")) - 1
        if self.block is None or self.block.k != k:
            self.block = None  # the old block's memory goes before the new one is read
            self.block = _Block(self.src, k, self.src.read_block(self.state, k, self.src.read_columns))
        return self.block, i - self.block.start

    def load(self, i: int) -> Any:
        block, j = self.row(i)
        self.src.local().current = (i, block, j)
        cell = block.images.get(j)
        if cell is None:
            raise InputError(f"missing: the image is null (column {self.src.image_column!r}, {self.src.where(i)})")
        if isinstance(cell, str):
            return read_file(self.src.image_path(i, cell))
        return cell


class ArrowSource(Source):
    """Rows of Arrow tables read block by block (see the module docstring).

    A subclass sets, in ``scan``, ``block_start`` (the first row of every
    block, and the row count last) and calls :meth:`finish_scan`; it
    implements ``read_block(state, k, columns)`` (a table of block ``k``'s
    ``columns``), ``open_state()`` (a reader's own handles) and ``where(i)``."""

    decoded = False

    def __init__(
        self,
        path: str,
        image_column: str | None = None,
        caption_column: str | None = None,
        label_column: str | None = None,
        columns: str | Sequence[str] | None = None,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(path)
        pyarrow()  # the missing extra is said before any work
        self.image_column = image_column
        self.caption_column = caption_column or None
        self.auto_label = label_column is None  # "": no labels; None: the ClassLabel column, if one
        self.label_column = label_column or None
        self.columns = parse_columns(columns)
        self.root = os.fspath(root) if root is not None else None
        self.block_start = np.zeros(1, np.int64)
        self.fields: Any = None
        self.image_kind = "bytes"
        self.value_columns: list[str] = []
        self.read_columns: list[str] = []
        self._tls: threading.local | None = None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(image_column=self.image_column, caption_column=self.caption_column, label_column=self.label_column,
                 columns=self.columns)
        return d

    # -- the scan ------------------------------------------------------------------------
    def choose_columns(self, schema: Any, image_default: list[str], where: str) -> None:
        """Check the chosen columns against the Arrow ``schema`` and fix the image
        column and the fields (``SourceError`` naming what is wrong)."""
        names = list(schema.names)

        def need(col: str, what: str) -> Any:
            if col not in names:
                raise SourceError(f"{where}: no column {col!r} ({what}); the columns are {names}")
            return schema.field(col).type

        if self.image_column is None:
            found = [c for c in image_default if c in names and _image_kind(schema.field(c).type) is not None]
            if not found:
                raise SourceError(f"{where}: which column holds the images? None is named {list(IMAGE_NAMES)} or "
                                  f"described as an Image; the columns are {names}: pass "
                                  "image_column= (--image-column NAME)")
            self.image_column = found[0]
        kind = _image_kind(need(self.image_column, "image_column"))
        if kind is None:
            raise SourceError(f"{where}: image column {self.image_column!r} is of type "
                              f"{schema.field(self.image_column).type}; expected encoded bytes (binary), a struct "
                              "{bytes, path} (a Hugging Face Image) or a string path")
        self.image_kind = kind
        spec: dict[str, Any] = {}
        if self.caption_column is not None:
            t = need(self.caption_column, "caption_column")
            if not _is_text(t):
                raise SourceError(f"{where}: caption column {self.caption_column!r} is of type {t}; expected a "
                                  "string column")
            spec["text"] = "str"
        if self.label_column is not None:
            need(self.label_column, "label_column")
        for c in self.columns:
            if c in _OWN:
                raise SchemaError(f"columns={self.columns}: {c!r} is a field the ingest stores itself; leave it out "
                                  "(the caption is caption_column=, the label label_column=)")
            spec[c] = _field_spec(c, need(c, "columns"))
        if self.image_column in self.columns:
            raise SourceError(f"{where}: the image column {self.image_column!r} is also in columns=")
        from ..format.schema import Schema

        self.fields = Schema(spec) if spec else None
        self.value_columns = ([self.caption_column] if self.caption_column else []) + self.columns
        self.read_columns = list(dict.fromkeys([self.image_column, *self.value_columns]))

    def read_labels(self, blocks: Iterator[tuple[int, Any]], names: list[str] | None, n: int
                    ) -> tuple[np.ndarray, list[str] | None, dict[int, str]]:
        """Labels of every row from ``blocks`` (first row, Arrow array of the
        label column): integers as they are (``names`` kept), strings
        numbered by their sorted names; nulls are holes."""
        pa = pyarrow()
        labels = np.full(n, -1, np.int64)
        errors: dict[int, str] = {}
        named: dict[str, int] = {}
        string = None
        for start, arr in blocks:
            t = arr.type
            if pa.types.is_dictionary(t):
                arr = arr.cast(t.value_type)
                t = arr.type
            valid = valid_mask(arr)
            is_str = _is_text(t)
            if not is_str and not pa.types.is_integer(t):
                raise SourceError(f"{self.path}: label column {self.label_column!r} is of type {t}; expected "
                                  "integers or strings (class names)")
            string = is_str if string is None else string
            if is_str:
                enc = arr.dictionary_encode()
                ids = np.array([named.setdefault(s, len(named)) for s in enc.dictionary.to_pylist()] or [0], np.int64)
                idx = enc.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                vals = ids[idx]
            else:
                try:
                    vals = arr.fill_null(0).cast(pa.int64()).to_numpy(zero_copy_only=False)
                except (pa.ArrowInvalid, OverflowError) as exc:
                    raise SourceError(f"{self.path}: label column {self.label_column!r} holds a value that does not "
                                      f"fit the store's int64 labels ({exc}); relabel it first") from None
            labels[start : start + len(arr)] = np.where(valid, vals, -1)
            for j in np.flatnonzero(~valid).tolist():
                errors[start + j] = f"bad-label: the label is null (column {self.label_column!r}, " \
                    f"{self.where(start + j)})"
        if string:
            order = sorted(named)
            rank = np.empty(max(len(named), 1), np.int64)
            for pos, s in enumerate(order):
                rank[named[s]] = pos
            labels = np.where(labels >= 0, rank[np.maximum(labels, 0)], -1)
            return labels, order, errors
        return labels, names, errors

    def finish_scan(self, offsets: np.ndarray, blob: np.ndarray, h: Any, label_data: Any = None,
                    warnings: dict[str, int] | None = None) -> Listing:
        """The listing from the keys, the fingerprint hash ``h`` so far and
        ``label_data`` (what :meth:`read_labels` returned, or None)."""
        labels, names, errors = label_data if label_data is not None else (None, None, {})
        if labels is not None:
            h.update(labels.tobytes())
            h.update(repr(names).encode("utf-8", "surrogateescape"))
            h.update(repr(sorted(errors.items())).encode("utf-8", "surrogateescape"))
        self.listing = Listing(offsets, blob, labels, names, h.hexdigest(), warnings)
        self.listing.label_errors = errors
        return self.listing

    # -- the workers' side ------------------------------------------------------------------
    def local(self) -> threading.local:
        """This thread's state (the row being made), created on first use."""
        if self._tls is None:
            self._tls = threading.local()
        return self._tls

    def reader(self) -> Any:
        return _Reader(self)

    def read_units(self) -> np.ndarray:
        """The first row of every block: a worker reads a block whole, so the
        work ranges are cut at these rows (``resume.pending_ranges``)."""
        return self.block_start[:-1]

    def load(self, i: int) -> Any:
        return _Reader(self).load(i)

    def open_state(self) -> Any:
        return None

    def read_block(self, state: Any, k: int, columns: list[str]) -> Any:
        raise NotImplementedError

    def where(self, i: int) -> str:
        raise NotImplementedError

    def image_path(self, i: int, path: str) -> str:
        """The file an image cell's path names (a relative one from ``root``)."""
        if os.path.isabs(path) or self.root is None:
            return path
        return os.path.join(self.root, path)

    def record_fields(self, i: int, decoded: Any = None) -> dict[str, Any]:
        """The caption and stored columns of row ``i`` (a null is a hole);
        taken by :class:`mmstore.ingest.records.RecordJob`."""
        if not self.value_columns:
            return {}
        cur = getattr(self.local(), "current", None)
        if cur is None or cur[0] != i:
            block, j = _Reader(self).row(i)
        else:
            _, block, j = cur
        out: dict[str, Any] = {}
        for c in self.value_columns:
            v = block.values[c][j]
            if v is None:
                raise InputError(f"missing: column {c!r} is null ({self.where(i)})")
            if c == self.caption_column:
                out["text"] = v
                if c not in self.columns:
                    continue
            spec = self.fields[c] if self.fields is not None else None
            out[c] = v if isinstance(v, str) else np.asarray(v, spec.dtype if spec is not None else None)
        return out


def _keys(name: bytes, rows: int) -> tuple[np.ndarray, bytes]:
    """Key lengths and blob of ``NAME:0`` .. ``NAME:rows-1``."""
    parts = [name + b":%d" % r for r in range(rows)]
    return np.fromiter((len(p) for p in parts), np.int64, rows), b"".join(parts)


def _footer_digest(path: str, size: int) -> str:
    """xxh3 of a Parquet file's footer (its last ``8 + footer length`` bytes)."""
    with open(path, "rb") as fh:
        if size < 12:
            raise SourceError(f"{path}: {size} bytes is too short for a Parquet file")
        fh.seek(size - 8)
        tail = fh.read(8)
        if tail[4:] != b"PAR1":
            raise SourceError(f"{path}: not a Parquet file (it does not end with PAR1)")
        n = int.from_bytes(tail[:4], "little")
        if n + 12 > size:
            raise SourceError(f"{path}: its Parquet footer claims {n} bytes, more than the file holds")
        fh.seek(size - 8 - n)
        return xxhash.xxh3_64(fh.read(n)).hexdigest()


class ParquetSource(ArrowSource):
    """Parquet files as inputs, one row each (see the module docstring)."""

    kind = "parquet"

    def __init__(self, path: str, **kw: Any) -> None:
        super().__init__(path, **kw)
        self.files: list[str] = []
        self.names: list[str] = []
        self.file_start = np.zeros(1, np.int64)
        self.block_file = np.zeros(0, np.int64)
        self.block_rg = np.zeros(0, np.int64)

    def _find(self) -> list[str]:
        p = self.path
        if os.path.isdir(p):
            found = glob.glob(os.path.join(glob.escape(p), "*.parquet"))
        elif glob.has_magic(p):
            found = glob.glob(p)
        else:
            if not os.path.isfile(p):
                raise SourceError(f"{p}: no such file")
            found = [p]
        found = sorted({f for f in found if os.path.isfile(f)}, key=os.fsencode)
        if not found:
            raise SourceError(f"{p}: matches no Parquet file")
        return found

    def scan(self) -> Listing:
        pq = pyarrow().parquet
        files = self._find()
        common = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        self.files = files
        self.names = [os.path.relpath(os.path.abspath(f), common) for f in files]
        h = xxhash.xxh3_128(b"parquet\0")
        starts, bfile, brg, lens, blobs, fstart = [0], [], [], [np.zeros(1, np.int64)], [], [0]
        schema0 = None
        label_names: list[str] | None = None
        total = 0
        for fi, (f, name) in enumerate(zip(files, self.names)):
            st = os.stat(f)
            digest = _footer_digest(f, st.st_size)
            try:
                pf = pq.ParquetFile(f)
            except Exception as exc:  # noqa: BLE001 - pyarrow's own error types; any is a bad file
                raise SourceError(f"{f}: not a readable Parquet file ({exc})") from None
            meta, schema = pf.metadata, pf.schema_arrow
            if schema0 is None:
                schema0 = schema
                hf = hf_image_columns(schema.metadata)
                if self.auto_label:
                    self.label_column = next(iter(hf_label_names(schema.metadata)), None)
                self.choose_columns(schema, hf + [c for c in IMAGE_NAMES if c not in hf], f)
                if self.label_column is not None:
                    label_names = hf_label_names(schema.metadata).get(self.label_column)
            else:
                for c in [*self.read_columns, *([self.label_column] if self.label_column else [])]:
                    if c not in schema.names or schema.field(c).type != schema0.field(c).type:
                        was = schema0.field(c).type
                        now = schema.field(c).type if c in schema.names else "missing"
                        raise SourceError(f"{f}: column {c!r} is {now}, but {files[0]} has it as {was}; every file "
                                          "must hold the chosen columns with one type")
            nb = name.encode("utf-8", "surrogateescape")
            h.update(b"%d:%d:%d:" % (len(nb), st.st_size, st.st_mtime_ns) + nb + digest.encode())
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows == 0:
                    continue
                bfile.append(fi)
                brg.append(g)
                total += rows
                starts.append(total)
            ln, keys = _keys(nb, meta.num_rows)
            lens.append(ln)
            blobs.append(keys)
            fstart.append(total)
        self.file_start = np.asarray(fstart, np.int64)
        self.block_start = np.asarray(starts, np.int64)
        self.block_file = np.asarray(bfile, np.int64)
        self.block_rg = np.asarray(brg, np.int64)
        offsets = np.cumsum(np.concatenate(lens)).astype(np.uint64)
        blob = np.frombuffer(b"".join(blobs), np.uint8) if total else np.zeros(0, np.uint8)
        label_data = None
        if self.label_column is not None:
            label_data = self.read_labels(self._label_blocks(), label_names, total)
        return self.finish_scan(offsets, blob, h, label_data)

    def _label_blocks(self) -> Iterator[tuple[int, Any]]:
        state = self.open_state()
        for k in range(len(self.block_file)):
            t = self.read_block(state, k, [str(self.label_column)])
            yield int(self.block_start[k]), _column(t, str(self.label_column))

    def open_state(self) -> Any:
        return {"file": -1, "pf": None}

    def read_block(self, state: Any, k: int, columns: list[str]) -> Any:
        fi = int(self.block_file[k])
        if state["file"] != fi:
            state["pf"] = None
            # read in this thread: pre-buffering hands each read to Arrow's I/O threads, which costs more
            # CPU than the read itself for a local file of one row group at a time
            state["pf"] = pyarrow().parquet.ParquetFile(self.files[fi], pre_buffer=False)
            state["file"] = fi
        return state["pf"].read_row_group(int(self.block_rg[k]), columns=columns, use_threads=False)

    def _file_of(self, i: int) -> int:
        return int(np.searchsorted(self.file_start, i, side="right")) - 1

    def where(self, i: int) -> str:
        fi = self._file_of(i)
        return f"{self.names[fi]}, row {i - int(self.file_start[fi])}"

    def image_path(self, i: int, path: str) -> str:
        if os.path.isabs(path):
            return path
        root = self.root if self.root is not None else os.path.dirname(self.files[self._file_of(i)])
        return os.path.join(root, path)
