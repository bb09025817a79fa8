"""Scale of the bookkeeping: open time, memory, ``len()`` and one read of a
store of many slots and of a store of many parts, against a small store.

The stores are built directly (not by an ingest): every file a finished
memmap store needs, with one ``|u1`` field, as sparse files. The record data
is zeros (a sparse hole costs no disk), ``_keys_offsets.npy`` is zeros (every
key empty: a valid key table whose last offset equals the empty
``_keys.bin``), and ``_checksums.npy`` is zeros too: the open never reads the
per-slot checksums, so zeros measure the open exactly, but a real store
needs real bytes there (8 per slot; a slot's checksum is 0 only for a hole),
as ``verify`` would report. The ``parts`` store has one slot per part, each
part's ``parts/<id>/u.npy`` a tiny file, its parts listed in a part table
(format 2.4, ``_parts.bin``, as the writers write it from 1,000 parts); the
``json-parts`` store is the same in the 2.2 form (``parts``, ``segments`` and
each part's file in the manifest's JSON), for comparison.

Each measurement runs in a fresh Python process (``mmstore.open``, then
``len()``, ``store[i]`` of a random ``i`` (the first read: for a store of
parts it reads and checks the part table, then that part's files) and of
another random ``i`` (a second part's first read), the process's peak RSS
(``VmHWM``: ``getrusage`` would count the memory of the process that built
the stores too, which the probe's ``exec`` inherits)), repeated; the medians are printed, and each one's
ratio against the smallest store.

Usage::

    python benchmarks/bench_scale.py [--dir /var/tmp/mmstore-scale]
        [--slots 1000 100000000] [--parts 1000000] [--json-parts 100000] [--reps 3] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

import numpy as np
import xxhash

from mmstore.format import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_FILE,
    FORMAT_NAME,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    PART_TABLE_FEATURE,
    PART_TABLE_FILE,
    PARTS_FEATURE,
    field_file,
    npy_header,
)
from mmstore.format.parttable import encode_part_table

FIELD = "u"
DT = np.dtype("|u1")
KEY = np.dtype("<u8")
_ZEROS = bytes(64 << 20)


def _zeros_digest(head: bytes, nbytes: int) -> str:
    """xxh3_64 of ``head`` followed by ``nbytes`` zero bytes (without reading a file)."""
    h = xxhash.xxh3_64(head)
    left = nbytes
    while left:
        n = min(left, len(_ZEROS))
        h.update(memoryview(_ZEROS)[:n])
        left -= n
    return h.hexdigest()


def _sparse_npy(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> int:
    head = npy_header(dtype, shape)
    size = len(head) + int(np.prod(shape, dtype=object)) * dtype.itemsize
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return size


def _bookkeeping(root: str, slots: int) -> tuple[dict[str, int], dict[str, str], str]:
    files = {
        CHECKSUMS_FILE: _sparse_npy(os.path.join(root, CHECKSUMS_FILE), KEY, (slots,)),
        KEYS_OFFSETS_FILE: _sparse_npy(os.path.join(root, KEYS_OFFSETS_FILE), KEY, (slots + 1,)),
    }
    open(os.path.join(root, KEYS_BLOB_FILE), "wb").close()
    files[KEYS_BLOB_FILE] = 0
    digests = {
        KEYS_OFFSETS_FILE: _zeros_digest(npy_header(KEY, (slots + 1,)), 8 * (slots + 1)),
        KEYS_BLOB_FILE: xxhash.xxh3_64(b"").hexdigest(),
    }
    return files, digests, _zeros_digest(b"", 8 * slots)


def _manifest(root: str, slots: int, files: dict[str, int], digests: dict[str, str], ck: str,
              extra: dict[str, object], version: list[int]) -> int:
    man = {
        "format": FORMAT_NAME, "version": version, "store_id": uuid.uuid4().hex, "backend": "memmap",
        "records": slots, "slots": slots, "schema": [{"name": FIELD, "dtype": DT.str, "shape": []}],
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "digest": ck}, "files": files, "digests": digests,
        "label_names": None, "provenance": {"source": "benchmarks/bench_scale.py"}, **extra,
    }
    raw = json.dumps(man, separators=(",", ":")).encode()
    with open(os.path.join(root, MANIFEST_FILE), "wb") as f:
        f.write(raw)
    return len(raw)


def build_plain(root: str, slots: int) -> None:
    """A one-segment memmap store of ``slots`` slots (sparse files)."""
    os.makedirs(root)
    files, digests, ck = _bookkeeping(root, slots)
    files[field_file(FIELD)] = _sparse_npy(os.path.join(root, field_file(FIELD)), DT, (slots,))
    _manifest(root, slots, files, digests, ck, {}, [1, 0])


def build_parts(root: str, nparts: int, table: bool = True) -> None:
    """A store of ``nparts`` parts of one slot each: format 2.4, its parts in a
    part table, or (``table=False``) 2.2, its parts in the manifest."""
    os.makedirs(root)
    files, digests, ck = _bookkeeping(root, nparts)
    head = npy_header(DT, (1,))
    tag = uuid.uuid4().hex[:8]
    ids = [f"{k:07d}-{tag}" for k in range(nparts)]
    body = head + b"\0"
    for pid in ids:
        d = os.path.join(root, "parts", pid)
        os.makedirs(d)
        with open(os.path.join(d, FIELD + ".npy"), "wb") as f:
            f.write(body)
        if not table:
            files[field_file(FIELD, pid)] = len(body)
    if not table:
        _manifest(root, nparts, files, digests, ck,
                  {"segments": [1] * nparts, "parts": ids, "requires": [PARTS_FEATURE]}, [2, 2])
        return
    raw = encode_part_table(ids, [1] * nparts, [[len(body)]] * nparts)
    with open(os.path.join(root, PART_TABLE_FILE), "wb") as f:
        f.write(raw)
    files[PART_TABLE_FILE] = len(raw)
    digests[PART_TABLE_FILE] = xxhash.xxh3_64(raw).hexdigest()
    _manifest(root, nparts, files, digests, ck,
              {"part_table": {"file": PART_TABLE_FILE, "parts": nparts},
               "requires": [PARTS_FEATURE, PART_TABLE_FEATURE]}, [2, 4])


def build_json_parts(root: str, nparts: int) -> None:
    """``build_parts`` in the 2.2 form (the parts in the manifest's JSON)."""
    build_parts(root, nparts, table=False)


_PROBE = r"""
import json, random, resource, sys, time
t0 = time.perf_counter()
import mmstore
t1 = time.perf_counter()
s = mmstore.open(sys.argv[1])
t2 = time.perf_counter()
n = len(s)
t3 = time.perf_counter()
rec = s[random.randrange(n)]
t4 = time.perf_counter()
rec = s[random.randrange(n)]
t5 = time.perf_counter()
assert rec["u"].shape == ()
try:  # this process's own peak (getrusage's also counts the parent's memory, the stores' builder, across exec)
    with open("/proc/self/status") as f:
        peak = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")) / 1024
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"import_s": t1 - t0, "open_s": t2 - t1, "len_s": t3 - t2, "getitem_s": t4 - t3,
                  "getitem2_s": t5 - t4, "len": n, "peak_rss_mb": peak}))
"""


def measure(root: str, reps: int) -> dict[str, float]:
    runs = []
    for _ in range(reps):
        out = subprocess.run([sys.executable, "-c", _PROBE, root], check=True, capture_output=True, text=True)
        runs.append(json.loads(out.stdout))
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    med["manifest_bytes"] = os.path.getsize(os.path.join(root, MANIFEST_FILE))
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/mmstore-scale")
    ap.add_argument("--slots", type=int, nargs="+", default=[1000, 100_000_000])
    ap.add_argument("--parts", type=int, nargs="*", default=[1_000_000])
    ap.add_argument("--json-parts", type=int, nargs="*", default=[],
                    help="part counts of stores in the 2.2 form (parts in the manifest), for comparison")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the stores (default: delete them)")
    ap.add_argument("--reuse", action="store_true", help="measure the stores a run with --keep left, not new ones")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    stores = [(f"{n} slots", os.path.join(a.dir, f"slots-{n}"), build_plain, n) for n in a.slots]
    stores += [(f"{n} parts", os.path.join(a.dir, f"parts-{n}"), build_parts, n) for n in a.parts]
    stores += [(f"{n} json parts", os.path.join(a.dir, f"json-parts-{n}"), build_json_parts, n) for n in a.json_parts]
    base: dict[str, float] | None = None
    print(f"{'store':>18} {'build s':>8} {'manifest B':>12} {'open ms':>9} {'x':>7} {'RSS MB':>8} {'x':>6} "
          f"{'len ms':>8} {'[i] ms':>8} {'[j] ms':>8}")
    try:
        for label, root, build, n in stores:
            t = time.perf_counter()
            if not (a.reuse and os.path.isfile(os.path.join(root, MANIFEST_FILE))):
                shutil.rmtree(root, ignore_errors=True)
                build(root, n)
            built = time.perf_counter() - t
            m = measure(root, a.reps)
            base = base or m
            print(f"{label:>18} {built:8.1f} {m['manifest_bytes']:12.0f} {1e3 * m['open_s']:9.1f} "
                  f"{m['open_s'] / base['open_s']:7.1f} {m['peak_rss_mb']:8.0f} "
                  f"{m['peak_rss_mb'] / base['peak_rss_mb']:6.1f} {1e3 * m['len_s']:8.3f} "
                  f"{1e3 * m['getitem_s']:8.2f} {1e3 * m['getitem2_s']:8.2f}", flush=True)
            if not a.keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not a.keep:
            shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
