"""Runs of consecutive records in a batch (one copy or read per run), and the small-record threshold."""

from __future__ import annotations

import numpy as np

__all__ = ["SMALL_RECORD_BYTES", "find_runs"]

# Records smaller than this are gathered in one vectorised call (numpy
# ``take``, or memmove without releasing the GIL); records at least this big
# are copied or read run by run, each call releasing the GIL so that reader
# threads overlap their page faults and reads. The one threshold for the
# memmap and segmented backends and the loader's pread path.
SMALL_RECORD_BYTES = 2048


def find_runs(step: int, *arrays: np.ndarray | list[int], same: np.ndarray | None = None,
              max_gap: int = 0) -> tuple[list[int], list[int]]:
    """Split positions ``0..n-1`` into maximal runs of neighbours.

    Position ``i + 1`` continues the run of ``i`` when every array in
    ``arrays`` advances by ``step`` to ``step + max_gap`` from ``i`` to
    ``i + 1`` and ``same`` (if given) holds the same value at both. Typical
    uses: file offsets advancing by the record size (one ``preadv`` per run),
    source slots and destination rows both advancing by 1 (one ``memmove``
    per run), sorted unique slots with gaps of at most ``max_gap`` (one range
    per run).

    ``arrays`` are 1-D integer arrays or lists of ints (a caller that has
    the lists anyway saves the conversion). Returns ``(starts, ends)``: lists of ints, run ``k`` covering positions
    ``starts[k]`` to ``ends[k] - 1``. Empty lists for empty arrays. Batches
    take a plain loop, long arrays (and ``same``/``max_gap``) numpy.
    """
    n = len(arrays[0]) if arrays else (0 if same is None else len(same))
    if n <= 1:
        return ([0], [1]) if n == 1 else ([], [])
    if n <= _LOOP_MAX and same is None and max_gap == 0:
        return _runs_loop(step, [a if isinstance(a, list) else a.tolist() for a in arrays], n)
    brk = np.zeros(n - 1, dtype=bool)
    for a in arrays:
        d = np.diff(np.asarray(a, dtype=np.int64))
        brk |= (d != step) if max_gap == 0 else ((d < step) | (d > step + max_gap))
    if same is not None:
        brk |= same[1:] != same[:-1]
    cut = np.flatnonzero(brk) + 1
    starts = [0] + cut.tolist()
    return starts, starts[1:] + [n]


# Up to this many positions (a batch) a plain loop over lists is cheaper than
# numpy's few calls: in the memmap copy of a batch right after the previous
# batch's memmoves, the numpy path cost several times more per batch over
# the inline loop it replaced than this loop does.
_LOOP_MAX = 1024


def _runs_loop(step: int, cols: list[list[int]], n: int) -> tuple[list[int], list[int]]:
    starts = [0]
    if len(cols) == 1:
        (c,) = cols
        starts += [i for i in range(1, n) if c[i] - c[i - 1] != step]
    elif len(cols) == 2:
        a, b = cols
        starts += [i for i in range(1, n) if a[i] - a[i - 1] != step or b[i] - b[i - 1] != step]
    else:
        starts += [i for i in range(1, n) if any(x[i] - x[i - 1] != step for x in cols)]
    return starts, starts[1:] + [n]

