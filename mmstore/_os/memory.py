"""Memory figures: ``MemAvailable`` from /proc/meminfo and the limits of the process's cgroups (v1 and v2)."""

from __future__ import annotations

import os

from .proc import NO_LIMIT, parse_mountinfo, read_int, read_stat_key

__all__ = ["cgroup_levels", "effective_available", "mem_available", "memory_limit"]


def _meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    mult = 1024 if len(parts) > 1 and parts[1] == "kB" else 1
                    out[key.strip()] = int(parts[0]) * mult
    except OSError:
        pass
    return out


def mem_available() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes.

    The kernel's estimate of memory usable without swapping; it *includes*
    reclaimable page cache (so pages of a store already cached count as
    available). On kernels older than 3.14, ``MemFree + Buffers + Cached``.
    Returns None where ``/proc/meminfo`` does not exist (non-Linux). Ignores
    cgroup limits; see :func:`effective_available`.
    """
    info = _meminfo()
    if "MemAvailable" in info:
        return info["MemAvailable"]
    if "MemFree" in info:
        return info["MemFree"] + info.get("Buffers", 0) + info.get("Cached", 0)
    return None


def cgroup_levels(cgroup_file: str = "/proc/self/cgroup",
                  mountinfo_file: str = "/proc/self/mountinfo"
                  ) -> list[tuple[int, int | None, int]]:
    """``(limit, usage, reclaimable)`` for every cgroup level with a memory
    limit, from the process's cgroup up to the root of its mount (v2 and v1).
    ``usage`` may be None when unreadable; ``reclaimable`` is the level's
    inactive file cache (0 if unknown)."""
    try:
        with open(cgroup_file, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = parse_mountinfo(mountinfo_file)
    levels: list[tuple[int, int | None, int]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, controllers, cpath = parts
        if controllers == "":
            version, mount = 2, next(
                (m for m in mounts if m["fs_type"] == "cgroup2"), None)
        elif "memory" in controllers.split(","):
            version, mount = 1, next(
                (m for m in mounts if m["fs_type"] == "cgroup"
                 and "memory" in m["super_options"].split(",")), None)
        else:
            continue
        if mount is not None:
            levels += _levels_up(version, mount, cpath)
    return levels


def _levels_up(version: int, mount: dict[str, str], cpath: str) -> list[tuple[int, int | None, int]]:
    """The limited levels from cgroup ``cpath`` up to its mount's root."""
    mp, root = mount["mount_point"], mount["root"].rstrip("/")
    rel = cpath
    if root and (rel == root or rel.startswith(root + "/")):
        rel = rel[len(root):]
    leaf = os.path.normpath(mp + "/" + rel.lstrip("/"))
    if not os.path.isdir(leaf):
        # a path from outside this cgroup namespace: the mount itself
        # is the closest view of our cgroup we have
        leaf = mp
    names = (("memory.max", "memory.current", "inactive_file") if version == 2
             else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    levels: list[tuple[int, int | None, int]] = []
    d = leaf
    while True:
        limit = read_int(os.path.join(d, names[0]))
        if limit is not None and limit < NO_LIMIT:
            usage = read_int(os.path.join(d, names[1]))
            inactive = read_stat_key(os.path.join(d, "memory.stat"), names[2])
            levels.append((limit, usage, inactive or 0))
        if version == 1 and d == leaf:
            # v1 with use_hierarchy also knows the effective limit
            h = read_stat_key(os.path.join(d, "memory.stat"), "hierarchical_memory_limit")
            if h is not None and h < NO_LIMIT and (limit is None or h < limit):
                usage = read_int(os.path.join(d, names[1]))
                inactive = read_stat_key(os.path.join(d, "memory.stat"), names[2])
                levels.append((h, usage, inactive or 0))
        if os.path.normpath(d) == os.path.normpath(mp):
            break
        parent = os.path.dirname(d)
        if parent == d or not parent.startswith(mp):
            break
        d = parent
    return levels


def memory_limit() -> int | None:
    """The memory limit of the process's cgroup, in bytes, or None.

    The smallest limit set on the process's cgroup or any ancestor visible in
    the container (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes`` /
    ``hierarchical_memory_limit``). None when no limit is set ("max", or v1's
    ~2**63 "unlimited"), or there is no cgroup filesystem (non-Linux). Never
    raises.
    """
    try:
        levels = cgroup_levels()
    except Exception:
        return None
    return min((lim for lim, _, _ in levels), default=None)


def effective_available() -> int | None:
    """Memory this process can still fill with page cache, in bytes.

    ``min(MemAvailable, limit - working_set)`` over every limited cgroup level,
    where ``working_set = usage - inactive_file`` (the kubelet's definition:
    like MemAvailable, it treats inactive page cache as reclaimable). None if
    no figure is available (non-Linux). Never raises.
    """
    try:
        avail = mem_available()
        levels = cgroup_levels()
    except Exception:
        return None
    for limit, usage, inactive in levels:
        room = limit - max(0, (usage or 0) - inactive)
        room = max(0, room)
        avail = room if avail is None else min(avail, room)
    return avail
