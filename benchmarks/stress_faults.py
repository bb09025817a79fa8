#!/usr/bin/env python3
"""The long fault-injection run (the suite in tests/faults runs a sample of it).

    python benchmarks/stress_faults.py [--seeds 20] [--flips 1000] [--quick]

- crash points: every write, fsync, commit and rename of a small ingest, in
  turn, for both backends; after each crash, resume must end byte-identical;
- power cuts: un-fsynced writes dropped or garbled at every write;
- SIGKILL of the ingest's main process at random moments (--seeds);
- single-bit flips in record data (--flips): verify must name each record.

Prints one line per fault class: trials and how many ended as required.
Exits 1 if any trial did not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [REPO, os.path.join(REPO, "tests"), os.path.join(REPO, "tests", "faults")]

import numpy as np  # noqa: E402
from support.compare import store_bytes  # noqa: E402
from support.faults import CRASHED, content_ok, ingest_argv, run_forked  # noqa: E402
from support.images import make_source  # noqa: E402
from support.proc import kill_after, killable_cli  # noqa: E402


def crash_points(work, src, backend, phase, ref):
    ok = tried = 0
    k = 1
    while True:
        dest = os.path.join(work, f"c-{backend}-{phase}-{k}")
        rc = run_forked(ingest_argv(src, dest, "--backend", backend), crash=f"{phase}:{k}")
        if rc == 0:
            break
        tried += 1
        good = rc == CRASHED
        if good and os.path.exists(dest):
            good = store_bytes(dest) == ref and content_ok(dest)
        elif good:
            good = (run_forked(ingest_argv(src, dest, "--backend", backend, "--resume")) == 0
                    and store_bytes(dest) == ref)
        ok += good
        if not good:
            print(f"  FAILED: {backend} {phase}:{k}", flush=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(dest + ".partial", ignore_errors=True)
        k += 1
    return tried, ok


def power_cuts(work, src, mode, ref):
    from test_power_cut import _power_cut_at

    ok = tried = 0
    for k in range(1, 100_000):
        dest = os.path.join(work, f"p-{mode}-{k}")
        rc = run_forked(ingest_argv(src, dest), setup=_power_cut_at(k, mode))
        if rc == 0:
            break
        tried += 1
        good = rc == CRASHED
        if good and os.path.exists(dest):
            good = store_bytes(dest) == ref and content_ok(dest)
        elif good:
            good = run_forked(ingest_argv(src, dest, "--resume")) == 0 and store_bytes(dest) == ref
        ok += good
        if not good:
            print(f"  FAILED: power cut ({mode}) at write {k}", flush=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(dest + ".partial", ignore_errors=True)
    return tried, ok


def sigkills(work, seeds):
    from test_sigkill import _argv, resume_until_done

    src = make_source(os.path.join(work, "ksrc"), n_per_class=300)
    ref_dest = os.path.join(work, "kref")
    t0 = time.monotonic()
    p = killable_cli(_argv(src, ref_dest))
    p.communicate()
    duration = time.monotonic() - t0
    ref = store_bytes(ref_dest)
    killed = ok = partial = 0
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        dest = os.path.join(work, f"k{seed}")
        p = killable_cli(_argv(src, dest))
        if kill_after(p, float(rng.uniform(0.05, 1.0)) * duration):
            killed += 1
            partial += os.path.isdir(dest + ".partial")
            try:
                resume_until_done(src, dest)
                good = store_bytes(dest) == ref
            except AssertionError as exc:
                print(f"  FAILED: seed {seed}: {exc}", flush=True)
                good = False
        else:
            good = p.returncode == 0 and store_bytes(dest) == ref
        ok += good
        shutil.rmtree(dest, ignore_errors=True)
    return seeds, ok, killed, partial, duration


def bit_flips(work, flips):
    import mmstore
    from mmstore.check import verify_store

    path = os.path.join(work, "flips")
    n = 2000
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(path, {"image": ("|u1", (16, 16, 3)), "label": ("<i8", ())}, slots=n) as w:
        w.write_batch(0, {"image": rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8), "label": np.arange(n)},
                      keys=[f"src/{i}" for i in range(n)])
    store = mmstore.open(path)
    ok = 0
    for t in range(flips):
        name = ("image", "label")[int(rng.integers(0, 2))]
        fpath, off0, entry = store.slot_view.backend.field_location(name)
        slot = int(rng.integers(0, n))
        off = off0 + slot * entry + int(rng.integers(0, entry))
        bit = 1 << int(rng.integers(0, 8))
        with open(fpath, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)[0]
            fh.seek(off)
            fh.write(bytes([b ^ bit]))
            fh.flush()
            rep = verify_store(path, threads=2)
            good = [(r.slot, r.index, r.key) for r in rep.bad_records] == [(slot, slot, f"src/{slot}")]
            fh.seek(off)
            fh.write(bytes([b]))
        ok += good
        if not good:
            print(f"  FAILED: flip {t} in {name} slot {slot}: {rep.bad_records[:3]}", flush=True)
    return flips, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--flips", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="fewer phases (a smoke run)")
    ap.add_argument("--dir", help="work directory (default: a temporary one on disk)")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="mmstore-stress-", dir=args.dir)
    failed = False
    try:
        src = make_source(os.path.join(work, "src"), n_per_class=3 if args.quick else 5)
        refs = {}
        for backend in ("memmap", "lmdb"):
            d = os.path.join(work, f"ref-{backend}")
            assert run_forked(ingest_argv(src, d, "--backend", backend)) == 0
            refs[backend] = store_bytes(d)
        rows = []
        for backend in ("memmap", "lmdb"):
            for phase in ("write", "fsync", "commit", "rename"):
                t0 = time.monotonic()
                tried, ok = crash_points(work, src, backend, phase, refs[backend])
                rows.append((f"crash points, {backend}, {phase}", tried, ok, time.monotonic() - t0))
                print(f"{rows[-1][0]}: {tried} points, {ok} resumed identically ({rows[-1][3]:.0f} s)", flush=True)
        for mode in ("drop", "garble"):
            t0 = time.monotonic()
            tried, ok = power_cuts(work, src, mode, refs["memmap"])
            rows.append((f"power cut ({mode} unsynced writes)", tried, ok, time.monotonic() - t0))
            print(f"{rows[-1][0]}: {tried} cuts, {ok} resumed identically", flush=True)
        t0 = time.monotonic()
        seeds, ok, killed, partial, dur = sigkills(work, args.seeds)
        rows.append((f"SIGKILL ({killed} killed mid-run, {partial} left a .partial; run {dur:.1f} s)", seeds, ok,
                     time.monotonic() - t0))
        print(f"{rows[-1][0]}: {seeds} seeds, {ok} identical after resume", flush=True)
        t0 = time.monotonic()
        flips, ok = bit_flips(work, args.flips)
        rows.append(("single-bit flips (verify names the record)", flips, ok, time.monotonic() - t0))
        print(f"{rows[-1][0]}: {flips} flips, {ok} detected and named", flush=True)
        print("\n| fault class | trials | as required | seconds |\n|---|---|---|---|")
        for name, tried, ok, sec in rows:
            print(f"| {name} | {tried} | {ok} | {sec:.0f} |")
            failed |= ok != tried
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
