"""Tests for mmstore._os: page cache residency, eviction, warm, hints,
positional record reads, memory and disk facts.

Residency tests need a filesystem whose pages can be evicted (not tmpfs); the
``disk_dir`` fixture finds one (pytest's tmp dir, /var/tmp, or .pytest_tmp in
the repo) by trying an evict, and skips those tests if none works.
"""

from __future__ import annotations

import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmstore._os as msys
from mmstore._os import cache, files, memory, pread, proc
from mmstore.errors import MmstoreError, StoreChangedError

LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not LINUX, reason="Linux page-cache behaviour")
KiB, MiB = 1 << 10, 1 << 20
PS = msys.PAGE_SIZE


# --------------------------------------------------------------------------
# helpers / fixtures
# --------------------------------------------------------------------------

def write_file(path: Path, data: bytes) -> Path:
    """Write, fsync (so the pages are clean and evictable) and return path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_all(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(4 * MiB):
            pass


def _evict_works(d: Path) -> bool:
    p = write_file(d / "probe.bin", os.urandom(256 * KiB))
    try:
        read_all(p)
        msys.evict(p)
        return msys.resident_bytes(p)[0] == 0
    except (OSError, NotImplementedError):
        return False
    finally:
        p.unlink()


@pytest.fixture(scope="session")
def _evictable_root(tmp_path_factory):
    if not LINUX:
        pytest.skip("page-cache eviction tests need Linux")
    made: list[str] = []
    found = None
    repo = Path(__file__).resolve().parents[2]
    candidates = [lambda: tmp_path_factory.mktemp("sys_evict")]
    for base in ("/var/tmp", str(repo / ".pytest_tmp")):
        def mk(base=base):
            os.makedirs(base, exist_ok=True)
            d = tempfile.mkdtemp(prefix="mmstore_sys_", dir=base)
            made.append(d)
            return Path(d)
        candidates.append(mk)
    for make in candidates:
        try:
            d = make()
        except OSError:
            continue
        if _evict_works(d):
            found = d
            break
    try:
        if found is None:
            pytest.skip("no filesystem here lets pages be evicted (tmpfs "
                        "everywhere?); residency tests need a real disk")
        yield found
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def disk_dir(_evictable_root, request):
    d = _evictable_root / request.node.name.replace("[", "_").replace("]", "_")
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------
# module surface
# --------------------------------------------------------------------------

def test_all_is_sorted_and_defined():
    assert msys.__all__ == sorted(msys.__all__)
    for name in msys.__all__:
        assert hasattr(msys, name), name


def test_import_does_not_load_thread_pool_machinery():
    import subprocess

    code = (
        "import sys, mmstore._os\n"
        "bad = [k for k in sys.modules if k.split('.')[0] in "
        "('torch', 'lmdb', 'cv2', 'PIL') or k == 'concurrent.futures']\n"
        "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------
# resident_bytes / evict
# --------------------------------------------------------------------------

@linux_only
def test_resident_bytes_zero_length(tmp_path):
    p = tmp_path / "empty"
    p.write_bytes(b"")
    assert msys.resident_bytes(p) == (0, 0)


def test_resident_bytes_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        msys.resident_bytes(tmp_path / "nope")


def test_resident_after_read_and_evict(disk_dir):
    size = 3 * MiB + 1234  # partial last page: resident never exceeds size
    p = write_file(disk_dir / "a.bin", os.urandom(size))
    msys.evict(p)
    assert msys.resident_bytes(p) == (0, size)
    read_all(p)
    assert msys.resident_bytes(p) == (size, size)
    msys.evict(p)
    assert msys.resident_bytes(p) == (0, size)


def test_evict_sync_drops_dirty_pages(disk_dir):
    p = disk_dir / "dirty.bin"
    with open(p, "wb") as f:  # no fsync: pages are dirty
        f.write(os.urandom(2 * MiB))
    assert msys.resident_bytes(p)[0] > 0
    msys.evict(p, sync=True)
    assert msys.resident_bytes(p)[0] == 0


def test_resident_partial_and_windowed(disk_dir, monkeypatch):
    size = 64 * PS + 100
    p = write_file(disk_dir / "part.bin", os.urandom(size))
    msys.evict(p)
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead
        for page in (3, 4, 10, 64):  # 64 = the partial last page
            os.pread(fd, 1, page * PS)
    finally:
        os.close(fd)
    res, sz = msys.resident_bytes(p)
    assert sz == size
    # large-folio kernels may pull in a little more around each page
    assert 3 * PS + 100 <= res <= size
    # the same figure when mincore sees the file 3 pages at a time
    monkeypatch.setattr(cache, "_MINCORE_WINDOW", 3 * PS)
    assert msys.resident_bytes(p) == (res, size)
    # a sub-range count: bytes of page 3 and 4 that lie in the range
    fd = os.open(p, os.O_RDONLY)
    try:
        got = msys.resident_fd(fd, size, 3 * PS + 10, 2 * PS - 20)
    finally:
        os.close(fd)
    assert got == 2 * PS - 20


def test_evict_range_drops_only_around_the_range(disk_dir):
    size = 4 * MiB
    p = write_file(disk_dir / "range.bin", os.urandom(size))
    read_all(p)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert msys.resident_fd(fd, size) == size
        assert msys.evict_range(fd, 5000, 3000, size) is True
        assert msys.resident_fd(fd, size, 5000, 3000) == 0
        # widened at most to the 2 MiB folio bounds: the second half stays
        assert msys.resident_fd(fd, size, 2 * MiB, 2 * MiB) == 2 * MiB
        # without a size nothing is checked, and the call says True
        assert msys.evict_range(fd, 3 * MiB, 100) is True
    finally:
        os.close(fd)


@linux_only
def test_evict_range_reports_pages_that_stay(tmp_path):
    """tmpfs pages are the file's storage: they stay, and evict_range says so."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or msys.disk_info(shm)["fs_type"] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    fd_, name = tempfile.mkstemp(dir=shm, prefix="mmstore_evict_")
    os.close(fd_)
    try:
        p = write_file(Path(name), os.urandom(256 * KiB))
        fd = os.open(p, os.O_RDONLY)
        try:
            assert msys.evict_range(fd, 0, 64 * KiB, 256 * KiB) is False
            assert msys.resident_fd(fd, 256 * KiB, 0, 64 * KiB) == 64 * KiB
        finally:
            os.close(fd)
    finally:
        os.unlink(name)


