"""Data loss: what a writer may replace or delete, and the destination lock.
Nothing a user wrote is lost or altered."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.proc import cli, cli_env
from support.stores import SMALL_SCHEMA, sample, write_store

import mmstore
from mmstore._os import lock as _lock_mod
from mmstore.errors import DestinationError, LockedError, StoreExistsError
from mmstore.store import writer as writer_mod
from mmstore.store.dest import check_dest, is_own_partial, is_store
from mmstore.store.writer import acquire_lock, publish, release_lock


def _user_folder(root) -> dict[str, bytes]:
    """A folder of someone's files; returns {relative path: bytes}."""
    files = {"notes/thesis.txt": b"chapter 1\n", "a.bin": bytes(range(256)), "deep/er/x.jpg": b"\xff\xd8\xff"}
    for rel, data in files.items():
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(data)
    return files


def _assert_intact(root, files) -> None:
    for rel, data in files.items():
        with open(os.path.join(root, rel), "rb") as fh:
            assert fh.read() == data, rel


# -- --overwrite only replaces a store --------------------------------------------


def test_writer_overwrite_refuses_a_directory_that_is_not_a_store(tmp_path):
    dest = tmp_path / "photos"
    files = _user_folder(dest)
    with pytest.raises(DestinationError, match="not an mmstore store"):
        mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1, overwrite=True)
    _assert_intact(dest, files)
    assert not os.path.exists(str(dest) + ".partial") and not os.path.exists(str(dest) + ".lock")
    # a regular file, a FIFO and a damaged manifest are not stores either
    (tmp_path / "f").write_bytes(b"keep me")
    os.mkfifo(tmp_path / "fifo")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text('{"format": "something else"}')
    for p in (tmp_path / "f", tmp_path / "fifo", bad):
        with pytest.raises(DestinationError):
            mmstore.StoreWriter(p, SMALL_SCHEMA, slots=1, overwrite=True)
    assert (tmp_path / "f").read_bytes() == b"keep me" and (bad / "manifest.json").exists()


def test_writer_overwrite_replaces_a_store(tmp_path):
    dest = write_store(tmp_path / "s", 3)
    old_id = mmstore.open(dest).store_id
    write_store(dest, 2, overwrite=True)
    s = mmstore.open(dest)
    assert s.records == 2 and s.store_id != old_id
    assert sorted(os.listdir(tmp_path)) == ["s"]  # nothing left aside: no .replaced-*, no .lock


def test_overwrite_refuses_symlinked_dest(tmp_path):
    target = write_store(tmp_path / "real", 3)
    before = {n: (tmp_path / "real" / n).read_bytes() for n in os.listdir(target)}
    os.symlink(target, tmp_path / "link")
    with pytest.raises(DestinationError, match="symbolic link"):
        mmstore.StoreWriter(tmp_path / "link", SMALL_SCHEMA, slots=1, overwrite=True)
    assert {n: (tmp_path / "real" / n).read_bytes() for n in os.listdir(target)} == before
    assert os.path.islink(tmp_path / "link")


def test_overwrite_deletes_nothing_through_a_symlink_inside_the_old_store(tmp_path):
    outside = tmp_path / "outside"
    files = _user_folder(outside)
    dest = write_store(tmp_path / "s", 3)
    os.unlink(os.path.join(dest, "_keys.bin"))  # a store from someone else may hold anything ...
    os.symlink(outside, os.path.join(dest, "_keys.bin"))  # ... under a name its manifest lists
    write_store(dest, 2, overwrite=True)
    _assert_intact(outside, files)
    assert mmstore.open(dest).records == 2


@pytest.mark.parametrize("entry", ["notes/thesis.txt", "todo.txt", "link"])
def test_overwrite_refuses_a_store_holding_entries_its_manifest_does_not_list(tmp_path, entry):
    """A user's file put inside a store is not ours to delete: --overwrite
    refuses, names it, and changes nothing."""
    dest = write_store(tmp_path / "s", 3)
    path = os.path.join(dest, entry)
    if entry == "link":
        os.symlink(tmp_path, path)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write("mine")
    before = sorted(os.listdir(dest))
    with pytest.raises(DestinationError, match=entry.split("/")[0]):
        write_store(dest, 2, overwrite=True)
    assert sorted(os.listdir(dest)) == before and mmstore.open(dest).records == 3
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.ppm").write_bytes(b"P6 2 2 255\n" + bytes(range(12)))
    assert cli("ingest", str(src), dest, "--size", "8x8", "--overwrite", "-q") == 2
    assert sorted(os.listdir(dest)) == before
    os.unlink(path)  # the user moves their file out: now it is replaced
    if entry == "notes/thesis.txt":
        os.rmdir(os.path.dirname(path))
    assert cli("ingest", str(src), dest, "--size", "8x8", "--overwrite", "-q") == 0  # the source was fine
    assert mmstore.open(dest).records == 1


