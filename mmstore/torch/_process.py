"""``Loader(process=True)``: the reads in a helper process, the batches in shared memory.

Why
---
The reader threads of a :class:`~mmstore.torch.Loader` release the GIL for
their copies and decodes, but each batch still takes the GIL a few times in
them (the tasks, their futures, the order, the hand-over), and every time a
reader thread wants it back, the training loop's thread is made to give it
up. A loop whose thread is busy with Python (launching GPU kernels) loses that
time. With ``process=True`` the reader threads run in one helper process; the
training process keeps only the consumer's side: one small message per batch.

How
---
The ring's buffers are shared memory files (``memfd``, ``Ring(shared=True)``)
mapped by both processes. The helper runs a Loader of the same store, order,
fields, crop and tuning (built from the parent's configuration, with the
parent's ``prefetch``), whose ring is the same buffers
(:meth:`Ring.attached`), and serves epochs over a socket:

* the parent claims a buffer (the kept-batch check of ``_ring.py``, in the
  parent, where the batches are; a buffer still referenced there is replaced
  by a new shared file, sent to the helper with ``SCM_RIGHTS``) and asks for
  batch ``k`` to be read into it;
* the helper's threads read it (the same reads, windows, crops and fetches as
  in one process) and answer ``done k`` (with the batch's ragged fields,
  which are not in the ring), or the read's exception;
* ending an epoch early (``break``, ``close()``, a dropped iterator) asks the
  helper to cancel and waits for its answer before the ring is reused, as the
  threaded loader waits for its reads.

So the batches the parent yields are views of shared memory, and every rule
of ``loader.py``'s docstring holds as in one process: kept batches, resume
(the epoch, order and position live in the parent), DDP (the same order
object in both), errors (the helper's exception is raised by the ``next()``
that would yield the batch), garbage (a dropped loader closes its socket; the
helper exits when it sees the end of it, and also when the parent dies:
``PR_SET_PDEATHSIG``), fork (a forked child starts its own helper), pickling,
Ctrl-C (the helper is in its own session, so a terminal's Ctrl-C reaches only
the training process, which ends the epoch as usual).

The helper is started by the first ``iter()`` (a new Python process that
imports torch: about as long as a DataLoader worker's start) and lives as long
as the loader. It is a plain ``python -c`` process with the parent's
``sys.path``, never a fork, so it inherits nothing of the training process
(threads, CUDA, locks).
"""

from __future__ import annotations

import array
import os
import pickle
import socket
import struct
import sys
import threading
import time
from typing import Any

import torch

from ..errors import LoaderHelperError
from ._epoch import Cancelled
from ._ragged import to_device
from ._ring import Ring

__all__ = ["Channel", "Helper", "HelperBatches", "HelperEpoch", "exc_blob", "helper_setup"]

_HEAD = struct.Struct("<QI")  # payload bytes, descriptors sent with the header
_ANC = socket.CMSG_SPACE(64 * 4)  # room for the descriptors of one receive
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from mmstore.torch._helper import serve; serve(int(sys.argv[2]))")


