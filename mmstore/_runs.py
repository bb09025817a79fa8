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


def find_runs(step: int, *arrays: np.ndarray, same: np.ndarray | None = None,
              max_gap: int = 0) -> tuple[list[int], list[int]]:
    """Split positions ``0..n-1`` into maximal runs of neighbours.

    Position ``i + 1`` continues the run of ``i`` when every array in
    ``arrays`` advances by ``step`` to ``step + max_gap`` from ``i`` to
    ``i + 1`` and ``same`` (if given) holds the same value at both. Typical
    uses: file offsets advancing by the record size (one ``preadv`` per run),
    source slots and destination rows both advancing by 1 (one ``memmove``
    per run), sorted unique slots with gaps of at most ``max_gap`` (one range
    per run).

    Returns ``(starts, ends)``: lists of ints, run ``k`` covering positions
    ``starts[k]`` to ``ends[k] - 1``. Empty lists for empty arrays.
    """
    n = len(arrays[0]) if arrays else (0 if same is None else len(same))
    if n <= 1:
        return ([0], [1]) if n == 1 else ([], [])
    brk = np.zeros(n - 1, dtype=bool)
    for a in arrays:
        d = np.diff(a)
        brk |= (d != step) if max_gap == 0 else ((d < step) | (d > step + max_gap))
    if same is not None:
        brk |= same[1:] != same[:-1]
    cut = np.flatnonzero(brk) + 1
    starts = [0] + cut.tolist()
    return starts, starts[1:] + [n]
