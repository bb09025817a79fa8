"""``doctor``: measure this machine and this store, predict epoch times, advise.

Measurements (all sampled, bounded by ``budget_s``):

- sequential read speed of the largest data file (a range of it is evicted
  first, so this is the disk, not the cache);
- cold random record reads per second: a sample of records is evicted from
  the page cache (a positional backend such as memmap: exactly their byte
  ranges, page-aligned), then read one by one through ``Store.read_batch``,
  by one reader and by ``threads`` concurrent readers (what
  ``mmstore.torch.Loader`` does); for other backends (lmdb), whose record
  positions are not known, random record-sized reads of the largest data
  file stand in;
- warm random record reads per second: the same records again, now cached,
  in batches;
- memory available (MemAvailable and the cgroup limit) against the store size.

The model (N records of R bytes, S bytes of data, h = the share of the store
the page cache can hold):

- full shuffle, cold: epoch 1 = N / cold_rate; epoch 2 = N / warm_rate when the
  store fits, else N * ((1 - h) / cold_rate + h / warm_rate);
- full shuffle after ``warm``: S / seq_speed + N / warm_rate, then N / warm_rate
  (only when it fits; else as cold);
- block shuffle (``BlockShuffle.auto`` sizes from the measured latency and
  speed): blocks * latency + S / seq_speed of I/O overlapped with
  N / warm_rate of copying; epoch 2 as epoch 1 unless it fits.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _os
from ..store.reader import Store, open_store
from .common import fmt_bytes, fmt_seconds, sample_indices
from .order_advice import order_advice

__all__ = ["DoctorReport", "Prediction", "disk_kind", "disk_reads_per_s", "doctor_store"]


@dataclass
class Prediction:
    order: str
    epoch1_s: float | None
    epoch2_s: float | None
    note: str = ""


@dataclass
class DoctorReport:
    path: str
    backend: str
    records: int
    record_bytes: int
    store_bytes: int
    disk: dict[str, Any] = field(default_factory=dict)
    resident_bytes: int | None = None
    mem_available: int | None = None
    effective_available: int | None = None
    seq_mb_per_s: float | None = None
    seq_bytes: int = 0
    seq_cold: bool | None = None
    cold_sample: int = 0
    cold_reads_per_s_1: float | None = None
    cold_reads_per_s: float | None = None
    cold_threads: int = 0
    cold_evicted: bool | None = None
    warm_reads_per_s: float | None = None
    latency_ms: float | None = None
    block: dict[str, Any] | None = None
    predictions: list[Prediction] = field(default_factory=list)
    fits: bool | None = None
    recommendation: str = ""
    order: dict[str, Any] | None = None  # fits / which order / rate to expect (``_order_advice``)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    codecs: Any = None  # _codec_advice.CodecAdvice: each codec's size, decode rate and predicted samples/s
    cores: int = 0  # usable cores (affinity, cgroup quota)
    decode_reads_per_s: float | None = None  # encoded stores: warm records/s the cores decode (order advice's cap)
    disk_kind: str | None = None  # what the disk behaved like when measured (disk_kind()), not the kernel's flag
    disk_reads_per_s: float | None = None  # the disk's share of the cold reads (disk_reads_per_s())


# NOTE [disk kind from the measurement]: the kernel's rotational flag is
# whatever the block driver reports; a virtual disk (virtio) often says
# "rotational" while serving cold random reads at flash rates. doctor names the disk
# by the cold random reads of one reader it measured (a seek is 4-15 ms).
FLASH_READS_PER_S = 1000.0  # one reader, cold: under 1 ms a read
SEEK_READS_PER_S = 250.0  # one reader, cold: 4 ms or more a read


def disk_reads_per_s(rep: DoctorReport) -> float | None:
    """The disk's share of one reader's cold random record reads, per second:
    a cold read costs the disk's time plus what a warm read costs (the copy,
    or for an encoded store the decode), so ``1 / (1 / cold - 1 / warm)``;
    inf when the two cannot be told apart; None when not measured cold."""
    c1, w = rep.cold_reads_per_s_1, rep.warm_reads_per_s
    if not c1 or rep.cold_evicted is False or rep.disk.get("tmpfs"):
        return None
    t = 1 / c1 - (1 / w if w else 0.0)
    return 1 / t if t > 0 else float("inf")


def disk_kind(rep: DoctorReport) -> str | None:
    """``"flash"``, ``"spinning"`` or ``"between"`` from :func:`disk_reads_per_s`;
    None when the cold reads were not measured."""
    r = disk_reads_per_s(rep)
    if r is None:
        return None
    return "flash" if r >= FLASH_READS_PER_S else "spinning" if r <= SEEK_READS_PER_S else "between"


def reads_text(r: float | None) -> str:
    return "?" if r is None else "more than 100,000" if r > 1e5 else f"{r:,.0f}"


def _note_disk_kind(rep: DoctorReport) -> None:
    rep.disk_kind = kind = disk_kind(rep)
    rep.disk_reads_per_s = disk_reads_per_s(rep)
    flag = rep.disk.get("rotational")
    if kind is None or flag is None or (kind == "spinning") == flag or kind == "between":
        return
    rep.notes.append(
        f"the kernel marks {rep.disk.get('device') or 'this device'} as {'rotational' if flag else 'non-rotational'}, "
        f"but it served {reads_text(rep.disk_reads_per_s)} cold random reads/s with one reader, as "
        f"{'flash' if kind == 'flash' else 'a spinning disk'} does (a virtual disk often reports either): "
        "the advice follows the measurement"
    )


def _evict_records(store: Store, slots: np.ndarray) -> bool:
    """Drop the pages of ``slots`` of every field (a positional backend's);
    True if mincore then shows none of them resident."""
    ok = True
    for f in store.schema:
        if f.variable:  # an encoded field: each sampled entry's own bytes
            for s in slots.tolist():
                for path, off, nb in store.slot_view.backend.entry_spans(f.name, s, s + 1):
                    ok = _evict_span(path, off, nb) and ok
            continue
        if not f.nbytes:
            continue
        for seg in store.slot_view.backend.field_segments(f.name):
            mine = slots[(slots >= seg.first) & (slots < seg.first + seg.count)] - seg.first
            if not len(mine):
                continue
            off, nb = seg.offset, seg.entry_bytes
            fd = os.open(seg.path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                for s in mine.tolist():
                    ok = _os.evict_range(fd, off + s * nb, nb, size) and ok
            finally:
                os.close(fd)
    return ok


def _evict_span(path: str, off: int, nb: int) -> bool:
    if nb <= 0:
        return True
    fd = os.open(path, os.O_RDONLY)
    try:
        return _os.evict_range(fd, off, nb, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _time_reads(store: Store, idx: np.ndarray, threads: int, deadline: float) -> tuple[int, float]:
    """Read ``idx`` one record per call with ``threads`` readers; return (reads, seconds)."""
    counts = [0] * threads

    def work(t: int) -> None:
        for i in idx[t::threads].tolist():
            store.read_batch([i])
            counts[t] += 1
            if time.perf_counter() > deadline:
                break

    t0 = time.perf_counter()
    if threads <= 1:
        work(0)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(work, range(threads)))
    return sum(counts), time.perf_counter() - t0


def doctor_store(
    path: str | os.PathLike[str],
    *,
    samples: int = 256,
    threads: int = 8,
    budget_s: float = 30.0,
    seq_bytes: int = 256 << 20,
    cold: bool = True,
    seed: int = 0,
    codecs: bool = True,
) -> DoctorReport:
    """Measure and advise (see the module docstring). ``cold=False`` skips
    every eviction (the cold figures are then not measured); ``budget_s``
    bounds the time of the measurements (about 40% sequential, 40% cold
    random, 20% warm); ``codecs`` adds the codec section (``codec_advice``:
    each codec measured on a sample, up to a quarter of ``budget_s`` more)."""
    t_start = time.perf_counter()
    store = open_store(path)
    try:
        data = store.slot_view.backend.data_paths()
        sbytes = sum(os.path.getsize(p) for p in data)
        rep = DoctorReport(store.path, store.backend_name, store.records, store.stored_record_bytes(), sbytes)
        rep.disk = _os.disk_info(store.path)
        try:
            rep.resident_bytes = sum(_os.resident_bytes(p)[0] for p in data)
        except (OSError, NotImplementedError):
            pass
        rep.mem_available = _os.mem_available()
        rep.effective_available = _os.effective_available()
        if rep.disk.get("tmpfs"):
            rep.notes.append("the store is on a memory file system (tmpfs): it is always 'in the page cache'; "
                             "cold figures are memory speeds")
        if rep.disk.get("network"):
            rep.notes.append(f"the store is on a network file system ({rep.disk.get('fs_type')}): latency is "
                             "high and eviction may not reach the server's cache")
        if store.records == 0:
            rep.recommendation = "the store is empty"
            return rep
        if store.replica is not None:
            _remote_notes(store, rep)
        # 1. sequential
        big = max(data, key=os.path.getsize)
        sp = _os.seq_read_speed(big, max_bytes=seq_bytes, cold=cold, max_seconds=0.4 * budget_s)
        rep.seq_mb_per_s = sp.mb_per_s or None
        rep.seq_bytes = sp.bytes
        rep.seq_cold = (sp.resident_before == 0) if cold and sp.resident_before is not None else None
        # 2. cold random records
        idx = sample_indices(store.records, samples, seed)
        np.random.default_rng(seed).shuffle(idx)
        rep.cold_sample = len(idx)
        rep.cold_threads = threads
        if cold:
            _measure_cold(store, rep, idx, big, threads, budget_s, seed)
        else:
            store.read_batch(np.sort(idx))
        if rep.cold_reads_per_s_1:
            rep.latency_ms = 1e3 / rep.cold_reads_per_s_1
        # 3. warm random records (the sample is now cached), in batches of 64
        t0 = time.perf_counter()
        reads = 0
        end = t0 + max(0.05, 0.2 * budget_s)
        while reads < 20 * len(idx) and time.perf_counter() < end:
            for a in range(0, len(idx), 64):
                store.read_batch(idx[a : a + 64])
            reads += len(idx)
        dt = time.perf_counter() - t0
        rep.warm_reads_per_s = reads / dt if dt > 0 else None
        rep.cores = _os.usable_cores()
        if store.schema.has_variable and rep.warm_reads_per_s:
            # one reader's warm reads of an encoded store are its decodes; the
            # Loader decodes on every core (the decoders release the GIL)
            rep.decode_reads_per_s = rep.warm_reads_per_s * rep.cores
        if cold:
            _note_disk_kind(rep)
        # the order section first: the advice follows it for a store that does not fit
        rep.order = order_advice(rep, probe=big if cold and store.slot_view.backend.positional else None,
                                 probe_s=0.1 * budget_s)
        _predict(rep)
        if codecs:
            from .codec_advice import codec_advice

            rep.codecs = codec_advice(store, available=rep.effective_available or rep.mem_available,
                                      seq_bytes_per_s=(rep.seq_mb_per_s or 0) * 1e6 or None, seed=seed,
                                      max_seconds=min(10.0, 0.25 * budget_s))
        return rep
    finally:
        store.close()
        try:
            rep.seconds = time.perf_counter() - t_start
        except NameError:
            pass


def _measure_cold(store: Store, rep: DoctorReport, idx: np.ndarray, big: str, threads: int, budget_s: float,
                  seed: int) -> None:
    """The cold random-read figures of ``rep``: the sampled records evicted
    and read (a positional backend), else random record-sized reads of the
    largest data file ``big``; leaves the sample in the page cache."""
    deadline = time.perf_counter() + 0.4 * budget_s
    if store.slot_view.backend.positional:  # exactly the sampled records' pages
        half = max(1, len(idx) // 2)
        a, b = idx[:half], idx[half:]
        rep.cold_evicted = _evict_records(store, store.slot_view.slots_of(idx))
        n1, t1 = _time_reads(store, a, 1, time.perf_counter() + 0.2 * budget_s)
        rep.cold_reads_per_s_1 = n1 / t1 if t1 > 0 and n1 else None
        if len(b):
            n2, t2 = _time_reads(store, b, threads, deadline)
            rep.cold_reads_per_s = n2 / t2 if t2 > 0 and n2 else None
        else:
            rep.cold_reads_per_s = rep.cold_reads_per_s_1
    else:
        rb = store.stored_record_bytes()
        r1 = _os.random_read_speed(big, rb, n=max(1, len(idx) // 2), cold=True, threads=1, seed=seed,
                                    max_seconds=0.2 * budget_s)
        r2 = _os.random_read_speed(big, rb, n=max(1, len(idx) // 2), cold=True, threads=threads,
                                    seed=seed + 1, max_seconds=0.2 * budget_s)
        rep.cold_reads_per_s_1 = r1.ops_per_s or None
        rep.cold_reads_per_s = r2.ops_per_s or None
        rep.cold_evicted = r1.resident_before == 0 if r1.resident_before is not None else None
        rep.notes.append(f"{store.backend_name}: cold figures are random record-sized reads of "
                         f"{os.path.basename(big)}")
        store.read_batch(np.sort(idx))  # bring the sampled records in for the warm figure
    if rep.cold_evicted is False:
        rep.notes.append("eviction did not take (tmpfs, locked or dirty pages): cold figures are too high")


def _predict(rep: DoctorReport) -> None:
    from ..order import BlockShuffle

    n, S, R = rep.records, rep.store_bytes, max(1, rep.record_bytes)
    avail = rep.effective_available or rep.mem_available
    seq = (rep.seq_mb_per_s or 0) * 1e6 or None
    cold = rep.cold_reads_per_s
    warm = rep.decode_reads_per_s or rep.warm_reads_per_s  # encoded: decoded on every core
    resident = rep.resident_bytes or 0
    rep.fits = None if avail is None else S <= 0.9 * (avail + 0) or resident >= 0.95 * S
    h = 1.0 if rep.fits or avail is None else min(1.0, 0.9 * avail / max(S, 1))
    t_warm = n / warm if warm else None
    t_cold = n / cold if cold else None

    def mix(hit: float) -> float | None:
        if warm is None or cold is None:
            return None
        return n * ((1 - hit) / cold + hit / warm)

    preds = []
    e2 = t_warm if rep.fits else mix(h)
    preds.append(Prediction("full shuffle, cold", t_cold, e2,
                            "epoch 1 reads every record from disk" + ("" if rep.fits else
                            f"; only {100 * h:.0f}% of the store can stay cached")))
    if rep.fits:
        e1 = (S / seq if seq else 0) + (t_warm or 0) if seq and t_warm else None
        preds.append(Prediction("full shuffle after `mmstore warm`", e1, t_warm,
                                f"one sequential pass ({fmt_seconds(S / seq) if seq else 'n/a'}) then memory copies"))
    else:
        preds.append(Prediction("full shuffle after `mmstore warm`", mix(h), mix(h),
                                "does not fit: warm can only cache part of the store"))
    latency = (rep.latency_ms or 8.0) / 1e3
    bw = seq or 150e6
    try:
        # the window the Loader uses: a fixed budget, the same on every rank (not this machine's memory)
        sizes = BlockShuffle.auto_sizes(n, R, seek_s=max(latency, 1e-5), bandwidth=bw)
    except ValueError:
        sizes = None
    rep.block = sizes
    if sizes:
        io = sizes["blocks"] * latency + S / bw
        e1 = max(io, t_warm or 0)
        preds.append(Prediction(
            f"block shuffle (block {sizes['block']}, window {sizes['window']})", e1,
            t_warm if rep.fits else e1,
            f"{sizes['blocks']:,} blocks of {fmt_bytes(sizes['block_bytes'])} read sequentially, "
            f"windows of {fmt_bytes(sizes['window_bytes'])}"))
    rep.predictions = preds
    rep.recommendation = _advise(rep, sizes, t_cold, t_warm)


def _advise(rep: DoctorReport, sizes: dict[str, Any] | None, t_cold: float | None, t_warm: float | None) -> str:
    S = rep.store_bytes
    avail = rep.effective_available or rep.mem_available
    if rep.resident_bytes is not None and rep.resident_bytes >= 0.95 * S and rep.fits:
        return ("the store is already in the page cache: use the full shuffle (order='permutation'); "
                f"an epoch should take about {fmt_seconds(t_warm)}")
    if rep.fits:
        p = next((x for x in rep.predictions if x.order.startswith("full shuffle after")), None)
        gain = ""
        if t_cold and p and p.epoch1_s:
            gain = f" (epoch 1: {fmt_seconds(p.epoch1_s)} instead of {fmt_seconds(t_cold)} cold)"
        return (f"the store ({fmt_bytes(S)}) fits in RAM ({fmt_bytes(avail)} available): a Loader reads it "
                f"into memory before its first epoch (or run `mmstore warm {rep.path}`), then use the full "
                f"shuffle{gain}")
    if avail is None:
        return "available memory is unknown: use the block shuffle (order='block') to be safe"
    ratio = S / max(avail, 1)
    adv = rep.order
    if adv and not adv["fits"] and adv.get("expected_MBps") and adv.get("permutation_probe"):
        # the order section measured the reads the Loader will do (O_DIRECT for a
        # permutation of a store that does not fit): its choice, not this table's
        return (f"the store is {ratio:.1f}x your available memory: use order={adv['order']!r} "
                f"(Loader(store, batch_size, order={adv['order']!r})), about {adv['expected_MBps']:,.0f} MB/s"
                + (f", {fmt_seconds(adv['epoch_s'])} per epoch" if adv.get("epoch_s") else "")
                + " (see `order` below)")
    blk = f"block={sizes['block']}, window={sizes['window']}" if sizes else "auto sizes"
    bp = next((x for x in rep.predictions if x.order.startswith("block")), None)
    fp = rep.predictions[0] if rep.predictions else None
    cmp = ""
    if bp and fp and bp.epoch1_s and fp.epoch1_s:
        if fp.epoch1_s <= 1.3 * bp.epoch1_s:
            return (f"the store is {ratio:.1f}x your available memory, but random reads are fast here "
                    f"({rep.cold_reads_per_s or 0:,.0f} records/s cold): the full shuffle costs "
                    f"{fmt_seconds(fp.epoch1_s)} per epoch, close to the block shuffle's {fmt_seconds(bp.epoch1_s)}; "
                    "keep the full shuffle")
        cmp = (f" (about {fmt_seconds(bp.epoch1_s)} per epoch instead of {fmt_seconds(fp.epoch1_s)} "
               "for the full shuffle)")
    return (f"the store is {ratio:.1f}x your available memory: use the block shuffle with {blk} "
            f"(Loader(store, batch_size, order='block')){cmp}")


def _remote_notes(store: Store, rep: DoctorReport) -> None:
    """A store opened from a URL: what its replica holds, how fast blocks
    arrive (a few absent blocks fetched, timed), and what each order costs.
    The local figures below are then those of the replica's disk."""
    replica = store.replica
    if replica is None:
        return
    d = replica.describe()
    rep.notes.append(f"opened from {replica.url}: the local replica holds {d['present']:.0%} of the record data "
                     f"({d['disk_bytes']:,} bytes on disk under {d['replica']}, limit {d['cache_limit'] or 'none'})")
    absent = np.flatnonzero(replica.state != 1)[:16]
    if len(absent):
        t0 = time.perf_counter()
        pin = replica.acquire(absent)
        dt = time.perf_counter() - t0
        if pin is not None:
            pin.release(consumed=True)
        got = int(replica.sizes[absent].sum())
        rep.notes.append(f"fetching {len(absent)} blocks ({got:,} bytes) from the URL took {dt:.2f} s: "
                         f"{got / 1e6 / max(dt, 1e-9):,.1f} MB/s with 16 requests in flight")
    rb = max(1, store.stored_record_bytes())
    amp = replica.block_bytes / rb
    rep.notes.append(f"until the store is cached, a block shuffle or a sequential order fetches each block of "
                     f"{replica.block_bytes >> 20} MiB once per epoch, ahead of the batches; a full permutation "
                     f"fetches a block per record it reads (up to {amp:,.0f}x the record's {rb:,} bytes): use "
                     "OrderSpec('block'), or a cache that holds the store (then every order reads locally)")
