"""A :class:`~mmstore.torch.Loader`'s per-process resources (thread pool,
``preadv`` descriptors, ring, background warm pass) and its argument checks
for ``device`` and ``pin_memory``. See "Lifetime" in ``loader.py``'s
docstring for the rules about fork and garbage collection."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .. import _os
from ..engine.reads import FieldFiles
from ._process import Helper
from ._ring import Ring

__all__ = ["Resources", "check_device", "check_pin_memory", "torch_dtype"]


def check_device(device: str | torch.device | None) -> tuple[torch.device | None, bool]:
    """``(the device, whether it is CUDA)``; CUDA must be available."""
    dev = torch.device(device) if device is not None else None
    cuda = dev is not None and dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} but torch.cuda.is_available() is False")
    if dev is not None and dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    return dev, cuda


def check_pin_memory(pin_memory: bool | None, cuda: bool) -> bool:
    """Pinned memory by default with a CUDA device; a warning without CUDA."""
    if pin_memory is None:
        pin_memory = cuda
    if pin_memory and not torch.cuda.is_available():
        warnings.warn(
            "mmstore.torch.Loader: pin_memory=True needs CUDA, which is not available; "
            "using ordinary memory", UserWarning, stacklevel=3,
        )
        return False
    return bool(pin_memory)


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class Resources:
    """A Loader's resources in one process: the reader pool, the ``preadv``
    files, the ring, a background warm pass. Referenced by the loader and by
    its ``weakref.finalize``; references neither the loader nor an epoch."""

    def __init__(self) -> None:
        self.pid = -1
        self.pool: ThreadPoolExecutor | None = None
        self.files: dict[str, FieldFiles] = {}
        self.ring: Ring | None = None
        self.warm_handle: _os.WarmHandle | None = None
        self.helper: Helper | None = None  # process=True: the helper process that reads

    def adopt(self) -> None:
        """Start clean in this process. After ``fork`` the parent's pool, its
        futures and its warm thread do not run here and their locks may be
        held forever: they are dropped untouched; the descriptors are this
        process's own copies and are closed."""
        self.pool = None
        self.warm_handle = None
        self._close_files()
        self.ring = None
        helper, self.helper = self.helper, None
        if helper is not None:  # the parent's: only our copy of its socket is closed
            helper.close()
        self.pid = os.getpid()

    def release(self, wait: bool) -> None:
        """Shut the pool down, close the descriptors, drop the ring.

        ``wait=False`` (the finalizer of a loader that became garbage, which
        may run in any thread, a pool thread included) blocks on nothing:
        queued reads are cancelled and the threads exit when their current
        read is done (nothing of the loader is left for them to write into)."""
        if self.pid != os.getpid():  # inherited through fork: nothing here is ours to stop
            self.adopt()
            return
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=True)
        warm, self.warm_handle = self.warm_handle, None
        if warm is not None:
            warm.stop()
            if wait:
                try:
                    warm.join()
                except Exception:  # noqa: BLE001 - a failed warm pass is not fatal at close
                    pass
        self._close_files()
        self.ring = None
        helper, self.helper = self.helper, None
        if helper is not None:  # it exits when it sees its socket closed
            helper.close()

    def _close_files(self) -> None:
        files, self.files = self.files, {}
        for ff in files.values():
            ff.close()
