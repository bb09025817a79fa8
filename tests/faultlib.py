"""Shared machinery of the fault-injection suite (importable as ``faultlib``).

Runs of the ingest happen in forked children of the test process (cheap: no
new interpreter, no re-import) with ``--workers 0`` so every write, fsync,
commit and rename happens in that child, where ``NOTE [crash points]`` in
``mmstore/_crash.py`` can stop it at the k-th occurrence with ``os._exit(77)``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np

CRASHED = 77
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_source(root: str, n_per_class: int = 5, seed: int = 0, broken: bool = True) -> str:
    """A small ImageFolder of photo-like JPEG/PNG files, plus broken ones."""
    import cv2

    rng = np.random.default_rng(seed)
    for c in ("ant", "bee"):
        d = os.path.join(root, c)
        os.makedirs(d, exist_ok=True)
        for i in range(n_per_class):
            h, w = (int(v) for v in rng.integers(24, 60, 2))
            y, x = np.mgrid[0:h, 0:w]
            img = np.stack([x * 255 // w, y * 255 // h, np.full_like(x, int(rng.integers(0, 255)))], -1)
            img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
            ext = ".jpg" if i % 2 == 0 else ".png"
            ok, buf = cv2.imencode(ext, img)
            assert ok
            with open(os.path.join(d, f"{i:03d}{ext}"), "wb") as fh:
                fh.write(buf.tobytes())
    if broken:
        with open(os.path.join(root, "ant", "zz_empty.jpg"), "wb"):
            pass
        with open(os.path.join(root, "bee", "zz_html.jpg"), "wb") as fh:
            fh.write(b"<html><body>404 not found</body></html>")
    return root


def ingest_argv(src: str, dest: str, *extra: str) -> list[str]:
    return ["ingest", src, dest, "--size", "16x16", "--workers", "0", "--quiet", "--chunk", "3", *extra]


def run_forked(argv: list[str], crash: str = "", setup=None) -> int:
    """Run ``mmstore.cli.main(argv)`` in a forked child; return its exit code.

    ``crash`` is a ``MMSTORE_CRASH_AT`` value (``phase:k``); ``setup`` is called
    in the child first (to monkeypatch fault injectors).
    """
    pid = os.fork()
    if pid == 0:  # child
        rc = 98
        try:
            from mmstore import _crash

            _crash.arm(crash)
            if setup is not None:
                setup()
            from mmstore.cli import main

            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            rc = main(argv)
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


def store_bytes(path: str) -> dict[str, bytes]:
    """Every file of a store but the manifest (which holds a time and a random id)."""
    out = {}
    for name in sorted(os.listdir(path)):
        if name != "manifest.json":
            with open(os.path.join(path, name), "rb") as fh:
                out[name] = fh.read()
    return out


def content_ok(path: str) -> bool:
    """Recompute every record's checksum; True when all match (a mini verify
    that does not depend on the tools package)."""
    import xxhash

    import mmstore

    s = mmstore.open(path)
    ck = s.checksums()
    holes = set(e["slot"] for e in s.skipped())
    for slot, packed in s.backend.iter_packed(0, s.slots):
        if slot in holes:
            if ck[slot] != 0:
                return False
            continue
        if packed is None or xxhash.xxh3_64_intdigest(bytes(packed)) != int(ck[slot]):
            return False
    s.close()
    return True


def cli_subprocess(argv: list[str], **kw) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-m", "mmstore", *argv], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, **kw)


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
