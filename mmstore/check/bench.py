"""``bench``: random-batch read throughput, per order, warm and cold.

For each order (sequential, full permutation, block shuffle sized for this
machine) the first ``samples`` indices of epoch 0 are read in batches through

- ``Store.read_batch``;
- ``StoreDataset`` + ``torch.utils.data.DataLoader`` (``workers`` processes);
- ``mmstore.torch.Loader`` (reader threads, ring buffers);

once after ``Store.evict()`` (cold) and once after ``Store.warm()`` (warm).
With ``codecs`` the codec choices are also measured side by side on a sample
of the store's records (``codec_advice``, the measurement ``doctor`` uses):
size, one-core encode and decode time, the decode rate of all cores at once,
and the predicted samples/s from this disk's sequential speed and the memory
available.
The torch paths run only when torch and ``mmstore.torch`` import. With a
source directory the same samples are also decoded from the source files
(``mmstore.decode``, the store's decode spec when the provenance has one),
cold (each file evicted first) and warm. ``shuffle_quality`` of each order is
reported alongside.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..store.reader import Store, open_store
from .common import find_label_field, write_output

__all__ = ["BenchCase", "BenchReport", "bench_figure", "bench_store", "plot_bench"]

ORDERS = ("sequential", "permutation", "block")
PATHS = ("read_batch", "DataLoader", "Loader", "source")


@dataclass
class BenchCase:
    path: str  # read_batch | DataLoader | Loader | source
    order: str
    cache: str  # cold | warm
    samples: int = 0
    seconds: float = 0.0
    samples_per_s: float = 0.0
    mb_per_s: float = 0.0
    note: str = ""


@dataclass
class BenchReport:
    path: str
    backend: str
    records: int
    record_bytes: int
    batch_size: int
    samples: int
    workers: int
    orders: dict[str, dict[str, Any]] = field(default_factory=dict)
    quality: dict[str, dict[str, Any]] = field(default_factory=dict)
    cases: list[BenchCase] = field(default_factory=list)
    torch: str | None = None
    source: str | None = None
    plot: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    codecs: Any = None  # _codec_advice.CodecAdvice when asked for


def _batches(idx: np.ndarray, bs: int) -> Iterator[np.ndarray]:
    for a in range(0, len(idx), bs):
        yield idx[a : a + bs]


def _run(fn: Callable[[float], int], max_seconds: float) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = fn(t0 + max_seconds)
    return n, time.perf_counter() - t0


def _case_read_batch(store: Store, idx: np.ndarray, bs: int) -> Callable[[float], int]:
    def fn(deadline: float) -> int:
        n = 0
        for b in _batches(idx, bs):
            store.read_batch(b)
            n += len(b)
            if time.perf_counter() > deadline:
                break
        return n

    return fn


def _case_dataloader(store: Store, idx: np.ndarray, bs: int, workers: int) -> Callable[[float], int]:
    from torch.utils.data import DataLoader

    from ..torch import StoreDataset

    def fn(deadline: float) -> int:
        ds = StoreDataset(store.path)
        batches = [b.tolist() for b in _batches(idx, bs)]
        dl = DataLoader(ds, batch_sampler=batches, num_workers=workers,
                        multiprocessing_context="fork" if workers else None)
        n = 0
        it = iter(dl)
        try:
            for batch in it:
                first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
                n += len(first)
                if time.perf_counter() > deadline:
                    break
        finally:
            del it
        return n

    return fn


def _case_loader(store: Store, order_obj: Any, samples: int, bs: int) -> Callable[[float], int]:
    from ..torch import Loader

    def fn(deadline: float) -> int:
        n = 0
        with Loader(store.path, bs, order=order_obj, copy=False) as ld:
            for batch in ld:
                first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
                n += len(first)
                if n >= samples or time.perf_counter() > deadline:
                    break
        return n

    return fn


def _source_decoder(store: Store, source: str) -> tuple[Callable[[str], Any], str]:
    from .. import decode as dec
    from .common import find_image_field
    from .repair import _bounded_spec

    found = find_image_field(store.schema)
    if found is None:
        raise ValueError("no image field to decode the source into")
    f, lay = found
    prov = store.provenance
    ing = prov.get("ingest")
    params = ing.get("params") if isinstance(ing, dict) else None
    # ingest writes ingest.params.decode; "decode" at the top: stores made before it did
    spec_dict = params.get("decode") if isinstance(params, dict) else None
    spec_dict = prov.get("decode") if spec_dict is None else spec_dict
    spec, why = None, "no spec in the provenance"
    if spec_dict is not None:
        try:  # checked and bounded as repair does: a store from someone else is untrusted
            spec = _bounded_spec(spec_dict, f.shape)
        except ValueError as exc:
            why = f"the provenance's spec is not usable: {exc}"
    if spec is None:
        shp = f.shape
        h, w, c = (shp[1], shp[2], shp[0]) if lay == "chw" else (shp[0], shp[1], shp[2] if len(shp) == 3 else 1)
        spec = dec.DecodeSpec(size=(h, w), channels=c, layout="chw" if lay == "chw" else "hwc")
        how = f"a decode spec guessed from the image field ({why})"
    else:
        how = "the store's decode spec (from its ingest provenance)"

    def one(key: str) -> Any:
        return dec.decode_image(dec.read_bytes(os.path.join(source, key)), spec)

    return one, how


def _case_source(store: Store, idx: np.ndarray, source: str, workers: int, cold: bool) -> Callable[[float], int]:
    from .. import _os

    one, _ = _source_decoder(store, source)
    keys = [store.key(int(i)) for i in idx]
    if cold:
        for k in keys:
            try:
                _os.evict(os.path.join(source, k))
            except (OSError, NotImplementedError):
                pass

    def fn(deadline: float) -> int:
        n = 0
        with ThreadPoolExecutor(max(1, workers)) as ex:
            for a in range(0, len(keys), 64):
                list(ex.map(one, keys[a : a + 64]))
                n += len(keys[a : a + 64])
                if time.perf_counter() > deadline:
                    break
        return n

    return fn


def _bench_codecs(store: Store, codecs: tuple[str, ...], seed: int, max_seconds: float) -> Any:
    """The codec choices side by side (the doctor's measurement, plus all cores at once)."""
    from .. import _os
    from ..ingest.workers import default_workers
    from .codec_advice import codec_advice

    big = max(store.slot_view.backend.data_paths(), key=os.path.getsize)
    sp = _os.seq_read_speed(big, max_bytes=256 << 20, cold=True, max_seconds=min(5.0, max_seconds))
    return codec_advice(store, available=_os.effective_available() or _os.mem_available(),
                        seq_bytes_per_s=sp.mb_per_s * 1e6 or None, codecs=codecs, seed=seed,
                        max_seconds=max_seconds, threads=default_workers())


def _torch_paths(rep: BenchReport, paths: tuple[str, ...]) -> tuple[str, ...]:
    """``paths`` without the torch cases when torch is missing (said in ``rep.torch``)."""
    if not any(p in ("DataLoader", "Loader") for p in paths):
        return paths
    try:
        import torch

        import mmstore.torch  # noqa: F401
    except ImportError as exc:
        rep.torch = f"not run: {exc}"
        return tuple(p for p in paths if p not in ("DataLoader", "Loader"))
    rep.torch = f"torch {torch.__version__}"
    return paths


def _build_orders(store: Store, rep: BenchReport, orders: tuple[str, ...], seed: int) -> dict[str, Any]:
    """The orders to measure, each described with its shuffle quality in ``rep``."""
    from ..order import make_order, shuffle_quality

    lf = find_label_field(store.schema)
    labels = store.column(lf.name) if lf is not None else None
    built = {}
    for kind in orders:
        kw: dict[str, Any] = {"seed": seed}
        if kind == "block":
            kw["record_bytes"] = rep.record_bytes
        o = make_order(kind, rep.records, **kw)
        built[kind] = o
        rep.orders[kind] = o.describe()
        rep.quality[kind] = shuffle_quality(o.epoch(0), labels, rep.batch_size, n=rep.records)
    return built


def bench_store(
    path: str | os.PathLike[str],
    *,
    samples: int = 4096,
    batch_size: int = 64,
    orders: tuple[str, ...] = ORDERS,
    caches: tuple[str, ...] = ("cold", "warm"),
    paths: tuple[str, ...] = ("read_batch", "DataLoader", "Loader"),
    workers: int | None = None,
    max_seconds: float = 10.0,
    source: str | None = None,
    seed: int = 0,
    codecs: tuple[str, ...] | None = None,
) -> BenchReport:
    """Run the benchmark (see the module docstring); every case stops after
    ``max_seconds``. Cold cases evict the whole store first (everyone's
    cache of it), warm cases read it all into the page cache first."""
    t_start = time.perf_counter()
    store = open_store(path)
    try:
        workers = min(4, os.cpu_count() or 1) if workers is None else int(workers)
        rb = store.stored_record_bytes()
        n = store.records
        rep = BenchReport(store.path, store.backend_name, n, rb, batch_size, min(samples, n), workers)
        if n == 0:
            rep.notes.append("the store is empty")
            return rep
        if codecs:
            rep.codecs = _bench_codecs(store, codecs, seed, max_seconds)
        paths = _torch_paths(rep, paths)
        if source is not None:
            if not os.path.isdir(source):
                raise FileNotFoundError(f"--source {source}: not a directory")
            _, how = _source_decoder(store, source)
            rep.source = f"{os.path.abspath(source)} (decoded with {how})"
            paths = tuple(paths) + ("source",)
        built = _build_orders(store, rep, orders, seed)
        data_bytes = rb
        # path-major: every DataLoader case forks before any Loader case runs
        # (a Loader leaves its lmdb environment registered in this process)
        for p in paths:
            for kind, o in built.items():
                idx = o.epoch(0)[: rep.samples]
                for cache in caches:
                    if cache == "cold":
                        store.evict()
                    else:
                        w = store.warm()
                        if not w.complete:
                            rep.notes.append(f"warm: {w.reason}")
                    if p == "read_batch":
                        fn = _case_read_batch(store, idx, batch_size)
                    elif p == "DataLoader":
                        fn = _case_dataloader(store, idx, batch_size, workers)
                    elif p == "Loader":
                        fn = _case_loader(store, o, len(idx), batch_size)
                    else:
                        fn = _case_source(store, idx, source or "", workers, cache == "cold")
                    if p in ("DataLoader", "Loader"):
                        # no lmdb environment may be open here when workers fork
                        # (py-lmdb refuses a second open of one file per process)
                        store.close()
                    c = BenchCase(p, kind, cache)
                    try:
                        c.samples, c.seconds = _run(fn, max_seconds)
                    except Exception as exc:  # noqa: BLE001 - reported per case
                        c.note = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
                    if c.seconds > 0:
                        c.samples_per_s = c.samples / c.seconds
                        c.mb_per_s = c.samples * data_bytes / c.seconds / 1e6
                    if p == "DataLoader" and workers:
                        c.note = c.note or f"{workers} workers, start-up included"
                    rep.cases.append(c)
        rep.seconds = time.perf_counter() - t_start
        return rep
    finally:
        store.close()


def plot_bench(rep: BenchReport, output: str) -> str:
    """A grouped bar chart of samples/s (matplotlib, an optional extra)."""
    fig = bench_figure(rep)  # first: it says what to install when matplotlib is missing
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return write_output(output, buf.getvalue())  # never through a link (see write_output)


def bench_figure(rep: BenchReport) -> Any:
    """The matplotlib figure of :func:`plot_bench`. The samples/s axis is
    logarithmic: the paths differ by orders of magnitude (a DataLoader with
    start-up, a source decode, a warm read_batch), and on a linear axis the
    slow bars are too short to read. Each bar is labelled with its rate."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install matplotlib") from None
    groups = []
    for c in rep.cases:
        g = f"{c.path}\n{c.order}"
        if g not in groups:
            groups.append(g)
    caches = sorted({c.cache for c in rep.cases})
    x = np.arange(len(groups))
    wdt = 0.8 / max(1, len(caches))
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(groups) + 2), 4.5))
    for k, cache in enumerate(caches):
        vals = [next((c.samples_per_s for c in rep.cases if f"{c.path}\n{c.order}" == g and c.cache == cache), 0)
                for g in groups]
        # a case that did not run (0) gets no bar: a log axis has no zero
        bars = ax.bar(x + (k - (len(caches) - 1) / 2) * wdt, [v if v > 0 else np.nan for v in vals], wdt,
                      label=cache)
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v > 0 else "" for v in vals], fontsize=6, rotation=90,
                     padding=2)
    ax.set_yscale("log")
    ax.margins(y=0.25)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, fontsize=7)
    ax.set_ylabel("samples / s (log scale)")
    ax.set_title(f"mmstore bench: {os.path.basename(rep.path)} ({rep.backend}, {rep.record_bytes:,} B/record, "
                 f"batch {rep.batch_size})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    return fig
