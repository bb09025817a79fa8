"""fsync and rename failing with EIO at call k: the ingest aborts cleanly, the
committed point does not advance past what is durable, and resume succeeds."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from support.compare import store_bytes
from support.faults import content_ok, ingest_argv, run_forked


def _fail_call(name, k):
    """Make the k-th ``os.<name>`` call fail with EIO. For fsync the failure
    also loses the file's unsynced writes (as a failed writeback can on
    Linux), so a run that committed past a failed fsync ends with wrong bytes."""

    def setup():
        real = getattr(os, name)
        real_pwrite = os.pwrite
        journal: dict[str, list[tuple[int, bytes]]] = {}
        n = [0]

        def path_of(fd):
            return os.readlink(f"/proc/self/fd/{fd}")

        def pwrite(fd, data, offset):
            size = len(memoryview(data).cast("B"))
            with open(path_of(fd), "rb") as fh:
                fh.seek(offset)
                old = fh.read(size)
            journal.setdefault(path_of(fd), []).append((offset, old + bytes(size - len(old))))
            return real_pwrite(fd, data, offset)

        def failing(*a, **kw):
            n[0] += 1
            if name == "fsync":
                lost = journal.pop(path_of(a[0]), [])
                if n[0] == k:
                    for off, old in reversed(lost):
                        real_pwrite(a[0], old, off)
                    raise OSError(errno.EIO, f"injected EIO in {name} call {k}")
            elif n[0] == k:
                raise OSError(errno.EIO, f"injected EIO in {name} call {k}")
            return real(*a, **kw)

        if name == "fsync":
            os.pwrite = pwrite
        setattr(os, name, failing)

    return setup


@pytest.mark.parametrize("call", ["fsync", "replace", "rename"])
def test_eio_at_each_call_aborts_then_resume_is_identical(src, ref, tmp_path, call):
    failures = 0
    for k in range(1, 200):
        dest = str(tmp_path / f"{call}-{k}")
        rc = run_forked(ingest_argv(src, dest), setup=_fail_call(call, k))
        if rc == 0:
            assert store_bytes(dest) == ref
            break
        failures += 1
        assert rc == 1, f"{call} #{k}: exit {rc} (expected a clean error, 1)"
        if os.path.exists(dest):
            assert store_bytes(dest) == ref and content_ok(dest)
        else:
            assert run_forked(ingest_argv(src, dest, "--resume")) == 0, f"{call} #{k}: resume failed"
            assert store_bytes(dest) == ref, f"{call} #{k}: committed past a failed {call}"
        shutil.rmtree(dest, ignore_errors=True)
    assert failures >= 1
