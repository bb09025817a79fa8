"""``disk_info``: best-effort facts about the filesystem and block device behind a path."""

from __future__ import annotations

import os
from typing import Any

from . import proc
from .files import PathLike

__all__ = ["disk_info"]

_NETWORK_FS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "ceph",
    "glusterfs", "beegfs", "afs", "panfs", "wekafs", "9p", "ncpfs", "davfs",
})
_MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "shm", "hugetlbfs"})


def disk_info(path: PathLike) -> dict[str, Any]:
    """Best-effort facts about the storage behind ``path``. Never raises.

    Parameters
    ----------
    path : str or os.PathLike
        A file or directory; if it does not exist, its nearest existing parent
        is described (where a store *would* go).

    Returns
    -------
    dict
        ``path`` (the existing path described), ``mount_point``, ``fs_type``,
        ``source`` (mount source, e.g. ``/dev/nvme0n1p2``), ``device`` (whole
        block device name, e.g. ``nvme0n1``), ``rotational`` (bool: HDD),
        ``read_ahead_kb``, ``tmpfs`` (memory-backed: tmpfs/ramfs/shm; pages
        cannot be evicted), ``network`` (nfs, cifs, lustre, gpfs, ceph, ...
        and any FUSE filesystem), ``fuse``, ``free_bytes`` (available to
        unprivileged users), ``total_bytes``. A key it cannot fill is None
        (on non-Linux, everything but the statvfs figures).
    """
    info: dict[str, Any] = dict.fromkeys((
        "path", "mount_point", "fs_type", "source", "device", "rotational",
        "read_ahead_kb", "tmpfs", "network", "fuse", "free_bytes",
        "total_bytes"))
    try:
        p = os.path.abspath(os.fsdecode(path))
        while not os.path.exists(p) and os.path.dirname(p) != p:
            p = os.path.dirname(p)
        p = os.path.realpath(p)
        info["path"] = p
    except Exception:
        return info
    try:
        sv = os.statvfs(p)
        info["free_bytes"] = sv.f_bavail * sv.f_frsize
        info["total_bytes"] = sv.f_blocks * sv.f_frsize
    except Exception:
        pass
    try:
        _fill_mount(info, p, depth=0)
    except Exception:
        pass
    return info


def _block_queue(majmin: str) -> tuple[str | None, str | None]:
    """(whole-disk name, its /sys queue dir) for a block device "maj:min"."""
    try:
        p = os.path.realpath(f"/sys/dev/block/{majmin}")
    except OSError:
        return None, None
    for d in (p, os.path.dirname(p)):  # a partition's queue is its parent's
        q = os.path.join(d, "queue")
        if os.path.isdir(q):
            return os.path.basename(d), q
    return (os.path.basename(p) if os.path.exists(p) else None), None


def _mount_of(p: str) -> dict[str, str] | None:
    """The mount entry holding ``p``: the longest mount point, preferring
    the entry of ``p``'s own device, then the latest."""
    mounts = proc.parse_mountinfo()
    if not mounts:
        return None
    st_dev = os.stat(p).st_dev
    devstr = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    best, best_key = None, None
    for idx, m in enumerate(mounts):
        mp = m["mount_point"]
        if not (p == mp or p.startswith(mp.rstrip("/") + "/")):
            continue
        key = (len(mp), m["majmin"] == devstr, idx)
        if best_key is None or key > best_key:
            best, best_key = m, key
    return best


def _fill_mount(info: dict[str, Any], p: str, depth: int) -> None:
    best = _mount_of(p)
    if best is None:
        return
    fs = best["fs_type"]
    if depth == 0:
        info["mount_point"] = best["mount_point"]
        info["fs_type"] = fs
        info["source"] = best["source"]
        info["tmpfs"] = fs in _MEMORY_FS
        info["fuse"] = fs == "fuse" or fs.startswith("fuse.")
        info["network"] = (fs in _NETWORK_FS or fs.split(".")[0] in _NETWORK_FS
                           or bool(info["fuse"]))
    if info["tmpfs"] or info["network"]:
        return
    if _fill_device(info, best):
        return
    # overlay: describe the upper directory's filesystem if it is visible
    if fs == "overlay" and depth == 0:
        for opt in best["super_options"].split(","):
            if opt.startswith("upperdir="):
                up = opt[len("upperdir="):]
                if os.path.isdir(up):
                    _fill_mount(info, os.path.realpath(up), depth=1)
                return


def _fill_device(info: dict[str, Any], mount: dict[str, str]) -> bool:
    """The block device: from the mount's maj:min, else from the source
    node. False when neither names one."""
    candidates = [mount["majmin"]]
    src = mount["source"]
    if src.startswith("/dev/"):
        try:
            rdev = os.stat(src).st_rdev
            candidates.append(f"{os.major(rdev)}:{os.minor(rdev)}")
        except OSError:
            pass
    for mm in candidates:
        if mm.startswith("0:"):
            continue  # anonymous device (overlay, btrfs subvolume, ...)
        name, q = _block_queue(mm)
        if name is None:
            continue
        info["device"] = name
        if q is not None:
            rot = proc.read_int(os.path.join(q, "rotational"))
            info["rotational"] = None if rot is None else bool(rot)
            info["read_ahead_kb"] = proc.read_int(os.path.join(q, "read_ahead_kb"))
        return True
    return False
