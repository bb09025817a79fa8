"""mmstore._os.safecopy: copies out of a mapping that a truncation cannot turn into SIGBUS."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore._os import safecopy as _safecopy
from mmstore._os.safecopy import MappingFault, copy_entries, safe_copy_available

linux_only = pytest.mark.skipif(not safe_copy_available(), reason="process_vm_readv is Linux-only")


def _mapped(tmp_path, data: bytes):
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as fh:
        fh.write(data)
    fd = os.open(path, os.O_RDONLY)
    mm = mmap.mmap(fd, len(data), prot=mmap.PROT_READ)
    os.close(fd)
    return path, mm, np.frombuffer(mm, np.uint8)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5000), st.lists(st.integers(0, 63), min_size=0, max_size=1500))
def test_copies_exactly_what_memmove_would(tmp_path_factory, nbytes, slots):
    src = np.random.default_rng(nbytes).integers(0, 256, (64, nbytes), dtype=np.uint8)
    dst = np.zeros((len(slots), nbytes), np.uint8)
    s = np.asarray(slots, np.int64)
    copy_entries(dst.ctypes.data + np.arange(len(s), dtype=np.int64) * nbytes, src.ctypes.data + s * nbytes, nbytes)
    np.testing.assert_array_equal(dst, src[s] if len(s) else dst)


@linux_only
def test_a_truncated_mapping_is_a_fault_not_sigbus(tmp_path):
    """The file under the mapping is cut to 2.5 pages: entries inside the
    first two pages are copied, the first one past them is the fault. The
    same copy with memmove would kill the process (run in a child)."""
    page = mmap.PAGESIZE
    data = np.random.default_rng(0).integers(0, 256, 8 * page, dtype=np.uint8).tobytes()
    path, mm, view = _mapped(tmp_path, data)
    os.truncate(path, 2 * page + page // 2)
    nb = page // 2
    slots = np.arange(16, dtype=np.int64)  # entries 0..4 lie inside the file's first 3 pages
    dst = np.zeros((16, nb), np.uint8)
    with pytest.raises(MappingFault) as e:
        copy_entries(dst.ctypes.data + slots * nb, view.ctypes.data + slots * nb, nb)
    assert e.value.entry == 6  # entries 0..5 lie in pages 0..2 (page 2 is the file's last, zero-filled)
    want = np.frombuffer(data, np.uint8).reshape(16, nb)
    np.testing.assert_array_equal(dst[:5], want[:5])
    pid = os.fork()
    if pid == 0:  # what the copy replaces: memmove out of the same mapping
        import faulthandler

        faulthandler.disable()  # a SIGBUS is expected here: no traceback
        ctypes.memmove(dst.ctypes.data, view.ctypes.data + 7 * page, 16)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 7  # SIGBUS
    del view
    mm.close()


def test_falls_back_to_memmove_where_the_call_is_refused(monkeypatch):
    """Under a seccomp profile without process_vm_readv the call fails with
    EPERM: the copy is still made, with memmove, and stays so."""
    calls = []

    def refused(*args):
        calls.append(args)
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(_safecopy, "_readv", refused)
    monkeypatch.setattr(_safecopy, "_usable", None)
    src = np.arange(4096 * 3, dtype=np.uint8).reshape(3, 4096)
    dst = np.zeros_like(src)
    order = np.array([2, 0, 1], np.int64)
    copy_entries(dst.ctypes.data + np.arange(3, dtype=np.int64) * 4096, src.ctypes.data + order * 4096, 4096)
    np.testing.assert_array_equal(dst, src[order])
    assert len(calls) == 1 and _safecopy._usable is False
    copy_entries(dst.ctypes.data + np.arange(3, dtype=np.int64) * 4096, src.ctypes.data + order * 4096, 4096)
    assert len(calls) == 1  # not tried again
