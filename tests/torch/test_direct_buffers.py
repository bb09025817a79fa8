"""The O_DIRECT window buffers (``mmstore/engine/direct.py``): aligned on a
huge-page boundary and backed by transparent huge pages where the kernel
offers them (NOTE [huge window buffers]: the disk requests an O_DIRECT read
becomes are at most ``max_segments`` contiguous pieces of the buffer)."""

from __future__ import annotations

import errno
import os
import re

import numpy as np
import pytest

import mmstore
from mmstore.engine import direct as _direct
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            m = re.search(r"\[(\w+)\]", fh.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _anon_huge_kb(addr: int) -> int:
    """``AnonHugePages`` of the mapping of this process that holds ``addr``."""
    inside = False
    with open("/proc/self/smaps") as fh:
        for line in fh:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.parametrize("size", [2 << 20, 6 << 20])
def test_buffer_is_aligned_private_and_writable(size):
    buf = _direct._Buffer(size)
    data = None
    try:
        assert buf.addr % _direct._HUGE == 0 and len(buf.view) == buf.size == size
        data = np.frombuffer(buf.view, np.uint8)
        data[:] = 7
        assert int(data.sum()) == 7 * size
        again = _direct._Buffer(size)  # a private mapping: one buffer's bytes are not another's
        assert not np.frombuffer(again.view, np.uint8).any()
        again.close()
    finally:
        del data
        buf.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or _thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this machine")
def test_buffer_is_backed_by_huge_pages_when_the_kernel_offers_them():
    buf = _direct._Buffer(8 << 20)
    try:
        fd = os.open(__file__, os.O_RDONLY)
        try:  # what the pass does: the kernel writes into the buffer
            got = os.preadv(fd, [buf.view[: 1 << 20]], 0)
        finally:
            os.close(fd)
        assert got > 0
        np.frombuffer(buf.view, np.uint8)[:: 4096] = 1  # touch every page
        assert _anon_huge_kb(buf.addr) >= 2048  # a shared (shmem) mapping has none here
    finally:
        buf.close()


# -- a permutation of a store that does not fit: records read with O_DIRECT ---------

def _epochs_exact(L, ref, epochs=(0, 1)):
    """Every batch of ``epochs`` byte-exact against the store, each record once."""
    for epoch in epochs:
        L.set_epoch(epoch)
        order = L.order.epoch(epoch)
        pos = 0
        for b in L:
            got = {k: v.numpy() for k, v in b.items()}
            want = ref.read_batch(order[pos : pos + len(got["idx"])])
            pos += len(got["idx"])
            for f in ref.fields:
                assert np.array_equal(got[f], want[f]), f
        assert pos == len(order)


@pytest.mark.parametrize("name", ["big", "holes", "merged"])
@pytest.mark.parametrize("refused", [False, True])
def test_permutation_that_does_not_fit_reads_records_with_o_direct(stores, monkeypatch, name, refused):
    """A permutation whose store does not fit in its budget reads each record
    with O_DIRECT (aligned staging buffer, then a copy into its row): batches
    byte-exact (holes, merged segments), each record once; where O_DIRECT is
    refused the same records come through the page cache."""
    from mmstore.engine import reads as _reads

    path = stores[name]
    ref = mmstore.open(path)
    rec = sum(ref.schema[f].nbytes for f in ref.fields)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    if refused:
        monkeypatch.setattr(_reads, "open_direct", lambda p: None)
    calls = []
    orig = _reads.read_records_direct
    monkeypatch.setattr(_reads, "read_records_direct", lambda *a: (calls.append(len(a[3])), orig(*a))[1])
    L = Loader(path, 7, OrderSpec("permutation", seed=4), tuning=LoaderTuning(mem_bytes=20 * rec, threads=3))
    d = L.describe()
    assert d["direct_reads"] and not d["fits"] and d["willneed"] == 0 and "O_DIRECT" in str(d)
    _epochs_exact(L, ref)
    L.close()
    seg = ref.slot_view.backend.field_segments("image")[0]
    can = _direct.open_direct(seg.path)
    if can is not None:
        os.close(can)
    if refused or can is None:
        assert calls == []
    else:  # the image field (the label is gathered from the mapping): every record, both epochs
        assert sum(calls) == 2 * len(ref)


def test_a_store_that_fits_or_is_cached_keeps_the_page_cache(stores, monkeypatch):
    """No O_DIRECT where the page cache serves: a store that fits the budget,
    or one found cached at the start of the epoch."""
    from mmstore.engine import reads as _reads

    path = stores["big"]
    ref = mmstore.open(path)
    calls = []
    monkeypatch.setattr(_reads, "read_records_direct", lambda *a: calls.append(1))
    L = Loader(path, 16, "permutation", tuning=LoaderTuning(mem_bytes=1 << 34))
    assert not L.describe()["direct_reads"]
    _epochs_exact(L, ref, (0,))
    assert not L._res.ring._huge  # rows filled by copies: small pages, as before
    L.close()
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 1.0)  # found cached
    L = Loader(path, 16, "permutation", tuning=LoaderTuning(mem_bytes=20 * 16, method="pread"))
    assert L.describe()["direct_reads"]
    _epochs_exact(L, ref, (0,))
    L.close()
    assert calls == []


