"""The replica's disk accounting and its eviction, against a real S3 server (SeaweedFS on
loopback): the running sum of the blocks' bytes always equals the sum counted from the block
states, whatever mix of fetches, pins, releases and checks ran (threads included); a process
killed in the middle of a change leaves a sum that the next holder counts again; eviction
takes consumed blocks first, then the least recently used, and never a block used again after
the eviction's candidates were picked while older ones remain."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote.helpers import BLOCK, finish, image_store, objects, python_child

import mmstore
from mmstore.remote.replica import open_replica
from mmstore.transfer import push

pytest.importorskip("obstore")

ABSENT, PRESENT = 0, 1  # block states (NOTE [block states] in mmstore/remote/replica.py)


def _counted(rep) -> int:
    """The accounted bytes of the blocks, counted here from the states (the truth)."""
    return int(rep.sizes[rep.state != ABSENT].sum())


def _assert_true_sum(rep) -> None:
    got = rep.accounting()
    assert got["dirty"] == 0, "the dirty word is left set"
    assert got["sum"] == got["counted"] == _counted(rep), (got, _counted(rep))
    assert rep.disk_bytes() == rep.whole_bytes + _counted(rep)


def _assert_blocks_match_source(rep, src: str) -> None:
    """Every present block holds the source file's bytes."""
    for g in np.flatnonzero(rep.state == PRESENT).tolist():
        name = rep.sparse[int(rep.owner[g])]
        start = (g - rep.first[name]) * rep.block_bytes
        size = int(rep.sizes[g])
        with open(os.path.join(rep.store_dir, name), "rb") as f, open(os.path.join(src, name), "rb") as s:
            f.seek(start)
            s.seek(start)
            assert f.read(size) == s.read(size), (name, g)


@pytest.fixture
def pushed(s3, tmp_path):
    src = image_store(tmp_path / "src.store", n=4000)  # ~12 MB of records: ~190 blocks of 64 KiB
    url = s3.url("acct.store")
    push(src, url, block_bytes=BLOCK)
    return src, url


_op = st.tuples(st.sampled_from(["pin", "ahead", "verify", "trim"]),
                st.lists(st.integers(0, 10_000), min_size=1, max_size=12), st.booleans())


def test_the_running_sum_equals_the_states_after_any_ops(pushed, tmp_path):
    src, url = pushed
    runs = iter(range(10**6))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(ops=st.lists(_op, min_size=1, max_size=25), limit_blocks=st.integers(24, 120))
    def check(ops, limit_blocks):
        cache = tmp_path / f"cache{next(runs)}"
        rep = open_replica(url, cache_dir=cache, cache_limit=rep_whole[0] + limit_blocks * BLOCK)
        pins = []
        try:
            for kind, picks, flag in ops:
                blocks = np.unique(np.asarray(picks) % rep.nblocks)
                if kind == "verify":
                    rep.verify_present()
                elif kind == "trim":
                    rep.trim()
                else:
                    pin = rep.acquire(blocks, ahead=kind == "ahead")
                    if pin is not None:
                        if flag:
                            pins.append(pin)  # held across the next ops
                        else:
                            pin.release(consumed=len(blocks) % 2 == 0)
                _assert_true_sum(rep)
            for pin in pins:
                pin.release()
            rep.trim()
            _assert_true_sum(rep)
            assert rep.disk_bytes() <= rep.cache_limit
            _assert_blocks_match_source(rep, src)
        finally:
            for pin in pins:
                pin.release()
            rep.close()

    probe = open_replica(url, cache_dir=tmp_path / "probe")
    rep_whole = [probe.whole_bytes + len(probe.sticky) * BLOCK]
    probe.close()
    check()


