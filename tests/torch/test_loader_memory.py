"""Loader under a memory budget: the sizing rule that
``describe()`` reports, the block order's reads reaching the files as long
offset-ordered requests, and every order reading each record exactly once
per epoch inside a memory cgroup smaller than the store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.stores import IDX_BIG_SCHEMA, write_indexed

import mmstore
from mmstore._os import memplan as _memplan
from mmstore._os.memplan import widen_ring
from mmstore.engine import reads as _reads
from mmstore.order import BlockShuffle, OrderSpec, plan_memory
from mmstore.torch import Loader, LoaderTuning
from mmstore.torch import loader as loader_mod

REC = sum(int(np.dtype(d).itemsize * np.prod(s, dtype=np.int64)) for d, s in IDX_BIG_SCHEMA.values())


def _mock_memory(monkeypatch, avail, limit):
    monkeypatch.setattr(_memplan, "effective_available", lambda: avail)
    monkeypatch.setattr(_memplan, "memory_limit", lambda: limit)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


@given(budget=st.integers(1, 1 << 34), batch=st.integers(1, 1 << 26), rec=st.integers(1, 1 << 20),
       records=st.integers(0, 1 << 24), hold=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_plan_memory_rule(budget, batch, rec, records, hold):
    """The documented rule: prefetch is the largest of 1..4 whose ring fits a
    quarter of the budget (1 if none does); the cache is what the ring leaves;
    a window is a quarter of the cache; 'fits' is 90 % of the cache."""
    p = plan_memory(batch_bytes=batch, record_bytes=rec, records=records, hold=hold, prefetch=None, mem_bytes=budget)
    k = p["prefetch"]
    assert 1 <= k <= 4 and p["budget"] == budget and p["budget_source"] == "given (mem_bytes=)"
    assert k == 1 or (k + hold) * batch <= budget // 4
    assert k == 4 or (k + 1 + hold) * batch > budget // 4
    assert p["ring_bytes"] == (k + hold) * batch and p["cache_bytes"] == max(0, budget - p["ring_bytes"])
    assert p["window_bytes"] == max(rec, p["cache_bytes"] // 4)
    assert p["fits"] == (records * rec <= 0.9 * p["cache_bytes"])
    given_k = plan_memory(batch_bytes=batch, record_bytes=rec, records=records, hold=hold, prefetch=3,
                          mem_bytes=budget)
    assert given_k["prefetch"] == 3  # a prefetch the user gave is kept
    w = widen_ring(p)  # an order read per batch: the ring may take half the budget when the store does not fit
    if p["fits"]:
        assert w == {}
    else:
        kw = w["prefetch"]
        assert k <= kw <= 4 and w["ring_bytes"] == (kw + hold) * batch
        assert kw == k or (kw + hold) * batch <= budget // 2
        assert kw == 4 or (kw + 1 + hold) * batch > budget // 2
        assert w["cache_bytes"] == max(0, budget - w["ring_bytes"])


def test_describe_follows_the_cgroup_budget(stores, monkeypatch):
    """describe() reports the budget from the (mocked) cgroup figures, the
    ring and the block window sized from it; str() reads as sentences."""
    path = stores["big"]
    n = len(mmstore.open(path))
    avail = 40 * 16 * REC  # room for 40 batches of 16 records
    _mock_memory(monkeypatch, avail, 3 * avail)
    with Loader(path, 16, "block") as L:
        d = L.describe()
        assert d["budget"] == avail and d["budget_source"] == "cgroup limit - working set"
        assert d["cgroup_limit"] == 3 * avail and d["batch_bytes"] == 16 * REC
        # the ring: 4 prefetch + hold 1 + 1 for the batch the loop variable holds (kept-batch check)
        assert d["prefetch"] == L.prefetch == 4 and L.ring_size == 6 and d["ring_bytes"] == 6 * 16 * REC
        cache = avail - 6 * 16 * REC
        assert d["window_chunk"] == min(8 << 20, max(1 << 20, cache // 16 // 2))  # 2 window threads
        assert d["cache_bytes"] == max(0, cache - 2 * d["window_chunk"])
        assert d["window_bytes"] == L.order.window * L.order.block * REC
        block = BlockShuffle.auto_sizes(n, REC, 1)["block"]
        assert L.order.block == block
        assert L.order.window == min(-(-n // block), max(1, cache // 4 // (block * REC)))
        assert d["store_bytes"] == n * REC and d["fits"] == (n * REC <= 0.9 * cache)
        assert d["readahead"] == "windows" and d["willneed"] == 0
        text = str(d)
        assert "memory budget" in text and "cgroup limit" in text and "ring: 4 prefetch + 2 hold" in text
    # a small budget: one batch ahead, the store does not fit, windows are dropped behind
    _mock_memory(monkeypatch, 6 * 16 * REC, None)
    with Loader(path, 16, "sequential") as L:
        d = L.describe()
        assert d["budget_source"] == "MemAvailable" and d["prefetch"] == 1 and not d["fits"]
        assert d["readahead"] == "windows" and not d["window_direct"] and d["drop_behind"]  # too small for buffers
        assert d["window_records"] == max(16, (6 * 16 * REC - 3 * 16 * REC) // 4 // REC)
    _mock_memory(monkeypatch, 8 * 16 * REC, None)
    with Loader(path, 16, "sequential") as L:  # a quarter of the budget: 2 buffers, prefetch at least 1
        assert L.prefetch == 1 and L.ring_size == 3
    with Loader(path, 16, "permutation") as L:
        # read per batch, and the page cache gains it nothing: the ring may take half the budget
        # (4 buffers: 2 prefetch + hold 1 + 1 for the loop variable's batch)
        d = L.describe()
        # each record read with O_DIRECT (no page cache: no WILLNEED hints)
        assert d["readahead"] == "per batch" and d["direct_reads"] and d["willneed"] == 0 and not d["fits"]
        assert d["prefetch"] == L.prefetch == 2 and L.ring_size == 4 and d["ring_bytes"] == 4 * 16 * REC
        assert d["cache_bytes"] == 8 * 16 * REC - d["ring_bytes"]
        assert "ring: 2 prefetch + 2 hold" in str(d)
    with Loader(path, 16, "permutation", tuning=LoaderTuning(prefetch=1)) as L:
        assert L.describe()["prefetch"] == 1  # a prefetch the user gave is kept
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks share the cgroup
    with Loader(path, 16, "permutation", tuning=LoaderTuning(prefetch=2)) as L:
        d = L.describe()
        assert d["budget"] == 4 * 16 * REC and "2 local ranks" in d["budget_source"] and d["prefetch"] == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    _mock_memory(monkeypatch, 10 * n * REC, None)  # the store fits: the quarter rule
    with Loader(path, 16, "permutation") as L:
        d = L.describe()
        assert d["fits"] and d["prefetch"] == 4 and d["readahead"] == "per batch"
        assert not d["direct_reads"] and d["willneed"] == 2  # the page cache serves it


def test_sequential_windows_start_with_one_batch(stores, monkeypatch):
    """A sequential order's read-ahead windows are the loader's own cut: the
    first one is one batch (the first batch waits for its own records, not a
    whole window), then windows of ``window_records``; an epoch through them
    reads every record once, in order."""
    path = stores["big"]
    n = len(mmstore.open(path))
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)  # the window pass runs
    with Loader(path, 10, "sequential", tuning=LoaderTuning(mem_bytes=200 * REC)) as L:
        d = L.describe()
        step = d["window_records"]
        assert d["readahead"] == "windows" and not d["fits"] and step > 10
        b = L._window_bounds(0, n)
        assert b[0] == 0 and b[1] == 10 and b[-1] == n
        assert (np.diff(b[1:-1]) == step).all() and 0 < b[-1] - b[-2] <= step
        got = np.concatenate([x["idx"].numpy().copy() for x in L])
        assert np.array_equal(got, L.order.epoch(0))
        assert L._window_bounds(0, 7).tolist() == [0, 7]  # shorter than a batch: one window


def _window_reads(monkeypatch, path, order, mode):
    """Run two epochs with the window pass forced on; return, per epoch, the
    requests the pass issued on the image file: (offset, length) in issue order."""
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    image = os.path.realpath(os.path.join(path, "image.npy"))
    seen: list[tuple[str, int, int]] = []
    lock = threading.Lock()

    def log(fd, pos, length, what):
        if os.path.realpath(f"/proc/self/fd/{fd}") == image:
            with lock:
                seen.append((what, pos, length))

    chunk = _reads.WindowPrefetch._read_chunk
    monkeypatch.setattr(_reads.WindowPrefetch, "_read_chunk",
                        lambda self, fd, pos, length: (log(fd, pos, length, "read"), chunk(self, fd, pos, length)))
    fadvise = os.posix_fadvise

    def fadv(fd, pos, length, advice):
        if advice == os.POSIX_FADV_WILLNEED and threading.current_thread().name == "mmstore-window":
            log(fd, pos, length, "willneed")
        return fadvise(fd, pos, length, advice)

    monkeypatch.setattr(_reads.os, "posix_fadvise", fadv)
    L = Loader(path, 10, order, tuning=LoaderTuning(window_prefetch=mode, window_threads=1, mem_bytes=1 << 20))
    per_epoch = []
    for epoch in (0, 1):
        seen.clear()
        L.set_epoch(epoch)
        got = np.concatenate([b["idx"].numpy().copy() for b in L])
        assert np.array_equal(got, L.order.epoch(epoch))  # each record once, in the order's order
        per_epoch.append(list(seen))
    L.close()
    return per_epoch


@pytest.mark.parametrize("mode", ["read", "willneed"])
def test_block_order_reads_are_long_offset_ordered_requests(stores, monkeypatch, mode):
    """The block shuffle's records reach the file as one request per run of
    consecutive records (a block, or blocks that touch), in offset order
    within each window, covering every record's bytes exactly once per epoch;
    not one small request per record."""
    path = stores["big"]
    n = len(mmstore.open(path))
    order = BlockShuffle(n, 8, 4, seed=3)
    seg = mmstore.open(path).slot_view.backend.field_segments("image")[0]
    nb = seg.entry_bytes
    for epoch, reqs in zip((0, 1), _window_reads(monkeypatch, path, order, mode)):
        kinds = {k for k, _, _ in reqs}
        assert kinds <= {mode, "read"} and mode in kinds
        issued = [(p, ln) for k, p, ln in reqs if k == mode]
        covered = np.zeros(n * nb, np.int64)
        for p, ln in issued:
            covered[p - seg.offset : p - seg.offset + ln] += 1
        assert (covered == 1).all()  # every byte once, nothing twice
        bounds = order.window_bounds(epoch)
        idx = order.epoch(epoch)
        want = []
        for w in range(len(bounds) - 1):
            starts, stops = mmstore.order.contiguous_ranges(idx[bounds[w] : bounds[w + 1]])
            want += [(seg.offset + a * nb, (b - a) * nb) for a, b in zip(starts.tolist(), stops.tolist())]
        assert issued == want  # one request per run, offset order within each window
        assert len(issued) <= -(-n // 8) + len(bounds)  # about one per block, far fewer than records
        assert min(ln for _, ln in issued) >= nb and np.mean([ln for _, ln in issued]) >= 4 * nb


def test_sequential_order_is_read_ahead_in_offset_order(stores, monkeypatch):
    """A sequential epoch is read ahead as long requests in offset order."""
    path = stores["big"]
    n = len(mmstore.open(path))
    seg = mmstore.open(path).slot_view.backend.field_segments("image")[0]
    for reqs in _window_reads(monkeypatch, path, "sequential", "read"):
        offs = [p for _, p, _ in reqs]
        assert offs == sorted(offs) and sum(ln for _, _, ln in reqs) == n * seg.entry_bytes
        assert len(reqs) < n // 4


@pytest.mark.parametrize("name", ["big", "holes", "merged"])
@pytest.mark.parametrize("kind", ["block", "sequential"])
def test_direct_window_buffers_give_exact_records(stores, monkeypatch, name, kind):
    """A store larger than the budget is read ahead into O_DIRECT window
    buffers: every batch is byte-exact (holes, merged segments included),
    each record once per epoch, the buffers recycled."""
    path = stores[name]
    ref = mmstore.open(path)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    order = BlockShuffle(len(ref), 5, 4, seed=2) if kind == "block" else "sequential"
    monkeypatch.setattr(loader_mod, "DIRECT_MIN_CACHE", 0)  # a small store: no room needed
    L = Loader(path, 7, order, tuning=LoaderTuning(mem_bytes=64 * REC, threads=3))
    assert L.describe()["window_direct"] and L.describe()["readahead"] == "windows"
    from mmstore.engine import direct as _direct
    made = []
    orig = _direct.DirectWindows._read
    monkeypatch.setattr(_direct.DirectWindows, "_read",
                        lambda self, idx, *a: (made.append(len(idx)), orig(self, idx, *a))[1])
    for epoch in (0, 1):
        L.set_epoch(epoch)
        got = [{k: v.numpy().copy() for k, v in b.items()} for b in L]
        idx = np.concatenate([g["idx"] for g in got])  # the slot each record says it is
        assert np.array_equal(idx, ref.slot_view.slots_of(L.order.epoch(epoch)))
        pos = 0
        for g in got:
            want = ref.read_batch(L.order.epoch(epoch)[pos : pos + len(g["idx"])])
            pos += len(g["idx"])
            for f in ref.fields:
                assert np.array_equal(g[f], want[f]), f
    assert sum(made) == 2 * len(L.order)  # the windows were read by the pass, every record once an epoch
    L.close()


# -- every order inside a memory cgroup smaller than the store --------------------

_CHILD = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import torch  # noqa: F401 - what a training process holds
    from mmstore.order import OrderSpec
    from mmstore.torch import Loader
    cg, memfile, path, n, margin = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    usage = int(open(os.path.join(
        cg, "memory.usage_in_bytes" if memfile.endswith("in_bytes") else "memory.current")).read())
    with open(os.path.join(cg, memfile), "w") as f:  # the store does not fit in what is left
        f.write(str(usage + margin))
    out = {}
    for kind in ("sequential", "block", "permutation"):
        with Loader(path, 32, OrderSpec(kind, seed=5)) as L:
            d = L.describe()
            for epoch in (0, 1):
                for fd_name in os.listdir(path):
                    fd = os.open(os.path.join(path, fd_name), os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                got = [b["idx"].numpy().copy() for b in L]
                idx = np.concatenate(got)
                first = next(iter(got))
            out[kind] = {"sorted_ok": bool(np.array_equal(np.sort(idx), np.arange(n))), "len": int(len(idx)),
                         "fits": d["fits"], "budget": d["budget"], "readahead": d["readahead"],
                         "windows_do_not_fit": bool(d.get("windows_do_not_fit"))}
    print(json.dumps(out))
""")


