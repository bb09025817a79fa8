"""Running things elsewhere: the CLI in this process or as a child process
(``python -m mmstore`` from this checkout), and a function in a forked child
so that a crash (SIGBUS, SIGSEGV) or a hang is a test failure, not the end of
the test run."""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, NamedTuple

from mmstore.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the CLI --------------------------------------------------------------------------------


def cli(*argv) -> int:
    """``mmstore argv...`` in this process; its exit code."""
    return main([str(a) for a in argv])


def run_cli(argv, capsys):
    """main(argv) in-process; return (rc, stdout, stderr)."""
    capsys.readouterr()
    rc = cli(*argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(argv, capsys):
    """main(argv + --json) in-process; return (rc, the parsed report)."""
    rc, out, _ = run_cli(list(argv) + ["--json"], capsys)
    return rc, json.loads(out)


def cli_env(**extra: str) -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH (plus ``extra``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_sub(argv, timeout=120, **kw) -> subprocess.CompletedProcess:
    """``python -m mmstore argv...`` in a child process, text output captured."""
    return subprocess.run([sys.executable, "-m", "mmstore", *[str(a) for a in argv]], capture_output=True,
                          text=True, timeout=timeout, env=kw.pop("env", None) or cli_env(), cwd=REPO, **kw)


def popen_cli(argv, env=None, **kw) -> subprocess.Popen:
    """``python -m mmstore argv...`` started as a child process (``env``
    entries added to ours); ``kw`` goes to Popen."""
    return subprocess.Popen([sys.executable, "-m", "mmstore", *map(str, argv)], env=cli_env(**(env or {})),
                            cwd=REPO, **kw)


def killable_cli(argv) -> subprocess.Popen:
    """``popen_cli`` for a child that a test will SIGKILL: its own session,
    stdout discarded, stderr (bytes) captured."""
    return popen_cli(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def kill_after(proc: subprocess.Popen, delay: float, group: bool = False) -> bool:
    """SIGKILL ``proc`` (its process group with ``group``) after ``delay`` s
    unless it ended; True if killed."""
    t_end = time.monotonic() + delay
    killed = False
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            break
        time.sleep(0.002)
    else:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGKILL)
            killed = True
        except ProcessLookupError:
            pass
    proc.communicate()  # reap it and close its pipes
    return killed


# -- a function in a forked child ------------------------------------------------------------


class Result(NamedTuple):
    kind: str  # "ok" | "raised" | "signal" | "timeout"
    value: Any = None  # ok: the return value; raised: (type name, message, [MRO names]); signal: its name

    def raised(self, name: str) -> bool:
        """The child raised an exception of class ``name`` (or a subclass)."""
        return self.kind == "raised" and name in self.value[2]


def _child_main(r: int, w: int, fn: Any, args: tuple) -> None:
    """In the child: run ``fn(*args)``, write the pickled outcome to ``w``, exit."""
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


def _read_until_exit(r: int, pid: int, timeout: float) -> tuple[bytes, int] | None:
    """All the child writes to ``r``, and its wait status, once it has exited;
    None (child killed) after ``timeout``. The child's exit, not EOF, ends the
    read: a process the child forked (a DataLoader worker) inherits the pipe
    and may hold it open for seconds after the child is gone."""
    buf = b""
    deadline = time.monotonic() + timeout
    status = None  # the child's wait status once it has exited
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        ready, _, _ = select.select([r], [], [], 0 if status is not None else min(left, 0.2))
        if ready:
            chunk = os.read(r, 1 << 16)
            if chunk:
                buf += chunk
                continue
            return buf, status if status is not None else os.waitpid(pid, 0)[1]  # EOF: all writers gone
        if status is not None:
            return buf, status  # exited, and the pipe is drained
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st


def in_child(fn: Any, *args: Any, timeout: float = 120.0) -> Result:
    """``fn(*args)`` in a forked child: its return value (picklable), the
    exception it raised, the signal that killed it, or a timeout."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child_main(r, w, fn, args)
    os.close(w)
    try:
        got = _read_until_exit(r, pid, timeout)
    finally:
        os.close(r)
    if got is None:
        return Result("timeout")
    buf, status = got
    if os.WIFSIGNALED(status):
        return Result("signal", signal.Signals(os.WTERMSIG(status)).name)
    if not buf:
        return Result("raised", ("NoResult", f"exit status {status}", []))
    kind, value = pickle.loads(buf)
    return Result(kind, value)
