"""Which codec for this store on this machine: measured, predicted, advised.

``doctor`` (and ``bench --codecs``) call :func:`measure_codecs` on a sample of
the store's own records: each candidate codec encodes the sample's image field
(the records as the reader returns them, so an encoded store is re-encoded from
its decoded pixels), then one core decodes the entries in a timed loop. ``raw``
has no decode; its per-record cost is the memory copy of the entry, timed the
same way. That gives, per codec, the stored bytes of a record and the seconds
one core spends to turn it into pixels.

:func:`advise` is a pure function of those figures and the machine's measured
numbers (records, memory available to the page cache, sequential read speed,
cores; ``doctor`` measures them, see ``benchmarks/doctor.py``). For each codec, with
``R`` its stored record bytes and ``S = records x R``:

- it *fits* when ``S <= 0.9 x available`` (the doctor's rule); otherwise the
  page cache keeps a share ``h = 0.9 x available / S`` between epochs;
- disk-bound rate: unlimited when it fits (every epoch after the first is
  served by memory), else ``seq_speed / ((1 - h) x R)`` (the block shuffle
  reads the uncached part sequentially);
- decode-bound rate: ``cores / decode_seconds`` (decoders release the GIL, the
  Loader decodes in its reader threads);
- predicted samples/s = the smaller of the two; epoch 1 also reads all of
  ``S`` from the disk: ``min(seq_speed / R, decode-bound)``.

The choice: ``raw`` whenever the raw store fits (nothing is faster than a
memory copy, and it is lossless); else the codec with the highest predicted
rate, lossless first on a tie; a higher JPEG quality is taken instead of a
lower one when it is within 10% of its rate and still beats every lossless
choice. The reason names the numbers that decided. Nothing here reads the
kernel's rotational flag: the disk is what ``doctor`` measured it to be.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import SchemaError
from ..format.codecs import Codec, parse_codec
from .common import find_image_field, fmt_bytes, sample_indices, table

__all__ = ["CANDIDATES", "CodecAdvice", "CodecFigure", "CodecPrediction", "Machine", "advise", "codec_advice",
           "decode_rate", "measure_codecs", "predict", "render_lines"]

CANDIDATES = ("raw", "jpeg:90", "jpeg:95", "png", "zstd")
FIT_SHARE = 0.9  # the share of available memory a store may take and still "fit" (as doctor's _predict)
QUALITY_SLACK = 0.9  # a higher JPEG quality is worth up to 10% of the rate


@dataclass
class CodecFigure:
    """One codec measured on the store's sample (one core)."""

    codec: str
    record_bytes: float  # mean stored bytes of a record (the field encoded, offsets entry included)
    ratio: float  # raw record bytes / record_bytes
    encode_ms: float | None = None  # per record, one core
    decode_ms: float | None = None  # per record, one core (raw: the copy)
    lossless: bool = True
    sample: int = 0
    threads_per_s: float | None = None  # measured: records/s decoded by ``threads`` threads at once
    threads: int = 0


@dataclass
class Machine:
    """What ``doctor`` measured about this machine and store."""

    records: int
    available: int | None  # bytes the page cache may hold (cgroup-aware)
    seq_bytes_per_s: float | None  # sequential read speed of the store's disk
    cores: int


@dataclass
class CodecPrediction:
    codec: str
    store_bytes: int
    fits: bool | None
    disk_per_s: float | None  # None: not disk-bound (fits), or unknown
    decode_per_s: float | None
    predicted_per_s: float | None
    epoch1_per_s: float | None
    bound: str  # "memory" | "disk" | "decode" | "unknown"


@dataclass
class CodecAdvice:
    field: str | None  # this name hides dataclasses.field in the class body, hence dataclasses.field below
    current: str
    cores: int
    sample: int
    figures: list[CodecFigure] = dataclasses.field(default_factory=list)
    predictions: list[CodecPrediction] = dataclasses.field(default_factory=list)
    choice: str = "raw"
    why: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


# -- the pure part ---------------------------------------------------------------------------


