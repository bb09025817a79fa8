"""``mmstore.ray.write(ds, dest, ..., append=True)``: a Ray Dataset's rows
appended to an existing store as new parts, under the rules of
:func:`mmstore.append` (:mod:`mmstore.ingest.append`).

:class:`AppendTarget` is what the write needs of the store it appends to:
read once on the driver before any task starts, it gives the decode options
(the store's own, those given checked against them: a difference is refused
by name, ``AppendMismatchError``), the codecs and the backend, and the label
names (the store's, then the names of ``label_names`` it lacks; a task
renumbers its rows' labels to them, so the store's numbers stay). The write
tasks then write their parts as for a new store; the commit joins the
store's records and the new parts (:func:`mmstore.ingest.append.append_parts`:
the same checks of schema, labels and keys as ``mmstore.append``, the store's
data files linked, not copied) and publishes the result as ``mmstore.append``
does:

- a local store: the parts are written in ``DEST.partial`` (marked as a Ray
  write's), the store's data files hard-linked beside them, and
  ``DEST.partial`` replaces ``DEST`` by one atomic exchange: a reader sees
  the old store or the new one, a reader of the old store keeps reading it,
  and a write killed before the exchange leaves the old store as it was (the
  next write removes what it left, and completes);
- a store in object storage (with parts): the parts are uploaded under
  ``URL/parts/`` by their tasks, and the push of the joined bookkeeping
  uploads the small files and the manifest last; the store's data objects
  are kept as they are (NOTE [what a push deletes] in
  :mod:`mmstore.transfer.push`: a store grows from the one it appends to).

The store must not change between the start of the write and its commit
(another append or ingest): the commit checks its id and refuses otherwise.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._os.io import atomic_write, fsync_dir
from ..errors import AppendMismatchError, DestinationError, IngestError, StoreExistsError
from ..format.layout import PARTIAL_SUFFIX, PARTS_DIR
from ..ingest.append import APPEND_MARK, append_parts, check_append_options
from ..ingest.parts import PartBook, drop_other_parts, drop_part_bookkeeping
from ..remote.client import Remote
from ..remote.replica import read_remote_manifest
from ..remote.url import parse_url
from ..store.dest import PARTIAL_MARK, RAY_MARK, is_store
from ..store.reader import Store, open_store
from ..store.writer import publish

__all__ = ["AppendTarget"]

_SIZES = ("size", "max_side", "short_side", "buckets")


class AppendTarget:
    """The store that a Ray write appends to, read on the driver.

    Parameters
    ----------
    dest
        The store: a local path or a URL.
    size, decode, codecs, backend
        The options given to the write (None: not given); they default to
        the store's own and may only repeat them.
    label_names
        The names of the rows' integer labels (None: the rows' labels are
        the store's numbers).
    duplicate_keys
        As in :func:`mmstore.append`.
    """

    def __init__(self, dest: str, remote: bool, size: Any, decode: Mapping[str, Any], codecs: Any,
                 backend: str | None, label_names: Sequence[str] | None, duplicate_keys: str) -> None:
        if duplicate_keys not in ("error", "keep"):
            raise ValueError(f"duplicate_keys must be 'error' or 'keep', got {duplicate_keys!r}")
        self.dest, self.remote, self.duplicate_keys = dest, remote, duplicate_keys
        if not remote and not is_store(dest):
            raise DestinationError(f"{dest}: no store there to append to; write one first (append=False) or "
                                   "with `mmstore ingest`")
        given = {k: v for k, v in decode.items() if v is not None}
        if size is not None:
            given["size"] = size
        if codecs is not None:
            given["codecs"] = codecs
        if backend is not None:
            given["backend"] = backend
        with self.open() as old:
            own = check_append_options(dest, old, given)
            self.store_id = old.store_id
            old_names = old.label_names
            if remote and old.parts is None:
                raise AppendMismatchError(
                    f"{dest}: a store of one segment (written by mmstore ingest, then pushed): an append into object "
                    "storage adds parts to a store made of parts (one that mmstore.ray.write or an append made). "
                    "Pull the store, append to the local copy, then push it")
        if own.get("unknown"):  # the store does not say how it was decoded: the options given, as they are
            dec = {k: v for k, v in given.items() if k not in ("codecs", "backend")}
        else:
            dec = {k: v for k, v in own.items() if k not in ("codecs", "backend", "unknown")}
        self.size = dec.pop("size", None)
        self.decode = dec
        self.codecs, self.backend = own["codecs"], own["backend"]
        self.label_names, self.label_map = _merge_labels(dest, old_names, label_names)

    def open(self) -> Store:
        """The store appended to (a URL through its replica)."""
        return open_store(self.dest)

    def relabel(self, cols: dict[str, list[Any]], label: str | None) -> dict[str, list[Any]]:
        """The rows' labels renumbered to the store's label names (in a write task)."""
        if not self.label_map or label is None or label not in cols:
            return cols
        m = self.label_map

        def one(v: Any) -> Any:
            if isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)):
                return m.get(int(v), v)
            return v

        return {**cols, label: [one(v) for v in cols[label]]}

    # -- a local store -------------------------------------------------------------------------------
    def prepare_local(self, ray_mark: bytes) -> None:
        """``DEST.partial`` made afresh for the parts (under the store's lock):
        what a killed write or append left there is removed; an unfinished
        ingest or merge is refused."""
        partial = self.dest + PARTIAL_SUFFIX
        if os.path.lexists(partial):
            ours = any(os.path.isfile(os.path.join(partial, m)) for m in (RAY_MARK, APPEND_MARK))
            if not ours:
                raise StoreExistsError(f"{partial}: an unfinished ingest or merge into {self.dest} is here; an "
                                       "append never discards it: finish that run, or move it away, then write again")
            shutil.rmtree(partial)
        os.makedirs(os.path.join(partial, PARTS_DIR))
        atomic_write(os.path.join(partial, PARTIAL_MARK), b"")
        atomic_write(os.path.join(partial, RAY_MARK), ray_mark)
        fsync_dir(partial)

    def commit_local(self, ids: list[str], source: Any) -> tuple[dict[str, Any], int]:
        """Append the parts ``ids`` of ``DEST.partial/parts/`` to the store and
        publish it (under the store's lock); returns what
        :func:`~mmstore.ingest.append.append_parts` returns, and the parts of
        other attempts removed."""
        partial = self.dest + PARTIAL_SUFFIX
        parts_dir = os.path.join(partial, PARTS_DIR)
        removed = drop_other_parts(parts_dir, ids)
        books = [PartBook(pid, os.path.join(parts_dir, pid)) for pid in ids]
        with self.open() as old:
            self._check_unchanged(old)
            joined = append_parts(old, partial, books, source=source, duplicate_keys=self.duplicate_keys)
        drop_part_bookkeeping(books)
        fsync_dir(parts_dir)
        publish(self.dest)
        return joined, removed

    # -- a store in object storage -------------------------------------------------------------------
    def join_remote(self, work: str, books: list[PartBook], present: dict[str, Any], source: Any) -> dict[str, Any]:
        """Write into ``work`` the bookkeeping and manifest of the store with
        ``books`` appended; add the store's data files to ``present`` (they are
        in the bucket, and stay)."""
        index, _, _ = read_remote_manifest(Remote(parse_url(self.dest)))
        with self.open() as old:
            self._check_unchanged(old)
            joined = append_parts(old, work, books, source=source, duplicate_keys=self.duplicate_keys, local=False)
        for name, entry in index.files.items():
            if name.startswith(PARTS_DIR + "/"):
                present.setdefault(name, entry)
        return joined

    def old_parts(self) -> set[str]:
        """The part ids of the store appended to."""
        with self.open() as old:
            return set(old.parts or ())

    def _check_unchanged(self, old: Store) -> None:
        if old.store_id != self.store_id:
            raise IngestError(f"{self.dest}: the store changed while the new rows were written (another append or "
                              "ingest); nothing was appended: run the write again")


def _merge_labels(dest: str, old: list[str] | None,
                  given: Sequence[str] | None) -> tuple[list[str] | None, dict[int, int] | None]:
    """The label names of the appended store, and the renumbering of the rows'
    labels (None: none): the store's names first, then the new ones."""
    if given is None:
        return (list(old) if old is not None else None), None
    names = [str(n) for n in given]
    if old is None:
        raise AppendMismatchError(
            f"{dest}: the store's labels have no names, the new rows' are named {names[:5]!r}...: an append keeps "
            "the store's label numbers; leave label_names out (the rows' labels are then taken as the store's "
            "numbers)")
    merged = list(old)
    for n in names:
        if n not in merged:
            merged.append(n)
    remap = {i: merged.index(n) for i, n in enumerate(names)}
    return merged, (None if all(i == j for i, j in remap.items()) else remap)