class Channel:
    """Framed pickled messages over a stream socket, with descriptors.

    Received bytes accumulate in a buffer until a whole message is there, so
    an exception raised while waiting (Ctrl-C) loses nothing: the next
    :meth:`recv` goes on where it stopped."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._chunk = memoryview(bytearray(1 << 16))  # received into, then moved to _buf
        self._fds: list[int] = []
        self._send_lock = threading.Lock()

    def send(self, msg: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        head = _HEAD.pack(len(data), len(fds))
        with self._send_lock:
            if fds:
                socket.send_fds(self.sock, [head], list(fds))
                self.sock.sendall(data)
            else:
                self.sock.sendall(head + data)

    def recv(self) -> tuple[Any, list[int]]:
        """The next message and the descriptors sent with it; ``EOFError`` at the end."""
        while True:
            if len(self._buf) >= _HEAD.size:
                n, nfds = _HEAD.unpack_from(self._buf)
                if len(self._buf) >= _HEAD.size + n and len(self._fds) >= nfds:
                    data = bytes(self._buf[_HEAD.size : _HEAD.size + n])
                    del self._buf[: _HEAD.size + n]
                    fds, self._fds = self._fds[:nfds], self._fds[nfds:]
                    return pickle.loads(data), fds
            got, anc, _flags, _addr = self.sock.recvmsg_into([self._chunk], _ANC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got_fds = array.array("i")
                    got_fds.frombytes(data[: len(data) - len(data) % got_fds.itemsize])
                    self._fds += list(got_fds)
            if not got:
                raise EOFError("the other end of the loader's helper socket is closed")
            self._buf += self._chunk[:got]

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def exc_blob(exc: BaseException) -> tuple[bytes | None, str, str]:
    """An exception as it can cross to the parent: pickled when it can be
    rebuilt there (as it pickles, or from its class, ``args`` and attributes:
    the project's errors with their own constructors), and its type name and
    message in any case."""
    blob: bytes | None = None
    args = exc.args
    if isinstance(exc, OSError) and exc.filename is not None:  # OSError keeps its file names outside args
        args = (exc.errno, exc.strerror, exc.filename, None, exc.filename2)
    for form in (exc, (_Rebuilt, type(exc), args, dict(vars(exc)))):
        try:
            b = pickle.dumps(form)
            back = _load_exc(b)
        except Exception:  # noqa: BLE001 - not every exception survives pickling
            continue
        if type(back) is type(exc) and str(back) == str(exc):
            blob = b
            break
    return blob, type(exc).__name__, str(exc)


class _Rebuilt:
    """Marks an exception sent as (class, args, attributes)."""


def _load_exc(blob: bytes) -> BaseException:
    obj = pickle.loads(blob)
    if isinstance(obj, tuple) and len(obj) == 4 and obj[0] is _Rebuilt:
        _, cls, args, attrs = obj
        if issubclass(cls, OSError):  # its own __init__ is skipped: OSError's sets errno, strerror, filename
            exc = OSError.__new__(cls, *args)
            OSError.__init__(exc, *args)
        else:
            exc = cls.__new__(cls, *args)
            exc.args = args
        exc.__dict__.update(attrs)
        return exc
    return obj


def _exc_from(sent: tuple[bytes | None, str, str], pid: int) -> BaseException:
    """The exception :func:`exc_blob` sent (a ``LoaderHelperError`` with its
    type and message when it cannot be rebuilt here)."""
    blob, name, text = sent
    if blob is not None:
        try:
            exc = _load_exc(blob)
            if isinstance(exc, BaseException):
                return exc
        except Exception:  # noqa: BLE001
            pass
    return LoaderHelperError(f"mmstore.torch.Loader(process=True): the helper process (pid {pid}) raised "
                             f"{name}: {text}")


class Helper:
    """The parent's handle of one helper process: started with the loader's
    configuration and its ring's shared files."""

    def __init__(self, setup: dict[str, Any], ring: Ring) -> None:
        check_picklable(setup)
        _reap()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.set_inheritable(child.fileno(), True)
            self.pid = os.posix_spawn(
                sys.executable, [sys.executable, "-c", _BOOT, _json_path(), str(child.fileno())], os.environ,
                setsid=True,  # a terminal's Ctrl-C goes to the training process only
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        _SPAWNED.add(self.pid)
        self.status: int | None = None  # its exit code once reaped
        self.dead = False  # it stopped: the loader starts a new one for its next epoch
        self.channel = Channel(parent)
        self.epoch_id = 0  # the last epoch started in the helper
        self.running = False  # an epoch of it may still be reading
        self.recv_lock = threading.Lock()
        self.mail: dict[int, tuple[str, Any]] = {}  # batch -> ("done", ragged) or ("error", blob) of the epoch
        try:
            self.channel.send(("init", setup, ring.layout), [f.fd for f in ring.fds])  # type: ignore[union-attr]
            msg, _ = self._recv()
        except BaseException:
            self.close()
            raise
        if msg[0] != "ready":
            self.close()
            raise _exc_from(msg[1:], self.pid)

    def _recv(self) -> tuple[Any, list[int]]:
        try:
            return self.channel.recv()
        except (EOFError, OSError) as exc:
            raise self.died() from exc

    def died(self) -> LoaderHelperError:
        self.dead = True
        self.running = False
        code = self._wait(1.0)
        how = ("is still running but closed its socket" if code is None else
               f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        return LoaderHelperError(
            f"mmstore.torch.Loader(process=True): the helper process that reads the batches (pid {self.pid}) "
            f"{how}; the epoch in progress ended. iter(loader) starts a new helper (out of memory or a "
            "crash in a decoder are the usual causes: see the system log)"
        )

    def start(self, epoch: int, start: int, base: int, renewed: dict[int, int]) -> int:
        """Start epoch ``epoch`` from batch ``start`` in the helper, its
        batch ``k`` in buffer ``(base + k) % len(ring)`` (the first
        ``prefetch`` batches queued at once); ``renewed``: buffers whose file
        changed since the helper last saw them. Returns the epoch's id."""
        self.epoch_id += 1
        self.mail = {}
        self._send_slots(renewed)
        self.channel.send(("epoch", self.epoch_id, epoch, start, base))
        self.running = True
        return self.epoch_id

    def read(self, eid: int, k: int, renewed: dict[int, int]) -> None:
        self._send_slots(renewed)
        self.channel.send(("read", eid, k))

    def _send_slots(self, renewed: dict[int, int]) -> None:
        for s, fd in renewed.items():
            self.channel.send(("slot", s), [fd])

    def wait(self, eid: int, k: int) -> tuple[str, Any]:
        """The helper's answer for batch ``k`` of epoch ``eid``."""
        with self.recv_lock:
            while k not in self.mail:
                msg, _ = self._recv()
                if msg[0] in ("done", "error") and msg[1] == eid:
                    self.mail[msg[2]] = (msg[0], msg[3])
        return self.mail.pop(k)

    def stop(self, eid: int) -> None:
        """End epoch ``eid`` in the helper and wait until none of its reads
        write into the ring any more."""
        if not self.running or self.epoch_id != eid:
            return
        with self.recv_lock:
            self.channel.send(("stop", eid))
            while True:
                msg, _ = self._recv()
                if msg[0] == "stopped" and msg[1] == eid:
                    break
            self.running = False
            self.mail = {}

    def _wait(self, seconds: float) -> int | None:
        """Its exit code, waiting up to ``seconds`` for it to end (None: still running)."""
        end = time.monotonic() + seconds
        while self.status is None:
            self.status = _reap_one(self.pid)
            if self.status is not None or time.monotonic() > end:
                break
            time.sleep(0.01)
        return self.status

    def close(self) -> None:
        """Let the helper go (it exits when it sees the socket closed; it is
        reaped by a later helper's start or close). Never blocks."""
        self.channel.close()
        _reap()


_SPAWNED: set[int] = set()  # helpers started by this process and not yet reaped


def _reap_one(pid: int) -> int | None:
    """``pid``'s exit code (negative: the signal) if it has ended, else None; reaped."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # reaped elsewhere (or not our child after a fork)
        _SPAWNED.discard(pid)
        return 0
    if got == 0:
        return None
    _SPAWNED.discard(pid)
    return os.waitstatus_to_exitcode(status)


def _reap() -> None:
    for pid in list(_SPAWNED):
        _reap_one(pid)


def _json_path() -> str:
    import json

    return json.dumps([p for p in sys.path if isinstance(p, str)])


class HelperEpoch:
    """The parent's side of one epoch read by the helper: what an
    ``EpochIterator`` needs of its reads (``_epoch.InFlight``'s interface).
    ``cancel`` never blocks (finalizers); ``wait`` asks the helper to stop
    and waits for it (the consumer's thread)."""

    def __init__(self, helper: Helper) -> None:
        self.pid = os.getpid()
        self.helper = helper
        self.eid = -1
        self.cancelled = False
        self.reason = ""

    def cancel(self, reason: str) -> None:
        if not self.cancelled:
            self.reason = reason
            self.cancelled = True

    def wait(self) -> None:
        if self.pid != os.getpid() or self.eid < 0:
            return
        try:
            self.helper.stop(self.eid)
        except LoaderHelperError:
            pass  # it is gone: nothing of it writes into the ring


class HelperBatches:
    """``_epoch.EpochBatches``' interface over the helper: ``submit(k)``
    claims batch ``k``'s buffer and asks the helper to read it,
    ``wait_batch(k)`` waits for its answer, ``host_batch(k)`` is the batch."""

    def __init__(self, helper: Helper, *, epoch: int, start: int, rows: int, batch_size: int, drop_last: bool,
                 prefetch: int, ring: Ring, device: torch.device | None, check_kept: bool) -> None:
        self.helper = helper
        self.batch_size = batch_size
        self.nbatches = rows // batch_size if drop_last else -(-rows // batch_size)
        self.rows = rows
        self.ring = ring
        self.R = len(ring)
        self.base = ring.cursor
        self.device = device
        self.check_kept = check_kept
        self.stream = torch.cuda.Stream(device=device) if device is not None else None
        self.events: list[Any] = [None] * self.R
        self.ragged: dict[int, Any] = {}
        self.inflight = HelperEpoch(helper)
        first = min(prefetch, self.nbatches)
        renewed = {}
        for k in range(first):
            renewed.update(self._claim(k))
        self.inflight.eid = helper.start(epoch, start, self.base, renewed)

    @property
    def cancelled(self) -> bool:
        return self.inflight.cancelled

    def slot(self, k: int) -> int:
        return (self.base + k) % self.R

    def _claim(self, k: int) -> dict[int, int]:
        """Make batch ``k``'s buffer free to refill: the buffer's last copy to
        the GPU done, a fresh one if a batch of it is still referenced."""
        s = self.slot(k)
        ev, self.events[s] = self.events[s], None
        if ev is not None:
            ev.synchronize()
        if not self.check_kept:
            return {}
        before = self.ring.fds[s]
        self.ring.claim(s)
        after = self.ring.fds[s]
        return {} if after is before else {s: after.fd}  # type: ignore[union-attr]

    def submit(self, k: int) -> None:
        if self.cancelled:
            raise Cancelled()
        self.helper.read(self.inflight.eid, k, self._claim(k))

    def wait_batch(self, k: int) -> None:
        kind, payload = self.helper.wait(self.inflight.eid, k)
        if self.cancelled:  # Loader.close() from another thread while this one waited
            raise Cancelled()
        if kind == "error":
            raise _exc_from(payload, self.helper.pid)
        if payload is not None:
            self.ragged[k] = payload

    def host_batch(self, k: int) -> dict[str, torch.Tensor]:
        a = k * self.batch_size
        out = self.ring.batch(self.slot(k), min(self.batch_size, self.rows - a))
        extra = self.ragged.pop(k, None)
        if extra is not None:
            out.update(extra)
        return out

    def to_gpu(self, k: int) -> tuple[dict[str, torch.Tensor], Any]:
        self.wait_batch(k)
        host = self.host_batch(k)
        with torch.cuda.stream(self.stream):
            gpu = {f: to_device(t, self.device) for f, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self.events[self.slot(k)] = ev  # the buffer is refilled once this copy is done
        return gpu, ev


def helper_setup(ld: Any) -> dict[str, Any]:
    """What the helper builds its loader from: the parent's configuration
    without what runs in the parent (device, transform, output form)."""
    import dataclasses

    return {
        "store": ld.store, "batch_size": ld.batch_size, "order": ld.order, "fields": ld.fields,
        "drop_last": ld.drop_last, "ragged": ld.ragged, "pad_value": ld.pad_value, "indices": ld.indices,
        "crop": ld.crop, "tuning": dataclasses.replace(ld.tuning, prefetch=ld.prefetch),
    }


def check_picklable(setup: dict[str, Any]) -> None:
    """Refuse a configuration the helper cannot be sent, before it starts."""
    try:
        pickle.dumps(setup)
    except Exception as exc:  # noqa: BLE001 - any pickling failure
        raise TypeError(
            f"mmstore.torch.Loader(process=True) sends its store, order, indices and crop to a helper "
            f"process, but they cannot be pickled ({type(exc).__name__}: {exc}); use objects defined in an "
            "importable module, or process=False"
        ) from exc