def predict(machine: Machine, fig: CodecFigure) -> CodecPrediction:
    """Samples/s of one codec on this machine (see the module docstring)."""
    n, R = max(0, machine.records), max(1.0, fig.record_bytes)
    S = n * R
    avail, seq, cores = machine.available, machine.seq_bytes_per_s, max(1, machine.cores)
    fits = None if avail is None else S <= FIT_SHARE * avail
    decode = cores * 1e3 / fig.decode_ms if fig.decode_ms else None
    disk = None  # fits: every epoch after the first comes from memory
    if not fits:
        h = 0.0 if avail is None else FIT_SHARE * avail / max(S, 1.0)  # < 1: it does not fit
        disk = seq / ((1 - h) * R) if seq else None
    rates = [r for r in (disk, decode) if r is not None]
    pred = min(rates) if rates and (fits or disk is not None) else None
    if pred is None:
        bound = "unknown"
    elif disk is not None and (decode is None or disk <= decode):
        bound = "disk"
    else:
        bound = "memory" if fig.codec == "raw" else "decode"
    e1_rates = [r for r in (seq / R if seq else None, decode) if r is not None]
    return CodecPrediction(fig.codec, int(S), fits, disk, decode, pred, min(e1_rates) if e1_rates else None, bound)


def advise(machine: Machine, figures: list[CodecFigure]) -> tuple[list[CodecPrediction], str, str]:
    """(predictions, chosen codec, why) from measured numbers only."""
    preds = [predict(machine, f) for f in figures]
    by = {p.codec: p for p in preds}
    figs = {f.codec: f for f in figures}
    raw = by.get("raw")
    if raw is not None and raw.fits:
        return preds, "raw", (
            f"the raw store ({fmt_bytes(raw.store_bytes)}) fits in the memory available "
            f"({fmt_bytes(machine.available)}): every epoch after the first is a memory copy"
            f"{_rate_text(raw.predicted_per_s)}, faster than any decode, and lossless")
    known = [p for p in preds if p.predicted_per_s is not None]
    if not known:
        return preds, "raw", "not enough was measured (disk speed or memory unknown) to prefer a codec: keep raw"
    best = max(known, key=lambda p: (_rate(p), figs[p.codec].lossless))
    choice = best
    if not figs[best.codec].lossless:
        floor = max((_rate(p) for p in known if figs[p.codec].lossless), default=0.0)
        for p in sorted(known, key=lambda p: -_quality(p.codec)):
            if (_quality(p.codec) > _quality(best.codec) and _rate(p) >= QUALITY_SLACK * _rate(best)
                    and _rate(p) >= floor):
                choice = p
                break
    return preds, choice.codec, _why(machine, choice, raw, by)


def _rate(p: CodecPrediction) -> float:
    """``p.predicted_per_s``, 0 where unknown."""
    return p.predicted_per_s if p.predicted_per_s is not None else 0.0


def _quality(spec: str) -> int:
    c = parse_codec(spec)
    return int(c.param or 0) if c.name == "jpeg" else 0


def _rate_text(r: float | None) -> str:
    return "" if r is None else f" (about {r:,.0f} samples/s)"


