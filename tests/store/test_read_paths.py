"""The hot read paths: ``Store.read_batch`` reads big entries with ``preadv``
into the caller's rows (a batch big enough shared by a few threads) and
``store[i]`` reads every fixed field that way. Byte-exact for every shape of
batch; a file truncated under a reader, even right between the size check
and the read, is a ``StoreChangedError`` naming the file, never SIGBUS (each
such case runs in a forked child, where a SIGBUS shows as a signal)."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.proc import in_child
from support.stores import write_merged, write_store

import mmstore
from mmstore._os import safecopy as _safecopy
from mmstore._os import usable_cores
from mmstore.store.backends.memmap import MemmapBackend

BIG = {"image": ("|u1", (24, 32, 3)), "label": ("<i8", ()), "score": ("<f4", (2,))}  # 2,304-byte images
N = 96
# a batch of every record (4.9 MB) is at least PARALLEL_MIN_BYTES: the split read
HUGE = {"image": ("|u1", (64, 64, 3)), "label": ("<i8", ())}
HUGE_N = 400


def make(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (24, 32, 3), dtype=np.uint8), "label": np.int64(1000 + i),
            "score": rng.random(2, dtype=np.float32)}


def make_huge(i: int) -> dict[str, np.ndarray]:
    img = np.full((64, 64, 3), i % 251, np.uint8)
    img[0, 0, :] = [i & 255, i >> 8, 7]
    return {"image": img, "label": np.int64(i)}


def write(kind: str, root: str) -> str:
    if kind == "plain":
        return write_store(os.path.join(root, "p"), N, schema=BIG, make=make)
    if kind == "merged":
        return write_merged(os.path.join(root, "m"), N, [17, 18, 60], schema=BIG, make=make)
    if kind == "holes":
        return write_store(os.path.join(root, "h"), N, schema=BIG, make=make, holes=(0, 5, 6, 95))
    return write_store(os.path.join(root, "u"), HUGE_N, schema=HUGE, make=make_huge)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Stores the tests only read (the truncation tests write their own)."""
    root = str(tmp_path_factory.mktemp("readpaths"))
    return {kind: write(kind, root) for kind in ("plain", "merged", "holes")}


@pytest.fixture(scope="module")
def huge(tmp_path_factory):
    return write("huge", str(tmp_path_factory.mktemp("huge")))


def expected(store, idx, fn=make):
    slots = store.slot_view.slots_of(idx)
    recs = [fn(int(s)) for s in slots]
    return {f: np.stack([r[f] for r in recs]) if recs else None for f in store.fields}


@pytest.mark.parametrize("kind", ["plain", "merged", "holes"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_read_batch_is_byte_exact_in_any_order(stores, kind, data):
    """Shuffled, sorted, runs of neighbours, duplicates: one preadv per run of
    consecutive slots, each row where its index asked for it."""
    s = mmstore.open(stores[kind])
    n = len(s)
    idx = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=70), label="idx")
    if data.draw(st.booleans(), label="runs"):  # neighbours in the file, rows scattered or not
        a = data.draw(st.integers(0, n - 1), label="a")
        idx = idx + list(range(a, min(n, a + 9)))
        if data.draw(st.booleans(), label="sorted"):
            idx = sorted(idx)
    want = expected(s, idx)
    use_out = data.draw(st.booleans(), label="out")
    out = {f: np.full((len(idx), *s.schema[f].shape), 77, s.schema[f].dtype) for f in s.fields} if use_out else None
    got = s.read_batch(idx, out=out)
    for f in s.fields:
        assert np.array_equal(got[f], want[f]), f
        if use_out:
            assert got[f] is out[f]


@pytest.mark.parametrize("kind", ["plain", "merged", "holes"])
def test_store_item_reads_every_field_exactly(stores, kind):
    s = mmstore.open(stores[kind])
    for i in [0, 1, len(s) - 1, *range(3, len(s), 7)]:
        rec = s[i]
        (want,) = [make(int(s.slot_view.slot(i)))]
        assert np.array_equal(rec["image"], want["image"]) and rec["image"].flags.writeable
        assert np.array_equal(rec["score"], want["score"])
        assert rec["label"] == want["label"] and isinstance(rec["label"], np.integer)  # a scalar, as arr[i] gives


