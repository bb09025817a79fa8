"""Read-speed probes for ``doctor``: one timed sequential read and timed random record reads."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from .cache import evict_range, resident_fd
from .files import HAS_FADVISE, PAGE_SIZE, MiB, PathLike, open_ro
from .pread import pread_into, read_full

__all__ = ["ReadSpeed", "random_read_speed", "seq_read_speed"]


@dataclass
class ReadSpeed:
    """One read-speed measurement.

    Attributes
    ----------
    kind : str
        ``"sequential"`` or ``"random"``.
    bytes : int
        Bytes read.
    ops : int
        Read calls timed (records for random reads, chunks for sequential).
    seconds : float
        Wall time of the timed reads.
    cold : bool
        Whether eviction of the sampled ranges was asked for first.
    resident_before : int or None
        Bytes of the sampled ranges still resident when timing started (after
        any eviction). Non-zero on a cold run means eviction did not work
        (tmpfs, dirty or locked pages) and the figure is a cache speed; None
        if it could not be measured.
    threads : int
        Concurrent readers (random reads only).
    """

    kind: str
    bytes: int = 0
    ops: int = 0
    seconds: float = 0.0
    cold: bool = False
    resident_before: int | None = None
    threads: int = 1

    @property
    def mb_per_s(self) -> float:
        """Rate in MB/s (10**6 bytes)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean time per op x threads, in ms (per-read latency seen by one
        reader)."""
        return 1e3 * self.seconds * self.threads / self.ops if self.ops else 0.0


def seq_read_speed(path: PathLike, max_bytes: int = 256 * MiB, *,
                   offset: int = 0, chunk_bytes: int = 4 * MiB,
                   cold: bool = True, max_seconds: float = 2.0) -> ReadSpeed:
    """Time one sequential read of up to ``max_bytes`` from ``offset``.

    Stops at ``max_bytes``, end of file, or after ``max_seconds``, whichever
    comes first. With ``cold=True`` the range is first evicted from the page
    cache (this drops it for everyone: a cached store gets slower until it is
    read again); where eviction is impossible (tmpfs, no posix_fadvise) the
    result says so through ``resident_before``.
    """
    fd = open_ro(path)
    try:
        size = os.fstat(fd).st_size
        end = min(size, int(offset) + int(max_bytes))
        length = max(0, end - int(offset))
        if cold and length:
            evict_range(fd, int(offset), length, size)
        try:
            resident = resident_fd(fd, size, int(offset), length) if length else 0
        except (OSError, NotImplementedError):
            resident = None
        if HAS_FADVISE:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        chunk = max(PAGE_SIZE, int(chunk_bytes))
        mv = memoryview(bytearray(chunk))
        pos, ops = int(offset), 0
        t0 = time.perf_counter()
        deadline = t0 + max_seconds
        while pos < end:
            got = pread_into(fd, mv[:min(chunk, end - pos)], pos)
            if got == 0:
                break
            pos += got
            ops += 1
            if time.perf_counter() > deadline:
                break
        dt = time.perf_counter() - t0
        return ReadSpeed("sequential", pos - int(offset), ops, dt, cold, resident, 1)
    finally:
        os.close(fd)


def random_read_speed(path: PathLike, record_bytes: int, n: int = 256, *,
                      cold: bool = True, threads: int = 1, seed: int = 0,
                      max_seconds: float = 2.0) -> ReadSpeed:
    """Time ``n`` reads of ``record_bytes`` at random record-aligned offsets.

    Offsets are ``k * record_bytes`` for random distinct ``k`` (like shuffled
    record reads of a store field). ``POSIX_FADV_RANDOM`` is set on the
    reading descriptor so kernel readahead does not fetch neighbours. With
    ``cold=True`` each sampled range is evicted first, widened to whole pages
    (and, where the kernel keeps a large folio straddling the range, to 64 KiB
    or 2 MiB bounds): at most about ``n * (record_bytes + 2 MiB)`` bytes of the
    file leave the cache, the rest stays. ``threads > 1`` keeps that many reads in
    flight. Stops after ``max_seconds`` (counting only the reads done).

    Raises
    ------
    ValueError
        The file holds fewer than one record.
    """
    record_bytes = int(record_bytes)
    if record_bytes <= 0:
        raise ValueError(f"record_bytes must be > 0, got {record_bytes}")
    fd = open_ro(path)
    try:
        size = os.fstat(fd).st_size
        nrec = size // record_bytes
        if nrec < 1:
            raise ValueError(f"{os.fsdecode(path)}: {size:,} bytes holds no "
                             f"record of {record_bytes:,} bytes")
        rng = np.random.default_rng(seed)
        n = int(min(n, nrec))
        ks = rng.choice(nrec, size=n, replace=False) if nrec > n else rng.permutation(nrec)
        offs = (ks.astype(np.int64) * record_bytes).tolist()
        if cold:
            for o in offs:
                evict_range(fd, o, record_bytes, size)
        try:
            resident: int | None = sum(resident_fd(fd, size, o, record_bytes) for o in offs)
        except (OSError, NotImplementedError):
            resident = None
        if HAS_FADVISE:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        ops, dt = _timed_reads(fd, offs, record_bytes, max(1, int(threads)), max_seconds)
        return ReadSpeed("random", ops * record_bytes, ops, dt, cold, resident, max(1, int(threads)))
    finally:
        os.close(fd)


def _timed_reads(fd: int, offs: list[int], record_bytes: int, threads: int, max_seconds: float
                 ) -> tuple[int, float]:
    """Read each offset with ``threads`` readers until done or ``max_seconds``;
    return (reads done, seconds). Re-raises the first reader's error."""
    counts = [0] * threads
    errors: list[BaseException] = []

    def worker(t: int, deadline: float) -> None:
        mv = memoryview(bytearray(record_bytes))
        try:
            for o in offs[t::threads]:
                read_full(fd, mv, o)
                counts[t] += 1
                if time.perf_counter() > deadline:
                    break
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    t0 = time.perf_counter()
    deadline = t0 + max_seconds
    if threads == 1:
        worker(0, deadline)
    else:
        ts = [threading.Thread(target=worker, args=(t, deadline)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(counts), dt
