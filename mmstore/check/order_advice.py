"""``doctor``'s order section: does the data fit, which order to use, and the
rate to expect, from what ``doctor`` measured on this store and machine.

Inputs (a :class:`~mmstore.check.doctor.DoctorReport`): the sequential read
speed ``seq`` (bytes/s), cold random record reads per second with one reader
(``c1``) and with ``threads`` readers (``cq``), warm (cached) record reads per
second ``w``, the record size ``R`` and the store size ``S``; the memory
budget and the ring/window sizes are those a ``Loader(store, 256, order)``
would choose here (:func:`mmstore.order.plan_memory`, the rule of
``Loader.describe()``).

Model (bytes/s; every rate is capped by the warm copy rate ``w * R``, or,
for a store with encoded fields, by its decode rate ``d * R``: ``d`` =
records/s the usable cores decode, one reader's warm reads times the cores,
so the prediction is ``min(disk rate, decode rate x cores)``):

* ``fits`` when ``S`` fits in 90 % of the page cache the budget leaves after
  the ring: after one sequential pass (``warm``) every order reads from
  memory; the permutation mixes best: use it.
* sequential: ``seq`` (the Loader reads it ahead in long requests).
* permutation: ``cq * R``: random record reads at the Loader's queue depth
  (16 in flight), measured by a short probe of the largest data file when
  ``doctor`` runs cold, else ``doctor``'s cold record reads. The probe reads
  the way the Loader will: a store that does not fit (records of at least
  ``SMALL_RECORD_BYTES``) is read with ``O_DIRECT`` (``describe()
  ["direct_reads"]``, NOTE [record reads in one submit] in
  ``mmstore/engine/aio.py``), so the probe reads with ``O_DIRECT`` too
  (:func:`probe_random_direct`); where ``O_DIRECT`` is refused, or the store
  fits, through the page cache. ``permutation_probe`` says which.
* block shuffle and sequential orders whose store does not fit are read
  with ``O_DIRECT`` into huge-page window buffers, in requests of the
  device's largest size: they read at about the disk's sequential rate (as
  ``dd`` does, on a flash disk and on a simulated hard disk, with the next
  window's reads in flight while a window is served); the model below, one access latency
  per block, is the conservative side of that.
* block shuffle: a block of ``B`` bytes costs one access latency plus its
  transfer: ``B / (seek + B / seq)``, ``seek = max(0, 1 / c1 - R / seq)``.

Advice when it does not fit: the block shuffle when it is at least 1.2x the
permutation (a disk with slow random reads), else the permutation (random
reads are nearly as fast here, and it mixes best).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from .._os import random_read_speed
from .._os.runs import SMALL_RECORD_BYTES
from ..order import BlockShuffle, plan_memory
from .common import fmt_bytes, fmt_seconds

__all__ = ["BATCH", "order_advice", "order_lines"]

BATCH = 256  # the batch size the figures assume
QUEUE_DEPTH = 16  # the Loader's reader threads (LoaderTuning.threads)
GAIN = 1.2  # how much faster the block shuffle must be to be advised over the permutation


def _rate(x: float | None) -> float | None:
    return x if x and x > 0 else None


def probe_random(path: str | None, record_bytes: int, threads: int, seconds: float) -> float | None:
    """Cold random record-sized ``preadv`` reads of ``path`` at queue depth
    ``threads`` (what the Loader does for a permutation), records/s; None
    when not measured."""
    if path is None or seconds <= 0:
        return None
    try:
        sp = random_read_speed(path, record_bytes, n=64 * threads, cold=True, threads=threads, seed=7,
                               max_seconds=seconds)
    except (OSError, ValueError):
        return None
    return sp.ops_per_s or None


_ALIGN = 4096  # O_DIRECT offset, length and address alignment (as the Loader's staged reads)


def probe_random_direct(path: str | None, record_bytes: int, threads: int, seconds: float) -> float | None:
    """Random record-sized reads of ``path`` with ``O_DIRECT`` (no page
    cache, nothing to evict), ``threads`` in flight, for at most
    ``seconds``: records/s, as a Loader reads a permutation of a store that
    does not fit. None when not measured (no path, ``O_DIRECT`` refused
    here: tmpfs, some network file systems)."""
    flag = getattr(os, "O_DIRECT", 0)
    if path is None or seconds <= 0 or not flag or record_bytes <= 0:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        nrec = os.fstat(fd).st_size // record_bytes
        if nrec < 1:
            return None
        rng = np.random.default_rng(7)
        n = min(nrec, 64 * threads)
        offs = (rng.choice(nrec, size=n, replace=False).astype(np.int64) * record_bytes).tolist()
        span = -(-(record_bytes + _ALIGN) // _ALIGN) * _ALIGN
        counts, errors = [0] * threads, []
        deadline = time.perf_counter() + seconds

        def reader(t: int) -> None:
            buf = mmap.mmap(-1, span)
            view = memoryview(buf)
            try:
                for off in offs[t::threads]:
                    a0 = off - off % _ALIGN
                    a1 = -(-(off + record_bytes) // _ALIGN) * _ALIGN
                    if os.preadv(fd, [view[: a1 - a0]], a0) < off + record_bytes - a0:
                        break  # the end of the file: what was read counts
                    counts[t] += 1
                    if time.perf_counter() > deadline:
                        break
            except OSError as exc:  # O_DIRECT refused for this file after all
                errors.append(exc)
            finally:
                view.release()
                buf.close()

        t0 = time.perf_counter()
        ts = [threading.Thread(target=reader, args=(t,), daemon=True) for t in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        dt = time.perf_counter() - t0
        if errors or dt <= 0 or not sum(counts):
            return None
        return sum(counts) / dt
    finally:
        os.close(fd)


def order_advice(rep: Any, probe: str | None = None, probe_s: float = 1.0) -> dict[str, Any]:
    """The order section of a doctor report (a dict; see the module docstring).

    ``probe``: a data file to measure the permutation's random reads on with
    the Loader's queue depth (``LoaderTuning.threads``) for at most
    ``probe_s`` seconds; without it ``rep.cold_reads_per_s`` stands in."""
    n, R, S = rep.records, max(1, rep.record_bytes), rep.store_bytes
    plan = plan_memory(batch_bytes=BATCH * R, record_bytes=R, records=n, hold=1, prefetch=None, mem_bytes=None)
    seq = _rate((rep.seq_mb_per_s or 0) * 1e6)
    c1, warm = _rate(rep.cold_reads_per_s_1), _rate(rep.warm_reads_per_s)
    # the permutation's reads as the Loader will do them (module docstring)
    cq, how = None, "doctor's cold record reads"
    if not plan["fits"] and R >= SMALL_RECORD_BYTES:
        cq = _rate(probe_random_direct(probe, R, QUEUE_DEPTH, probe_s))
        how = "O_DIRECT random reads, as the Loader reads a store that does not fit"
    if cq is None:
        cq = _rate(probe_random(probe, R, QUEUE_DEPTH, probe_s))
        how = "random reads through the page cache"
    if cq is None:
        cq, how = _rate(rep.cold_reads_per_s), "doctor's cold record reads"
    decode = _rate(getattr(rep, "decode_reads_per_s", None))
    cap = decode * R if decode else warm * R if warm else float("inf")
    block = BlockShuffle.auto_sizes(n, R, 1)["block"]
    blocks = max(1, -(-n // block))
    window = min(blocks, max(1, plan["window_bytes"] // (block * R)))
    rates: dict[str, float | None] = {"sequential": None, "permutation": None, "block": None}
    if seq:
        rates["sequential"] = min(seq, cap)
    if cq:
        rates["permutation"] = min(cq * R, cap)
    if seq and c1:
        seek = max(0.0, 1 / c1 - R / seq)
        rates["block"] = min(block * R / (seek + block * R / seq), cap)
    out: dict[str, Any] = {
        "fits": bool(plan["fits"]), "budget": plan["budget"], "budget_source": plan["budget_source"],
        "cgroup_limit": plan["cgroup_limit"], "store_bytes": S, "cache_bytes": plan["cache_bytes"],
        "block": block, "window": window, "window_bytes": window * block * R,
        "rates_MBps": {k: (None if v is None else v / 1e6) for k, v in rates.items()},
        "permutation_probe": how if cq else None,
    }
    if plan["fits"]:
        order, rate = "permutation", (cap if cap < float("inf") else None)
        why = (f"the store ({fmt_bytes(S)}) fits in the page cache this process may use "
               f"({fmt_bytes(plan['cache_bytes'])}): it is read into it once (a Loader does so before its first "
               "epoch, or `mmstore warm`), "
               "then every order reads from memory and the full shuffle mixes best")
    else:
        rp, rb = rates["permutation"], rates["block"]
        if rb and (not rp or rb >= GAIN * rp):
            order, rate = "block", rb
            why = (f"the store is {S / max(1, plan['cache_bytes']):.1f}x the page cache this process may use, and "
                   f"long reads are faster than random ones here: blocks of {fmt_bytes(block * R)} read at "
                   f"~{rb / 1e6:,.0f} MB/s, random records at ~{(rp or 0) / 1e6:,.0f} MB/s")
        else:
            order, rate = "permutation", rp
            why = (f"the store is {S / max(1, plan['cache_bytes']):.1f}x the page cache this process may use, "
                   f"but random reads are fast here (~{(rp or 0) / 1e6:,.0f} MB/s vs ~{(rb or 0) / 1e6:,.0f} MB/s "
                   "for blocks): the full shuffle costs about the same and mixes best")
    if decode and rate is not None and rate >= cap:
        why += (f"; decoding the encoded fields on {getattr(rep, 'cores', 0) or '?'} cores caps it at "
                f"~{decode:,.0f} records/s")
    out.update(decode_records_per_s=decode, bound="decode" if decode and rate is not None and rate >= cap else
               "disk" if rate is not None and not plan["fits"] else "memory")
    out.update(order=order, expected_MBps=None if rate is None else rate / 1e6,
               expected_records_per_s=None if rate is None else rate / R,
               epoch_s=None if not rate else S / rate, why=why)
    return out


def order_lines(adv: dict[str, Any] | None) -> list[str]:
    """The order section as ``doctor``'s text lines."""
    if not adv:
        return []
    lim = f", cgroup limit {fmt_bytes(adv['cgroup_limit'])}" if adv.get("cgroup_limit") else ""
    r = adv["rates_MBps"]
    f = lambda x: "n/a" if x is None else f"{x:,.0f} MB/s"  # noqa: E731
    rate = adv["expected_MBps"]
    return [
        f"fits           {'yes' if adv['fits'] else 'no'}: {fmt_bytes(adv['store_bytes'])} of data, "
        f"{fmt_bytes(adv['cache_bytes'])} of page cache for a Loader (budget {fmt_bytes(adv['budget'])} from "
        f"{adv['budget_source']}{lim})",
        f"order rates    sequential {f(r['sequential'])}, block shuffle {f(r['block'])} (block {adv['block']}, "
        f"window {adv['window']}), permutation {f(r['permutation'])}"
        + (f" ({adv['permutation_probe']}, {QUEUE_DEPTH} in flight)" if adv.get("permutation_probe") else ""),
        f"order          Loader(store, {BATCH}, order={adv['order']!r}): expect ~{f(rate)}"
        + (f", {fmt_seconds(adv['epoch_s'])} an epoch" if adv.get("epoch_s") else "") + f"; {adv['why']}",
    ]