def test_a_big_batch_is_read_by_more_than_one_thread(huge):
    """NOTE [parallel entry reads]: a batch of at least PARALLEL_MIN_BYTES is
    cut in parts read at once by this module's threads and the caller."""
    if usable_cores() < 2:
        pytest.skip("one usable core: the read is not split")
    assert HUGE_N * 64 * 64 * 3 >= _safecopy.PARALLEL_MIN_BYTES
    s = mmstore.open(huge)
    idx = np.random.default_rng(3).permutation(len(s))
    out = {"image": np.zeros((len(s), 64, 64, 3), np.uint8), "label": np.zeros(len(s), np.int64)}
    s.read_batch(idx, out=out)
    want = expected(s, idx, make_huge)
    assert np.array_equal(out["image"], want["image"]) and np.array_equal(out["label"], want["label"])
    assert any(t.name.startswith("mmstore-read") for t in threading.enumerate())
    # two callers at once: one split at a time, the other reads alone; both exact
    outs = [{f: np.zeros_like(v) for f, v in out.items()} for _ in range(3)]
    ts = [threading.Thread(target=s.read_batch, args=(idx,), kwargs={"out": o}) for o in outs]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for o in outs:
        assert np.array_equal(o["image"], want["image"])


# -- truncated under a reader --------------------------------------------------------------

def _race_window() -> None:
    """No size check before the reads: a truncation then lands where it would
    in the race the check cannot close, between the check and the read."""
    MemmapBackend.check_mapped = lambda self, name: None  # type: ignore[method-assign]
    MemmapBackend.check_read = lambda self, name, fd: None  # type: ignore[method-assign]


def _truncate_then(path, prefix, size, read):
    _race_window()
    s = mmstore.open(path)
    read(s)  # descriptors (and mappings of the small fields) in place
    for dp, _, fs in os.walk(path):
        for f in fs:
            if f.startswith(prefix):
                os.truncate(os.path.join(dp, f), size)
    try:
        read(s)
    except mmstore.errors.StoreChangedError as exc:
        return str(exc)
    return "no error"


def _all(s):
    s.read_batch(np.arange(len(s))[::-1])


@pytest.mark.parametrize("kind", ["plain", "merged"])
def test_truncated_during_read_batch_is_typed_not_sigbus(tmp_path, kind):
    res = in_child(_truncate_then, write(kind, str(tmp_path)), "image", 4096, _all)
    assert res.kind == "ok", res
    assert "image" in res.value and "truncated to 4096 bytes" in res.value and "reopen" in res.value, res.value


def test_truncated_during_a_split_read_is_typed_not_sigbus(tmp_path):
    res = in_child(_truncate_then, write("huge", str(tmp_path)), "image", 3 * 4096, _all)
    assert res.kind == "ok", res
    assert "image" in res.value and "truncated" in res.value, res.value


@pytest.mark.parametrize("field", ["image", "label", "score"])
@pytest.mark.parametrize("kind", ["plain", "merged"])
def test_store_item_truncated_under_it_is_typed_not_sigbus(tmp_path, kind, field):
    """Small fields too: ``store[i]`` reads labels with ``preadv``, so the
    race between the size check and the copy out of the mapping is gone
    (a copy from a page past the new end of the file was SIGBUS)."""
    res = in_child(_truncate_then, write(kind, str(tmp_path)), field, 200, lambda s: s[len(s) - 1])
    assert res.kind == "ok", res
    assert field in res.value and "truncated to 200 bytes" in res.value and "reopen" in res.value, res.value


def test_read_entries_short_read_names_the_first_missing_entry(tmp_path):
    """The helper itself: entries past the end of the file are a MappingFault
    at the first entry of the run that came up short; rows before it are read."""
    p = tmp_path / "f"
    data = np.arange(10 * 512, dtype=np.uint8).reshape(10, 512)
    p.write_bytes(data.tobytes()[: 6 * 512 + 100])  # entries 0..5 whole, 6 cut
    fd = os.open(p, os.O_RDONLY)
    try:
        dst = np.zeros((4, 512), np.uint8)
        _safecopy.read_entries(fd, [512 * 5, 512 * 1, 512 * 2], 512, dst, [0, 3, 1])
        assert np.array_equal(dst[[0, 3, 1]], data[[5, 1, 2]]) and not dst[2].any()
        with pytest.raises(_safecopy.MappingFault) as exc:
            _safecopy.read_entries(fd, [0, 512 * 4, 512 * 5, 512 * 6, 512 * 7], 512, np.zeros((5, 512), np.uint8),
                                   [0, 1, 2, 3, 4])
        assert exc.value.entry == 1  # the run 4, 5, 6, 7 starts at entry 1
    finally:
        os.close(fd)