# --------------------------------------------------------------------------
# warm
# --------------------------------------------------------------------------

def test_warm_reads_exact_sizes_and_makes_resident(disk_dir):
    sizes = [5 * MiB + 17, 0, 1 * MiB]
    paths = [write_file(disk_dir / f"f{i}.bin", os.urandom(s))
             for i, s in enumerate(sizes)]
    for p in paths:
        msys.evict(p)
    calls = []
    rep = msys.warm(paths + [paths[0]], chunk_bytes=1 * MiB,
                    progress=lambda d, t: calls.append((d, t)))
    assert rep.complete and rep.reason is None
    assert rep.bytes_total == rep.bytes_planned == rep.bytes_read == sum(sizes)
    assert rep.paths == tuple(str(p) for p in paths)  # duplicate read once
    assert rep.resident_before == 0
    assert rep.seconds > 0 and rep.mb_per_s > 0
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    assert calls[-1] == (sum(sizes), sum(sizes))
    assert len(calls) == 6 + 1  # 6 chunks of file 0, 1 of file 2
    for p, s in zip(paths, sizes):
        assert msys.resident_bytes(p) == (s, s)


def test_warm_accepts_a_single_path(tmp_path):
    p = write_file(tmp_path / "one.bin", os.urandom(100_000))
    rep = msys.warm(str(p))
    assert rep.bytes_read == 100_000 and rep.complete


def test_warm_missing_file_raises_before_reading(tmp_path):
    p = write_file(tmp_path / "ok.bin", b"x" * 1000)
    seen = []
    with pytest.raises(FileNotFoundError):
        msys.warm([p, tmp_path / "missing.bin"],
                  progress=lambda d, t: seen.append(d))
    assert seen == []


