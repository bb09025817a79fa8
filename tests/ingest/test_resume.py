"""Determinism, crashes, resume, disk full, fingerprints, locks, shards and merge."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import time

import pytest
from support.compare import assert_reads_same

import mmstore
from mmstore.errors import IngestError, LockedError, ResumeMismatchError
from mmstore.ingest import ingest, merge
from mmstore.store.writer import acquire_lock

cv2 = pytest.importorskip("cv2")


@pytest.fixture
def mixed(tmp_path, h):
    """A folder with good images in two classes and a few bad files."""
    root = str(tmp_path / "mixed")
    h.make_folder(root, per_class=12, seed=7)
    with open(os.path.join(root, "cat", "bad.jpg"), "wb") as fh:
        fh.write(b"<html>")
    with open(os.path.join(root, "dog", "zero.png"), "wb"):
        pass
    return root


def _run_ok(h, *argv):
    assert h.cli(*argv) == 0


def test_byte_identical_for_any_worker_count_and_chunk(tmp_path, h, mixed):
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", mixed, ref, "--size", "16x16", "--workers", "0", "-q")
    for i, extra in enumerate([["--workers", "1"], ["--workers", "2"], ["--workers", "2", "--chunk", "1"],
                               ["--workers", "2", "--chunk", "5"]]):
        d = str(tmp_path / f"s{i}")
        _run_ok(h, "ingest", mixed, d, "--size", "16x16", "-q", *extra)
        h.assert_same_store(ref, d)
    assert mmstore.open(ref).slots - len(mmstore.open(ref)) == 2


def test_lmdb_backend_byte_identical(tmp_path, h, mixed):
    pytest.importorskip("lmdb")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _run_ok(h, "ingest", mixed, a, "--size", "8x8", "--workers", "0", "-q", "--backend", "lmdb")
    _run_ok(h, "ingest", mixed, b, "--size", "8x8", "--workers", "2", "-q", "--backend", "lmdb", "--chunk", "2")
    h.assert_same_store(a, b)
    s = mmstore.open(b)
    assert s.backend_name == "lmdb" and len(s) == s.slots - 2


def _no_writers_left(dest: str) -> bool:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        if dest.encode() in cmd and b"mmstore" in cmd:
            return False
    return True


@pytest.mark.slow  # a whole job of several processes: CI's step for slow tests
def test_sigkill_then_resume_is_byte_identical(tmp_path, h):
    root = str(tmp_path / "k")
    h.make_folder(root, per_class=40, seed=8)
    ref = str(tmp_path / "ref")
    t0 = time.monotonic()
    p = h.cli_subprocess("ingest", root, ref, "--size", "32x32", "--workers", "2", "--chunk", "2", "-q")
    assert p.wait(120) == 0
    full = time.monotonic() - t0
    rnd = random.Random(1234)
    killed_mid = 0
    for trial in range(5):
        dest = str(tmp_path / f"t{trial}")
        p = h.cli_subprocess("ingest", root, dest, "--size", "32x32", "--workers", "2", "--chunk", "2", "-q")
        # kill at a random moment of the writing phase: start-up time varies
        # with the machine's load, so wait for the .partial first
        deadline = time.monotonic() + 60
        while not os.path.isdir(dest + ".partial") and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(rnd.uniform(0.0, full * 0.5))
        p.send_signal(signal.SIGKILL)
        p.wait(60)
        deadline = time.monotonic() + 5
        while not _no_writers_left(dest) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _no_writers_left(dest), "worker processes survived the parent"
        if os.path.isdir(dest + ".partial"):
            killed_mid += 1
        # resume, possibly with other worker count / chunk size; then finish
        q = h.cli_subprocess("ingest", root, dest, "--size", "32x32", "--workers", str(1 + trial % 2), "-q",
                             "--resume")
        assert q.wait(120) == 0
        h.assert_same_store(ref, dest)
    assert killed_mid >= 1


def _crash_run(h, root, dest, at, workers="0"):
    p = h.cli_subprocess("ingest", root, dest, "--size", "8x8", "--workers", workers, "--chunk", "3", "-q",
                         "--resume", env={"MMSTORE_CRASH_AT": at}, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    return p.returncode, err.decode()


@pytest.mark.parametrize("phase", ["commit", "any"])
def test_crash_points_then_resume(tmp_path, h, phase):
    root = str(tmp_path / "c")
    h.make_folder(root, per_class=5, seed=9)
    with open(os.path.join(root, "cat", "bad.jpg"), "wb") as fh:
        fh.write(b"junk")
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", root, ref, "--size", "8x8", "--workers", "0", "-q")
    # walk crash points 1, 2, ... (sampled for "any") until the run no longer crashes
    ks = range(1, 200) if phase == "commit" else [1, 9, 30, 75, 160, 330, 600]
    crashed = 0
    for k in ks:
        dest = str(tmp_path / f"{phase}{k}")
        rc, err = _crash_run(h, root, dest, f"{phase}:{k}")
        if rc == 0:
            break
        assert rc == 77, err
        crashed += 1
        p = h.cli_subprocess("ingest", root, dest, "--size", "8x8", "--workers", "2", "-q", "--resume")
        assert p.wait(120) == 0
        h.assert_same_store(ref, dest)
    assert crashed >= 3


def test_crash_in_worker_write_then_resume(tmp_path, h):
    root = str(tmp_path / "w")
    h.make_folder(root, per_class=6, seed=10)
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", root, ref, "--size", "8x8", "--workers", "0", "-q")
    dest = str(tmp_path / "d")
    rc, err = _crash_run(h, root, dest, "write:5", workers="2")
    assert rc == 77, err
    _run_ok(h, "ingest", root, dest, "--size", "8x8", "--resume", "-q")
    h.assert_same_store(ref, dest)


def _fsize_limit(limit):
    def f():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return f


@pytest.mark.parametrize("where", ["setup", "mid-run"])
def test_disk_full_then_resume(tmp_path, h, where):
    root = str(tmp_path / "df")
    h.make_folder(root, per_class=20, seed=11)
    ref = str(tmp_path / "ref")
    size = "4x4"  # image.npy = 128 + 40 * 48 = 2048 bytes
    _run_ok(h, "ingest", root, ref, "--size", size, "--workers", "0", "-q")
    dest = str(tmp_path / "d")
    limit = 1000 if where == "setup" else 2100  # mid-run: the commit log outgrows the limit
    p = h.cli_subprocess("ingest", root, dest, "--size", size, "--workers", "2", "--chunk", "1", "-q",
                         preexec_fn=_fsize_limit(limit), stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 1, err
    assert "File too large" in err and "Traceback" not in err
    if where == "setup":  # refused before anything is reserved: nothing is left
        assert "nothing was reserved" in err and not os.path.exists(dest + ".partial")
    else:
        assert "--resume" in err and os.path.isdir(dest + ".partial")
    assert not os.path.exists(dest) and not os.path.exists(dest + ".lock")
    _run_ok(h, "ingest", root, dest, "--size", size, "--workers", "2", "-q", "--resume")
    h.assert_same_store(ref, dest)


def test_resume_refuses_other_inputs_or_parameters(tmp_path, h, capsys):
    root = str(tmp_path / "fp")
    h.make_folder(root, per_class=4, seed=12)
    with open(os.path.join(root, "cat", "bad.jpg"), "wb") as fh:
        fh.write(b"junk")
    dest = str(tmp_path / "d")
    assert h.cli("ingest", root, dest, "--size", "8x8", "--on-error", "fail", "-q", "--chunk", "1",
                 "--workers", "1") == 1
    assert os.path.isdir(dest + ".partial")
    capsys.readouterr()
    # without --resume: a clear message
    # a partial ingest there: the user chooses (--resume or --overwrite)
    assert h.cli("ingest", root, dest, "--size", "8x8", "-q") == 2
    assert "--resume" in capsys.readouterr().err
    # other parameters
    assert h.cli("ingest", root, dest, "--size", "8x9", "-q", "--resume") == 2
    err = capsys.readouterr().err
    assert "cannot resume" in err and "size was 8x8, now 8x9" in err
    with pytest.raises(ResumeMismatchError):
        ingest(root, dest, (8, 8), resize="stretch", resume=True, quiet=True)
    # other inputs: a file changed
    good = os.path.join(root, "dog", "img000.jpg")
    st = os.stat(good)
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert h.cli("ingest", root, dest, "--size", "8x8", "-q", "--resume") == 2
    assert "input files changed" in capsys.readouterr().err
    os.utime(good, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert h.cli("ingest", root, dest, "--size", "8x8", "-q", "--resume") == 0
    assert mmstore.open(dest).slots == 9
    # rerunning a finished ingest with --resume is a no-op
    assert h.cli("ingest", root, dest, "--size", "8x8", "--resume") == 0
    assert "already complete" in capsys.readouterr().err


def test_concurrent_ingest_refused(tmp_path, h, capsys):
    root = str(tmp_path / "cc")
    h.make_folder(root, per_class=2, seed=13)
    dest = str(tmp_path / "d")
    fd = acquire_lock(dest)
    try:
        assert h.cli("ingest", root, dest, "--size", "8x8", "-q") == 1
        assert "another process is writing" in capsys.readouterr().err
        with pytest.raises(LockedError):
            ingest(root, dest, 8, quiet=True)
    finally:
        os.close(fd)
    assert not os.path.exists(dest)
    _run_ok(h, "ingest", root, dest, "--size", "8x8", "-q")


def test_crash_during_publish_resume_publishes(tmp_path, h):
    root = str(tmp_path / "pb")
    h.make_folder(root, per_class=2, seed=14)
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", root, ref, "--size", "8x8", "-q", "--workers", "0")
    # count the rename crash points of a run; the last one is publish's rename
    n = 0
    while True:
        n += 1
        d = str(tmp_path / f"r{n}")
        rc, err = _crash_run(h, root, d, f"rename:{n}")
        if rc == 0:
            break
    last = str(tmp_path / f"r{n - 1}")
    assert os.path.isfile(os.path.join(last + ".partial", "manifest.json"))
    _run_ok(h, "ingest", root, last, "--size", "8x8", "-q", "--resume")
    h.assert_same_store(ref, last)


def test_shard_and_merge_identical_to_single_run(tmp_path, h, mixed, capsys):
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", mixed, ref, "--size", "16x16", "-q", "--workers", "2")
    parts = []
    for k in range(3):
        d = str(tmp_path / f"part{k}")
        _run_ok(h, "ingest", mixed, d, "--size", "16x16", "-q", "--shard", f"{k}/3", "--workers", "1")
        parts.append(d)
    total = sum(mmstore.open(p).slots for p in parts)
    assert total == mmstore.open(ref).slots
    out = str(tmp_path / "merged")
    assert h.cli("merge", parts[2], parts[0], parts[1], out) == 0  # any order
    assert "no record data copied" in capsys.readouterr().err
    assert_reads_same(ref, out)
    s = mmstore.open(out)
    assert s.segments == [mmstore.open(p).slots for p in parts]
    for k, p in enumerate(parts):  # the parts' files, not copies
        assert os.stat(os.path.join(out, f"image.{k:05d}.npy")).st_ino == os.stat(os.path.join(p, "image.npy")).st_ino
    assert s.label_names == mmstore.open(ref).label_names
    assert s.provenance["ingest"]["fingerprint"] == mmstore.open(ref).provenance["ingest"]["fingerprint"]
    # missing part / parts of another ingest
    assert h.cli("merge", parts[0], parts[1], str(tmp_path / "m2")) == 2
    assert "missing shard" in capsys.readouterr().err
    other = str(tmp_path / "other")
    _run_ok(h, "ingest", mixed, other, "--size", "8x8", "-q", "--shard", "2/3")
    with pytest.raises(IngestError, match="different ingests"):
        merge([parts[0], parts[1], other], str(tmp_path / "m3"))


def test_interrupt_prints_resume_command(tmp_path, h):
    root = str(tmp_path / "ki")
    h.make_folder(root, per_class=60, seed=15)
    dest = str(tmp_path / "d")
    p = h.cli_subprocess("ingest", root, dest, "--size", "32x32", "--workers", "2", "--chunk", "1",
                         stderr=subprocess.PIPE)
    # wait until the partial exists and has committed something, then Ctrl-C (SIGINT to the group)
    deadline = time.monotonic() + 60
    log = os.path.join(dest + ".partial", "_ingest_commits.log")
    while time.monotonic() < deadline and not (os.path.exists(log) and os.path.getsize(log) > 0):
        if p.poll() is not None:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    err = err.decode()
    if p.returncode == 0:
        pytest.skip("the run finished before the interrupt")
    assert p.returncode == 130, err
    assert "--resume" in err and "mmstore ingest" in err and "Traceback" not in err
    _run_ok(h, "ingest", root, dest, "--size", "32x32", "--workers", "2", "-q", "--resume")
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", root, ref, "--size", "32x32", "-q")
    h.assert_same_store(ref, dest)


def test_a_crash_point_in_a_worker_crashes_the_whole_run(tmp_path, h):
    """A worker that dies at a crash point takes the parent down with it (as a
    power cut would), instead of the parent retrying the range as a decoder
    crash; the run then resumes to the reference bytes."""
    root = str(tmp_path / "w")
    h.make_folder(root, per_class=12, seed=21)
    ref = str(tmp_path / "ref")
    _run_ok(h, "ingest", root, ref, "--size", "8x8", "--workers", "0", "-q")
    dest = str(tmp_path / "d")
    # a worker writes one call per small file a range (the counts go on from the parent's at the fork);
    # the parent writes far fewer (headers, state, one commit line per chunk of 3), so a worker gets here first
    rc, err = _crash_run(h, root, dest, "write:30", workers="2")
    assert rc == 77, err
    assert os.path.isdir(dest + ".partial") and not os.path.exists(dest)
    with open(os.path.join(dest + ".partial", "_ingest_commits.log"), "rb") as fh:
        assert b"decoding crashed" not in fh.read()
    p = h.cli_subprocess("ingest", root, dest, "--size", "8x8", "--workers", "2", "-q", "--resume")
    assert p.wait(120) == 0
    h.assert_same_store(ref, dest)