def _make_cgroup(name):
    """A memory cgroup (v1 or v2) this process may use: (dir, limit file) or a reason to skip."""
    if os.geteuid() != 0:
        return None, "needs root to create a memory cgroup"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1) and os.path.exists(os.path.join(v1, "memory.limit_in_bytes")):
        base, limit = v1, "memory.limit_in_bytes"
    elif os.path.exists("/sys/fs/cgroup/cgroup.subtree_control") and \
            "memory" in open("/sys/fs/cgroup/cgroup.subtree_control").read().split():
        base, limit = "/sys/fs/cgroup", "memory.max"
    else:
        return None, "no cgroup v1 memory hierarchy and no v2 memory controller here"
    cg = os.path.join(base, name)
    try:
        os.makedirs(cg)
    except OSError as exc:
        return None, f"cannot create a memory cgroup here ({exc})"
    return (cg, limit), ""


def test_every_order_under_a_memory_limit(tmp_path):
    """In a child confined to a memory cgroup whose room is a quarter of the
    store (157 MB: large enough that the process's own few MB of growth
    leave the kernel room to reclaim under CPU contention): each order
    reads every record exactly once per epoch (two epochs, evicted before
    each), with the default sizing, and no OOM kill."""
    made, why = _make_cgroup(f"mmstore_test_{os.getpid()}")
    if made is None:
        pytest.skip(why)
    cg, limit = made
    try:
        n = 2400
        schema = {"image": ("|u1", (128, 128, 4)), "label": ("<i8", ()), "idx": ("<i8", ())}
        path = write_indexed(str(tmp_path / "s"), n, schema=schema)  # 157 MB
        margin = n * 65536 // 4
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))

        def enter():
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        p = subprocess.run([sys.executable, "-c", _CHILD, cg, limit, path, str(n), str(margin)], env=env,
                           preexec_fn=enter, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, f"child failed (rc {p.returncode}; -9 is an OOM kill): {p.stderr[-2000:]}"
        import json
        out = json.loads(p.stdout.strip().splitlines()[-1])
        for kind in ("sequential", "block", "permutation"):
            r = out[kind]
            assert r["sorted_ok"] and r["len"] == n, (kind, r)
            assert not r["fits"] and r["budget"] < n * 65536 // 2, (kind, r)  # it read under pressure
        assert out["sequential"]["readahead"] == "windows"
        # the block shuffle's default window (the same on every rank, not sized from this memory):
        # two do not fit in a quarter of the store, so batches read their own records
        assert out["block"]["readahead"] == "per batch" and out["block"]["windows_do_not_fit"], out["block"]
        if limit == "memory.limit_in_bytes":
            with open(os.path.join(cg, "memory.oom_control")) as f:
                oom = f.read()
            assert "oom_kill 0" in oom or "oom_kill" not in oom
    finally:
        os.rmdir(cg)


def test_direct_window_buffers_on_a_truncated_store_raise_the_typed_error(stores, tmp_path, monkeypatch):
    """A store truncated after the epoch's checks: the window pass cannot
    read the windows past the cut, so their batches read for themselves and
    raise the typed truncation error; nothing past the cut is delivered as data."""
    import shutil

    from mmstore.errors import MmstoreError, StoreChangedError
    from mmstore.store.backends import memmap as memmap_backend

    monkeypatch.setattr(memmap_backend, "note_identity", lambda *a, **k: None)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    monkeypatch.setattr(loader_mod, "DIRECT_MIN_CACHE", 0)
    dst = str(tmp_path / "big")
    shutil.copytree(stores["big"], dst)
    ref = mmstore.open(stores["big"])
    seg = mmstore.open(dst).slot_view.backend.field_segments("image")[0]
    order = BlockShuffle(301, 5, 4, seed=1)
    L = Loader(dst, 8, order, tuning=LoaderTuning(mem_bytes=64 * REC, threads=3))
    assert L.describe()["window_direct"]
    iter(L).close()
    os.truncate(os.path.join(dst, "image.npy"), seg.offset + 150 * seg.entry_bytes)
    seen = []
    with pytest.raises((OSError, StoreChangedError)) as e:
        for b in L:
            want = ref.read_batch(ref.slot_view.slots_of(b["idx"].numpy()))  # slots = indices here (no holes)
            assert np.array_equal(b["image"].numpy(), want["image"])
            seen += b["idx"].tolist()
    assert isinstance(e.value, (EOFError, StoreChangedError))  # typed, not garbage delivered as data
    assert isinstance(e.value, MmstoreError)
    assert len(seen) < 301  # the epoch did not complete
    L.close()


def test_random_reads_spread_each_batch_over_every_thread(stores):
    """A shuffled epoch read per batch with preadv cuts each batch into one
    piece per reader thread (the batch the consumer waits for next is read by
    all of them); a sequential one keeps pieces of ``piece_bytes``; an epoch
    with the smaller pieces still reads every record once."""
    path = stores["big"]
    st = mmstore.open(path)
    fields = ("image", "label", "idx")
    files = _reads.open_field_files(st, fields, "pread")
    try:
        t = LoaderTuning(threads=4, method="pread")
        shuffled = _reads.EpochReads(st, fields, files, t, batch_size=10, shuffled=True, block=False)
        assert shuffled.piece_rows == 3  # ceil(10 / 4)
        seq = _reads.EpochReads(st, fields, files, t, batch_size=10, shuffled=False, block=False)
        assert seq.piece_rows == max(1, t.piece_bytes // REC)
    finally:
        for ff in files.values():
            ff.close()
        st.close()
    with Loader(path, 10, OrderSpec("permutation", seed=5), tuning=LoaderTuning(threads=4, method="pread")) as L:
        got = np.concatenate([b["idx"].numpy().copy() for b in L])
        assert np.array_equal(got, L.order.epoch(0))