def test_warm_stops_where_the_budget_runs_out(disk_dir, monkeypatch):
    a = write_file(disk_dir / "a.bin", os.urandom(8 * MiB))  # larger than a read of 512 KiB plus a 2 MiB folio
    b = write_file(disk_dir / "b.bin", os.urandom(2 * MiB))
    msys.evict(a)
    msys.evict(b)
    monkeypatch.setattr(memory, "mem_available", lambda: 1 * MiB)
    monkeypatch.setattr(memory, "cgroup_levels", lambda *a, **k: [])
    rep = msys.warm([a, b], chunk_bytes=256 * KiB, max_fraction=0.5)
    assert not rep.complete
    assert rep.available == 1 * MiB
    assert rep.bytes_planned == rep.bytes_read == 512 * KiB
    assert "512.00 KiB may be used" in rep.reason
    assert "not yet resident" in rep.reason
    # only readahead overshoot past the stop point (a kernel with large folios reads
    # whole folios of up to 2 MiB), never file b
    assert msys.resident_bytes(b)[0] == 0
    assert msys.resident_bytes(a)[0] <= 512 * KiB + 2 * MiB + 2 * MiB


def test_warm_counts_resident_pages_against_the_budget(disk_dir, monkeypatch):
    a = write_file(disk_dir / "a.bin", os.urandom(1 * MiB))
    b = write_file(disk_dir / "b.bin", os.urandom(2 * MiB))
    read_all(a)
    msys.evict(b)
    # room for all of a (already cached) plus 256 KiB of new pages
    monkeypatch.setattr(memory, "effective_available", lambda: 1 * MiB + 256 * KiB)
    rep = msys.warm([a, b], max_fraction=1.0)
    assert rep.resident_before == 1 * MiB
    assert not rep.complete
    assert rep.bytes_read == rep.bytes_planned == 1 * MiB + 256 * KiB


def test_warm_without_residency_plans_linearly(tmp_path, monkeypatch):
    a = write_file(tmp_path / "a.bin", os.urandom(300 * KiB))

    def no_mincore(*args, **kw):
        raise NotImplementedError("no mincore")

    monkeypatch.setattr(cache, "resident_fd", no_mincore)
    monkeypatch.setattr(memory, "effective_available", lambda: 100 * KiB + 5)
    rep = msys.warm(a, max_fraction=1.0)
    assert rep.resident_before == 0 and not rep.complete
    assert rep.bytes_read == 100 * KiB - (100 * KiB) % PS


def test_warm_fit_check_can_be_disabled_or_pass(tmp_path, monkeypatch):
    a = write_file(tmp_path / "a.bin", os.urandom(300 * KiB))
    monkeypatch.setattr(memory, "effective_available", lambda: 1)
    rep = msys.warm(a, max_fraction=None)
    assert rep.complete and rep.bytes_read == 300 * KiB and rep.available is None
    monkeypatch.setattr(memory, "effective_available", lambda: None)
    rep = msys.warm(a)  # no memory figure: no check
    assert rep.complete and rep.bytes_read == 300 * KiB
    with pytest.raises(ValueError):
        msys.warm(a, max_fraction=1.5)