def test_threads_fetching_and_evicting_keep_the_sum(pushed, tmp_path):
    src, url = pushed
    probe = open_replica(url, cache_dir=tmp_path / "probe")
    limit = probe.whole_bytes + 40 * BLOCK
    probe.close()
    rep = open_replica(url, cache_dir=tmp_path / "cache", cache_limit=limit)
    errors: list[BaseException] = []

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(60):
                first = int(rng.integers(0, rep.nblocks - 6))
                pin = rep.acquire(np.arange(first, first + 6), ahead=bool(rng.integers(0, 2)))
                if pin is not None:
                    pin.release(consumed=bool(rng.integers(0, 2)))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert not errors, errors
        _assert_true_sum(rep)
        assert rep.evicted_blocks > 0
        rep.trim()
        assert rep.disk_bytes() <= limit
        _assert_blocks_match_source(rep, src)
    finally:
        rep.close()


# a holder of the accounting lock killed in the middle of a change: it set the dirty word and
# half-updated the sum (the words of acct.lock, NOTE [accounting]), then died holding the lock
_KILLED_MID_CHANGE = """
import fcntl, os, signal, struct, sys
fd = os.open(os.path.join(sys.argv[1], "acct.lock"), os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
total, _ = struct.unpack("<qq", os.pread(fd, 16, 0))
os.pwrite(fd, struct.pack("<q", 1), 8)
os.pwrite(fd, struct.pack("<q", total + 123_456_789), 0)
print("changing", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_holder_killed_mid_change_leaves_a_sum_the_next_holder_counts_again(pushed, tmp_path):
    src, url = pushed
    cache = tmp_path / "cache"
    rep = open_replica(url, cache_dir=cache, cache_limit=10 << 20)
    pin = rep.acquire(np.arange(10))
    pin.release()
    before = _counted(rep)
    child = python_child(_KILLED_MID_CHANGE, rep.home)
    out, _ = finish(child)
    assert child.returncode == -signal.SIGKILL and b"changing" in out
    got = rep.accounting()
    assert got["dirty"] == 1 and got["sum"] == before + 123_456_789  # as the killed holder left them
    assert rep.disk_bytes() == rep.whole_bytes + before  # read without the lock: counted from the states
    pin = rep.acquire(np.arange(10, 20))  # a fetch takes the lock: the sum is counted again
    pin.release()
    _assert_true_sum(rep)
    assert _counted(rep) == before + 10 * BLOCK
    rep.close()


def test_eviction_takes_consumed_blocks_first_then_the_least_recently_used(pushed, tmp_path):
    src, url = pushed
    probe = open_replica(url, cache_dir=tmp_path / "probe")
    base = probe.whole_bytes + len(probe.sticky) * BLOCK
    probe.close()
    rep = open_replica(url, cache_dir=tmp_path / "cache", cache_limit=base + 300 * BLOCK)
    try:
        data = np.setdiff1d(np.arange(rep.nblocks), rep.sticky)
        assert len(data) > 180
        old, consumed, recent = data[:60], data[60:80], data[80:140]
        for group in (old, consumed, recent):
            for g in group.tolist():  # one at a time: each its own last use, in this order
                rep.acquire(np.array([g])).release()
        rep.acquire(consumed).release(consumed=True)
        rep.cache_limit = rep.whole_bytes + _counted(rep)  # full: every new block evicts one
        rep.acquire(data[140:150]).release()
        assert np.all(rep.state[consumed[:10]] == ABSENT) and np.all(rep.state[consumed[10:]] == PRESENT)
        assert np.all(rep.state[old] == PRESENT)
        rep.acquire(data[150:170]).release()  # 10 consumed left, then the 10 oldest
        assert np.all(rep.state[consumed] == ABSENT)
        assert np.all(rep.state[old[:10]] == ABSENT) and np.all(rep.state[old[10:]] == PRESENT)
        # used again after the candidates were picked: kept while older blocks remain
        rep.acquire(old[10:15]).release()
        rep.acquire(data[170:180]).release()
        assert np.all(rep.state[old[10:15]] == PRESENT)
        assert np.all(rep.state[old[15:25]] == ABSENT) and np.all(rep.state[old[25:]] == PRESENT)
        _assert_true_sum(rep)
        assert rep.disk_bytes() <= rep.cache_limit
        _assert_blocks_match_source(rep, src)
    finally:
        rep.close()


def test_a_store_opened_under_a_limit_reads_through_the_sum(pushed, tmp_path):
    """The accounting seen through the public API: an epoch under a small limit evicts, stays
    under the limit, and every record is the source's."""
    from mmstore.order import OrderSpec
    from mmstore.torch import Loader

    src, url = pushed
    store = mmstore.open(url, cache_dir=tmp_path / "cache", cache_limit="8MB")
    local = mmstore.open(src)
    got = np.concatenate([b["label"].numpy() for b in Loader(store, 100, OrderSpec("block", seed=3))])
    assert sorted(got.tolist()) == list(range(len(local)))
    rep = store.replica
    _assert_true_sum(rep)
    assert rep.evicted_blocks > 0 and rep.disk_bytes() <= 8_000_000
    _assert_blocks_match_source(rep, src)
    store.close()


