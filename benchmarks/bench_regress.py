#!/usr/bin/env python3
"""Regression benchmark: the project's key speed ratios, each against its own
baseline in the same run, compared with the ratios of a committed baseline file.

Usage::

    python benchmarks/bench_regress.py                      # the full run
    python benchmarks/bench_regress.py --quick              # fewer repetitions, the same data
    python benchmarks/bench_regress.py --json out.json      # the results as JSON too
    python benchmarks/bench_regress.py --write-baseline     # (re)write benchmarks/bench_regress_baseline.json
    python benchmarks/bench_regress.py --only read_batch,getitem --dir DIR   # keep the stores in DIR, reuse them

Run it before closing any change that touches a read path, and put its table
in the closing note. Exit status: 1 when a ratio fell by more than its noise
band, 0 otherwise (also when there is no baseline to compare with); 2 for a
usage error. It is a benchmark, not a test: nothing in the test suite runs it.

Data (written with ``mmstore.StoreWriter`` into a fresh directory on a real
disk, removed at the end unless ``--dir`` names one): ``--records`` (4,000)
records of a 224x224x3 uint8 image (smooth synthetic pictures with noise,
every record distinct) and an int64 label, memmap backend, the page cache
warm (each file evicted, then read once sequentially); the same images with
the image field JPEG-encoded (``jpeg:90``); and, for the memory-limit row, a
raw store of ``--ltr-records`` (8,000: 1.2 GB). Batches of 256, shuffled.

The ratios (higher is better in every row; "rate" is records/s unless said):

``read_batch_out_vs_ram``
    ``Store.read_batch(idx, out=)`` into buffers allocated once, against the
    in-RAM limit: the same shuffled batches' rows (image and label) copied from
    in-RAM numpy arrays into one buffer, the faster of ``np.take(..., out=)``
    and a per-row copy loop, both measured in the same repetition. The store is
    opened once and read once before timing (steady state: the mapping is set up).
``getitem_vs_npy_memmap``
    ``store[i]`` over random ``i`` against a plain numpy memmap read the same
    way: ``{"image": mm[i].copy(), "label": lb[i].copy()}`` with
    ``mm = np.load(<image .npy of Store.data_paths()>, mmap_mode="r")`` (and the
    label's ``.npy``), the same ``i``'s: one call per sample returning new
    arrays, as a hand-written ``Dataset.__getitem__`` does.
``loader_warm_vs_ram`` and ``loader_warm_vs_dataloader``
    ``mmstore.torch.Loader(path, 256)`` with its defaults, the rate of its epochs
    after a first (untimed) epoch, against the in-RAM limit (as above, full
    shuffled epochs) and against ``torch.utils.data.DataLoader(StoreDataset(path),
    batch_size=256, shuffle=True, num_workers=2)`` (workers started by each
    epoch, as those defaults do; one untimed epoch first too). Each DataLoader
    pass forks this process; one untimed pass of the Loader and of the in-RAM
    limit follows it, so the copy-on-write faults a fork leaves on their
    buffers are not timed (NOTE [a fork between passes]).
``loader_coldbuilt_vs_ram``
    The same Loader, built on the store right after its files were evicted
    (the way a training run starts), one untimed first (cold) epoch, then its
    warm epochs against the in-RAM limit: how the reads follow the page cache
    once it fills. A new Loader per repetition.
``compact_loader_vs_decode``
    The Loader (defaults) over the JPEG store, warm, one epoch after a first,
    against the decode limit: the store's own JPEG entries (read from
    ``image.bin`` with ``image.offsets.npy``, the layout of ``mmstore/format/__init__.py``)
    held in RAM and decoded by the field's own codec (``Field.codec.decode_into``,
    the call the reader makes) into one batch buffer, each shuffled batch cut into
    one contiguous piece per usable core, decoded by a pool of that many threads:
    the structure of the Loader's decoding epoch (NOTE [decode-bound reads] in
    ``mmstore/engine/reads.py``) without the store.
``block_ltr_vs_sequential``
    Under a cgroup-v1 memory limit (``--ltr-limit-mb``, 300 MB, a quarter of
    the 1.2 GB store) a child process in the cgroup, ``mmstore.torch`` imported
    first (outside the clock), reads one epoch with ``Loader(path, 256, "block")``
    (timed from the Loader's construction to its last batch, MB/s of record
    bytes) against one sequential read of the image ``.npy`` in 8 MiB chunks
    (MB/s), the store's files evicted before each pass. Where the cgroup cannot
    be made (not root, no ``/sys/fs/cgroup/memory``) the row says so and is
    skipped.

Measurement: every ratio is the median of per-repetition ratios; in each
repetition the subject and its baseline(s) run back to back, their order
rotated from one repetition to the next, so a noisy spell of a shared machine
lands on both sides. A timed pass of the warm raw rows is 3 epochs (one epoch
is a fraction of a second; ``DataLoader``: one epoch, its workers' start
included); the compact and memory-limit passes are one epoch. The table prints
the median and the range of the repetition ratios.

The noise band (how "fell" is decided): a ratio fell when this run's median is
below ``baseline x (1 - band)``, with

    band = max(FLOOR, spread of this run, spread of the baseline run)

A run's spread is the scatter of its k repetition ratios relative to their
median: the interquartile range ``(q3 - q1) / median`` when k >= 7, the range
``(max - min) / median`` when 4 <= k < 7, twice the range when k < 4. Why:
with normal noise of deviation d, the difference of two runs' medians of k
has a two-sigma band of about ``3.5 d / sqrt(k)``; the interquartile range
is about ``1.35 d``, so it covers that band from k = 7 on; the range of 4 to
6 repetitions (``2.1 d`` to ``2.5 d``) covers it there, and twice the range
of 2 or 3 does below; the range of many repetitions would instead grow with
k and be set by the one repetition that another tenant's burst hit.

``FLOOR`` (``NOISE_FLOOR`` below, 10 % for every ratio) covers what varies
between runs and not within one (page cache and folio state after the
writes, where the buffers landed): it is the spread the simple rows showed on
the project's 2-core VM at its least loaded. The rule was checked on
back-to-back runs of the same code on that VM while other work loaded it,
every run taken as the baseline of every other: a median fell by more than
its band only between runs whose loads were more than a core apart, in rows
whose subject uses both cores and its baseline one (``loader_warm_vs_ram``,
``block_ltr_vs_sequential``): the load moves them beyond their spread. So
when the two runs' mean 1-minute load averages differ by more than half the
usable cores, a fall says so and asks for both to be rerun at a similar load
(it still counts).

A ratio above ``baseline x (1 + band)`` is reported as "improved" (not a
failure); a band of 50 % or more is called inconclusive; skipped rows are not
compared, a memory-limit child that died (killed under the limit, or an
error) is a failure. The load average is recorded before and after the run
and a busy machine is pointed out: it gives wide spreads, hence wide bands;
rerun on a quiet machine rather than trusting a narrow verdict.

``--write-baseline`` writes the ratios, their repetition ratios and spreads, the
machine, date, command and load average to the baseline file; write it from the
code that is meant to be the reference, on the machine the comparisons run on.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_BASELINE = os.path.join(HERE, "bench_regress_baseline.json")
BASELINE_FORMAT = "mmstore-bench-regress"
BASELINE_VERSION = 1
SIDE = 224
BATCH = 256
REC_BYTES = SIDE * SIDE * 3 + 8  # image + label
CG_ROOT = "/sys/fs/cgroup/memory"
CHUNK = 8 << 20
IQR_MIN_REPS = 7  # from this many repetitions on, a run's spread is its interquartile range
LOAD_SLACK = 0.5  # loads further apart than this many cores are pointed out beside a fall
NOISY_BAND = 0.5  # a band this wide cannot tell a moderate fall from the noise: said so
COMPARED_SETTINGS = ("records", "ltr_records", "ltr_limit_mb", "epochs_per_pass")

# name -> (subject, baseline, unit): the rows of the table, in order
RATIOS: dict[str, tuple[str, str, str]] = {
    "read_batch_out_vs_ram": ("read_batch(out=)", "in-RAM limit", "records/s"),
    "getitem_vs_npy_memmap": ("store[i]", "np.load(mmap_mode='r')[i].copy()", "records/s"),
    "loader_warm_vs_ram": ("Loader warm", "in-RAM limit", "records/s"),
    "loader_warm_vs_dataloader": ("Loader warm", "DataLoader(StoreDataset, num_workers=2)", "records/s"),
    "loader_coldbuilt_vs_ram": ("Loader built on an evicted store, warm epochs", "in-RAM limit", "records/s"),
    "compact_loader_vs_decode": ("Loader, jpeg:90 store, warm", "decode limit", "records/s"),
    "block_ltr_vs_sequential": ("Loader 'block' under a memory limit", "sequential read, same cgroup",
                                "MB/s"),
}
GROUPS = {  # --only names -> ratios
    "read_batch": ["read_batch_out_vs_ram"],
    "getitem": ["getitem_vs_npy_memmap"],
    "loader": ["loader_warm_vs_ram", "loader_warm_vs_dataloader", "loader_coldbuilt_vs_ram"],
    "compact": ["compact_loader_vs_decode"],
    "ltr": ["block_ltr_vs_sequential"],
}
# The smallest band of each ratio (see the module docstring, "The noise band").
NOISE_FLOOR: dict[str, float] = dict.fromkeys(RATIOS, 0.10)


def say(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- #
# machine
# --------------------------------------------------------------------------- #
def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def usable_cores() -> int:
    """The affinity mask, lowered to a cgroup CPU quota where one is set (as
    the Loader counts the cores it decodes on)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = period = None
    try:
        with open("/sys/fs/cgroup/cpu.max") as fh:
            w = fh.read().split()
        if w[0] != "max":
            quota, period = int(w[0]), int(w[1])
    except (OSError, ValueError, IndexError):
        try:
            with open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us") as fh:
                quota = int(fh.read())
            with open("/sys/fs/cgroup/cpu/cpu.cfs_period_us") as fh:
                period = int(fh.read())
        except (OSError, ValueError):
            quota = period = None
    if quota is not None and period and quota > 0:
        n = min(n, -(-quota // period))
    return max(1, n)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
                            "usable_cores": usable_cores(), "python": platform.python_version(),
                            "numpy": np.__version__}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            info["mem_gib"] = round(int(fh.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return info


def code_version(pkg_dir: str) -> dict[str, Any]:
    """The measured code: its path, and the git commit and changed files of
    the work tree holding it (when it is one)."""
    info: dict[str, Any] = {"path": pkg_dir}
    try:
        head = subprocess.run(["git", "-C", pkg_dir, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", pkg_dir, "status", "--porcelain", "--", "."],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.splitlines()
        info.update(commit=head, changed_files=len(changed))
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def fs_type(path: str) -> str:
    path, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        pass
    return kind


def default_parent() -> str:
    """A directory on a real disk (never tmpfs): $TMPDIR, /var/tmp, /tmp."""
    for cand in (os.environ.get("TMPDIR"), "/var/tmp", "/tmp"):
        if (cand and os.path.isdir(cand) and os.access(cand, os.W_OK)
                and fs_type(cand) not in ("tmpfs", "ramfs")):
            return cand
    return tempfile.gettempdir()


# --------------------------------------------------------------------------- #
# files and stores
# --------------------------------------------------------------------------- #
def evict(paths: list[str]) -> None:
    """Drop the files' cached pages (written back first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_sequential(path: str) -> int:
    """Read ``path`` once in 8 MiB chunks; the bytes read."""
    buf = bytearray(CHUNK)
    n = 0
    with open(path, "rb", buffering=0) as fh:
        os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            k = fh.readinto(buf)
            if not k:
                return n
            n += k


def warm(paths: list[str]) -> None:
    """Evict, then read each file once sequentially: the page cache as a warm
    pass leaves it (large folios), not as the writer's small writes did."""
    evict(paths)
    for p in paths:
        read_sequential(p)


def base_images(count: int = 64, seed: int = 0) -> np.ndarray:
    """``count`` smooth 224x224 RGB pictures with noise (JPEG sizes near a
    photo's at quality 90), numpy only."""
    rng = np.random.default_rng(seed)
    k = 15
    x = np.linspace(0, k - 1, SIDE)
    lo = np.floor(x).astype(int).clip(0, k - 2)
    frac = x - lo
    interp = np.zeros((SIDE, k))
    interp[np.arange(SIDE), lo] = 1 - frac
    interp[np.arange(SIDE), lo + 1] = frac
    small = rng.integers(0, 256, (count, k, k, 3)).astype(np.float32)
    img = np.einsum("ik,nklc,jl->nijc", interp, small, interp)
    img += rng.integers(-12, 13, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def write_store(path: str, n: int, base: np.ndarray, codec: str | None = None) -> None:
    """``n`` records (``image`` = a base picture tagged with the record number,
    ``label`` = i % 10); an existing complete store of ``n`` records is kept."""
    import mmstore

    if os.path.exists(os.path.join(path, "manifest.json")):
        try:
            with mmstore.open(path) as s:
                complete = len(s) == n
        except Exception:  # noqa: BLE001 - an unreadable store is rewritten
            complete = False
        if complete:
            return
    if os.path.exists(path):
        shutil.rmtree(path)
    img_field: tuple[Any, ...] = ("|u1", (SIDE, SIDE, 3)) + (() if codec is None else (codec,))
    with mmstore.StoreWriter(path, {"image": img_field, "label": ("<i8", ())}) as w:
        for i in range(n):
            img = base[i % len(base)].copy()
            img[0, :8, 0] = np.frombuffer(np.int64(i).tobytes(), np.uint8)  # every record distinct
            w.append({"image": img, "label": np.int64(i % 10)})


def store_files(path: str) -> list[str]:
    """Every file of the store at ``path`` (its data, index and manifest)."""
    return [os.path.join(path, f) for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))]


def field_file(store: Any, name: str) -> str:
    """The file of field ``name`` in ``store.data_paths()`` (``<name>.npy``,
    or ``<name>.bin`` for an encoded field)."""
    for p in store.data_paths():
        if os.path.basename(p) in (f"{name}.npy", f"{name}.bin"):
            return p
    raise FileNotFoundError(f"{store.path}: no data file of field {name!r} among {store.data_paths()}")


# --------------------------------------------------------------------------- #
# measurement helpers
# --------------------------------------------------------------------------- #
def timed(fn: Callable[[Any], int], arg: Any, times: int = 1) -> float:
    """Records/s of ``times`` calls ``fn(arg)`` (each returns the records it handled)."""
    t = time.perf_counter()
    k = sum(fn(arg) for _ in range(times))
    return k / (time.perf_counter() - t)


def rotated(items: list[Any], r: int) -> list[Any]:
    r %= len(items)
    return items[r:] + items[:r]


def batches(perm: np.ndarray) -> list[np.ndarray]:
    return [perm[a : a + BATCH] for a in range(0, len(perm), BATCH)]


def spread_of(rr: list[float]) -> float | None:
    """The scatter of repetition ratios relative to their median: the
    interquartile range with 7 or more, the range with 4 to 6, twice the
    range with fewer (see the module docstring, "The noise band")."""
    m = statistics.median(rr)
    if not m:
        return None
    if len(rr) >= IQR_MIN_REPS:
        q1, _, q3 = statistics.quantiles(rr, n=4, method="inclusive")
        return (q3 - q1) / m
    return (max(rr) - min(rr)) / m * (1 if len(rr) >= 4 else 2)


def ratio_result(subject: list[float], base: list[float]) -> dict[str, Any]:
    rr = [s / b for s, b in zip(subject, base)]
    m = statistics.median(rr)
    return {"ratio": m, "reps": rr, "spread": spread_of(rr), "range": (max(rr) - min(rr)) / m if m else None,
            "subject_rates": subject, "baseline_rates": base,
            "subject_median": statistics.median(subject), "baseline_median": statistics.median(base)}


class InRam:
    """The in-RAM limit: each batch's rows copied from in-RAM arrays into one
    buffer, the faster of ``np.take(out=)`` and a per-row copy loop."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images, self.labels = images, labels
        self.img = np.empty((BATCH, *images.shape[1:]), images.dtype)
        self.lab = np.empty((BATCH,), labels.dtype)

    def take(self, bs: list[np.ndarray]) -> int:
        for idx in bs:
            k = len(idx)
            np.take(self.images, idx, axis=0, out=self.img[:k])
            np.take(self.labels, idx, axis=0, out=self.lab[:k])
        return sum(len(b) for b in bs)

    def loop(self, bs: list[np.ndarray]) -> int:
        img, lab, images, labels = self.img, self.lab, self.images, self.labels
        for idx in bs:
            for j, i in enumerate(idx.tolist()):
                img[j] = images[i]
                lab[j] = labels[i]
        return sum(len(b) for b in bs)

    def limit(self, bs: list[np.ndarray], epochs: int = 1) -> float:
        return max(timed(self.take, bs, epochs), timed(self.loop, bs, epochs))


# --------------------------------------------------------------------------- #
# the ratios
# --------------------------------------------------------------------------- #
def run_read_batch(path: str, ram: InRam, reps: int, epochs: int, seed: int) -> dict[str, Any]:
    import mmstore

    st = mmstore.open(path)
    n = len(st)
    img = np.empty((BATCH, SIDE, SIDE, 3), np.uint8)
    lab = np.empty((BATCH,), np.int64)

    def subject(bs: list[np.ndarray]) -> int:
        for idx in bs:
            k = len(idx)
            st.read_batch(idx, out={"image": img[:k], "label": lab[:k]})
        return sum(len(b) for b in bs)

    first = batches(np.random.default_rng(seed).permutation(n))
    subject(first)  # map the files outside the timing
    if not (np.array_equal(img[: len(first[-1])], ram.images[first[-1]])
            and np.array_equal(lab[: len(first[-1])], ram.labels[first[-1]])):
        raise RuntimeError(f"{path}: read_batch(out=) returned other bytes than the in-RAM arrays")
    sub, base = [], []
    for r in range(reps):
        bs = batches(np.random.default_rng([seed, r]).permutation(n))
        for who in rotated(["s", "b"], r):
            if who == "s":
                sub.append(timed(subject, bs, epochs))
            else:
                base.append(ram.limit(bs, epochs))
    st.close()
    return ratio_result(sub, base)


def run_getitem(path: str, reps: int, epochs: int, seed: int) -> dict[str, Any]:
    import mmstore

    st = mmstore.open(path)
    n = len(st)
    mm = np.load(field_file(st, "image"), mmap_mode="r")
    lb = np.load(field_file(st, "label"), mmap_mode="r")

    def subject(ii: list[int]) -> int:
        for i in ii:
            st[i]
        return len(ii)

    def baseline(ii: list[int]) -> int:
        for i in ii:
            {"image": mm[i].copy(), "label": lb[i].copy()}
        return len(ii)

    warmup = np.random.default_rng(seed).integers(0, n, n).tolist()
    subject(warmup)
    baseline(warmup)
    got, want = st[warmup[0]], mm[warmup[0]]
    if not np.array_equal(got["image"], want):
        raise RuntimeError(f"{path}: store[i] returned other bytes than the image .npy")
    sub, base = [], []
    for r in range(reps):
        ii = np.random.default_rng([seed, r]).integers(0, n, n).tolist()
        for who in rotated(["s", "b"], r):
            if who == "s":
                sub.append(timed(subject, ii, epochs))
            else:
                base.append(timed(baseline, ii, epochs))
    st.close()
    return ratio_result(sub, base)


def loader_epoch(loader: Any, n: int, epochs: int = 1) -> float:
    """Records/s of ``epochs`` epochs of ``loader`` (each checked to yield ``n`` records)."""
    t = time.perf_counter()
    total = 0
    for _ in range(epochs):
        k = 0
        for b in loader:
            k += len(b["label"])
        if k != n:
            raise RuntimeError(f"a loader epoch yielded {k} records, expected {n}")
        total += k
    return total / (time.perf_counter() - t)


def run_loader(path: str, ram: InRam, reps: int, epochs: int, seed: int) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from mmstore.torch import Loader, StoreDataset

    n = len(ram.images)
    torch.manual_seed(seed)
    L = Loader(path, BATCH)
    loader_epoch(L, n)  # the first epoch, untimed
    dl = DataLoader(StoreDataset(path), batch_size=BATCH, shuffle=True, num_workers=2)
    loader_epoch(dl, n)  # untimed too
    sub, lim, dls = [], [], []
    contenders = ["loader", "ram", "dl"]
    for r in range(reps):
        bs = batches(np.random.default_rng([seed, 100, r]).permutation(n))
        for who in rotated(contenders, r):
            if who == "loader":
                sub.append(loader_epoch(L, n, epochs))
            elif who == "ram":
                lim.append(ram.limit(bs, epochs))
            else:
                dls.append(loader_epoch(dl, n))
                # NOTE [a fork between passes]: starting the DataLoader's workers
                # forks this process, which makes every private page copy-on-write:
                # the first write to each page of the Loader's ring buffers (and of
                # the in-RAM limit's output buffers) after it takes a page fault,
                # which would land on whichever pass comes next. One untimed pass
                # of each settles them, so each contender is timed in its steady
                # state, as in a training loop that does not fork.
                loader_epoch(L, n)
                ram.limit(bs[:2])
    describe = dict(L.describe()) if hasattr(L, "describe") else {}
    L.close()
    out = {"loader_warm_vs_ram": ratio_result(sub, lim), "loader_warm_vs_dataloader": ratio_result(sub, dls)}
    out["loader_warm_vs_ram"]["describe"] = {k: v for k, v in describe.items()
                                             if isinstance(v, (int, float, str))}
    del dl
    gc.collect()
    return out


def run_loader_coldbuilt(path: str, ram: InRam, reps: int, epochs: int, seed: int) -> dict[str, Any]:
    from mmstore.torch import Loader

    n = len(ram.images)
    paths = store_files(path)
    sub, lim = [], []
    for r in range(reps):
        evict(paths)  # the way a training run starts: nothing of the store cached
        L = Loader(path, BATCH)
        loader_epoch(L, n)  # the first (cold) epoch, untimed
        bs = batches(np.random.default_rng([seed, 200, r]).permutation(n))
        for who in rotated(["loader", "ram"], r):
            if who == "loader":
                sub.append(loader_epoch(L, n, epochs))
            else:
                lim.append(ram.limit(bs, epochs))
        L.close()
    return ratio_result(sub, lim)


def run_compact(path: str, reps: int, seed: int) -> dict[str, Any]:
    import mmstore
    from mmstore.torch import Loader

    st = mmstore.open(path)
    n = len(st)
    field = st.schema["image"]
    decode = field.codec.decode_into
    bin_path = field_file(st, "image")
    offs = np.load(os.path.join(os.path.dirname(bin_path), "image.offsets.npy")).astype(np.int64)
    labels = np.load(field_file(st, "label"))
    with open(bin_path, "rb") as fh:
        blob = memoryview(fh.read())
    if len(offs) != st.slots + 1 or int(offs[-1]) != len(blob):
        raise RuntimeError(f"{bin_path}: offsets do not match the data file ({len(offs)} offsets, "
                           f"last {int(offs[-1])}, {len(blob)} bytes)")
    entries = [blob[a:b] for a, b in itertools.pairwise(offs.tolist())]
    st.close()
    cores = usable_cores()
    img = np.empty((BATCH, SIDE, SIDE, 3), np.uint8)
    lab = np.empty((BATCH,), np.int64)
    pool = ThreadPoolExecutor(cores, thread_name_prefix="regress-decode")

    def piece(rows: np.ndarray, idx: np.ndarray) -> None:
        for j in rows.tolist():
            decode(entries[int(idx[j])], img[j])

    def decode_limit(bs: list[np.ndarray]) -> int:
        for idx in bs:
            parts = [p for p in np.array_split(np.arange(len(idx)), cores) if len(p)]
            futs = [pool.submit(piece, p, idx) for p in parts]
            np.take(labels, idx, out=lab[: len(idx)])
            for f in futs:
                f.result()
        return sum(len(b) for b in bs)

    L = Loader(path, BATCH)
    loader_epoch(L, n)  # the first epoch, untimed
    check = batches(np.arange(n))[0]
    decode_limit([check])
    with mmstore.open(path) as s2:
        if not np.array_equal(img[: len(check)], s2.read_batch(check, fields=["image"])["image"]):
            raise RuntimeError(f"{path}: the decode limit decoded other pixels than the store")
    sub, base = [], []
    for r in range(reps):
        bs = batches(np.random.default_rng([seed, 200, r]).permutation(n))
        for who in rotated(["s", "b"], r):
            if who == "s":
                sub.append(loader_epoch(L, n))
            else:
                base.append(timed(decode_limit, bs))
    L.close()
    pool.shutdown()
    res = ratio_result(sub, base)
    res.update(decode_threads=cores, jpeg_bytes_per_record=len(blob) / n)
    return res


# -- under a memory limit: the parent makes the cgroup, a child reads in it ----------------


def ltr_child(store: str, reps: int) -> dict[str, Any]:
    """In the cgroup: ``reps`` x (one sequential read of the image .npy, one
    ``Loader(path, 256, "block")`` epoch), alternating which goes first,
    every store file evicted before each pass."""
    import warnings

    t0 = time.perf_counter()
    import mmstore
    from mmstore.torch import Loader

    import_s = time.perf_counter() - t0
    with mmstore.open(store) as st:
        n = len(st)
        files = st.data_paths()
        img = field_file(st, "image")
    seq, blk, secs = [], [], []
    caught: list[str] = []
    describe: dict[str, Any] = {}
    for r in range(reps):
        for who in rotated(["seq", "block"], r):
            evict(files)
            t = time.perf_counter()
            if who == "seq":
                nbytes = read_sequential(img)
                seq.append(nbytes / (time.perf_counter() - t) / 1e6)
                continue
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                L = Loader(store, BATCH, "block")
                k = 0
                for b in L:
                    k += len(b["label"])
            dt = time.perf_counter() - t
            caught += [str(x.message) for x in w if str(x.message) not in caught]
            if hasattr(L, "describe"):
                describe = {a: v for a, v in dict(L.describe()).items() if isinstance(v, (int, float, str))}
            L.close()
            if k != n:
                raise RuntimeError(f"a block epoch yielded {k} records, expected {n}")
            blk.append(k * REC_BYTES / dt / 1e6)
            secs.append(dt)
    anon = None
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
    return {"seq": seq, "block": blk, "block_s": secs, "import_s": import_s, "warnings": caught,
            "describe": describe, "rss_anon_bytes": anon}


def run_ltr(path: str, limit: int, reps: int) -> dict[str, Any]:
    if os.geteuid() != 0 or not os.path.isdir(CG_ROOT):
        return {"skipped": f"no cgroup-v1 memory controller at {CG_ROOT} or not root: "
                           "cannot make the memory limit"}
    cg = os.path.join(CG_ROOT, f"mmstore_bench_regress_{os.getpid()}")
    try:
        os.makedirs(cg, exist_ok=True)
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as fh:
            fh.write(str(limit))
    except OSError as exc:
        try:
            os.rmdir(cg)
        except OSError:
            pass
        return {"skipped": f"cannot make a memory cgroup under {CG_ROOT} ({exc})"}

    def join() -> None:
        with open(os.path.join(cg, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))

    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--ltr-child", path, "--reps", str(reps)]
        p = subprocess.run(cmd, preexec_fn=join, capture_output=True, text=True, timeout=900, check=False)
        if p.returncode != 0:  # killed under the limit, or an error: a result, not a skip
            rc = p.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
            return {"failed": f"the reading child in the memory cgroup {how}", "limit_bytes": limit,
                    "stderr": p.stderr[-3000:]}
        child = json.loads(p.stdout.strip().splitlines()[-1])
        info: dict[str, Any] = {"limit_bytes": limit}
        for name, key in (("memory.max_usage_in_bytes", "cgroup_max_usage_bytes"),
                          ("memory.failcnt", "failcnt")):
            try:
                with open(os.path.join(cg, name)) as fh:
                    info[key] = int(fh.read())
            except (OSError, ValueError):
                pass
    finally:
        try:
            os.rmdir(cg)
        except OSError:
            pass
    res = ratio_result(child["block"], child["seq"])
    res.update(info)
    res.update({k: child[k] for k in ("block_s", "import_s", "warnings", "describe", "rss_anon_bytes")})
    return res


# --------------------------------------------------------------------------- #
# the comparison and the report
# --------------------------------------------------------------------------- #
def band_of(name: str, now: dict[str, Any], base: dict[str, Any] | None) -> float:
    spreads = [NOISE_FLOOR.get(name, 0.10), now.get("spread") or 0.0]
    if base and base.get("spread") is not None:
        spreads.append(float(base["spread"]))
    return max(spreads)


def mean_load(doc: dict[str, Any] | None) -> float | None:
    """The mean of a run's 1-minute load averages before and after it."""
    loads = [x[0] for x in ((doc or {}).get("loadavg_before"), (doc or {}).get("loadavg_after")) if x]
    return sum(loads) / len(loads) if loads else None


def load_differs(out: dict[str, Any], baseline: dict[str, Any] | None) -> str | None:
    """A note when this run's load and the baseline's differ by more than
    half the usable cores (the rows whose subject uses more cores than its
    baseline move with the load, beyond their spread)."""
    now, then = mean_load(out), mean_load(baseline)
    cores = out["machine"].get("usable_cores") or 1
    if now is None or then is None or abs(now - then) <= LOAD_SLACK * cores:
        return None
    return f"the load differed from the baseline's (mean 1-minute load {now:.1f} here, {then:.1f} there)"


def compare(results: dict[str, Any], baseline: dict[str, Any] | None,
            load_note: str | None = None) -> tuple[list[dict[str, Any]], bool]:
    rows, fell_any = [], False
    bratios = (baseline or {}).get("ratios") or {}
    for name in RATIOS:
        if name not in results:
            continue
        now = results[name]
        base = bratios.get(name) if isinstance(bratios.get(name), dict) else None
        row: dict[str, Any] = {"name": name, "ratio": now.get("ratio"), "spread": now.get("spread"),
                               "reps": now.get("reps"), "baseline": None, "band": None}
        if "skipped" in now:
            row["verdict"] = "skipped: " + now["skipped"]
        elif "failed" in now:
            row["verdict"] = "FAILED: " + now["failed"]
            fell_any = True
        else:
            band = band_of(name, now, base)
            row["band"] = band
            b = None if base is None else base.get("ratio")
            if b is None:
                row["verdict"] = "no baseline"
            else:
                row["baseline"] = b
                if now["ratio"] < b * (1 - band):
                    row["verdict"] = f"FELL ({now['ratio'] / b - 1:+.0%})"
                    if load_note:
                        row["verdict"] += f"; {load_note}: rerun both at a similar load to confirm"
                    fell_any = True
                elif now["ratio"] > b * (1 + band):
                    row["verdict"] = f"improved ({now['ratio'] / b - 1:+.0%})"
                else:
                    row["verdict"] = f"ok ({now['ratio'] / b - 1:+.0%}, within noise)"
                if band >= NOISY_BAND and not row["verdict"].startswith("FELL"):
                    row["verdict"] += f"; band of {band:.0%}: inconclusive, rerun on a quieter machine"
        rows.append(row)
    return rows, fell_any


def render(out: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    L: list[str] = []
    A = L.append
    s = out["settings"]
    m = out["machine"]
    A(f"## mmstore regression benchmark ({out['when']})")
    A("")
    mm = out["mmstore"]
    git = f", commit {mm['commit'][:10]}, {mm['changed_files']} changed file(s)" if "commit" in mm else ""
    A(f"command: `{out['command']}`; mmstore {mm['version']} from {mm['path']}{git}")
    A(f"machine: {m.get('cpu', '?')}, {m.get('cpus')} CPUs ({m.get('usable_cores')} usable), "
      f"{m.get('mem_gib')} GiB, kernel {m.get('kernel')}; load average before {out['loadavg_before']}, "
      f"after {out['loadavg_after']}")
    A(f"data: {s['records']:,} records of 224x224x3 uint8 + int64 label, batch {BATCH}, shuffled, warm; "
      f"memory-limit row: {s['ltr_records']:,} records ({s['ltr_records'] * REC_BYTES / 1e9:.2f} GB) under "
      f"{s['ltr_limit_mb']} MB; repetitions {s['reps']} (Loader rows {s['loader_reps']}, compact "
      f"{s['compact_reps']}, memory limit {s['ltr_reps']}); baseline: {out.get('baseline_note')}")
    busy = max((x[0] for x in (out["loadavg_before"], out["loadavg_after"]) if x), default=0.0)
    if busy > 0.5 * (m.get("usable_cores") or 1):
        A(f"NOTE: the machine was busy (1-minute load average up to {busy:.2f} on {m.get('usable_cores')} "
          "cores): wide spreads give wide bands; rerun on a quiet machine before trusting a narrow verdict")
    A("")
    A("| ratio | this run: median (min-max of reps) | baseline | band | verdict |")
    A("|---|---|---|---|---|")
    for row in rows:
        name = row["name"]
        subj, basis, _ = RATIOS[name]
        label = f"{name}: {subj} / {basis}"
        if row["ratio"] is None:
            A(f"| {label} | - | - | - | {row['verdict']} |")
            continue
        rr = row["reps"]
        base = "-" if row["baseline"] is None else f"{row['baseline']:.3f}"
        A(f"| {label} | {row['ratio']:.3f} ({min(rr):.3f}-{max(rr):.3f}) | {base} | {row['band']:.0%} | "
          f"{row['verdict']} |")
    A("")
    A("| ratio | subject median | baseline median | unit | reps | spread | range (max-min)/median |")
    A("|---|---|---|---|---|---|---|")
    for name, r in out["results"].items():
        if "skipped" in r or "failed" in r:
            continue
        k = len(r["reps"])
        kind = "IQR" if k >= IQR_MIN_REPS else ("range" if k >= 4 else "2 x range")
        A(f"| {name} | {r['subject_median']:,.0f} | {r['baseline_median']:,.0f} | {RATIOS[name][2]} | "
          f"{k} | {r['spread']:.1%} ({kind}) | {r['range']:.1%} |")
    lt = out["results"].get("block_ltr_vs_sequential", {})
    if lt.get("stderr"):
        A("")
        A("memory-limit child's error output (its end): " + lt["stderr"][-1500:])
    if lt.get("warnings"):
        A("")
        A("memory-limit child's warnings: " + " | ".join(w[:300] for w in lt["warnings"]))
    A("")
    A(f"total {out['total_s']:.0f} s")
    return "\n".join(L)


def load_baseline(path: str) -> tuple[dict[str, Any] | None, str]:
    if not os.path.exists(path):
        return None, f"none ({path} does not exist)"
    try:
        with open(path) as fh:
            b = json.load(fh)
    except (OSError, ValueError) as exc:
        return None, f"unreadable ({path}: {exc})"
    if b.get("format") != BASELINE_FORMAT:
        return None, f"not a baseline of this benchmark ({path}: format {b.get('format')!r})"
    if not any(isinstance(v, dict) and v.get("ratio") is not None for v in (b.get("ratios") or {}).values()):
        return None, f"placeholder without ratios ({path}; fill it with --write-baseline)"
    return b, f"{path}, written {b.get('written')} by `{b.get('command')}`"


def baseline_doc(out: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": BASELINE_FORMAT, "version": BASELINE_VERSION,
        "written": out["when"], "command": out["command"], "machine": out["machine"],
        "loadavg_before": out["loadavg_before"], "loadavg_after": out["loadavg_after"],
        "mmstore": out["mmstore"], "settings": out["settings"],
        "ratios": {name: ({k: r[k] for k in ("skipped", "failed") if k in r} if "ratio" not in r else
                          {"ratio": r["ratio"], "spread": r["spread"], "reps": r["reps"],
                           "subject_median": r["subject_median"], "baseline_median": r["baseline_median"]})
                   for name, r in out["results"].items()},
    }


# --------------------------------------------------------------------------- #
# main
# --------------------------------------------------------------------------- #
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about 1 minute)")
    ap.add_argument("--records", type=int, default=4000, help="records of the warm stores (default 4,000)")
    ap.add_argument("--ltr-records", type=int, default=8000,
                    help="records of the memory-limit store (default 8,000: 1.2 GB)")
    ap.add_argument("--ltr-limit-mb", type=int, default=300, help="the cgroup memory limit, MB (default 300)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions of the read_batch and store[i] rows")
    ap.add_argument("--only", default="", help=f"comma-separated groups: {', '.join(GROUPS)}")
    ap.add_argument("--dir", default=None, help="keep the stores here and reuse them (default: a temporary "
                    "directory on a real disk, removed at the end)")
    ap.add_argument("--baseline", default=DEFAULT_BASELINE, help="the baseline file (default: %(default)s)")
    ap.add_argument("--write-baseline", action="store_true", help="write this run's ratios to --baseline")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ltr-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.ltr_child is None:
        groups = [g for g in args.only.split(",") if g]
        bad = [g for g in groups if g not in GROUPS]
        if bad:
            ap.error(f"--only: unknown group(s) {bad}; choose from {', '.join(GROUPS)}")
        if args.write_baseline and groups:
            ap.error("--write-baseline writes every ratio of one run: leave out --only")
        for name in ("records", "ltr_records", "ltr_limit_mb"):
            if getattr(args, name) < 1:
                ap.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import mmstore
    except ImportError:  # run from a checkout without an installed mmstore
        sys.path.append(os.path.dirname(HERE))
        import mmstore
    if args.ltr_child is not None:
        print(json.dumps(ltr_child(args.ltr_child, args.reps or 1)))
        return 0
    reps = args.reps or (5 if args.quick else 15)
    loader_reps = 4 if args.quick else 9
    compact_reps = 4 if args.quick else 7
    ltr_reps = 2 if args.quick else 4
    epochs = 3  # epochs per timed pass of the warm raw rows (each a fraction of a second)
    groups = [g for g in args.only.split(",") if g] or list(GROUPS)
    t_start = time.perf_counter()
    out: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable)]
                            + (sys.argv if argv is None else [__file__, *argv])),
        "machine": machine(), "loadavg_before": loadavg(),
        "mmstore": {"version": getattr(mmstore, "__version__", "?"),
                    **code_version(os.path.dirname(os.path.abspath(mmstore.__file__)))},
        "settings": {"records": args.records, "ltr_records": args.ltr_records,
                     "ltr_limit_mb": args.ltr_limit_mb,
                     "reps": reps, "loader_reps": loader_reps, "compact_reps": compact_reps,
                     "ltr_reps": ltr_reps, "epochs_per_pass": epochs,
                     "quick": args.quick, "groups": groups, "seed": args.seed},
        "results": {},
    }
    baseline, note = load_baseline(args.baseline)
    out["baseline_note"] = note
    made = args.dir is None
    root = tempfile.mkdtemp(prefix="mmstore-bench-regress-", dir=default_parent()) if made else args.dir
    os.makedirs(root, exist_ok=True)
    res = out["results"]
    try:
        base = base_images(seed=args.seed)
        raw = os.path.join(root, f"raw{args.records}")
        need_raw = any(g in groups for g in ("read_batch", "getitem", "loader"))
        ram = None
        if need_raw:
            say(f"writing {args.records:,} records into {raw} ...")
            write_store(raw, args.records, base)
            with mmstore.open(raw) as st:
                files = st.data_paths()
                warm(files)
                ram = InRam(np.load(field_file(st, "image")), np.load(field_file(st, "label")))
        if "read_batch" in groups:
            say("read_batch(out=) vs the in-RAM limit ...")
            res["read_batch_out_vs_ram"] = run_read_batch(raw, ram, reps, epochs, args.seed)
        if "getitem" in groups:
            say("store[i] vs a numpy memmap ...")
            res["getitem_vs_npy_memmap"] = run_getitem(raw, reps, epochs, args.seed)
        if "loader" in groups:
            say("Loader warm vs the in-RAM limit and DataLoader(num_workers=2) ...")
            res.update(run_loader(raw, ram, loader_reps, epochs, args.seed))
            say("Loader built on an evicted store, its warm epochs vs the in-RAM limit ...")
            res["loader_coldbuilt_vs_ram"] = run_loader_coldbuilt(raw, ram, loader_reps, epochs, args.seed)
        del ram
        gc.collect()
        if "compact" in groups:
            jpg = os.path.join(root, f"jpeg90_{args.records}")
            say(f"writing the jpeg:90 store {jpg} ...")
            write_store(jpg, args.records, base, "jpeg:90")
            with mmstore.open(jpg) as st:
                warm(st.data_paths())
            say("the compact Loader vs the decode limit ...")
            res["compact_loader_vs_decode"] = run_compact(jpg, compact_reps, args.seed)
        if "ltr" in groups:
            big = os.path.join(root, f"raw{args.ltr_records}")
            say(f"writing {args.ltr_records:,} records into {big} ...")
            write_store(big, args.ltr_records, base)
            with mmstore.open(big) as st:
                evict(st.data_paths())
            say(f"block shuffle under a {args.ltr_limit_mb} MB memory limit vs a sequential read ...")
            res["block_ltr_vs_sequential"] = run_ltr(big, args.ltr_limit_mb * 1_000_000, ltr_reps)
    finally:
        if made:
            shutil.rmtree(root, ignore_errors=True)
    out["loadavg_after"] = loadavg()
    out["total_s"] = time.perf_counter() - t_start
    load_note = load_differs(out, baseline)
    rows, fell = compare(res, baseline, load_note)
    if load_note:
        out["baseline_note"] += f"; {load_note}"
    if baseline is not None:
        differ = {k: (v, (baseline.get("settings") or {}).get(k)) for k, v in out["settings"].items()
                  if k in COMPARED_SETTINGS and (baseline.get("settings") or {}).get(k) != v}
        if differ:
            out["baseline_note"] += ("; settings differ from the baseline's (this run vs baseline): "
                                     + ", ".join(f"{k} {a} vs {b}" for k, (a, b) in differ.items()))
    out["comparison"] = rows
    out["fell"] = fell
    print(render(out, rows), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    if args.write_baseline:
        with open(args.baseline, "w") as fh:
            json.dump(baseline_doc(out), fh, indent=1)
            fh.write("\n")
        say(f"baseline written: {args.baseline}")
    return 1 if fell else 0


if __name__ == "__main__":
    sys.exit(main())
