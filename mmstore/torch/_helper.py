"""The helper process of ``Loader(process=True)``: a Loader of the parent's
configuration whose ring is the parent's shared buffers, serving the epochs
the parent asks for (the protocol is in ``_process.py``'s docstring)."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
from typing import Any

import torch

from ._epoch import Cancelled, EpochBatches
from ._process import Channel, exc_blob
from ._resources import torch_dtype
from ._ring import Ring
from .loader import Loader

__all__ = ["serve"]


def _die_with_parent() -> None:
    """Exit when the parent does (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def serve(fd: int) -> None:
    """The helper process: build the loader from the parent's configuration,
    then serve its epochs until the socket closes."""
    ppid = os.getppid()
    _die_with_parent()
    if os.getppid() != ppid:  # the parent died before the signal was asked for
        os._exit(0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    torch.set_num_threads(1)
    channel = Channel(socket.socket(fileno=fd))
    try:
        msg, fds = channel.recv()
    except (EOFError, OSError):
        os._exit(0)
    try:
        server = _Server(channel, msg[1], msg[2], fds)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        channel.send(("failed", *exc_blob(exc)))
        os._exit(1)
    channel.send(("ready",))
    server.run()
    os._exit(0)  # reader threads may be inside a read: nothing of theirs is needed any more


class _Server:
    def __init__(self, channel: Channel, setup: dict[str, Any], layout: dict[str, tuple[int, int]],
                 fds: list[int]) -> None:
        self.channel = channel
        ld = Loader(setup.pop("store"), setup.pop("batch_size"), **setup)
        ld._warmed = True  # the parent warms the page cache, which both share
        ld._res.adopt()
        shapes = {f: (ld._ring_shape(f), torch_dtype(ld.store.schema[f].dtype)) for f in ld._fixed}
        ld._res.ring = Ring.attached(ld.batch_size, shapes, layout, fds)
        self.loader = ld
        self.epoch: tuple[int, EpochBatches, threading.Thread] | None = None
        self.submitted = -1  # the last batch of the epoch queued
        self.cv = threading.Condition()

    def run(self) -> None:
        while True:
            try:
                msg, fds = self.channel.recv()
            except (EOFError, OSError):
                self._cancel()
                return
            kind = msg[0]
            if kind == "slot":
                self.loader._res.ring.attach(msg[1], fds[0])  # type: ignore[union-attr]
            elif kind == "epoch":
                self._start(*msg[1:])
            elif kind == "read":
                self._read(msg[1], msg[2])
            elif kind == "stop":
                self._stop()
                self._send(("stopped", msg[1]))

    def _start(self, eid: int, epoch: int, start: int, base: int) -> None:
        self._stop()
        ld = self.loader
        try:
            ld._setup()
            ld._res.ring.cursor = base  # type: ignore[union-attr]
            batches, reads = ld._epoch_batches(epoch, start, check_kept=False, device=None)
        except BaseException as exc:  # noqa: BLE001 - raised by the parent's next() for the first batch
            self._send(("error", eid, 0, exc_blob(exc)))
            return
        with self.cv:
            self.submitted = min(ld.prefetch, batches.nbatches) - 1
        t = threading.Thread(target=self._deliver, args=(eid, batches, reads), daemon=True,
                             name="mmstore-helper-deliver")
        self.epoch = (eid, batches, t)
        t.start()

    def _read(self, eid: int, k: int) -> None:
        if self.epoch is None or self.epoch[0] != eid:
            return
        try:
            self.epoch[1].submit(k)
        except BaseException:  # noqa: BLE001 - cancelled, or the pool is gone: the deliver thread reports
            pass
        with self.cv:
            self.submitted = max(self.submitted, k)
            self.cv.notify_all()

    def _deliver(self, eid: int, batches: EpochBatches, reads: Any) -> None:
        """Answer each batch of the epoch, in order, once its reads are done."""
        fixed = set(self.loader._fixed)
        for k in range(batches.nbatches):
            with self.cv:
                while self.submitted < k and not batches.cancelled:
                    self.cv.wait()
            if batches.cancelled:
                return
            try:
                batches.wait_batch(k)
                extra = None
                if batches.ragged is not None:  # the ragged fields: fresh tensors, sent with the answer
                    extra = {f: v for f, v in batches.host_batch(k).items() if f not in fixed}
                reads.follow(k)
            except Cancelled:
                return
            except BaseException as exc:  # noqa: BLE001 - raised by the parent's next() for batch k
                self._send(("error", eid, k, exc_blob(exc)))
                return
            self._send(("done", eid, k, extra))

    def _send(self, msg: Any) -> None:
        try:
            self.channel.send(msg)
        except OSError:
            pass

    def _stop(self) -> None:
        if self.epoch is None:
            return
        _eid, batches, t = self.epoch
        self.epoch = None
        batches.inflight.cancel("ended")
        with self.cv:
            self.cv.notify_all()
        batches.inflight.wait()
        t.join()

    def _cancel(self) -> None:
        if self.epoch is not None:
            self.epoch[1].inflight.cancel("ended")
