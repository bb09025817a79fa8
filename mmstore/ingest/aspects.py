"""The first pass of ``buckets="auto"``: every input's oriented size, read from its header, and the
shapes chosen from them (:func:`mmstore.decode.buckets.auto_buckets`).

A file input is opened and its first ``HEAD_BYTES`` (64 KiB) read with one
``pread``; only a file whose header is longer (a JPEG with large EXIF or ICC
segments, a WebP whose EXIF chunk follows its pixels) is read whole. Nothing
is decoded. An encoded input of another source (an LMDB value) is read as
the source reads it; a decoded one (an array, a dataset item) gives its
shape, so a dataset's items are loaded once more. An input whose size cannot
be read is left out of the count (the ingest itself decides whether it is a
hole). The pass covers every input of the source, whatever the shard, so
that every part of a sharded ingest chooses the same shapes.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..decode import read_bytes
from ..decode.buckets import HEAD_BYTES, auto_buckets, header_size
from .sources import DatasetSource, as_hwc, to_array

__all__ = ["choose_buckets", "input_sizes"]

_THREADS = 8  # files read at once (the reads wait on the disk; the parsing holds the GIL)


def _file_size(path: bytes) -> tuple[int, int] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, HEAD_BYTES, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    try:
        return header_size(head, (lambda: read_bytes(path)) if len(head) == HEAD_BYTES else None)
    except Exception:  # noqa: BLE001 - an unreadable input is left out of the count
        return None


def _loaded_size(source: Any, reader: Any, i: int) -> tuple[int, int] | None:
    try:
        item = reader.load(i)
        if isinstance(source, DatasetSource):
            img, _ = source.split(item)
            item = as_hwc(to_array(img))
        if not source.decoded:
            return header_size(item)
        arr = np.asarray(item)
        return (int(arr.shape[0]), int(arr.shape[1])) if arr.ndim >= 2 else None
    except Exception:  # noqa: BLE001 - as above
        return None


def input_sizes(source: Any) -> np.ndarray:
    """The oriented ``(h, w)`` of every input of the scanned ``source``
    (``(n, 2)`` ``int64``; ``(0, 0)`` where it cannot be read)."""
    n = len(source.listing)
    out = np.zeros((n, 2), np.int64)
    path_of = getattr(source, "input_path", None)
    if path_of is not None:
        with ThreadPoolExecutor(_THREADS) as pool:
            for i, hw in enumerate(pool.map(lambda j: _file_size(path_of(j)), range(n), chunksize=256)):
                if hw is not None:
                    out[i] = hw
        return out
    reader = source.reader()
    for i in range(n):
        hw = _loaded_size(source, reader, i)
        if hw is not None:
            out[i] = hw
    return out


def choose_buckets(source: Any, spec: Any) -> tuple[Any, dict[str, Any]]:
    """``spec`` (``resize="buckets"`` with ``AutoBuckets``) with the shapes
    chosen from the sizes of ``source``'s inputs, and what the pass found
    (for the provenance: inputs, those whose size was read)."""
    import dataclasses

    sizes = input_sizes(source)
    read = sizes[(sizes[:, 0] > 0) & (sizes[:, 1] > 0)]
    shapes = auto_buckets(read, spec.buckets.side)
    report = {"inputs": int(len(sizes)), "sizes_read": int(len(read)), "shapes": [list(b) for b in shapes]}
    return dataclasses.replace(spec, buckets=shapes), report