def test_warm_stop_event_and_progress_errors(tmp_path):
    a = write_file(tmp_path / "a.bin", os.urandom(300 * KiB))
    ev = threading.Event()
    ev.set()
    rep = msys.warm(a, stop_event=ev)
    assert rep.bytes_read == 0 and not rep.complete and "stopped" in rep.reason

    def boom(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        msys.warm(a, chunk_bytes=64 * KiB, progress=boom)


def test_warm_in_background(tmp_path):
    paths = [write_file(tmp_path / f"{i}.bin", os.urandom(400 * KiB))
             for i in range(3)]
    h = msys.warm_in_background(iter(paths), chunk_bytes=64 * KiB)
    rep = h.join(timeout=30)
    assert h.done and rep is h.report and rep.complete
    assert rep.bytes_read == 3 * 400 * KiB

    started = threading.Event()

    def slow(done, total):
        started.set()
        time.sleep(0.01)

    h = msys.warm_in_background(paths, chunk_bytes=4 * KiB, progress=slow)
    assert started.wait(10)
    h.stop()
    rep = h.join(timeout=30)
    assert not rep.complete and "stopped" in rep.reason
    assert 0 < rep.bytes_read < 3 * 400 * KiB

    h = msys.warm_in_background([tmp_path / "missing"])
    with pytest.raises(FileNotFoundError):
        h.join(timeout=30)
    assert isinstance(h.error, FileNotFoundError)


# --------------------------------------------------------------------------
# memory figures
# --------------------------------------------------------------------------

@pytest.mark.skipif(not LINUX, reason="reads /proc/meminfo")
def test_memory_figures_agree_with_proc_meminfo():
    avail = msys.mem_available()
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    lim, eff = msys.memory_limit(), msys.effective_available()
    assert lim is None or (isinstance(lim, int) and lim > 0)
    assert isinstance(avail, int) and 0 < avail <= info["MemTotal"]
    assert abs(avail - info["MemAvailable"]) <= info["MemTotal"] // 20  # read moments apart
    # read moments apart from avail: the free memory may have grown in between
    assert isinstance(eff, int) and 0 <= eff <= avail + info["MemTotal"] // 20 and (lim is None or eff <= lim)


def test_effective_available_takes_the_tightest(monkeypatch):
    monkeypatch.setattr(memory, "mem_available", lambda: 10 * MiB)
    monkeypatch.setattr(memory, "cgroup_levels", lambda *a, **k: [
        (8 * MiB, 5 * MiB, 1 * MiB),   # room 4 MiB
        (100 * MiB, 1 * MiB, 0)])
    assert msys.effective_available() == 4 * MiB
    assert msys.memory_limit() == 8 * MiB
    monkeypatch.setattr(memory, "cgroup_levels", lambda *a, **k: [
        (1 * MiB, 3 * MiB, 0)])      # over the limit: no room, not negative
    assert msys.effective_available() == 0
    monkeypatch.setattr(memory, "mem_available", lambda: None)
    monkeypatch.setattr(memory, "cgroup_levels", lambda *a, **k: [])
    assert msys.effective_available() is None
    assert msys.memory_limit() is None


def _fake_cgroup(tmp_path, version):
    root = tmp_path / f"cg{version}"
    if version == 2:
        leaf = root / "kubepods" / "pod1"
        leaf.mkdir(parents=True)
        (root / "kubepods" / "memory.max").write_text("1073741824\n")
        (root / "kubepods" / "memory.current").write_text("104857600\n")
        (root / "kubepods" / "memory.stat").write_text(
            "anon 1\ninactive_file 4857600\nactive_file 7\n")
        (leaf / "memory.max").write_text("max\n")
        (leaf / "memory.current").write_text("5\n")
        mountinfo = (f"41 31 0:38 / {root} rw,relatime - cgroup2 cgroup2 rw\n")
        cgroup = "0::/kubepods/pod1\n"
    else:
        leaf = root / "docker" / "abc"
        leaf.mkdir(parents=True)
        (leaf / "memory.limit_in_bytes").write_text("2147483648\n")
        (leaf / "memory.usage_in_bytes").write_text("1000\n")
        (leaf / "memory.stat").write_text(
            "cache 5\ntotal_inactive_file 400\n"
            "hierarchical_memory_limit 536870912\n")
        (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        mountinfo = (f"35 31 0:32 / {root} rw,relatime - cgroup cgroup "
                     f"rw,memory\n"
                     f"36 31 0:33 / /x rw - cgroup cgroup rw,cpu\n")
        cgroup = "5:cpu:/\n4:memory:/docker/abc\n"
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return str(tmp_path / "cgroup"), str(tmp_path / "mountinfo")


def test_cgroup_v2_limit_of_an_ancestor(tmp_path):
    cg, mi = _fake_cgroup(tmp_path, 2)
    assert memory.cgroup_levels(cg, mi) == [(1 << 30, 104857600, 4857600)]


def test_cgroup_v1_limit_and_hierarchical_limit(tmp_path):
    cg, mi = _fake_cgroup(tmp_path, 1)
    levels = memory.cgroup_levels(cg, mi)
    assert min(lim for lim, _, _ in levels) == 512 * MiB
    assert (2 << 30, 1000, 400) in levels


def test_cgroup_path_outside_namespace_uses_mount(tmp_path):
    cg, mi = _fake_cgroup(tmp_path, 2)
    Path(cg).write_text("0::/elsewhere/not/visible\n")
    (tmp_path / "cg2" / "memory.max").write_text("4096\n")
    assert memory.cgroup_levels(cg, mi) == [(4096, None, 0)]


def test_cgroup_missing_files(tmp_path):
    assert memory.cgroup_levels(str(tmp_path / "no"), str(tmp_path / "no")) == []


# --------------------------------------------------------------------------
# hints
# --------------------------------------------------------------------------

def test_fadvise_helpers(tmp_path):
    p = write_file(tmp_path / "h.bin", os.urandom(64 * KiB))
    with open(p, "rb") as f:
        expect = files.HAS_FADVISE
        assert msys.fadvise_random(f) is expect
        assert msys.fadvise_sequential(f.fileno()) is expect
        assert msys.advise(f, 0, 4096, "willneed") is expect
        assert msys.advise(f, 0, None, "normal") is expect
        with pytest.raises(ValueError, match="unknown advice"):
            msys.advise(f, 0, 0, "sometimes")
    with pytest.raises(TypeError):
        msys.fadvise_random("not a file")


def test_advise_takes_open_files_only(tmp_path):
    """Hints go to file descriptors (``posix_fadvise``): a mapping, a numpy
    memmap or bytes is refused with a TypeError naming what it got, and
    the file a mapping was made from can still be advised."""
    p = tmp_path / "arr.npy"
    np.save(p, np.arange(100_000, dtype=np.int64))
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        with pytest.raises(TypeError, match="mmap"):
            msys.advise(mm, 0, 0, "random")
        assert msys.advise(f, 5000, 10_000, "willneed") is files.HAS_FADVISE
    arr = np.load(p, mmap_mode="r")
    with pytest.raises(TypeError, match="memmap"):
        msys.fadvise_random(arr)
    with pytest.raises(TypeError, match="bytes"):
        msys.fadvise_sequential(b"bytes")
    del arr


# --------------------------------------------------------------------------
# pread_records
# --------------------------------------------------------------------------

DATA_SIZE = 64 * KiB + 333


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(1).integers(0, 256, DATA_SIZE, dtype=np.uint8)
    p = tmp_path_factory.mktemp("pread") / "data.bin"
    write_file(p, data.tobytes())
    fd = os.open(p, os.O_RDONLY)
    yield fd, data
    os.close(fd)


def reference(data, offsets, nbytes):
    if len(offsets) == 0:
        return np.empty((0, nbytes), np.uint8)
    return np.stack([data[o:o + nbytes] for o in offsets])


@st.composite
def record_offsets(draw):
    nbytes = draw(st.sampled_from([1, 3, 64, 1000, 4096, 5000]))
    hi = DATA_SIZE - nbytes
    offsets = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["one", "run", "dup", "back"]))
        start = draw(st.integers(0, hi))
        if kind == "run":  # adjacent records, adjacent rows: one preadv
            k = draw(st.integers(2, 6))
            offsets += [o for o in range(start, start + k * nbytes, nbytes)
                        if o <= hi]
        elif kind == "dup" and offsets:
            offsets.append(draw(st.sampled_from(offsets)))
        elif kind == "back":  # adjacent records in descending row order
            offsets += [o for o in (start + nbytes, start) if o <= hi]
        else:
            offsets.append(start)
    return nbytes, np.array(offsets, dtype=np.int64)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=record_offsets(), as_float=st.booleans(), flat=st.booleans())
