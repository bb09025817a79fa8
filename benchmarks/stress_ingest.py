#!/usr/bin/env python
"""Stress the ingest's crash safety: kill it again and again, resume, compare bytes.

Usage::

    .venv/bin/python benchmarks/stress_ingest.py --n 400 --trials 20 [--seed 1] [--workdir DIR]

Each trial runs ``mmstore ingest`` in a subprocess and interrupts it one or
more times at random moments (SIGKILL mostly, sometimes SIGINT or SIGTERM, or
an ``MMSTORE_CRASH_AT`` fault point), then resumes with a random worker count
and chunk size until it finishes, and checks that every file of the store
(except ``manifest.json``) is byte-identical to an uninterrupted run, and
that no worker process outlived its parent. Exit status 1 on any mismatch.

With ``--shards N`` each trial instead ingests the N parts of ``--shard K/N``
(each interrupted and resumed the same way), then merges them, in a shuffled
order, sometimes killing the merge at a random crash point first; the merged
(segmented) store's files, with each field's segments laid end to end, must
be byte-identical to the uninterrupted single-run store's.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from support.compare import store_bytes as files  # noqa: E402 - every file but the manifest


def make_inputs(root: str, n: int, seed: int) -> None:
    import cv2

    rng = np.random.default_rng(seed)
    for i in range(n):
        d = os.path.join(root, f"class{i % 5}")
        os.makedirs(d, exist_ok=True)
        h, w = (int(v) for v in rng.integers(40, 160, 2))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        img = cv2.GaussianBlur(img, (0, 0), 3)
        ext = ".jpg" if i % 3 else ".png"
        ok, buf = cv2.imencode(ext, img)
        data = buf.tobytes()
        if i % 37 == 5:
            data = data[: len(data) // 2]  # truncated
        if i % 53 == 7:
            data = b"<html>not an image</html>"
        with open(os.path.join(d, f"{i:05d}{ext}"), "wb") as fh:
            fh.write(data)


def run(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    e = dict(os.environ, PYTHONPATH=REPO)
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "mmstore", *argv], env=e, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def survivors(dest: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if dest.encode() in fh.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def flattened(path: str) -> dict[str, bytes]:
    """The files of a store, a segmented store's segments joined into the
    single-store file each field would be (same header, data end to end)."""
    from mmstore.format.layout import npy_header
    from mmstore.format.manifest import read_manifest
    from mmstore.format.schema import Schema

    m = read_manifest(path)
    out = files(path)
    if m.get("segments") is None:
        return out
    for f in Schema(m["schema"]):
        parts = []
        for k in range(len(m["segments"])):
            raw = out.pop(f"{f.name}.{k:05d}.npy")
            parts.append(raw[int.from_bytes(raw[8:10], "little") + 10 :])
        out[f"{f.name}.npy"] = npy_header(f.dtype, (m["slots"], *f.shape)) + b"".join(parts)
    return dict(sorted(out.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--size", default="48x48")
    ap.add_argument("--workdir")
    ap.add_argument("--shards", type=int, default=0, help="ingest N shards per trial, then merge them")
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    work = a.workdir or tempfile.mkdtemp(prefix="mmstore-stress-")
    os.makedirs(work, exist_ok=True)
    bad = 0
    try:
        src = os.path.join(work, "src")
        if not os.path.isdir(src):
            make_inputs(src, a.n, a.seed)
        ref = os.path.join(work, "ref.store")
        shutil.rmtree(ref, ignore_errors=True)
        t0 = time.monotonic()
        p = run(["ingest", src, ref, "--size", a.size, "-q", "--workers", "2"])
        assert p.wait() == 0, p.stderr.read().decode()
        full = time.monotonic() - t0
        want = files(ref)
        print(f"reference: {a.n} inputs in {full:.1f} s")
        def interrupted(t: int, dest: str, extra: list[str]) -> tuple[int, list[str]]:
            """Ingest into ``dest`` with 1-3 random interruptions, then finish it."""
            nonlocal bad
            events = []
            for _attempt in range(rnd.randint(1, 3)):
                workers = str(rnd.choice([0, 1, 2, 3]))
                chunk = str(rnd.choice([1, 4, 16, 64]))
                how = rnd.choice(["kill", "kill", "kill", "int", "term", "crash"])
                env = {}
                if how == "crash":
                    env["MMSTORE_CRASH_AT"] = (f"{rnd.choice(['write', 'fsync', 'commit', 'rename', 'any'])}:"
                                               f"{rnd.randint(1, 300)}")
                p = run(["ingest", src, dest, "--size", a.size, "-q", "--resume", "--workers", workers,
                         "--chunk", chunk, *extra], env)
                if how != "crash":
                    time.sleep(rnd.uniform(0.05, full * 1.1 / max(1, a.shards)))
                    p.send_signal({"kill": signal.SIGKILL, "int": signal.SIGINT, "term": signal.SIGTERM}[how])
                rc = p.wait()
                err = p.stderr.read().decode()
                events.append(f"{how}{'(' + env.get('MMSTORE_CRASH_AT', '') + ')' if env else ''}"
                              f" w{workers} c{chunk} -> rc {rc}")
                startup_int = how == "int" and err.rstrip().endswith("KeyboardInterrupt")  # before main() ran
                if rc not in (0, 1, 77, 130, -9, -2, -15) or ("Traceback" in err and not startup_int):
                    print(f"trial {t}: unexpected exit {rc}:\n{err[-2000:]}")
                    bad += 1
                deadline = time.monotonic() + 5
                while survivors(dest) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if survivors(dest):
                    print(f"trial {t}: processes survived their parent: {survivors(dest)}")
                    bad += 1
            p = run(["ingest", src, dest, "--size", a.size, "-q", "--resume", "--workers", "2", *extra])
            return p.wait(), events

        for t in range(a.trials):
            dest = os.path.join(work, f"t{t}.store")
            shutil.rmtree(dest, ignore_errors=True)
            shutil.rmtree(dest + ".partial", ignore_errors=True)
            if not a.shards:
                rc, events = interrupted(t, dest, [])
                ok = rc == 0 and files(dest) == want
            else:
                parts, events, rc = [], [], 0
                for k in range(a.shards):
                    part = os.path.join(work, f"t{t}.part{k}")
                    shutil.rmtree(part, ignore_errors=True)
                    shutil.rmtree(part + ".partial", ignore_errors=True)
                    prc, ev = interrupted(t, part, ["--shard", f"{k}/{a.shards}"])
                    rc |= prc
                    events.append(f"shard {k}: " + ", ".join(ev))
                    parts.append(part)
                rnd.shuffle(parts)
                if rnd.random() < 0.5:
                    at = f"any:{rnd.randint(1, 12 + 4 * a.shards)}"
                    p = run(["merge", *parts, dest, "-q"], {"MMSTORE_CRASH_AT": at})
                    events.append(f"merge crash({at}) -> rc {p.wait()}")
                p = run(["merge", *parts, dest, "-q", "--overwrite"])
                rc |= p.wait()
                ok = rc == 0 and flattened(dest) == want
            bad += not ok
            print(f"trial {t}: {'ok ' if ok else 'MISMATCH'} " + "; ".join(events))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("all identical" if not bad else f"{bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
