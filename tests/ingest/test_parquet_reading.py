"""How a Parquet ingest reads its files: the work ranges follow the row groups (a worker reads a
row group once, not every worker that holds a piece of it), and a worker reading rows never
imports pandas (pyarrow's boolean ``to_numpy`` does, at a cost above that of the rows)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore.ingest.resume import UNIT_MAX, pending_ranges

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), chunk=st.integers(1, 64), data=st.data())
def test_ranges_cover_the_pending_slots_and_keep_units_whole(n, chunk, data):
    done = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, n - 1), max_size=12)) if n > 1 else []))
    units = np.array([0, *cuts], np.int64)
    got = list(pending_ranges(done, chunk, units))
    covered = np.zeros(n, bool)
    last = 0
    for a, b in got:
        assert last <= a < b <= n
        last = b
        covered[a:b] = True
        assert not done[a:b].any()
    assert np.array_equal(covered, ~done)  # every pending slot once, in order, nothing done again
    bounds = [0, *cuts, n]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi - lo <= UNIT_MAX:  # a unit's pending slots in one range: one reader reads it
            owners = {i for i, (a, b) in enumerate(got) for s in range(lo, hi) if a <= s < b}
            contiguous = [lo + k for k in np.flatnonzero(~done[lo:hi]).tolist()]
            if contiguous and np.all(np.diff(contiguous) == 1):
                assert len(owners) == 1, (lo, hi, got)
    assert got == list(pending_ranges(done, chunk, units))  # a function of its inputs


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 400), chunk=st.integers(1, 64), taper=st.integers(0, 4), data=st.data())
def test_tapered_ranges_cover_the_pending_slots_once(n, chunk, taper, data):
    """Without units, every pending slot once, in order, in ranges of at most ``chunk``; the last
    ``2 * taper`` chunks' worth in quarter chunks."""
    done = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
    got = list(pending_ranges(done, chunk, None, taper))
    covered = np.zeros(n, bool)
    last = 0
    for a, b in got:
        assert last <= a < b <= n and b - a <= chunk and not done[a:b].any()
        last = b
        covered[a:b] = True
    assert np.array_equal(covered, ~done)
    sizes = np.array([b - a for a, b in got])
    pending = np.cumsum(sizes[::-1])[::-1]  # slots still to hand out when each range is cut
    assert np.all(sizes[pending <= 2 * taper * chunk] <= max(1, chunk // 4))
    if taper == 0:
        assert got == list(pending_ranges(done, chunk))


def test_a_row_group_is_one_range():
    done = np.zeros(1000, bool)
    assert list(pending_ranges(done, 32, np.arange(0, 1000, 100))) == [(k, k + 100) for k in range(0, 1000, 100)]
    assert list(pending_ranges(done, 250, np.arange(0, 1000, 100)))[:2] == [(0, 300), (300, 600)]
    # without units: ranges of the chunk, as before
    assert list(pending_ranges(done, 300, None)) == [(0, 300), (300, 600), (600, 900), (900, 1000)]


_WORKER = r"""
import sys
from mmstore.ingest.parquet import ParquetSource
src = ParquetSource(sys.argv[1], image_column="jpg", caption_column="caption", columns="n")
src.scan()
assert "pandas" not in sys.modules, "the scan imported pandas"
r = src.reader()
seen = []
for i in range(12):
    try:
        r.load(i)
        src.record_fields(i)
        seen.append(i)
    except Exception as exc:  # a null image or caption: a hole
        assert "null" in str(exc), exc
assert seen == [0, 3, 6, 9], seen
assert "pandas" not in sys.modules, "reading rows imported pandas"
"""


def test_reading_rows_does_not_import_pandas(tmp_path):
    t = pa.table({"jpg": pa.array([b"x", None, b"z"] * 4, pa.binary()), "caption": ["a", "b", None] * 4,
                  "n": pa.array([1, 2, 3] * 4, pa.int32())})
    pq.write_table(t, str(tmp_path / "t.parquet"), row_group_size=5)
    r = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path / "t.parquet")], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]


def test_each_row_group_is_read_by_one_worker_once(tmp_path, monkeypatch):
    """Two worker processes over 6 row groups of 10 rows: every row group is read once, by one of
    them (the work ranges would otherwise hold 2 rows each, and both workers read most groups)."""
    cv2 = pytest.importorskip("cv2")
    import mmstore
    from mmstore.ingest import parquet

    rng = np.random.default_rng(0)
    jpgs = [cv2.imencode(".jpg", rng.integers(0, 255, (12, 14, 3), dtype=np.uint8))[1].tobytes() for _ in range(60)]
    for f in range(2):
        rows = range(30 * f, 30 * f + 30)
        pq.write_table(pa.table({"jpg": pa.array([jpgs[i] for i in rows], pa.binary())}),
                       str(tmp_path / f"{f}.parquet"), row_group_size=10)
    log = str(tmp_path / "reads.log")
    parent = os.getpid()
    read_block = parquet.ParquetSource.read_block

    def logged(self, state, k, columns):
        if os.getpid() != parent:  # a worker's read (the parent reads one row to plan the store)
            with open(log, "a") as fh:
                fh.write(f"{os.getpid()} {k}\n")
        return read_block(self, state, k, columns)

    monkeypatch.setattr(parquet.ParquetSource, "read_block", logged)
    res = mmstore.ingest(str(tmp_path / "*.parquet"), str(tmp_path / "s.store"), size=8, workers=2, quiet=True,
                         image_column="jpg")
    assert res.records == 60
    with open(log) as fh:
        reads = [line.split() for line in fh]
    assert sorted(int(k) for _, k in reads) == list(range(6)), reads
    assert len({pid for pid, _ in reads}) == 2  # both workers had work