def test_pread_records_matches_numpy(data_file, case, as_float, flat):
    fd, data = data_file
    nbytes, offsets = case
    n = len(offsets)
    if as_float and nbytes % 4 == 0:
        out = np.full((n, nbytes // 4), np.nan, dtype=np.float32)
    elif flat:
        out = np.zeros(n * nbytes, np.uint8)
    else:
        out = np.zeros((n, nbytes), np.uint8)
    msys.pread_records(fd, offsets, nbytes, out)
    got = out.reshape(-1).view(np.uint8).reshape(n, nbytes)
    np.testing.assert_array_equal(got, reference(data, offsets, nbytes))


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=record_offsets(), which=st.lists(st.integers(0, 2), min_size=12, max_size=12))
def test_pread_records_multi_matches_numpy(tmp_path_factory, data_file, case, which):
    """Each record from its own file: three files holding the data, its
    reverse and its complement; runs never cross from one file to another."""
    fd, data = data_file
    nbytes, offsets = case
    n = len(offsets)
    variants = [data, data[::-1].copy(), (255 - data).astype(np.uint8)]
    d = tmp_path_factory.mktemp("multi")
    fds = [fd]
    for k in (1, 2):
        write_file(d / f"v{k}.bin", variants[k].tobytes())
        fds.append(os.open(d / f"v{k}.bin", os.O_RDONLY))
    try:
        pick = np.array([which[j % len(which)] for j in range(n)], np.int64)
        out = np.zeros((n, nbytes), np.uint8)
        msys.pread_records_multi(np.array(fds)[pick] if n else [], offsets, nbytes, out)
        want = (np.stack([variants[k][o:o + nbytes] for k, o in zip(pick.tolist(), offsets.tolist())])
                if n else np.empty((0, nbytes), np.uint8))
        np.testing.assert_array_equal(out, want)
    finally:
        for f in fds[1:]:
            os.close(f)
    with pytest.raises(ValueError, match="file descriptors"):
        msys.pread_records_multi([fd], np.zeros(2, np.int64), 4, np.zeros((2, 4), np.uint8))


@pytest.fixture
def count_reads(monkeypatch):
    calls = []
    real = os.preadv

    def spy(fd, bufs, off, *a):
        calls.append((off, sum(len(b) for b in bufs)))
        return real(fd, bufs, off, *a)

    monkeypatch.setattr(os, "preadv", spy)
    return calls


@pytest.mark.skipif(not hasattr(os, "preadv"), reason="no os.preadv")
def test_pread_records_merges_adjacent_runs(data_file, count_reads):
    fd, data = data_file
    nb = 1000
    offs = np.array([0, nb, 2 * nb, 10 * nb, 11 * nb, 5 * nb, 4 * nb, 4 * nb])
    out = np.empty((len(offs), nb), np.uint8)
    msys.pread_records(fd, offs, nb, out)
    np.testing.assert_array_equal(out, reference(data, offs, nb))
    assert count_reads == [(0, 3 * nb), (10 * nb, 2 * nb), (5 * nb, nb),
                           (4 * nb, nb), (4 * nb, nb)]


def test_pread_records_retries_short_reads(data_file, monkeypatch):
    fd, data = data_file
    if hasattr(os, "preadv"):
        real = os.preadv
        monkeypatch.setattr(
            os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:7]], off))
    offs = np.array([5, 100, 107, 3000])
    out = np.empty((4, 100), np.uint8)
    msys.pread_records(fd, offs, 100, out)
    np.testing.assert_array_equal(out, reference(data, offs, 100))


