"""A server program the tests run (a storage emulator): on a free loopback port, in a session of
its own, its output in a file under its root, stopped by its own pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from typing import BinaryIO

_STOP_TIMEOUT = 10.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalServer:
    """The life of one server program: :meth:`command` and :meth:`answers` say what it is; its
    output goes to ``root/<output>``; ``error`` is raised when it cannot start."""

    name = "the server"
    error: type[RuntimeError] = RuntimeError
    poll_s = 0.05  # between two readiness requests

    def __init__(self, root: str, binary: str, output: str) -> None:
        self.root = os.path.abspath(root)
        self.binary = binary
        self.output = os.path.join(self.root, output)
        os.makedirs(self.root, exist_ok=True)
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: BinaryIO | None = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def answers(self) -> int:
        """One readiness request: its HTTP status (200: ready). Raises ``OSError`` when nothing answers."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout: float) -> None:
        """Start it; return once :meth:`answers` gives 200."""
        self._out = open(self.output, "ab")
        self._proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._out,
                                      stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True)
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while True:
            code = self._proc.poll()
            if code is not None:
                self._proc = None
                raise self.error(f"{self.name} exited with code {code} while starting\n{self.log_tail()}")
            try:
                status = self.answers()
                if status == 200:
                    return
                last = f"HTTP {status}"
            except OSError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                self.stop()
                raise self.error(f"{self.name} at {self.endpoint} did not answer within {timeout:.0f} s "
                                 f"(last: {last})\n{self.log_tail()}")
            time.sleep(self.poll_s)

    def stop(self) -> None:
        """Stop it by its own pid (its session holds it alone)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=_STOP_TIMEOUT)
        if self._out is not None:
            self._out.close()
            self._out = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.output, "rb") as f:
                text = f.read()[-32 * 1024:].decode("utf-8", "replace")
        except OSError:
            return "(no output)"
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"
