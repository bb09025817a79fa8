"""Where a writer may write: the one guard of every destination.

``ingest``, ``convert``, ``merge`` and ``StoreWriter`` call :func:`check_dest`
before they create or replace anything (and again under the destination
lock). The rule:

* ``DEST`` must not be a symbolic link (a store is written at a real path).
* ``DEST`` (and ``DEST.partial``) must not be, contain, or lie inside any of
  the inputs (compared by ``realpath``, so symlinks do not hide it).
* With ``overwrite``, an existing ``DEST`` is replaced only when it is an
  mmstore store (a real directory whose ``manifest.json`` is a regular file
  that parses as an mmstore manifest) holding nothing its manifest does not
  list (a user's notes put inside a store are not ours to delete).
* An empty real directory at ``DEST`` holds nothing to lose: with or
  without ``overwrite`` it is used (:func:`claim_empty_dest` removes it
  before the store takes its name).
* An existing ``DEST.partial`` is resumed or discarded only when it is one
  of ours (see :func:`is_own_partial`).
  Anything else is a :class:`~mmstore.errors.DestinationError` and nothing is
  touched.

Deleting never follows symlinks: ``shutil.rmtree`` unlinks a symlink found
inside a store instead of descending into it, and the top directory is
checked to be a real directory first. Besides a store (``overwrite``) and
our own ``.partial``, the only thing ever deleted is ``DEST.replaced-XXXXXXXX``,
a store a publish moved aside (format.py, "Replacing a store").
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Iterable

from ..errors import DestinationError
from ..format.layout import MANIFEST_FILE, MANIFEST_MAX_BYTES, PARTIAL_SUFFIX, PARTS_DIR, REPLACED_INFIX
from ..format.manifest import read_manifest
from ..remote.url import local_dest

__all__ = ["APPEND_MARK", "PARTIAL_MARK", "RAY_MARK", "check_dest", "claim_empty_dest", "is_empty_dir",
           "is_own_partial", "is_store", "make_partial", "remove_replaced"]

# the first file of every .partial a writer creates; with the bookkeeping
# files of older versions it is how a .partial is recognised as ours
PARTIAL_MARK = "_mmstore_partial"
APPEND_MARK = "_appending.json"  # marks an append's DEST.partial: the store appended to and the request
RAY_MARK = "_ray.json"  # a .partial that a distributed write (mmstore.ray) works in
_OWN_FILES = (PARTIAL_MARK, "_writer.json", "_ingest.json", "_merging", RAY_MARK)


def _real_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _regular(path: str, limit: int | None = None) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and (limit is None or st.st_size <= limit)


def is_empty_dir(path: str) -> bool:
    """``path`` is a real directory (not a symbolic link) with nothing in it."""
    if not _real_dir(path):
        return False
    try:
        return not os.listdir(path)
    except OSError:
        return False


def claim_empty_dest(dest: str) -> bool:
    """Remove ``dest`` when it is an empty real directory, so that a store
    can be published at its name; True when it was removed. A directory that
    is not empty (or gains an entry meanwhile: ``rmdir`` refuses it) stays."""
    if not is_empty_dir(dest):
        return False
    try:
        os.rmdir(dest)
    except OSError:
        return False
    return True


def is_store(path: str) -> bool:
    """``path`` is a real directory holding a parseable mmstore manifest."""
    if not _real_dir(path) or not _regular(os.path.join(path, MANIFEST_FILE), MANIFEST_MAX_BYTES):
        return False
    try:
        read_manifest(path)
    except (OSError, ValueError):
        return False
    return True


def is_own_partial(path: str) -> bool:
    """``path`` is a ``.partial`` an mmstore writer made: a real directory that
    is empty (nothing to lose), carries one of our marker or state files, or
    holds a finished manifest."""
    if not _real_dir(path):
        return False
    try:
        if not os.listdir(path):
            return True
    except OSError:
        return False
    return any(_regular(os.path.join(path, n)) for n in _OWN_FILES) or is_store(path)


def _overlap(dest: str, what: str, src: str, tree: bool) -> str | None:
    rd, rs = os.path.realpath(dest), os.path.realpath(src)
    if rd == rs:
        return f"{what} is the input {src}"
    if os.path.commonpath([rd, rs]) == rd:
        return f"{what} contains the input {src}"
    if tree and os.path.commonpath([rd, rs]) == rs:
        return f"{what} lies inside the input folder {src}"
    return None


def check_dest(
    dest: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    sources: Iterable[str | os.PathLike[str]] = (),
    protect: Iterable[str | os.PathLike[str]] = (),
) -> str:
    """Refuse a destination mmstore may not write; return its absolute path.

    ``sources`` are the inputs: DEST may not be, contain or lie inside one
    (inside only matters for a directory input). ``protect`` are paths DEST
    may not be or contain (an image root that a list file points into).

    Raises
    ------
    DestinationError
        Says what DEST is, why it cannot be written, and what to do.
    StoreURLError
        DEST is a URL (a store is written locally, then pushed) or starts
        like one.
    """
    local_dest(dest)  # never a directory named ``s3:``
    dest = os.path.abspath(os.fspath(dest))
    partial = dest + PARTIAL_SUFFIX
    for src in sources:
        s = os.fspath(src)
        for path, what in ((dest, "DEST"), (partial, "DEST.partial")):
            why = _overlap(path, what, s, os.path.isdir(s))
            if why:
                raise DestinationError(f"{dest}: {why}; the store must be written outside its inputs: "
                                       "choose another DEST")
    for src in protect:
        s = os.fspath(src)
        for path, what in ((dest, "DEST"), (partial, "DEST.partial")):
            why = _overlap(path, what, s, False)
            if why:
                raise DestinationError(f"{dest}: {why}; choose another DEST")
    if os.path.islink(dest):
        raise DestinationError(f"{dest}: is a symbolic link (to {os.readlink(dest)!r}); a store is written at a "
                               "real path: pass the directory itself, or another DEST")
    if overwrite and os.path.lexists(dest) and not is_store(dest) and not is_empty_dir(dest):
        kind = "a directory" if _real_dir(dest) else "a file" if _regular(dest) else "not a directory"
        raise DestinationError(f"{dest}: exists and is {kind} that is not an mmstore store (no valid "
                               f"{MANIFEST_FILE}); --overwrite only ever replaces a store: choose another DEST, "
                               "or move it away yourself")
    if overwrite and is_store(dest):
        foreign = _foreign_entries(dest)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            what = "1 entry that is" if len(foreign) == 1 else f"{len(foreign)} entries that are"
            raise DestinationError(f"{dest}: the store holds {what} not part of it ({shown}); --overwrite "
                                   "replaces only what mmstore wrote: move them out first (`mmstore verify` "
                                   "lists them as stray)")
    if os.path.lexists(partial) and not is_own_partial(partial):
        if _real_dir(partial) and os.path.isfile(os.path.join(partial, APPEND_MARK)):
            raise DestinationError(f"{partial}: an unfinished `mmstore append` into {dest} is here; it is never "
                                   "discarded by another command: run the same append again to finish it, or "
                                   "remove it yourself to give it up")
        raise DestinationError(f"{partial}: exists and was not made by mmstore (no mmstore marker); it is never "
                               "written to or discarded: move it away yourself, or choose another DEST")
    return dest


def _foreign_entries(store: str) -> list[str]:
    """Names in ``store`` that its manifest does not list (someone else's files)."""
    try:
        listed = set(read_manifest(store).get("files", {})) | {MANIFEST_FILE}
        listed |= {n.split("/", 1)[0] for n in listed}  # a store with parts: its parts/ directory
        return sorted(n for n in os.listdir(store) if n not in listed)
    except (OSError, ValueError):
        return []


def make_partial(partial: str) -> None:
    """Create ``partial`` (a new directory) with our marker inside it."""
    os.makedirs(partial)
    fd = os.open(os.path.join(partial, PARTIAL_MARK), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)


def remove_replaced(dest: str) -> list[str]:
    """Delete the ``DEST.replaced-XXXXXXXX`` directories a killed publish
    left next to ``dest`` (a store moved aside: the old one, or a new one
    that was never swapped in); called under the destination lock. Only real
    directories of exactly that name holding only a store's files are ours;
    returns what was deleted."""
    dest = os.path.abspath(dest)
    parent, base = os.path.split(dest)
    mine = re.compile(re.escape(base + REPLACED_INFIX) + r"[0-9a-f]{8}\Z")
    removed: list[str] = []
    try:
        with os.scandir(parent) as it:
            aside = [e.path for e in it if mine.match(e.name) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return removed
    for path in aside:
        if _store_files_only(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _store_files_only(path: str) -> bool:
    """Whether directory ``path`` holds what a store holds and nothing else: regular files, and a real
    ``parts/`` directory of real part directories of regular files (format.py, "Parts")."""
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    continue
                if e.name != PARTS_DIR or not e.is_dir(follow_symlinks=False):
                    return False
                with os.scandir(e.path) as parts:
                    for part in parts:
                        if not part.is_dir(follow_symlinks=False):
                            return False
                        with os.scandir(part.path) as files:
                            if not all(f.is_file(follow_symlinks=False) for f in files):
                                return False
    except OSError:
        return False
    return True