def test_pread_records_without_preadv(data_file, monkeypatch):
    fd, data = data_file
    monkeypatch.setattr(pread, "_HAS_PREADV", False)
    offs = np.array([0, 50, 50, 9000])
    out = np.empty((4, 50), np.uint8)
    msys.pread_records(fd, offs, 50, out)
    np.testing.assert_array_equal(out, reference(data, offs, 50))


def test_pread_records_truncated_file_names_offset(tmp_path):
    p = write_file(tmp_path / "short.bin", bytes(1000))
    out = np.empty((2, 300), np.uint8)
    with open(p, "rb") as f:
        with pytest.raises(msys.TruncatedReadError) as ei:
            msys.pread_records(f, [0, 900], 300, out)
        e = ei.value
        assert isinstance(e, OSError) and isinstance(e, EOFError)
        assert isinstance(e, MmstoreError) and isinstance(e, StoreChangedError)  # typed: one except catches it
        assert (e.offset, e.expected, e.received, e.file_size) == (900, 300, 100, 1000)
        msg = str(e)
        assert "900" in msg and "300" in msg and "truncated or replaced" in msg
        if LINUX:
            assert e.filename == str(p)
        with pytest.raises(OSError, match="got only 0"):
            msys.pread_records(f, [5000], 300, out[:1])
        msys.pread_records(f, [400, 700], 300, out)  # ends exactly at EOF
        # a merged run crossing EOF names the record that came up short
        with pytest.raises(msys.TruncatedReadError) as ei:
            msys.pread_records(f, [500, 800], 300, out)
        assert (ei.value.offset, ei.value.expected, ei.value.received) == (
            800, 300, 200)