def test_foreign_partial_is_never_written_or_discarded(tmp_path):
    dest = tmp_path / "out"
    files = _user_folder(str(dest) + ".partial")
    for kw in ({"overwrite": True}, {"resume": True}, {}):
        with pytest.raises(DestinationError, match="not made by mmstore"):
            mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1, **kw)
    _assert_intact(str(dest) + ".partial", files)
    assert not is_own_partial(str(dest) + ".partial")
    # a symlink named like our .partial is not ours either
    os.rename(str(dest) + ".partial", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", str(dest) + ".partial")
    with pytest.raises(DestinationError):
        mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1, overwrite=True)
    _assert_intact(tmp_path / "elsewhere", files)


def test_own_partial_is_discarded_with_overwrite(tmp_path):
    dest = str(tmp_path / "out")
    w = mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=2)
    w.write(0, sample(0))
    w.abort()
    assert is_own_partial(dest + ".partial")
    write_store(dest, 2, overwrite=True)
    assert mmstore.open(dest).records == 2


def test_writer_refuses_dest_that_is_or_contains_an_input(tmp_path):
    files = _user_folder(tmp_path / "proj")
    src = write_store(tmp_path / "proj" / "train.store", 3)
    for dest, why in ((tmp_path / "proj", "contains the input"), (src, "is the input"),
                      (tmp_path / "proj" / "train.store" / "x", "inside the input")):
        with pytest.raises(DestinationError, match=why):
            mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1, overwrite=True, inputs=[src])
    _assert_intact(tmp_path / "proj", files)
    assert mmstore.open(src).records == 3


def test_publish_never_replaces_what_is_not_a_store(tmp_path, monkeypatch):
    dest = str(tmp_path / "s")
    w = mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1)
    w.write(0, sample(0))
    # finish the writer's .partial up to its manifest, then let a user folder appear at DEST
    monkeypatch.setattr(writer_mod, "publish", lambda path: None)
    w.close()
    monkeypatch.undo()
    files = _user_folder(dest)
    with pytest.raises(DestinationError, match="not an mmstore store"):
        publish(dest)
    _assert_intact(dest, files)
    assert is_store(dest + ".partial")


def test_overwrite_refuses_dest_that_appears_under_the_lock(tmp_path, monkeypatch):
    """The "DEST exists" check runs under the lock: a store published by another
    writer between a first look and the lock is never silently replaced."""
    dest = str(tmp_path / "s")
    write_store(tmp_path / "other", 2)
    real = writer_mod.acquire_lock

    def racing_acquire(path):
        os.rename(tmp_path / "other", dest)  # the other writer publishes right now
        return real(path)

    monkeypatch.setattr(writer_mod, "acquire_lock", racing_acquire)
    with pytest.raises(StoreExistsError, match="already exists"):
        mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1)
    assert mmstore.open(dest).records == 2
    assert not os.path.exists(dest + ".lock") and not os.path.exists(dest + ".partial")


def test_check_dest_uses_realpath(tmp_path):
    src = tmp_path / "photos"
    src.mkdir()
    os.symlink(src, tmp_path / "alias")
    for dest in (tmp_path / "alias", tmp_path / "alias" / "s.store"):
        with pytest.raises(DestinationError):
            check_dest(dest, sources=[str(src)])
    os.symlink(tmp_path, tmp_path / "up")
    with pytest.raises(DestinationError, match="contains the input"):
        check_dest(tmp_path / "up", sources=[str(src)], overwrite=True)
    assert check_dest(tmp_path / "s.store", sources=[str(src)]) == str(tmp_path / "s.store")


def test_convert_and_merge_refusals_exit_2_and_touch_nothing(tmp_path, capsys):
    proj = tmp_path / "proj"
    files = _user_folder(proj)
    src = write_store(proj / "train.store", 4)
    before = {n: (proj / "train.store" / n).read_bytes() for n in os.listdir(src)}
    assert cli("convert", src, proj, "--backend", "lmdb", "--overwrite", "--no-progress") == 2
    assert "contains the input" in capsys.readouterr().err
    os.symlink(src, tmp_path / "alias")
    assert cli("convert", src, tmp_path / "alias", "--backend", "lmdb", "--overwrite", "--no-progress") == 2
    assert cli("merge", src, proj, "--overwrite", "-q") == 2
    assert cli("merge", src, proj / "train.store" / "m", "-q") == 2
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "keep.txt").write_text("x")
    assert cli("merge", src, tmp_path / "plain", "--overwrite", "-q") == 2
    assert cli("convert", src, tmp_path / "plain", "--backend", "lmdb", "--overwrite", "--no-progress") == 2
    assert (tmp_path / "plain" / "keep.txt").read_text() == "x"
    _assert_intact(proj, files)
    assert {n: (proj / "train.store" / n).read_bytes() for n in os.listdir(src)} == before
    # converting into a real store with --overwrite still works
    out = write_store(tmp_path / "out", 1)
    assert cli("convert", src, out, "--backend", "lmdb", "--overwrite", "--no-progress") == 0
    assert mmstore.open(out).records == 4


