"""Space reservation: an ingest that cannot fit is refused before it reserves
anything, saying how much it needs and how much is free, and a reservation
that fails half way gives back every block it took (ext4 keeps them)."""

from __future__ import annotations

import errno
import os

import pytest
from support.faults import ingest_argv, mount_ext4, mount_tmpfs, umount
from support.proc import run_sub
from support.stores import SMALL_SCHEMA, sample

import mmstore
from mmstore._os import io as _io
from mmstore.store import writer as writer_mod


def _free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bfree * st.f_frsize


@pytest.fixture
def ext4(tmp_path):
    mnt = str(tmp_path / "e4")
    if not mount_ext4(str(tmp_path / "e4.img"), mnt, 8 << 20):
        pytest.skip("loop-mounting an ext4 image is not permitted here")
    yield mnt
    umount(mnt)


def test_ingest_that_cannot_fit_is_refused_before_reserving(src, tmp_path):
    mnt = str(tmp_path / "mnt")
    if not mount_tmpfs(mnt, "64k"):
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        free = _free(mnt)
        dest = os.path.join(mnt, "s")
        r = run_sub(ingest_argv(src, dest, "--size", "64x64"), timeout=300)
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr
        assert "needs" in r.stderr and "are free on the file system" in r.stderr and "Errno 28" in r.stderr
        assert os.listdir(mnt) == []  # no .partial holding the space, no lock file
        assert _free(mnt) == free
    finally:
        umount(mnt)


def test_failed_reservation_gives_back_what_it_took(ext4):
    free = _free(ext4)
    path = os.path.join(ext4, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"header")
        with pytest.raises(OSError) as ei:
            _io.fallocate(fd, 6, 64 << 20, path)
        assert ei.value.errno == errno.ENOSPC and "cannot reserve" in str(ei.value)
        assert os.fstat(fd).st_size == 6
        assert os.pread(fd, 6, 0) == b"header"
    finally:
        os.close(fd)
    os.unlink(path)
    assert _free(ext4) == free


def test_writer_whose_reservation_fails_leaves_nothing(ext4, monkeypatch):
    """The free-space check passed (the space went to someone else in between):
    the half-made reservation is given back and no .partial keeps it."""
    free = _free(ext4)
    monkeypatch.setattr(writer_mod, "check_space", lambda *a: None)
    dest = os.path.join(ext4, "s")
    with pytest.raises(OSError) as ei:
        mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=100_000)
    assert ei.value.errno == errno.ENOSPC
    assert sorted(os.listdir(ext4)) == ["lost+found"]
    assert _free(ext4) == free


def test_writer_growth_is_checked_before_reserving(ext4):
    free = _free(ext4)
    dest = os.path.join(ext4, "s")
    w = mmstore.StoreWriter(dest, SMALL_SCHEMA)
    w.append(sample(0))
    with pytest.raises(mmstore.errors.ResourceLimitError, match="needs .* free"):
        w.write(10_000_000, sample(1))
    w.abort()
    assert _free(ext4) > free - (1 << 20)  # only the first small reservation is held by the .partial
