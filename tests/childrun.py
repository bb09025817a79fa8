"""Run a function in a forked child, so a crash (SIGBUS, SIGSEGV) or a hang
is a test failure, not the end of the test run (importable as ``childrun``)."""

from __future__ import annotations

import os
import pickle
import select
import signal
import time
import traceback
from typing import Any, NamedTuple


class Result(NamedTuple):
    kind: str  # "ok" | "raised" | "signal" | "timeout"
    value: Any = None  # ok: the return value; raised: (type name, message, [MRO names]); signal: its name

    def raised(self, name: str) -> bool:
        """The child raised an exception of class ``name`` (or a subclass)."""
        return self.kind == "raised" and name in self.value[2]


def in_child(fn: Any, *args: Any, timeout: float = 120.0) -> Result:
    """``fn(*args)`` in a forked child: its return value (picklable), the
    exception it raised, the signal that killed it, or a timeout."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(r)
            try:
                out = ("ok", fn(*args))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                out = ("raised", (type(exc).__name__, f"{exc}\n{traceback.format_exc()[-3000:]}",
                                  [c.__name__ for c in type(exc).__mro__]))
            data = pickle.dumps(out)
            while data:
                data = data[os.write(w, data):]
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return Result("timeout")
            ready, _, _ = select.select([r], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(r, 1 << 16)
                if chunk:
                    buf += chunk
                    continue
                break  # EOF: the child closed its end (exited)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
    if os.WIFSIGNALED(status):
        return Result("signal", signal.Signals(os.WTERMSIG(status)).name)
    if not buf:
        return Result("raised", ("NoResult", f"exit status {status}", []))
    kind, value = pickle.loads(buf)
    return Result(kind, value)