def _blocks_match(rep, spans, segs, n: int) -> None:
    """For any few slots, ``rep.blocks_of(spans(slots))`` is the set of blocks holding a byte of
    their records, counted from ``segs`` ((file name, FieldSegment) of each fixed field)."""
    B = rep.block_bytes

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(slots=st.lists(st.integers(0, n - 1), max_size=6))
    def check(slots):
        want = set()
        for s in slots:
            for name, g in segs:
                if g.first <= s < g.first + g.count and name in rep.first:
                    lo = g.offset + (s - g.first) * g.entry_bytes
                    hi = lo + g.entry_bytes
                    want.update(rep.first[name] + b for b in range(lo // B, (hi - 1) // B + 1))
        got = rep.blocks_of(spans(np.array(slots, dtype=np.int64)))
        assert list(got) == sorted(want), (slots, list(got), sorted(want))

    check()


def test_the_blocks_a_read_touches_are_those_of_its_records_bytes(s3, tmp_path):
    """``Replica.blocks_of(RecordSpans(...)(slots))`` (the pin of every read of a store from a
    URL, its one-record path in integers included) is exactly the set of blocks that hold a byte
    of the slots' records, counted here byte range by byte range from the files' layout; for a
    store of several segments (a merge) with blocks smaller and larger than a record."""
    from support.stores import write_parts

    from mmstore.store.spans import RecordSpans

    schema = {"image": ("|u1", (96, 96, 3)), "label": ("<i8", ())}  # 27 KB records: many straddle two blocks
    rng = np.random.default_rng(5)
    parts = write_parts(tmp_path / "parts", 300, [120], schema=schema,
                        make=lambda i: {"image": rng.integers(0, 255, (96, 96, 3), dtype=np.uint8),
                                        "label": np.int64(i)})
    src = str(mmstore.merge(parts, tmp_path / "merged.store"))
    local = mmstore.open(src)
    backend = local.slot_view.backend
    names = [n for n in local.schema.names if not local.schema[n].variable]
    with pytest.raises(ValueError, match="multiple of 4096"):
        push(src, s3.url("small.store"), block_bytes=4096)  # refused before any upload: no reader takes it
    assert not [k for k in objects(s3) if "small.store" in k]
    for block in (BLOCK, 2 * BLOCK):
        url = s3.url(f"spans-{block}.store")
        push(src, url, block_bytes=block)
        rep = open_replica(url, cache_dir=tmp_path / f"cache-{block}")
        try:
            spans = RecordSpans(backend, local.schema, names)
            segs = [(os.path.relpath(g.path, backend.root), g) for n in names for g in backend.field_segments(n)]
            _blocks_match(rep, spans, segs, len(local))
        finally:
            rep.close()