def test_direct_record_reads_of_a_truncated_store_raise_the_typed_error(stores, tmp_path, monkeypatch):
    """A record past the end of a truncated file: the O_DIRECT read comes up
    short, the buffered one raises TruncatedReadError (an EOFError) naming
    the record; nothing past the cut is delivered as data."""
    import shutil

    from mmstore._os import TruncatedReadError
    from mmstore.engine import reads as _reads
    from mmstore.errors import MmstoreError, StoreChangedError
    from mmstore.store.backends import memmap as memmap_backend

    monkeypatch.setattr(memmap_backend, "note_identity", lambda *a, **k: None)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    dst = str(tmp_path / "big")
    shutil.copytree(stores["big"], dst)
    ref = mmstore.open(stores["big"])
    rec = sum(ref.schema[f].nbytes for f in ref.fields)
    seg = mmstore.open(dst).slot_view.backend.field_segments("image")[0]
    L = Loader(dst, 8, "permutation", tuning=LoaderTuning(mem_bytes=20 * rec, threads=3))
    assert L.describe()["direct_reads"]
    iter(L).close()
    os.truncate(os.path.join(dst, "image.npy"), seg.offset + 150 * seg.entry_bytes + 100)
    seen = []
    with pytest.raises((OSError, StoreChangedError)) as e:
        for b in L:
            want = ref.read_batch(ref.slot_view.slots_of(b["idx"].numpy()))
            assert np.array_equal(b["image"].numpy(), want["image"])
            seen += b["idx"].tolist()
    assert isinstance(e.value, (TruncatedReadError, StoreChangedError))
    assert isinstance(e.value, MmstoreError)  # one `except MmstoreError` catches every store fault
    assert len(seen) < 301
    L.close()


def test_plan_says_o_direct_only_where_fields_are_read_positionally(stores, monkeypatch):
    """describe() promises O_DIRECT only for fields read with preadv: not on
    LMDB, not with method="mmap"; the epochs are exact either way."""
    from mmstore.torch import loader as loader_mod

    monkeypatch.setattr(loader_mod, "DIRECT_MIN_CACHE", 0)
    for name, method, want in (("lmdb", "auto", False), ("big", "mmap", False), ("big", "auto", True)):
        ref = mmstore.open(stores[name])
        rec = sum(ref.schema[f].nbytes for f in ref.fields)
        for kind in ("permutation", "block"):
            sizes = {"block": 5, "window": 1} if kind == "block" else {}  # two windows fit in the budget
            L = Loader(
                stores[name],
                7,
                OrderSpec(kind, **sizes),
                tuning=LoaderTuning(mem_bytes=40 * rec, method=method, threads=2),
            )
            d = L.describe()
            assert not d["fits"]
            assert (d["direct_reads"] if kind == "permutation" else d["window_direct"]) == want, (name, method, kind)
            _epochs_exact(L, ref, (0,))
            L.close()


# -- records read in place: ring rows aligned to their records' file offsets -----------

def _takes_512(path):
    """Whether ``path``'s device takes an O_DIRECT read of one 512-byte block
    at a 512-byte (not 4 KiB) offset and address: False on a device of 4 KiB
    logical blocks (many NVMe drives, a loop device with ``--sector-size
    4096``), which refuses what NOTE [rows read in place] reads in place;
    None where O_DIRECT is not open here."""
    import mmap

    fd = _direct.open_direct(path)
    if fd is None:
        return None
    buf = mmap.mmap(-1, 8192)
    view = memoryview(buf)
    try:
        return os.preadv(fd, [view[512:1024]], 512) > 0
    except OSError:
        return False
    finally:
        view.release()
        buf.close()
        os.close(fd)


