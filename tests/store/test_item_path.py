"""Per-sample speed: ``store[i]`` has a one-record path of its own
(NOTE [one-record path], backends/base.py). It must read exactly what
``read_batch`` reads on every kind of store, and keep every check: bounds,
the files the store was opened with, a truncation while open (a typed error,
never SIGBUS), fork, close and reopen."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.proc import in_child
from support.stores import compact_store, write_merged, write_store

import mmstore
from mmstore.errors import StoreChangedError

BIG = {"image": ("|u1", (24, 32, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}  # 2,304 B: the preadv path


def big(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8), "label": np.int64(i % 7),
            "score": rng.random(2, dtype=np.float32)}


def assert_item_is_batch_row(store, i: int) -> None:
    got = store[i]
    want = store.read_batch([i])
    assert list(got) == list(store.fields)
    for name in store.fields:
        f = store.schema[name]
        g = got[name]
        if f.shape == ():
            assert isinstance(g, np.generic) and g.dtype == f.dtype  # a numpy scalar, as before
        else:
            assert isinstance(g, np.ndarray) and g.shape == f.shape and g.dtype == f.dtype
            assert g.flags.writeable and g.flags.c_contiguous
        assert np.asarray(g).tobytes() == want[name][0].tobytes(), (name, i)


KINDS = ["plain", "holes", "merged", "merged-holes", "lmdb", "compact", "compact-merged"]


def make(kind: str, tmp_path, n: int = 40) -> str:
    p = os.path.join(tmp_path, kind)
    holes = (0, 7, 39) if "holes" in kind else ()
    if kind == "lmdb":
        return write_store(p, n, backend="lmdb", schema=BIG, make=big, holes=(3,))
    if kind == "compact":
        return compact_store(p, n, holes=(5,))
    if kind == "compact-merged":
        return compact_store(p, n, cuts=[13, 13, 30])
    if kind.startswith("merged"):
        return write_merged(p, n, [10, 10, 25], schema=BIG, make=big, holes=holes)
    return write_store(p, n, schema=BIG, make=big, holes=holes)


@pytest.mark.parametrize("kind", KINDS)
def test_every_record_equals_its_batch_read(kind, tmp_path):
    with mmstore.open(make(kind, tmp_path)) as s:
        for i in range(len(s)):
            assert_item_is_batch_row(s, i)
        assert_item_is_batch_row(s, -1)
        assert_item_is_batch_row(s, np.int32(len(s) - 2))
        for bad in (len(s), -len(s) - 1, np.uint64(len(s))):
            with pytest.raises(IndexError, match="out of range"):
                s[bad]
        with pytest.raises(TypeError):
            s[True]  # a boolean is not an index (a mask is refused too)


def test_values_are_the_written_ones(tmp_path):
    p = write_store(os.path.join(tmp_path, "s"), 30, schema=BIG, make=big, holes=(4,))
    with mmstore.open(p) as s:
        slots = [j for j in range(30) if j != 4]
        for i, slot in enumerate(slots):
            got, want = s[i], big(slot)
            assert all(np.array_equal(got[k], want[k]) for k in want)


def test_the_returned_arrays_are_the_callers(tmp_path):
    p = write_store(os.path.join(tmp_path, "s"), 5, schema=BIG, make=big)
    with mmstore.open(p) as s:
        a = s[1]
        a["image"][:] = 0  # writable and owned: the next read is unaffected
        assert np.array_equal(s[1]["image"], big(1)["image"])
        assert not np.shares_memory(s[2]["image"], s.slot_view.backend.array("image"))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from([(), (3,), (0,), (700,), (40, 20), (1024,)]),
       dtype=st.sampled_from(["|u1", "<i2", "<f4", "<f8", "<u8"]),
       n=st.integers(1, 12))
def test_any_fixed_field_round_trips(tmp_path_factory, shape, dtype, n):
    path = os.path.join(tmp_path_factory.mktemp("h"), "s")
    rng = np.random.default_rng(n)
    recs = [{"x": rng.integers(0, 100, shape).astype(dtype), "y": np.int64(j)} for j in range(n)]
    write_store(path, n, schema={"x": (dtype, shape), "y": ("<i8", ())}, make=lambda j: recs[j])
    with mmstore.open(path) as s:
        for i in range(n):
            got = s[i]
            assert np.asarray(got["x"]).shape == shape and got["x"].dtype == np.dtype(dtype)
            assert np.array_equal(got["x"], recs[i]["x"]) and got["y"] == i


@pytest.mark.parametrize("field,kind", [("image", "plain"), ("label", "plain"), ("image", "merged")])
def test_truncated_while_open_is_a_typed_error(field, kind, tmp_path):
    """Big entries (preadv: a short read) and small ones (the mapping, its size
    checked first) alike; in a child, where a SIGBUS would show as a signal."""
    path = make(kind, tmp_path)

    def child():
        s = mmstore.open(path)
        for i in range(0, len(s), 5):
            s[i]  # descriptors and mappings in place, in every segment
        files = [os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs if f.startswith(field)]
        for f in files:
            os.truncate(f, 200)
        try:
            s[len(s) - 1]
        except StoreChangedError as exc:
            return str(exc)
        return "no error"

    res = in_child(child)
    assert res.kind == "ok", res
    assert "truncated" in res.value and field in res.value and "reopen" in res.value


def test_a_replaced_file_is_refused(tmp_path):
    """The identity noted at open is checked on the descriptor the reads use."""
    p = write_store(os.path.join(tmp_path, "s"), 10, schema=BIG, make=big)
    s = mmstore.open(p)
    f = os.path.join(p, "image.npy")
    with open(f, "rb") as fh:
        data = fh.read()
    os.unlink(f)
    with open(f, "wb") as fh:  # same bytes, another file
        fh.write(data)
    with pytest.raises(StoreChangedError, match="changed since the store was opened"):
        s[0]


def test_fork_close_reopen_and_no_descriptor_leak(tmp_path):
    p = write_merged(os.path.join(tmp_path, "m"), 30, [10, 20], schema=BIG, make=big)
    s = mmstore.open(p)
    first = s[25]
    res = in_child(lambda: [s[i]["image"].tobytes() for i in (25, 0, 15)])
    assert res.kind == "ok" and res.value == [big(j)["image"].tobytes() for j in (25, 0, 15)]
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(30):
        s.close()
        assert np.array_equal(s[25]["image"], first["image"])  # reopened after close
    s.close()
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_a_reader_outlived_by_its_backend_refuses(tmp_path):
    """It never preads a descriptor number that close() gave back (and the
    system may have reused for another file)."""
    p = write_store(os.path.join(tmp_path, "s"), 5, schema=BIG, make=big)
    with mmstore.open(p) as s:
        b = s.slot_view.backend
        read = b.item_reader()
        assert np.array_equal(read(2)["image"], big(2)["image"])
        b.close()
        with pytest.raises(ValueError, match="closed"):
            read(2)
        with pytest.raises(IndexError):
            b.item_reader()(5)


def test_threads_read_exactly(tmp_path):
    """Reader threads share the per-process reader (its preads release the
    GIL); their first calls race to make it."""
    from concurrent.futures import ThreadPoolExecutor

    p = write_merged(os.path.join(tmp_path, "m"), 60, [20, 40], schema=BIG, make=big)
    with mmstore.open(p) as s:
        order = np.random.default_rng(0).permutation(60).tolist()
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda i: s[i]["image"].tobytes(), order * 3))
        assert got == [big(i)["image"].tobytes() for i in order * 3]


def test_first_reads_racing_the_lazy_check(tmp_path, monkeypatch):
    """Threads whose first reads race into a segment's lazy header check all
    see it complete (it was published field by field, and a thread that saw
    the first field skipped the check: KeyError for the next field)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import mmstore.store.backends.memmap as mm

    real = mm.check_npy

    def slow(*a, **kw):
        time.sleep(0.02)  # widen the window between the fields' checks
        return real(*a, **kw)

    monkeypatch.setattr(mm, "check_npy", slow)
    p = write_merged(os.path.join(tmp_path, "m"), 60, [20, 40], schema=BIG, make=big)
    with mmstore.open(p) as s:
        go = threading.Barrier(4)

        def first(i):
            go.wait()
            time.sleep(0.015 * (i - 41))  # later threads arrive while the first one checks
            return s[i]["image"].tobytes()

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(first, [41, 42, 43, 44]))  # a segment no read touched yet
        assert got == [big(i)["image"].tobytes() for i in (41, 42, 43, 44)]


def test_unsigned_indices_do_not_wrap_around(tmp_path):
    """A uint64 index past the end is out of range, not -1 (the last record)."""
    p = write_store(os.path.join(tmp_path, "s"), 10, schema=BIG, make=big)
    with mmstore.open(p) as s:
        for bad in (np.array([2**64 - 1], np.uint64), np.array([0, 10], np.uint32)):
            with pytest.raises(IndexError, match="out of range"):
                s.read_batch(bad)
        got = s.read_batch(np.array([9, 0], np.uint64))
        assert np.array_equal(got["label"], [big(9)["label"], big(0)["label"]])
