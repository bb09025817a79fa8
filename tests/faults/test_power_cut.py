"""Lost writes: a power cut drops (or garbles) every write that was not fsynced.

The file layer is wrapped in the ingest child: each ``os.pwrite`` records the
bytes it overwrites until an ``os.fsync`` of that file; at the k-th write the
"power fails": un-synced writes are undone (or replaced by garbage) and the
process dies. Resume must return to the last committed point and end
byte-identical; a store that looks complete must verify.
"""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest
from support.compare import store_bytes
from support.faults import CRASHED, content_ok, ingest_argv, run_forked


def _power_cut_at(k: int, mode: str):
    def setup():
        real_pwrite, real_fsync = os.pwrite, os.fsync
        journal: dict[str, list[tuple[int, bytes, int]]] = {}
        count = [0]
        rng = np.random.default_rng(k)

        def path_of(fd):
            return os.readlink(f"/proc/self/fd/{fd}")

        cutting = []

        def cut():
            cutting.append(1)  # other threads' writes stop here: the power is gone
            for path, entries in list(journal.items()):
                try:
                    fd = os.open(path, os.O_RDWR)
                except FileNotFoundError:
                    continue
                for off, old, old_size in reversed(entries):
                    if mode == "drop":
                        real_pwrite(fd, old, off)
                        if old_size < off + len(old):
                            os.ftruncate(fd, max(old_size, 0))
                    else:
                        real_pwrite(fd, rng.integers(0, 256, max(len(old), 1), dtype=np.uint8).tobytes(), off)
                os.close(fd)
            os._exit(CRASHED)

        def pwrite(fd, data, offset):
            while cutting:
                time.sleep(1)
            count[0] += 1
            if count[0] == k:
                cut()
            path = path_of(fd)
            n = len(memoryview(data).cast("B"))
            size = os.fstat(fd).st_size
            with open(path, "rb") as fh:
                fh.seek(offset)
                old = fh.read(n)
            old = old + bytes(n - len(old)) if mode == "drop" else old
            journal.setdefault(path, []).append((offset, old, size))
            return real_pwrite(fd, data, offset)

        def fsync(fd):
            journal.pop(path_of(fd), None)
            return real_fsync(fd)

        os.pwrite, os.fsync = pwrite, fsync

    return setup


@pytest.mark.parametrize("mode", ["drop", "garble"])
def test_power_cut_at_every_fifth_write_resumes_to_identical(src, ref, tmp_path, mode):
    cuts = 0
    for k in range(1, 10_000, 5):
        dest = str(tmp_path / f"{mode}-{k}")
        rc = run_forked(ingest_argv(src, dest), setup=_power_cut_at(k, mode))
        if rc == 0:
            break
        assert rc == CRASHED, f"write {k}: exit {rc}"
        cuts += 1
        if os.path.exists(dest):
            assert store_bytes(dest) == ref and content_ok(dest), f"write {k}: published store damaged"
        else:
            assert run_forked(ingest_argv(src, dest, "--resume")) == 0, f"write {k}: resume failed"
            assert store_bytes(dest) == ref, f"write {k}: resumed store differs after a {mode} power cut"
            assert content_ok(dest)
        shutil.rmtree(dest, ignore_errors=True)
    assert cuts >= 5
