"""``RowsSource``: the rows of a table (columns of equal length) as an ingest
source: what one task of a distributed engine (``mmstore.ray``) holds.

The image column holds, row by row, one of: encoded bytes (``bytes``,
``bytearray``, ``memoryview`` or a 1-D ``uint8`` array: a file's content,
decoded exactly as ``ingest`` decodes that file), a path (``str`` or
``os.PathLike``: the file is read and decoded, as in a list), or an array of
pixels (``H x W`` or ``H x W x C``, or a PIL image: already decoded, fitted
to ``size`` like :func:`mmstore.from_dataset` items). The kind is taken from
the first row; a row of another kind becomes a hole that says so.

Keys: the ``key`` column when given; else the path column (made relative to
``root`` when the path lies under it, so a folder read by the engine gets the
keys ``mmstore ingest FOLDER`` gives); else the image column's path when
images are paths; else none (empty keys). Labels: the label column's
integers (a missing or non-integer label, or one outside ``label_names`` when they are given, is a
hole with its reason).
``fields``: more columns stored as they are (a schema, as in ``from_dataset``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import SchemaError, SourceError
from ..format.layout import encode_key
from ._listing import InputError, Listing, Source, _Builder, read_file
from .sources import to_array

__all__ = ["RowsSource", "image_kind"]

_OWN = ("image", "label", "orig_size", "box", "dst")


def image_kind(value: Any) -> str:
    """``"encoded"``, ``"path"`` or ``"pixels"``: what an image cell holds."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "encoded"
    if isinstance(value, (str, os.PathLike)):
        return "path"
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype == np.uint8:
        return "encoded"
    return "pixels"


def _roots(root: str | os.PathLike[str] | None) -> list[bytes]:
    """The prefixes a path under ``root`` starts with: ``root`` as given, with
    no URL scheme (an engine lists ``s3://bucket/photos`` as
    ``bucket/photos/...``), and a local root made absolute."""
    if root is None:
        return []
    r = os.fsencode(root)
    if b"://" in r:
        r = r.split(b"://", 1)[1]
        out = [r]
    else:
        out = [r, os.fsencode(os.path.abspath(root))]
    return [x.rstrip(b"/") + b"/" for x in out if x.strip(b"/")]


def _path_key(path: Any, roots: list[bytes]) -> bytes:
    p = os.fsencode(path)
    for r in roots:
        for prefix in (r, b"local://" + r, b"/" + r):
            if p.startswith(prefix):
                return p[len(prefix):]
    return p


def _label_of(value: Any) -> tuple[int, str | None]:
    """``(label, None)`` or ``(-1, hole reason)``."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return -1, "bad-label: the row has no label"
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer)) or float(value) != int(value):
        return -1, f"bad-label: {str(value)[:80]!r} is not an integer label"
    return int(value), None


class RowsSource(Source):
    """Rows of a table as ingest inputs (see the module docstring).

    ``columns``: name -> a sequence (list or array) of the column's values,
    all of the same length. ``image`` / ``label`` / ``key`` / ``path``: the
    column names (``label``, ``key``, ``path``: None for none; a name that is
    not a column is none too, but for ``image``)."""

    kind = "rows"

    def __init__(
        self,
        columns: Mapping[str, Sequence[Any]],
        *,
        image: str = "image",
        label: str | None = "label",
        key: str | None = "key",
        path: str | None = "path",
        root: str | os.PathLike[str] | None = None,
        label_names: Sequence[str] | None = None,
        fields: Any = None,
        description: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__("")
        if image not in columns:
            raise SourceError(f"the rows have no image column {image!r} (columns: {sorted(columns)}); pass "
                              "image= the column that holds the images (encoded bytes, paths or pixels)")
        lengths = {name: len(col) for name, col in columns.items()}
        if len(set(lengths.values())) > 1:
            raise SourceError(f"the columns have different lengths: {lengths}")
        self.columns = columns
        self.image, self.n = image, lengths[image]
        self.label = label if label is not None and label in columns else None
        self.key = key if key is not None and key in columns else None
        self.path_col = path if path is not None and path in columns else None
        self.roots = _roots(root)
        self.label_names = [str(c) for c in label_names] if label_names is not None else None
        self.fields = None
        if fields:
            from ..format.schema import Schema

            self.fields = fields if isinstance(fields, Schema) else Schema(fields)
            taken = [n for n in self.fields.names if n in _OWN]
            if taken:
                raise SchemaError(f"fields={list(self.fields.names)}: {taken} are the ingest's own fields; "
                                  "name the extra fields otherwise")
            missing = [n for n in self.fields.names if n not in columns]
            if missing:
                raise SourceError(f"fields {missing} are not columns of the rows (columns: {sorted(columns)})")
        first = next((v for v in columns[image] if v is not None), None)
        self.image_kind = image_kind(first) if first is not None else "encoded"
        self.decoded = self.image_kind == "pixels"
        self.description = dict(description or {})

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "rows": self.n, "image": self.image, "image_kind": self.image_kind}
        for name in ("label", "key"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.path_col is not None:
            out["path"] = self.path_col
        if self.fields is not None:
            out["fields"] = self.fields.to_json()
        out.update(self.description)
        return out

    def _key(self, i: int) -> bytes:
        if self.key is not None:
            v = self.columns[self.key][i]
            return b"" if v is None else v if isinstance(v, bytes) else encode_key(str(v))
        if self.path_col is not None:
            v = self.columns[self.path_col][i]
            return b"" if v is None else _path_key(v, self.roots)
        if self.image_kind == "path":
            v = self.columns[self.image][i]
            return b"" if v is None else encode_key(os.fspath(v))
        return b""

    def scan(self) -> Listing:
        b = _Builder("rows", self.label is not None)
        errors: dict[int, str] = {}
        img = self.columns[self.image]
        for i in range(self.n):
            v = img[i]
            size = len(v) if isinstance(v, (bytes, bytearray, memoryview, np.ndarray)) else -1
            lab = -1
            if self.label is not None:
                lab, why = _label_of(self.columns[self.label][i])
                if why is None and self.label_names is not None and not 0 <= lab < len(self.label_names):
                    lab, why = -1, (f"bad-label: {lab} is not a number of the {len(self.label_names)} label names "
                                    f"(0..{len(self.label_names) - 1})")
                if why is not None:
                    errors[i] = why
            b.add(self._key(i), size, -1, lab)
        self.listing = b.finish(self.label_names, extra=repr(self.describe()))
        self.listing.label_errors = errors
        return self.listing

    def load(self, i: int) -> Any:
        v = self.columns[self.image][i]
        if v is None:
            raise InputError("missing: the row has no image")
        kind = image_kind(v)
        if kind != self.image_kind:
            raise InputError(f"wrong-shape: the image column holds {self.image_kind} images, this row holds {kind}")
        if kind == "encoded":
            return np.frombuffer(v, dtype=np.uint8) if not isinstance(v, np.ndarray) else v
        if kind == "path":
            return read_file(os.fspath(v))
        return to_array(v)

    def record_fields(self, i: int, decoded: Any) -> dict[str, Any]:
        """The ``fields`` columns of row ``i``."""
        if self.fields is None:
            return {}
        return {n: self.columns[n][i] for n in self.fields.names}
