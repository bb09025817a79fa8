"""Tests of mmstore._os.runs.find_runs: the one run-finding helper of reads and copies."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore._os.runs import find_runs


def naive_runs(step, arrays, same, max_gap):
    """The obvious loop: extend the run while every array advances by step..step+max_gap."""
    n = len(arrays[0])
    starts, ends, j = [], [], 0
    while j < n:
        k = j + 1
        while k < n and all(step <= int(a[k]) - int(a[k - 1]) <= step + max_gap for a in arrays) and (
                same is None or same[k] == same[k - 1]):
            k += 1
        starts.append(j)
        ends.append(k)
        j = k
    return starts, ends


@settings(max_examples=300, deadline=None)
@given(data=st.data(), step=st.sampled_from([1, 3, 160, 4096]), n=st.integers(0, 40),
       max_gap=st.sampled_from([0, 0, 1, 5]), two=st.booleans(), with_same=st.booleans())
def test_find_runs_matches_the_obvious_loop(data, step, n, max_gap, two, with_same):
    def column():
        # mostly consecutive, with jumps forward and back
        moves = data.draw(st.lists(st.sampled_from([step, step, step, step + 1, step + 7, -step, 0, step * 3]),
                                   min_size=n, max_size=n))
        return np.cumsum([data.draw(st.integers(0, 10_000))] + moves[:-1] if n else [], dtype=np.int64)

    arrays = [column()] + ([column()] if two else [])
    same = np.array(data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int64) if with_same else None
    starts, ends = find_runs(step, *arrays, same=same, max_gap=max_gap)
    assert (starts, ends) == naive_runs(step, arrays, same, max_gap)
    # the runs tile 0..n-1 exactly once
    assert sum(e - s for s, e in zip(starts, ends)) == n and all(e > s for s, e in zip(starts, ends))


def test_find_runs_examples():
    offs = np.array([0, 100, 200, 500, 600, 300, 300], np.int64)
    assert find_runs(100, offs) == ([0, 3, 5, 6], [3, 5, 6, 7])
    fds = np.array([3, 3, 4, 4, 4, 4, 4])
    assert find_runs(100, offs, same=fds) == ([0, 2, 3, 5, 6], [2, 3, 5, 6, 7])
    slots, rows = np.array([4, 5, 6, 9]), np.array([0, 1, 3, 4])
    assert find_runs(1, slots, rows) == ([0, 2, 3], [2, 3, 4])
    u = np.array([1, 2, 4, 8, 9])
    assert find_runs(1, u, max_gap=1) == ([0, 3], [3, 5])
    assert find_runs(1, np.array([7])) == ([0], [1])
    assert find_runs(1, np.array([], np.int64)) == ([], [])


def test_find_runs_long_arrays_match_the_obvious_loop():
    """Above a thousand positions the vectorised path runs; it must agree too."""
    rng = np.random.default_rng(5)
    for n in (1023, 1024, 1025, 5000):
        moves = rng.choice([160, 160, 160, 320, -160, 0], size=n - 1)
        a = np.cumsum(np.concatenate([[10_000], moves])).astype(np.int64)
        b = np.cumsum(np.concatenate([[0], rng.choice([160, 160, 1], size=n - 1)])).astype(np.int64)
        for arrays in ([a], [a, b]):
            assert find_runs(160, *arrays) == naive_runs(160, arrays, None, 0)