def test_pread_records_validates_arguments(data_file):
    fd, _ = data_file
    out = np.empty((4, 10), np.uint8)
    with pytest.raises(ValueError, match="C-contiguous"):
        msys.pread_records(fd, [0, 1], 10, np.empty((2, 20), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match="need 30"):
        msys.pread_records(fd, [0, 1, 2], 10, out)
    ro = np.empty((4, 10), np.uint8)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        msys.pread_records(fd, [0, 1, 2, 3], 10, ro)
    with pytest.raises(ValueError, match="rows"):
        msys.pread_records(fd, [0, 1, 2, 3], 10, np.empty((2, 20), np.uint8))
    with pytest.raises(TypeError):
        msys.pread_records(fd, [0.5, 1.0, 2, 3], 10, out)
    with pytest.raises(ValueError, match="negative"):
        msys.pread_records(fd, [0, -1, 2, 3], 10, out)
    with pytest.raises(ValueError, match="nbytes"):
        msys.pread_records(fd, [], 0, np.empty(0, np.uint8))
    msys.pread_records(fd, [], 10, np.empty((0, 10), np.uint8))  # no-op


def _pread_in_pieces(fd, offs, nb, out, pool, pieces):
    """pread_records from ``pool`` threads, each into its own rows of ``out``
    (as the loader's reader threads do); waits for all, returns the errors."""
    bounds = np.linspace(0, len(offs), pieces + 1).astype(int).tolist()
    futs = [pool.submit(msys.pread_records, fd, offs[a:b], nb, out[a:b])
            for a, b in zip(bounds[:-1], bounds[1:])]
    return [f.exception() for f in futs]


def test_pread_records_from_threads_equals_single(data_file):
    from concurrent.futures import ThreadPoolExecutor

    fd, data = data_file
    rng = np.random.default_rng(7)
    nb = 777
    offs = rng.integers(0, DATA_SIZE - nb, 2000)
    offs[100:110] = offs[100] + nb * np.arange(10) if offs[100] + 10 * nb < DATA_SIZE \
        else offs[100]
    single = np.empty((len(offs), nb), np.uint8)
    msys.pread_records(fd, offs, nb, single)
    np.testing.assert_array_equal(single, reference(data, offs, nb))
    with ThreadPoolExecutor(4) as pool:
        for pieces in (1, 3, 8, 2000):
            out = np.zeros_like(single)
            assert _pread_in_pieces(fd, offs, nb, out, pool, pieces) == [None] * pieces
            np.testing.assert_array_equal(out, single)


def test_pread_records_from_threads_past_eof(tmp_path):
    """Threads reading past end of file each get a TruncatedReadError naming
    their first short record; the others fill their rows exactly."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.random.default_rng(3).integers(0, 256, 10_000, dtype=np.uint8)
    p = write_file(tmp_path / "short.bin", data.tobytes())
    offs = np.arange(0, 12_000, 100)  # the last 20 records are past EOF
    out = np.zeros((len(offs), 100), np.uint8)
    with open(p, "rb") as f, ThreadPoolExecutor(3) as pool:
        errs = _pread_in_pieces(f.fileno(), offs, 100, out, pool, 6)  # 20 rows each
    assert errs[:5] == [None] * 5
    assert isinstance(errs[5], msys.TruncatedReadError) and errs[5].offset == 10_000
    np.testing.assert_array_equal(out[:100], data.reshape(100, 100))


# --------------------------------------------------------------------------
# disk_info
# --------------------------------------------------------------------------

KEYS = {"path", "mount_point", "fs_type", "source", "device", "rotational",
        "read_ahead_kb", "tmpfs", "network", "fuse", "free_bytes", "total_bytes"}


@pytest.mark.parametrize("arg", ["TMP", "TMP/missing/deeper", "", "/proc/self",
                                 "/dev/shm", None, 12345, b"/tmp", "\x00bad"])
def test_disk_info_never_raises(tmp_path, arg):
    if isinstance(arg, str) and arg.startswith("TMP"):
        arg = arg.replace("TMP", str(tmp_path))
    info = msys.disk_info(arg)
    assert set(info) == KEYS


@linux_only
def test_disk_info_describes_tmp_path(tmp_path):
    info = msys.disk_info(tmp_path / "not" / "yet")
    assert info["path"] == str(tmp_path.resolve())
    assert isinstance(info["fs_type"], str) and isinstance(info["free_bytes"], int)
    assert info["tmpfs"] in (True, False) and info["network"] in (True, False)
    assert info["rotational"] in (True, False, None)
    if Path("/dev/shm").is_dir() and "tmpfs" in Path("/proc/mounts").read_text():
        shm = msys.disk_info("/dev/shm")
        if shm["fs_type"] == "tmpfs":
            assert shm["tmpfs"] is True and shm["device"] is None


@linux_only
@pytest.mark.parametrize("fs, network, fuse, tmpfs", [
    ("nfs4", True, False, False), ("lustre", True, False, False),
    ("fuse.gcsfuse", True, True, False), ("tmpfs", False, False, True),
    ("ext4", False, False, False)])
def test_disk_info_classifies_filesystems(tmp_path, monkeypatch, fs, network,
                                          fuse, tmpfs):
    mounts = [{"majmin": "0:1", "root": "/", "mount_point": "/", "fs_type": "ext4",
               "source": "/dev/nonexistent", "super_options": "rw"},
              {"majmin": "0:99", "root": "/", "mount_point": str(tmp_path),
               "fs_type": fs, "source": "srv:/x", "super_options": "rw"}]
    monkeypatch.setattr(proc, "parse_mountinfo", lambda *a: mounts)
    info = msys.disk_info(tmp_path / "sub")
    assert info["mount_point"] == str(tmp_path)
    assert (info["fs_type"], info["network"], info["fuse"], info["tmpfs"]) == (
        fs, network, fuse, tmpfs)
    assert info["device"] is None


def test_parse_mountinfo_unescapes(tmp_path):
    mi = tmp_path / "mi"
    mi.write_text("36 35 98:0 /mnt1 /mnt/my\\040disk rw,noatime master:1 - "
                  "ext3 /dev/root rw,errors=continue\nbroken line\n")
    (m,) = proc.parse_mountinfo(str(mi))
    assert m["mount_point"] == "/mnt/my disk" and m["fs_type"] == "ext3"
    assert m["majmin"] == "98:0" and m["source"] == "/dev/root"


# --------------------------------------------------------------------------
# doctor micro-measurements
# --------------------------------------------------------------------------

def test_seq_read_speed_bounded(disk_dir):
    p = write_file(disk_dir / "s.bin", os.urandom(3 * MiB))
    read_all(p)
    r = msys.seq_read_speed(p, 2 * MiB, chunk_bytes=512 * KiB, cold=True)
    assert r.kind == "sequential" and r.bytes == 2 * MiB and r.ops == 4
    assert r.resident_before == 0 and r.mb_per_s > 0
    r = msys.seq_read_speed(p, 10 * MiB, offset=1 * MiB, cold=False)
    assert r.bytes == 2 * MiB and r.resident_before == 2 * MiB
    r = msys.seq_read_speed(p, 10 * MiB, chunk_bytes=4096, max_seconds=0)
    assert r.ops == 1 and r.bytes == 4096


def test_random_read_speed_cold_and_threads(disk_dir):
    nb = 150_528
    p = write_file(disk_dir / "r.bin", os.urandom(40 * nb + 5))
    read_all(p)
    r = msys.random_read_speed(p, nb, 16, cold=True)
    assert r.kind == "random" and r.ops == 16 and r.bytes == 16 * nb
    assert r.resident_before == 0 and r.mean_latency_ms > 0
    r = msys.random_read_speed(p, nb, 1000, cold=False, threads=3)
    assert r.ops == 40 and r.threads == 3 and r.ops_per_s > 0
    r = msys.random_read_speed(p, nb, 1000, max_seconds=0)
    assert r.ops == 1
    with pytest.raises(ValueError, match="holds no record"):
        msys.random_read_speed(p, 10**9)


@pytest.mark.parametrize("files, expect", [
    ({}, None),  # no cgroup files: the affinity mask
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs of quota: 2 cores busy
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no quota
    ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
])
def test_usable_cores_follows_affinity_and_cgroup_quota(tmp_path, monkeypatch, files, expect):
    assert 1 <= msys.usable_cores() <= (os.cpu_count() or 1)  # this machine, its own cgroup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert proc.usable_cores(str(tmp_path)) == (4 if expect is None else expect)
