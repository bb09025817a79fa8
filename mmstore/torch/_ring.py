"""The Loader's ring of batch buffers, and the reads in flight into it.

``Ring`` is ``prefetch + hold`` (+ 1) reusable batch buffers (torch
tensors, optionally pinned, with numpy views of the same memory for the
reader threads); batch ``k`` of an epoch goes into buffer ``(cursor + k) %
len(ring)``, ``cursor`` the buffer after the last one yielded.
``InFlight`` is one epoch's reads into a ring (futures per buffer), and
whether that epoch was cancelled; the loader waits for it before the ring is
reused. See "Buffer lifetime" and "Lifetime" in ``loader.py``'s docstring.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["ALIGN", "Ring"]


class Ring:
    """``size`` batch buffers of ``batch_size`` rows per field.

    ``shapes`` maps a field to ``(record shape, torch dtype)``. ``slots[s]``
    are the loader's tensors of buffer ``s`` (never yielded themselves:
    :meth:`batch` yields views of them), ``views[s]`` numpy views of the same
    memory, which the reader threads write into.

    NOTE [kept batches]: a yielded tensor, and every view of it (a slice,
    ``permute``, ``.numpy()``, a tuple or dict holding it), holds a reference
    to its buffer's storage (``StorageImpl``'s use count); the ring's own
    tensors and numpy views hold a fixed number, counted in ``_base`` when the
    buffer is allocated. :meth:`claim` compares the two before a buffer is
    refilled: more than the base means something outside the loader still
    holds a batch of that buffer, so the buffer is left to it and the slot
    gets a fresh one (``renewed`` counts them). A copy (``.clone()``,
    ``.cuda()``, ``.float()``) holds nothing of the buffer. A batch's
    ``share_memory_()`` (a ``torch.multiprocessing`` queue's ``put``) moves
    the memory of the storage the ring's tensor shares and frees the old
    one: :meth:`claim` also renews a buffer whose memory is no longer where
    its numpy views point (:meth:`moved`). Not
    seen: a bare ``untyped_storage()`` object kept without any tensor of it
    (torch does not count it in the use count). A fresh buffer is
    pinned when the ring is; the pinned-memory guard (a CUDA event per
    buffer, ``_epoch.EpochBatches``) applies to it as to the old one. The
    window pass's buffers (``_reads``, ``_direct``) are never yielded: rows
    are copied out of them into these buffers, so they need no check.
    The CUDA path yields fresh GPU tensors and does not check.

    ``shared``: each buffer is one shared memory file (``memfd``) holding its
    fields at the offsets of :attr:`layout`, so that a helper process can map
    the same buffers (``Loader(process=True)``, ``_process.py``) and read
    into them; ``fds[s]`` is buffer ``s``'s file. A renewed buffer gets a new
    file (the old mapping lives on in the batches that keep it).
    :meth:`attached` builds the helper's side: the same buffers, mapped from
    the files it was sent."""

    def __init__(
        self, size: int, batch_size: int, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        pin_memory: bool, align: Mapping[str, int] | None = None, huge: bool = False, shared: bool = False,
    ) -> None:
        self._shapes = dict(shapes)
        # field -> the address of each buffer's first row mod ALIGN (NOTE [rows read in place])
        self._align = {f: int(r) % ALIGN for f, r in (align or {}).items() if f in self._shapes}
        self._huge = bool(huge) and not pin_memory and not shared  # those fields' buffers on huge pages (same NOTE)
        self._rows = batch_size
        self._pin = pin_memory
        self.layout = _layout(batch_size, self._shapes, self._align) if shared else None
        self.fds: list[SharedFile | None] = [None] * size
        self.slots: list[dict[str, torch.Tensor]] = []
        self.views: list[dict[str, np.ndarray]] = []
        self._base: list[dict[str, int]] = []
        self._ptr: list[dict[str, int]] = []  # where the numpy views of each buffer point
        for _ in range(size):
            self.slots.append({})
            self.views.append({})
            self._base.append({})
            self._ptr.append({})
            self._alloc(len(self.slots) - 1)
        self.renewed = 0  # buffers replaced because a yielded batch was still referenced
        self.cursor = 0  # the buffer of the next epoch's first batch

    @classmethod
    def attached(cls, batch_size: int, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 layout: Mapping[str, tuple[int, int]], fds: Sequence[int]) -> Ring:
        """The buffers of a shared ring, mapped from their files ``fds`` (the
        helper process's side: it reads into them and never renews one)."""
        ring = cls(0, batch_size, shapes, False)
        ring.layout = dict(layout)
        for fd in fds:
            ring.slots.append({})
            ring.views.append({})
            ring._base.append({})
            ring._ptr.append({})
            ring.fds.append(None)
            ring.attach(len(ring.slots) - 1, fd)
        return ring

    def attach(self, s: int, fd: int) -> None:
        """Buffer ``s`` is now the shared file ``fd`` (taken over: closed when the buffer goes)."""
        self.fds[s] = f = SharedFile(fd, _layout_bytes(self.layout))  # type: ignore[arg-type]
        self._set(s, self._map(f))

    def _map(self, f: SharedFile) -> dict[str, torch.Tensor]:
        out = {}
        for name, (shape, dt) in self._shapes.items():
            off, nbytes = self.layout[name]  # type: ignore[index]
            arr = np.frombuffer(f.map, np.uint8, nbytes, off).view(_np_dtype(dt)).reshape((self._rows, *shape))
            out[name] = torch.from_numpy(arr)
        return out

    def _alloc(self, s: int) -> None:
        if self.layout is not None:
            self.fds[s] = f = SharedFile.create(_layout_bytes(self.layout), pin=self._pin)
            self._set(s, self._map(f))
            return
        self._set(s, {f: self._empty(f, shape, dt) for f, (shape, dt) in self._shapes.items()})

    def _set(self, s: int, slot: dict[str, torch.Tensor]) -> None:
        self.slots[s] = slot
        self.views[s] = {f: t.numpy() for f, t in slot.items()}
        self._base[s] = {f: _uses(t) for f, t in slot.items()}
        self._ptr[s] = {f: t.data_ptr() for f, t in slot.items()}

    def _empty(self, f: str, shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
        """A buffer of field ``f``: ``torch.empty``, or, for a field in
        ``align``, a view of a slightly larger one whose first row starts at
        the residue asked for (NOTE [rows read in place])."""
        if f not in self._align:
            return torch.empty((self._rows, *shape), dtype=dt, pin_memory=self._pin)
        nbytes = self._rows * int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=self._pin)
        if self._huge:  # before the first write faults the pages in
            _advise_huge(raw.data_ptr(), nbytes + ALIGN)
        skip = (self._align[f] - raw.data_ptr()) % ALIGN
        if skip % dt.itemsize:  # cannot start a row of this dtype there: unaligned
            return torch.empty((self._rows, *shape), dtype=dt, pin_memory=self._pin)
        return raw[skip : skip + nbytes].view(dt).view((self._rows, *shape))

    def __len__(self) -> int:
        return len(self.slots)

    def referenced(self, s: int) -> bool:
        """Whether a batch yielded from buffer ``s`` is still referenced
        outside the loader (NOTE [kept batches])."""
        base = self._base[s]
        return any(_uses(t) != base[f] for f, t in self.slots[s].items())

    def moved(self, s: int) -> bool:
        """Whether buffer ``s``'s memory is no longer where its numpy views
        point: a yielded batch's ``share_memory_()`` (what a
        ``torch.multiprocessing`` queue's ``put`` does) replaced the storage's
        memory and freed the old one, so the views would write into freed
        memory and the batches read stale rows."""
        ptr = self._ptr[s]
        return any(t.data_ptr() != ptr[f] for f, t in self.slots[s].items())

    def claim(self, s: int) -> dict[str, np.ndarray]:
        """Buffer ``s``'s numpy views, to be refilled: a fresh buffer when a
        yielded batch of the old one is still referenced (the caller keeps it)
        or its memory was moved (:meth:`moved`: the storage is the user's now)."""
        if self.referenced(s) or self.moved(s):
            self._alloc(s)
            self.renewed += 1
        return self.views[s]

    def batch(self, s: int, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of buffer ``s`` (no copy; always a new
        view, so the yielded tensors are never the ring's own). The next
        epoch starts with the buffer after it (``cursor``): the buffers
        refilled first are those of the oldest batches, not the one the
        loop variable still holds."""
        self.cursor = (s + 1) % len(self.slots)
        return {f: t[:rows] for f, t in self.slots[s].items()}


# NOTE [rows read in place]: a permutation of a store that does not fit reads
# each record with O_DIRECT, whose requests need the file offset, the length
# and every memory piece aligned to the device's block (512 bytes on most
# disks). A record at file offset ``off`` can land straight in its ring row
# when the row's address is congruent to ``off`` modulo the block: the read
# then covers the block holding the record's head and the one holding its
# tail with two scratch blocks, and the whole blocks between go to the row
# itself (``_direct.read_records_direct``). Every record of a field sits at
# ``data_offset + slot * entry_bytes``; when ``entry_bytes`` is a multiple of
# the block (224x224x3 bytes is 294 x 512), giving each buffer of the field a
# first row at ``data_offset mod ALIGN`` makes every row congruent, so no
# record is copied through a staging buffer. ``align`` maps those fields to
# ``data_offset``; the cost is ALIGN bytes per buffer.
#
# With ``huge`` (a loader whose plan reads records with O_DIRECT: describe()
# ["direct_reads"]) the same buffers are asked to be backed by transparent
# huge pages (not pinned ones, which CUDA allocates): an O_DIRECT read pins
# and maps its destination page by page, and the device gets one segment per
# physically contiguous piece: a record read in place into huge pages costs
# less system CPU and less time than into 4 KiB pages. Not for the other
# plans, whose rows are filled by copies: there a huge page asked for under a
# tight memory limit may cost compaction, and for a store that fits the
# copies into huge pages ran slightly faster once the ring was faulted in,
# while faulting in a ring of them made the first epoch slower (warm store).
ALIGN = 4096
_HUGE = 2 << 20


class SharedFile:
    """A shared memory file (``memfd``) and its mapping. The descriptor is
    closed when this object goes; the mapping stays while a tensor of it does.

    ``pin``: the mapping is page-locked for CUDA (``cudaHostRegister``), so
    that the copies to the GPU out of it run as DMA, asynchronously, as out of
    ``torch.empty(..., pin_memory=True)``. It is unregistered when this
    object goes, which is before the mapping can be unmapped (this object
    holds it); a batch that still holds the memory then reads it as plain
    memory. A mapping that CUDA refuses to lock stays unpinned
    (``pinned`` False): copies out of it are synchronous, never wrong."""

    def __init__(self, fd: int, nbytes: int, pin: bool = False) -> None:
        self.fd = fd
        self.map = mmap.mmap(fd, nbytes)
        self._locked = _host_register(self.map) if pin else 0  # its address when registered

    @property
    def pinned(self) -> bool:
        return self._locked != 0

    @classmethod
    def create(cls, nbytes: int, pin: bool = False) -> SharedFile:
        fd = os.memfd_create("mmstore-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            return cls(fd, nbytes, pin)
        except BaseException:
            os.close(fd)
            raise

    def __del__(self) -> None:
        locked, self._locked = getattr(self, "_locked", 0), 0
        if locked:
            _host_unregister(locked)
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def _host_register(mm: mmap.mmap) -> int:
    """Page-lock mapping ``mm`` for CUDA; its address, or 0 when CUDA refused."""
    view = np.frombuffer(mm, np.uint8)
    ptr = int(view.ctypes.data)
    del view  # (no export of the mapping left behind)
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, len(mm), 0)
        torch.cuda.check_error(err)
    except (RuntimeError, AttributeError):  # not locked: the copies out of it stay synchronous
        return 0
    return ptr


def _host_unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except (RuntimeError, AttributeError):  # CUDA already shut down at exit: nothing to give back
        pass


def _np_dtype(dt: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dt).numpy().dtype


def _layout(rows: int, shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
            align: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Each field's ``(offset, bytes)`` in a shared buffer: fields one after
    the other, each at a multiple of 64 bytes, an aligned field's rows at its
    residue mod ``ALIGN`` (the mapping starts on a page: NOTE [rows read in place])."""
    out, at = {}, 0
    for f, (shape, dt) in shapes.items():
        nbytes = rows * int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        at = -(-at // 64) * 64
        if f in align and align[f] % dt.itemsize == 0:
            at += (align[f] - at) % ALIGN
        out[f] = (at, nbytes)
        at += nbytes
    return out


def _layout_bytes(layout: Mapping[str, tuple[int, int]]) -> int:
    return max(1, max((off + n for off, n in layout.values()), default=0))


def _libc_madvise() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _libc_madvise() if getattr(mmap, "MADV_HUGEPAGE", None) is not None else None


def _advise_huge(addr: int, nbytes: int) -> None:
    """``MADV_HUGEPAGE`` on the whole huge pages of ``[addr, addr + nbytes)``
    (a hint: where THP is off the pages stay small)."""
    a = -(-addr // _HUGE) * _HUGE
    b = (addr + nbytes) // _HUGE * _HUGE
    if _MADVISE is not None and b > a:
        _MADVISE(a, b - a, mmap.MADV_HUGEPAGE)

_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # private; present in the torch releases tested
_unknown = iter(range(1, 1 << 62))  # where it is missing: a new count each call


def _uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors and views of it). The count
    includes the temporary storage object of this call, the same in every call.
    Without torch's use count, a different number every call: every buffer
    then counts as still referenced and is renewed (always correct, slower)."""
    if _USE_COUNT is None:
        return -next(_unknown)
    return int(_USE_COUNT(t.untyped_storage()._cdata))