class _Everything(set):
    def __contains__(self, x: object) -> bool:
        return True


@pytest.mark.parametrize("mode", ["aio", "preadv", "staged"])
@pytest.mark.parametrize("image", [(32, 32, 3), (24, 32, 3)])
def test_permutation_reads_records_in_place_into_aligned_rows(build_store, tmp_path, monkeypatch, mode, image):
    """NOTE [rows read in place] (_ring.py): the ring's rows of a preadv field
    start at the field's data offset modulo 4096, so a record whose size is a
    multiple of the device block (32x32x3 = 6 x 512) is read by O_DIRECT
    straight into its row: in one AIO submit per piece ("aio"), one preadv
    each where AIO is missing ("preadv"), through the staging buffer where
    the device refuses ("staged"). A record size that is not a multiple
    (24x32x3 = 4.5 x 512) puts every other row off the block: those are
    staged. Batches byte-exact, each record once, in every case."""
    from mmstore.engine import aio as _aio
    from mmstore.engine import reads as _reads

    schema = {"image": ("|u1", image), "label": ("<i8", ()), "idx": ("<i8", ())}
    path = build_store(str(tmp_path / "s"), 150, holes=(3, 90), schema=schema)
    ref = mmstore.open(path)
    rec = sum(ref.schema[f].nbytes for f in ref.fields)
    seg = ref.slot_view.backend.field_segments("image")[0]
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    if mode == "preadv":
        monkeypatch.setitem(_aio._off, "unavailable", True)
    # the descriptors refused in place are known by number: none from another test's files
    monkeypatch.setattr(_direct, "_no_in_place", _Everything() if mode == "staged" else set())
    counts = {"aio": 0, "sync": 0}  # records read in place (a run of consecutive ones is one read)
    rv, rip = _aio.read_vectors, _direct._read_in_place
    nb = int(np.prod(image))

    def aio(c, f, o, iov):
        res = rv(c, f, o, iov)
        counts["aio"] += int((iov["len"].sum(axis=1) // nb)[res > 0].sum())  # less than a record of padding
        return res

    def sync(dfd, off, length, dst, row):
        counts["sync"] += length // nb
        return rip(dfd, off, length, dst, row)

    monkeypatch.setattr(_aio, "read_vectors", aio)
    monkeypatch.setattr(_direct, "_read_in_place", sync)
    L = Loader(path, 7, OrderSpec("permutation", seed=4), tuning=LoaderTuning(mem_bytes=20 * rec, threads=3))
    assert L.describe()["direct_reads"]
    _epochs_exact(L, ref)
    ring = L._res.ring
    assert all(v["image"].ctypes.data % 4096 == seg.offset % 4096 for v in ring.views)
    assert ring._huge  # a plan of O_DIRECT record reads asks for huge pages (NOTE [rows read in place])
    L.close()
    can = _direct.open_direct(seg.path)
    if can is None:  # no O_DIRECT on this file system: nothing is read in place
        assert counts == {"aio": 0, "sync": 0}
        return
    os.close(can)
    if not _takes_512(seg.path):  # 4 KiB blocks: every read in place refused, then staged (exact above)
        assert counts["aio"] == 0 and (mode == "staged" or len(_direct._no_in_place) > 0)
        return
    n = 2 * len(ref)  # records read, two epochs
    whole = image[0] * image[1] * image[2] % _direct._BLOCK == 0
    in_place = counts["aio"] + counts["sync"]
    if mode == "staged":
        assert in_place == 0
    elif whole:
        assert in_place == n  # every row congruent
    else:
        assert 0 < in_place < n
    if mode == "preadv" or _aio._SYS is None:
        assert counts["aio"] == 0
    elif mode == "aio":
        assert counts["sync"] == 0 and counts["aio"] > 0


def test_read_vectors_reads_each_vector_and_reports_short_reads(tmp_path):
    """``_aio.read_vectors``: every read lands in its iovecs (head, middle,
    tail pieces of 512-byte multiples), a read past the end of the file
    reports the bytes it got, a read of a bad descriptor is reported
    failed, never raised."""
    import mmap

    from mmstore.engine import aio as _aio

    data = np.random.default_rng(3).integers(0, 256, 40_000 + 100, dtype=np.uint8)
    p = tmp_path / "f.bin"
    p.write_bytes(data.tobytes())
    fd = _direct.open_direct(str(p))
    ctx = _aio.context()
    if fd is None or ctx is None:
        assert _aio._SYS is None or fd is None or _aio._off["unavailable"]
        return
    small = _takes_512(str(p))  # False: 4 KiB blocks, each 512-byte piece refused (-EINVAL)
    buf = mmap.mmap(-1, 1 << 16)
    base = np.frombuffer(buf, np.uint8).ctypes.data
    try:
        iov = np.zeros((3, 3), _aio.IOVEC)
        iov[0] = [(base, 512), (base + 4096, 1024), (base + 8192, 512)]  # 2,048 bytes at 4,096
        iov[1][0] = (base + 12288, 4096)  # 4,096 bytes at 36,864: 3,236 before the end
        iov[2][0] = (base + 20480, 512)
        res = _aio.read_vectors(ctx, np.array([fd, fd, fd]), np.array([4096, 36864, 512]), iov)
        if not small:
            assert res.tolist() == [-errno.EINVAL, 40_100 - 36864, -errno.EINVAL]
            got = np.frombuffer(buf, np.uint8)
            assert np.array_equal(got[12288:12288 + 3236], data[36864:])
            del got
            return
        assert res.tolist() == [2048, 40_100 - 36864, 512]
        got = np.frombuffer(buf, np.uint8)
        assert np.array_equal(got[:512], data[4096:4608])
        assert np.array_equal(got[4096:5120], data[4608:5632])
        assert np.array_equal(got[8192:8704], data[5632:6144])
        assert np.array_equal(got[12288:12288 + 3236], data[36864:])
        assert np.array_equal(got[20480:20992], data[512:1024])
        del got
        bad = _aio.read_vectors(ctx, np.array([fd + 1000]), np.array([0]), iov[2:])
        assert bad.tolist()[0] < 0
    finally:
        os.close(fd)
        buf.close()


def test_method_pread_reads_only_large_records_with_o_direct(stores, build_store, tmp_path, monkeypatch):
    """With ``method="pread"`` the small fields (an 8-byte label) are read
    with ``preadv`` too, but not with O_DIRECT: each of their records would
    cost a 4 KiB disk read of its own (a second random read per record) where
    their small file stays in the page cache. Only the fields of at least
    ``PREAD_MIN_BYTES`` a record are read with O_DIRECT; the epochs are exact."""
    from mmstore.engine import reads as _reads

    path = stores["big"]
    ref = mmstore.open(path)
    rec = sum(ref.schema[f].nbytes for f in ref.fields)
    monkeypatch.setattr(_reads, "resident_fraction", lambda paths: 0.0)
    sizes = []
    orig = _reads.read_records_direct
    monkeypatch.setattr(_reads, "read_records_direct", lambda *a: (sizes.append(a[4]), orig(*a))[1])
    L = Loader(
        path, 7, OrderSpec("permutation", seed=4), tuning=LoaderTuning(mem_bytes=20 * rec, threads=3, method="pread")
    )
    assert L.describe()["direct_reads"]
    _epochs_exact(L, ref)
    assert set(L._res.files) >= {"image", "label"}  # both read with preadv
    L.close()
    can = _direct.open_direct(ref.slot_view.backend.field_segments("image")[0].path)
    if can is None:  # no O_DIRECT on this file system
        assert sizes == []
        return
    os.close(can)
    assert sizes and min(sizes) >= _reads.PREAD_MIN_BYTES, sorted(set(sizes))
    # a store of small fields only: describe() promises no O_DIRECT
    schema = {"image": ("|u1", (4, 4, 1)), "label": ("<i8", ()), "idx": ("<i8", ())}
    small = build_store(str(tmp_path / "small"), 300, schema=schema)
    L = Loader(small, 7, "permutation", tuning=LoaderTuning(mem_bytes=20 * 32, threads=2, method="pread"))
    assert not L.describe()["fits"] and not L.describe()["direct_reads"]
    _epochs_exact(L, mmstore.open(small), (0,))
    L.close()