def _why(machine: Machine, choice: CodecPrediction, raw: CodecPrediction | None,
         by: dict[str, CodecPrediction]) -> str:
    avail = fmt_bytes(machine.available)
    if choice.codec == "raw":
        bound = "the disk" if choice.bound == "disk" else "memory copies"
        others = [p for p in by.values() if p.codec != "raw" and p.predicted_per_s]
        alt = max(others, key=lambda p: p.predicted_per_s or 0.0, default=None)
        vs = f"; the best codec, {alt.codec}, would give {alt.predicted_per_s:,.0f}" if alt else ""
        return (f"the raw store ({fmt_bytes(choice.store_bytes)}) does not fit in {avail}, but reading it is "
                f"bound by {bound} at about {choice.predicted_per_s:,.0f} samples/s{vs}: keep raw (lossless)")
    parts = [f"the raw store ({fmt_bytes(raw.store_bytes)}) does not fit in {avail}" if raw and raw.fits is False
             else "raw is not the fastest here"]
    if raw and raw.predicted_per_s:
        parts.append(f"raw is {raw.bound}-bound at about {raw.predicted_per_s:,.0f} samples/s")
    fit = "fits" if choice.fits else "does not fit either"
    parts.append(f"{choice.codec} ({fmt_bytes(choice.store_bytes)}) {fit} and is {choice.bound}-bound at about "
                 f"{choice.predicted_per_s:,.0f} samples/s on {machine.cores} cores")
    if raw and raw.predicted_per_s and choice.predicted_per_s is not None:
        parts.append(f"{choice.predicted_per_s / raw.predicted_per_s:.1f}x raw")
    lossy = "" if parse_codec(choice.codec).lossless else " (lossy: see the quality cost in the README)"
    return "; ".join(parts) + f": ingest or convert with --codec FIELD={choice.codec}{lossy}"


# -- the measuring part -----------------------------------------------------------------------


def _cores() -> int:
    from ..ingest.workers import default_workers

    return default_workers()


def _pick_field(store: Any) -> Any:
    found = find_image_field(store.schema)
    if found is not None:
        return found[0]
    return max(store.schema, key=lambda f: f.nbytes)


def _time_per_entry(fn: Any, items: list[Any], min_seconds: float) -> float:
    """Mean seconds of ``fn(item)`` over ``items``, repeated to at least ``min_seconds``."""
    done, t0 = 0, time.perf_counter()
    while True:
        for it in items:
            fn(it)
        done += len(items)
        dt = time.perf_counter() - t0
        if dt >= min_seconds or done >= 200 * len(items):
            return dt / done


def decode_rate(codec: Codec, encoded: list[Any], out: np.ndarray, threads: int, min_seconds: float) -> float:
    """Entries/s of ``threads`` threads decoding ``encoded`` (bytes in RAM, no
    store) into their own ``out``-like buffers at once: the decode limit."""
    from concurrent.futures import ThreadPoolExecutor

    def one(_: int) -> int:
        dst = np.empty_like(out)
        fn = (lambda d: np.copyto(dst, d)) if codec.raw else (lambda d: codec.decode_into(d, dst))
        done, end = 0, time.perf_counter() + min_seconds
        while time.perf_counter() < end:
            for d in encoded:
                fn(d)
            done += len(encoded)
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        n = sum(ex.map(one, range(threads)))
    return n / (time.perf_counter() - t0)


def _figure(codec: Codec, entries: np.ndarray, rest_bytes: int, raw_bytes: int, deadline: float,
            min_seconds: float, threads: int) -> CodecFigure:
    out = np.empty_like(entries[0])
    if codec.raw:
        rb = float(raw_bytes)
        ms = 1e3 * _time_per_entry(lambda e: np.copyto(out, e), list(entries), min_seconds)
        fig = CodecFigure("raw", rb, 1.0, None, ms, True, len(entries))
        if threads:
            fig.threads, fig.threads_per_s = threads, decode_rate(codec, list(entries), out, threads, min_seconds)
        return fig
    encoded, t0 = [], time.perf_counter()
    for e in entries:  # at least one entry, then as many as the time allows
        encoded.append(codec.encode(e))
        if time.perf_counter() > deadline:
            break
    enc_ms = 1e3 * (time.perf_counter() - t0) / len(encoded)
    dec_ms = 1e3 * _time_per_entry(lambda d: codec.decode_into(d, out), encoded, min_seconds)
    rb = rest_bytes + 8 + float(np.mean([len(d) for d in encoded]))  # 8: the entry's offset
    fig = CodecFigure(codec.spec, rb, raw_bytes / rb, enc_ms, dec_ms, codec.lossless, len(encoded))
    if threads:
        fig.threads, fig.threads_per_s = threads, decode_rate(codec, encoded, out, threads, min_seconds)
    return fig