# -- the lock ---------------------------------------------------------------------


def test_lock_unlink_race_is_safe(tmp_path, monkeypatch):
    """B opens DEST.lock, A releases (unlinks, closes), B flocks the unlinked
    file, C creates a new DEST.lock: B must notice and take the new file, so
    that B and C never both hold the lock."""
    dest = str(tmp_path / "s")
    a = acquire_lock(dest)
    real_flock = _lock_mod.fcntl.flock
    state = {"released": False}

    def interleaved(fd, op):
        if not state["released"]:  # B has opened the old file; now A lets go
            state["released"] = True
            release_lock(dest, a)
        return real_flock(fd, op)

    monkeypatch.setattr(_lock_mod.fcntl, "flock", interleaved)
    b = acquire_lock(dest)
    monkeypatch.setattr(_lock_mod.fcntl, "flock", real_flock)
    assert state["released"]
    st_b, st_name = os.fstat(b), os.stat(dest + ".lock")
    assert (st_b.st_dev, st_b.st_ino) == (st_name.st_dev, st_name.st_ino)
    with pytest.raises(LockedError):
        acquire_lock(dest)  # C
    release_lock(dest, b)
    assert not os.path.exists(dest + ".lock")


def test_lock_two_processes_racing_never_both_hold_it(tmp_path):
    """Many acquire/release rounds in two processes: a file created with
    O_EXCL inside the critical section proves that no two hold it at once."""
    dest = str(tmp_path / "s")
    code = textwrap.dedent(f"""
        import os, sys
        from mmstore.errors import LockedError
        from mmstore.store.writer import release_lock, acquire_lock
        dest, held, got = {dest!r}, {str(tmp_path / 'held')!r}, 0
        for _ in range(300):
            try:
                fd = acquire_lock(dest)
            except LockedError:
                continue
            mark = os.open(held, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # fails if the other holds it too
            os.close(mark)
            os.unlink(held)
            release_lock(dest, fd)
            got += 1
        print(got)
    """)
    env = cli_env()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err  # a FileExistsError here: both held the lock
    assert sum(int(out) for out, _ in outs) > 0
    assert not os.path.exists(dest + ".lock")


def test_refused_writes_leave_no_lock_file(tmp_path):
    dest = write_store(tmp_path / "s", 1)
    with pytest.raises(StoreExistsError):
        mmstore.StoreWriter(dest, SMALL_SCHEMA, slots=1)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "notes.txt").write_text("not a store")  # an empty directory would simply be used
    with pytest.raises(DestinationError):
        mmstore.StoreWriter(tmp_path / "dir", SMALL_SCHEMA, slots=1, overwrite=True)
    w = mmstore.StoreWriter(tmp_path / "t", SMALL_SCHEMA, slots=1)
    w.abort()
    assert sorted(os.listdir(tmp_path)) == ["dir", "s", "t.partial"]


def test_lock_file_that_is_not_ours_is_never_followed_or_changed(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_bytes(b"do not truncate")
    os.symlink(precious, tmp_path / "s.lock")
    with pytest.raises(DestinationError, match="symbolic link"):
        mmstore.StoreWriter(tmp_path / "s", SMALL_SCHEMA, slots=1)
    assert precious.read_bytes() == b"do not truncate"
    os.unlink(tmp_path / "s.lock")
    (tmp_path / "s.lock").write_bytes(b"my own notes")
    with pytest.raises(DestinationError, match="not an mmstore lock"):
        mmstore.StoreWriter(tmp_path / "s", SMALL_SCHEMA, slots=1)
    assert (tmp_path / "s.lock").read_bytes() == b"my own notes"
    # a lock file left by a killed writer (a pid) is reused and removed
    (tmp_path / "s.lock").write_bytes(b"12345\n")
    write_store(tmp_path / "s", 1)
    assert not os.path.exists(tmp_path / "s.lock")
    assert np.array_equal(mmstore.open(tmp_path / "s")[0]["image"], sample(0)["image"])
