"""The O_DIRECT window buffers (``mmstore/torch/_direct.py``): aligned on a
huge-page boundary and backed by transparent huge pages where the kernel
offers them (NOTE [huge window buffers]: the disk requests an O_DIRECT read
becomes are at most ``max_segments`` contiguous pieces of the buffer)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from mmstore.torch import _direct


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
