"""Fault injection: ingest runs in forked children stopped at crash points,
damaged files and manifests, small file systems, dropped root privileges.

Runs of the ingest happen in forked children of the test process (cheap: no
new interpreter, no re-import) with ``--workers 0`` so every write, fsync,
commit and rename happens in that child, where ``NOTE [crash points]`` in
``mmstore/_os/crash.py`` can stop it at the k-th occurrence with ``os._exit(77)``.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess

import xxhash

import mmstore
from mmstore._os import crash as _crash
from mmstore.cli import main
from mmstore.store.writer import file_digest

CRASHED = 77


# -- ingest runs that crash ----------------------------------------------------------------


def ingest_argv(src: str, dest: str, *extra: str) -> list[str]:
    return ["ingest", src, dest, "--size", "16x16", "--workers", "0", "--quiet", "--chunk", "3", *extra]


def _forked_cli(argv: list[str], crash: str, setup) -> int:
    """In the child: arm the crash point, run ``setup``, then the CLI silenced."""
    _crash.arm(crash)
    if setup is not None:
        setup()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    return main(argv)


def run_forked(argv: list[str], crash: str = "", setup=None) -> int:
    """Run ``mmstore.cli.main(argv)`` in a forked child; return its exit code.

    ``crash`` is a ``MMSTORE_CRASH_AT`` value (``phase:k``); ``setup`` is called
    in the child first (to monkeypatch fault injectors).
    """
    pid = os.fork()
    if pid == 0:  # child
        rc = 98
        try:
            rc = _forked_cli(argv, crash, setup)
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            rc = 99
            if os.environ.get("MMSTORE_FAULT_DEBUG"):
                import traceback

                with open(os.environ["MMSTORE_FAULT_DEBUG"], "a") as fh:
                    traceback.print_exc(file=fh)
        finally:
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def content_ok(path: str) -> bool:
    """Recompute every record's checksum; True when all match (a mini verify
    that does not depend on the tools package)."""
    with mmstore.open(path) as s:
        ck = s.slot_view.checksums()
        holes = set(e["slot"] for e in s.skipped())
        for slot, packed in s.slot_view.backend.iter_packed(0, s.slots):
            if slot in holes:
                if ck[slot] != 0:
                    return False
                continue
            if packed is None or xxhash.xxh3_64_intdigest(bytes(packed)) != int(ck[slot]):
                return False
    return True


# -- damaged files and manifests -----------------------------------------------------------


def flip_bit(path, offset: int, bit: int = 0) -> None:
    """Flip one bit of the byte at ``offset`` of the file ``path``."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ (1 << bit)]))


def edit_manifest(store, fn) -> None:
    """Load ``store``'s manifest, let ``fn`` change it in place, write it back."""
    mp = os.path.join(store, "manifest.json")
    with open(mp) as fh:
        m = json.load(fh)
    fn(m)
    with open(mp, "w") as fh:
        json.dump(m, fh)


def sync_manifest(store, name: str, digest: bool = False) -> None:
    """Make the manifest list file ``name``'s current size (and, with
    ``digest``, its digest where one is listed), as a crafted store would."""
    path = os.path.join(store, name)

    def fix(m):
        m["files"][name] = os.path.getsize(path)
        if digest and name in m.get("digests", {}):
            m["digests"][name] = file_digest(path, 0)

    edit_manifest(store, fix)


def rewrite_file(store, name: str, data: bytes, digest: bool = False) -> None:
    """Replace store file ``name`` with ``data`` and ``sync_manifest`` it."""
    with open(os.path.join(store, name), "wb") as fh:
        fh.write(data)
    sync_manifest(store, name, digest)


def flip_lmdb_bits(store, slots, pos: int, mask: int = 1, name: str = "records.mdb", digest: bool = False) -> None:
    """XOR ``mask`` into byte ``pos`` of the LMDB value of each of ``slots``
    (damage LMDB itself cannot see), then ``sync_manifest`` the file."""
    import lmdb

    env = lmdb.open(os.path.join(store, name), subdir=False, lock=False)
    try:
        with env.begin(write=True) as txn:
            for slot in slots:
                k = int(slot).to_bytes(8, "big")
                v = bytearray(txn.get(k))
                v[pos] ^= mask
                txn.put(k, bytes(v))
    finally:
        env.close()
    sync_manifest(store, name, digest)


# -- small file systems and privileges -----------------------------------------------------


def mount_tmpfs(path: str, size) -> bool:
    """Mount a tmpfs of ``size`` (bytes or "16k") at ``path``; False where not permitted."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return r.returncode == 0


def mount_ext4(image: str, path: str, size: int) -> bool:
    """Make an ext4 file system of ``size`` bytes in the file ``image`` and
    loop-mount it at ``path``; False where that is not permitted."""
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        return False
    with open(image, "wb") as fh:
        fh.truncate(size)
    for cmd in (["mkfs.ext4", "-q", "-F", image], ["mount", "-o", "loop", image, path]):
        try:
            if subprocess.run(cmd, capture_output=True).returncode != 0:
                return False
        except FileNotFoundError:
            return False
    return True


def umount(path: str) -> None:
    subprocess.run(["umount", path], capture_output=True)


def drop_dac_override() -> None:
    """As root, in a child before exec: drop CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH from the bounding set, so the exec'd process (still
    uid 0) obeys file permissions like a normal user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP failed")
