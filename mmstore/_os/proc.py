"""The process id without a system call, and parsers for the /proc and /sys files that ``memory`` and
``disk`` read (mountinfo, one-number files)."""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["NO_LIMIT", "current_pid", "parse_mountinfo", "read_int", "read_stat_key", "set_pdeathsig", "usable_cores"]

_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def current_pid() -> int:
    """``os.getpid()``, kept up to date across ``fork``: a per-record check of
    whether this is still the process that opened something costs no system call."""
    return _PID[0]

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX * page size (~2**63); v2
# writes "max". Anything at or above this is treated as "no limit".
NO_LIMIT = 1 << 62


def _unescape_mountinfo(s: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    if "\\" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s[i] == "\\" and i + 4 <= len(s) and s[i + 1:i + 4].isdigit():
            out.append(chr(int(s[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def parse_mountinfo(path: str = "/proc/self/mountinfo") -> list[dict[str, str]]:
    """One dict per mount (``majmin``, ``root``, ``mount_point``, ``fs_type``,
    ``source``, ``super_options``); [] when the file cannot be read."""
    entries: list[dict[str, str]] = []
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return entries
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        a = left.split()
        b = right.split()
        if len(a) < 5 or len(b) < 2:
            continue
        entries.append({
            "majmin": a[2],
            "root": _unescape_mountinfo(a[3]),
            "mount_point": _unescape_mountinfo(a[4]),
            "fs_type": b[0],
            "source": _unescape_mountinfo(b[1]),
            "super_options": b[2] if len(b) > 2 else "",
        })
    return entries


def read_int(path: str) -> int | None:
    """The integer a file holds (``"max"`` = :data:`NO_LIMIT`), or None."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return NO_LIMIT
    try:
        return int(text)
    except ValueError:
        return None


def read_stat_key(path: str, key: str) -> int | None:
    """The value of ``key`` in a ``key value`` per line file, or None."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
    except (OSError, ValueError):
        pass
    return None


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPU cores this process may keep busy: its affinity mask, lowered to
    the CPU quota of its cgroup where one is set (v2 ``cpu.max``, v1
    ``cpu/cpu.cfs_quota_us / cpu/cpu.cfs_period_us``, as a container sees them
    under ``cgroup_root``), rounded up; at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    quota = period = None
    try:
        with open(os.path.join(cgroup_root, "cpu.max"), encoding="ascii") as f:
            words = f.read().split()  # "QUOTA PERIOD" or "max PERIOD"
        if words[0] != "max":
            quota, period = int(words[0]), int(words[1])
    except (OSError, ValueError, IndexError):
        quota = read_int(os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us"))
        period = read_int(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us"))
    if quota is not None and period and 0 < quota < NO_LIMIT:
        n = min(n, -(-quota // period))
    return max(1, n)


def set_pdeathsig() -> None:
    """This process is killed (SIGKILL) when its parent dies (Linux; elsewhere nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux: its caller has another way to end it
        pass
