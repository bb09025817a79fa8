"""The cut of a stream of blocks into parts (``mmstore.ray.plan``): every row once, in
order; parts of ``part_rows`` rows but the last ones, which are split evenly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore.ray.plan import PartPlan


def _run(blocks, part_rows, slots, min_rows=64):
    plan = PartPlan(part_rows, slots, min_rows=min_rows)
    parts = []
    for i, (rows, cut) in enumerate(blocks):
        parts.extend(plan.add(f"b{i}", rows, cut))
    parts.extend(plan.finish())
    return parts


def _rows(parts):
    return [(p.ref, r) for part in parts for p in part for r in range(p.start, p.end)]


def _block(n):
    """A block of ``n`` rows, whole or a slice of it."""
    return st.tuples(st.just(n), st.none() | st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted).map(tuple))


_blocks = st.lists(st.integers(0, 400).flatmap(_block), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_blocks, st.none() | st.integers(1, 500), st.integers(1, 6), st.integers(1, 100))
def test_every_row_once_in_order(blocks, part_rows, slots, min_rows):
    parts = _run(blocks, part_rows, slots, min_rows)
    want = [(f"b{i}", r) for i, (n, cut) in enumerate(blocks) for r in range(*(cut or (0, n)))]
    assert _rows(parts) == want
    assert all(part and all(p.n > 0 for p in part) for part in parts)
    sizes = [sum(p.n for p in part) for part in parts]
    if part_rows is None:
        assert len(parts) == sum(1 for n, cut in blocks if (cut or (0, n))[1] > (cut or (0, n))[0])
        return
    assert all(s <= part_rows for s in sizes)
    full = [s for s in sizes if s == part_rows]
    tail = sizes[len(full):] if sizes[: len(full)] == full else None
    assert tail is not None  # full parts first, then the tail
    if tail:
        assert max(tail) - min(tail) <= 1  # split evenly
        assert len(tail) <= max(-(-sum(tail) // part_rows), 4 * slots)


def test_a_small_job_is_spread_over_the_slots():
    """2,000 rows, parts of 1,000, 2 slots: 8 parts of 250 (each CPU gets 4)."""
    sizes = [sum(p.n for p in part) for part in _run([(10, None)] * 200, 1000, 2)]
    assert sizes == [250] * 8


def test_a_large_job_is_cut_in_full_parts_and_an_even_tail():
    sizes = [sum(p.n for p in part) for part in _run([(100, None)] * 105, 1000, 2)]
    # the stream is read 2 parts ahead: 8 full parts, then the 2,500 rows left in 8 parts
    assert sizes[:8] == [1000] * 8 and sum(sizes[8:]) == 2500 and len(sizes[8:]) == 8
    assert max(sizes[8:]) - min(sizes[8:]) <= 1


def test_tiny_jobs_stay_one_part_and_a_block_is_cut_where_a_part_ends():
    assert [sum(p.n for p in part) for part in _run([(30, None)], 1000, 4)] == [30]
    parts = _run([(2500, None)], 1000, 1, min_rows=1000)
    assert [[(p.start, p.end, p.cut) for p in part] for part in parts] == [
        [(0, 1000, (0, 1000))], [(1000, 1750, (1000, 1750))], [(1750, 2500, (1750, 2500))]]
    whole = _run([(50, None)], None, 1)
    assert whole[0][0].cut is None
