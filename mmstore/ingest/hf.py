"""A Hugging Face ``datasets.Dataset`` as an ingest source, read as Arrow.

``mmstore.from_hf(ds, DEST, size=224)`` (or ``mmstore.ingest(ds, DEST, ...)``)

The dataset's rows are read as Arrow tables (``ds.with_format("arrow")``),
blocks of :data:`BLOCK_ROWS` rows at a time, never through the dataset's
Python formatting, which would decode every image to a PIL image: an
``Image`` column's cells are a struct ``{bytes, path}`` and are decoded by
mmstore's own rules from the bytes (or the file at ``path`` when the
dataset holds paths), exactly as a file of a folder. A selection, shuffle
or filter of the dataset (an indices mapping) is honoured: input ``i`` is
``ds[i]``. Keys are the row numbers (``"0"``, ``"1"`` ...).

Columns: as for Parquet files (:mod:`mmstore.ingest.parquet`), with these
defaults: the image column is the first ``Image`` feature, the label
column the first ``ClassLabel`` feature, whose names become the store's
``label_names`` (``label_column=""``: no labels).

Resume: the listing's fingerprint covers the dataset's length, features and
content fingerprint (the one ``datasets`` keeps for caching: the same data
loaded again gives the same one) and the size and modification time of its
Arrow cache files.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import xxhash

from ..errors import MissingExtraError, SourceError
from ._listing import Listing
from .parquet import IMAGE_NAMES, ArrowSource

__all__ = ["BLOCK_ROWS", "HF_OPTIONS", "HFSource", "hf_options", "is_hf_dataset"]

BLOCK_ROWS = 256  # rows a reader holds at a time (their images' bytes, a few MB)
_INSTALL = "pip install 'mmstore[hf]'"


def is_hf_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face dataset (``Dataset``, ``DatasetDict``
    or their iterable kinds, which :class:`HFSource` refuses with what to
    pass instead), told without importing ``datasets``."""
    mod = type(obj).__module__ or ""
    return mod.split(".")[0] == "datasets" and type(obj).__name__ in ("Dataset", "DatasetDict", "IterableDataset",
                                                                      "IterableDatasetDict")


HF_OPTIONS = ("image_column", "caption_column", "label_column", "columns", "root")


def hf_options(given: dict[str, Any]) -> dict[str, Any]:
    """The options of :class:`HFSource` among ``given`` source options (any
    other is refused: it applies to another kind of source)."""
    bad = sorted(set(given) - set(HF_OPTIONS))
    if bad:
        raise SourceError(f"a Hugging Face dataset: options {bad} do not apply to it (its options: "
                          f"{list(HF_OPTIONS)})")
    return dict(given)


def _datasets() -> Any:
    try:
        import datasets  # lazy: only this source needs it
    except ImportError as exc:
        raise MissingExtraError(f"reading a Hugging Face dataset needs the datasets package: {_INSTALL}") from exc
    return datasets


class HFSource(ArrowSource):
    """A ``datasets.Dataset`` as inputs, one row each (see the module docstring).

    Parameters
    ----------
    ds
        The dataset (a ``DatasetDict`` is refused: pass one split,
        ``ds["train"]``; an ``IterableDataset`` too: it has no rows by
        index).
    image_column, caption_column, label_column, columns, root
        As for :class:`~mmstore.ingest.parquet.ParquetSource`; ``root``: the
        directory relative image paths start from (default: the current
        directory).
    """

    kind = "hf"

    def __init__(self, ds: Any, image_column: str | None = None, caption_column: str | None = None,
                 label_column: str | None = None, columns: str | Sequence[str] | None = None,
                 root: str | os.PathLike[str] | None = None) -> None:
        datasets = _datasets()
        if isinstance(ds, datasets.DatasetDict):
            raise SourceError(f"a DatasetDict of splits {sorted(ds)}: pass one split, e.g. ds[{sorted(ds)[0]!r}]")
        if not isinstance(ds, datasets.Dataset):
            raise SourceError(f"a {type(ds).__module__}.{type(ds).__qualname__} is not a datasets.Dataset (an "
                              "IterableDataset has no rows by index): load it without streaming=True")
        super().__init__("", image_column, caption_column, label_column, columns, root)
        self.ds = ds
        self.view: Any = None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(path=None, rows=len(self.ds), features=repr(self.ds.features))
        return d

    def scan(self) -> Listing:
        datasets = _datasets()
        ds = self.ds
        feats = ds.features
        schema = feats.arrow_schema
        images = [n for n, f in feats.items() if isinstance(f, datasets.Image)]
        if self.auto_label:
            self.label_column = next((n for n, f in feats.items() if isinstance(f, datasets.ClassLabel)), None)
        self.choose_columns(schema, images + [c for c in IMAGE_NAMES if c not in images], "the dataset")
        n = len(ds)
        self.block_start = np.append(np.arange(0, n, BLOCK_ROWS, dtype=np.int64), n) if n else np.zeros(1, np.int64)
        self.view = ds.select_columns(self.read_columns).with_format("arrow")
        h = xxhash.xxh3_128(b"hf\0")
        h.update(repr((n, repr(feats), getattr(ds, "_fingerprint", None))).encode("utf-8", "surrogateescape"))
        if getattr(ds, "_fingerprint", None) is None:  # no content fingerprint: the content itself
            for batch in ds.with_format("arrow").iter(batch_size=4096):
                for col in batch.columns:
                    for chunk in col.chunks:
                        for buf in chunk.buffers():
                            if buf is not None:
                                h.update(memoryview(buf))
        for c in ds.cache_files:
            f = c.get("filename")
            if f:
                st = os.stat(f)
                h.update(repr((f, st.st_size, st.st_mtime_ns)).encode("utf-8", "surrogateescape"))
        keys = [str(i).encode() for i in range(n)]
        offsets = np.zeros(n + 1, np.uint64)
        offsets[1:] = np.cumsum(np.fromiter((len(k) for k in keys), np.int64, n))
        blob = np.frombuffer(b"".join(keys), np.uint8) if n else np.zeros(0, np.uint8)
        label_data = None
        if self.label_column is not None:
            f = feats[self.label_column]
            names = [str(x) for x in f.names] if isinstance(f, datasets.ClassLabel) else None
            label_data = self.read_labels(self._label_blocks(), names, n)
        return self.finish_scan(offsets, blob, h, label_data)

    def _label_blocks(self) -> Iterator[tuple[int, Any]]:
        col = str(self.label_column)
        view = self.ds.select_columns([col]).with_format("arrow")
        step = 1 << 20
        for a in range(0, len(self.ds), step):
            t = view[a : a + step]
            arr = t.column(col)
            yield a, arr.combine_chunks() if hasattr(arr, "combine_chunks") else arr

    def read_block(self, state: Any, k: int, columns: list[str]) -> Any:
        a, b = int(self.block_start[k]), int(self.block_start[k + 1])
        return self.view[a:b]

    def where(self, i: int) -> str:
        return f"row {i}"