def measure_codecs(store: Any, codecs: Any = CANDIDATES, *, sample: int = 32, seed: int = 0,
                   max_seconds: float = 6.0, threads: int = 0) -> tuple[str | None, list[CodecFigure], list[str]]:
    """Encode a sample of the store's records with each codec and time one
    core decoding them (and ``threads`` threads at once, if > 0); returns
    (field encoded, figures, notes)."""
    notes: list[str] = []
    if store.records == 0:
        return None, [], ["the store is empty: no codec measured"]
    f = _pick_field(store)
    if f.shaped:  # entries of their own sizes: the figures below assume one decoded size per record
        return f.name, [], [f"field {f.name!r} holds images of their own shape: codecs are not measured on "
                            "it yet (mmstore convert STORE OUT --codec image=CODEC, then compare with inspect)"]
    idx = sample_indices(store.records, sample, seed)
    entries = store.read_batch(idx, fields=[f.name])[f.name]
    raw_bytes = sum(x.nbytes for x in store.schema)  # every field decoded (record_bytes: the fixed ones)
    specs = [parse_codec(c) for c in codecs]
    per = max_seconds / max(1, len(specs))
    figs = []
    for c in specs:
        try:
            c.check(f.dtype, f.shape, where=f"field {f.name!r}")
        except SchemaError as exc:
            notes.append(f"{c.spec} not measured: {exc}")
            continue
        figs.append(_figure(c, entries, raw_bytes - f.nbytes, raw_bytes, time.perf_counter() + per / 2,
                            min(0.2, per / 4), threads))
    return f.name, figs, notes


def codec_advice(store: Any, *, records: int | None = None, available: int | None = None,
                 seq_bytes_per_s: float | None = None, codecs: Any = CANDIDATES, sample: int = 32,
                 seed: int = 0, max_seconds: float = 6.0, threads: int = 0) -> CodecAdvice:
    """Measure the codecs on ``store`` and advise from the given machine figures
    (``doctor`` passes its own measurements)."""
    t0 = time.perf_counter()
    name, figs, notes = measure_codecs(store, codecs, sample=sample, seed=seed, max_seconds=max_seconds,
                                       threads=threads)
    cur = "raw"
    if name is not None:
        cur = str(getattr(store.schema[name], "codec", None) or "raw")
    machine = Machine(store.records if records is None else records, available, seq_bytes_per_s, _cores())
    adv = CodecAdvice(name, cur, machine.cores, max((f.sample for f in figs), default=0), figs, notes=notes)
    if figs:
        adv.predictions, adv.choice, adv.why = advise(machine, figs)
    else:
        adv.why = "no codec could be measured on this store"
    adv.seconds = time.perf_counter() - t0
    return adv


def render_lines(adv: CodecAdvice | None) -> list[str]:
    """The doctor's / bench's codec section."""
    if adv is None:
        return []
    figs = {f.codec: f for f in adv.figures}
    threaded = any(f.threads for f in adv.figures)
    rows = []
    for p in adv.predictions:
        f = figs[p.codec]
        rows.append([p.codec, fmt_bytes(int(f.record_bytes)), f"{f.ratio:.1f}x",
                     "-" if f.encode_ms is None else f"{f.encode_ms:.2f}", f"{f.decode_ms:.3f}",
                     fmt_bytes(p.store_bytes), {True: "yes", False: "no", None: "?"}[p.fits],
                     _num(p.disk_per_s), _num(p.decode_per_s), _num(p.epoch1_per_s), _num(p.predicted_per_s)]
                    + ([_num(f.threads_per_s)] if threaded else []))
    out = [(f"codecs         field {adv.field!r} (now {adv.current}), {adv.sample} records sampled, "
            f"{adv.cores} cores; samples/s:")]
    out.append(table(rows, header=["codec", "bytes/record", "vs raw", "encode ms", "decode ms/core", "store",
                                   "fits", "disk-bound", "decode-bound", "epoch 1", "every epoch"]
                     + ([f"measured, {adv.figures[0].threads} threads"] if threaded else [])))
    for n in adv.notes:
        out.append(f"note           {n}")
    out.append(f"codec advice   {adv.choice}: {adv.why}")
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"
