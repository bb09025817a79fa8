"""How a :class:`~mmstore.torch.Loader` sizes its ring and its read-ahead
window from the memory it may use, and how it says what it chose
(``Loader.describe()``). The rule itself is torch-free
(:func:`mmstore._os.memplan.plan_memory`, re-exported by ``mmstore.order``;
``doctor`` uses it too).

The sizing rule (NOTE [memory plan]; every figure is in ``describe()``)
------------------------------------------------------------------------
``budget``
    The memory the loader may fill: ``LoaderTuning.mem_bytes`` when given,
    else :func:`mmstore._os.effective_available` (``min(MemAvailable,
    limit - working set)`` over the process's memory cgroups, v1 and v2: a
    container's limit, not the host's free memory), divided by the ranks
    that share it (``$LOCAL_WORLD_SIZE``, as set by torchrun); 1 GiB when
    no figure is available.
``ring``
    ``prefetch + hold`` batch buffers of ``batch_bytes``. ``prefetch``
    (default) is the largest of 1..4 whose ring takes at most a quarter of
    the budget: the ring is private memory inside the same limit as the page
    cache the reads need. An order read per batch (a permutation) whose
    store does not fit gets the largest of 1..4 whose ring takes at most
    half of it (``widen_ring``): no record is read twice in an epoch, so the
    page cache gains it nothing, and more batches in flight keep the random
    reads at full queue depth across batch boundaries.
``cache``
    ``budget - ring``: what the page cache may hold for this loader.
``fits``
    The fields read (``records * record_bytes``) fit in 90 % of ``cache``:
    the store can stay cached; reads are left to the page cache.
``window_bytes``
    A block shuffle's window (``block * window`` records): built from the
    kind name, its size comes from the fixed budget
    ``mmstore.order.WINDOW_BYTES``, never from this memory (every rank and
    every resumed run computes the same order). The read-ahead pass keeps the
    window being served and the next one in the page cache; when those two
    do not fit in ``cache`` the loader warns and the batches read their own
    records (``windows_do_not_fit``). A sequential order is read ahead in
    windows of ``max(batch_size, (cache / 4) // record_bytes)`` records.
``window_chunk``
    The window pass reads runs in requests of at most
    ``clamp(cache / 16 / window_threads, 1 MiB, 8 MiB)``, one buffer of that
    size per window thread, taken out of ``cache``.
``readahead``
    ``"windows"`` for block-shuffle and sequential orders (long reads of the
    next window in offset order, ahead of the batches); ``"per batch"`` for
    a permutation (every record is a random read at queue depth
    ``threads``; ``WILLNEED`` on the records of later batches).
``reads``
    The epoch in progress (or the last one), as it reads now: ``cached``
    (its records are in the page cache: one piece per core, no
    ``WILLNEED``; else a piece per reader thread and ``WILLNEED``
    ``willneed`` batches ahead), ``piece_rows``, ``willneed``, ``direct``,
    ``resident`` (the fraction cached when the epoch started) and
    ``switches`` (how often the cut changed within the epoch: the page cache
    is sampled on records ahead every few batches, NOTE [warm vs cold
    reads] in ``mmstore/engine/reads.py``). Not there before the first epoch.
``direct_reads``
    A shuffled order read per batch (a permutation) whose store does not
    fit, ``method`` not ``"mmap"``: each record (each run of consecutive
    ones) of a field of at least ``PREAD_MIN_BYTES`` (2 KiB) a record (not
    the small fields ``method="pread"`` also reads with ``preadv``: a disk
    read each, where their file stays cached) is read with ``O_DIRECT``
    straight into its ring row where the row is aligned to the record's file offset modulo the device block (the
    ring's rows are allocated so: NOTE [rows read in place] in ``_ring.py``),
    else into a reader thread's aligned buffer and copied into its row
    (``_direct.read_records_direct``); a batch is read in a few pieces, each
    piece's reads in one Linux AIO submit (NOTE [record reads in one submit]
    in ``mmstore/engine/aio.py``; one ``preadv`` per record where AIO is missing). No
    ``WILLNEED``: no record is read twice in an epoch, so the page cache
    only costs its inserts and reclaim (NOTE [direct record reads]).
``window_direct``
    A block shuffle or a sequential order, the store does not fit,
    ``window_prefetch="read"`` and ``cache`` is at least 64 MiB: the windows
    are read with ``O_DIRECT`` into private buffers on transparent huge pages
    (at most ``2 * window_bytes`` of them, more only for the windows the next
    batch reads) and the batches copy their records out of them
    (``mmstore/engine/direct.py``): no page cache, one copy per record, disk requests of
    the device's largest size. Otherwise, when the store does not fit, the
    pass reads through the page cache and drops each window from it once its
    batches are read (``drop_behind``).

NOTE [memory plan]: why the rule is what it is (the measurements are in the
benchmark pages, ``docs/benchmarks/measurements.md``):

* the block shuffle's order must not depend on the memory a process sees
  (ranks and resumed runs would compute other orders), and a window sized
  from the host's free memory can exceed a container's limit: a pass that
  asks the kernel for more than the limit holds reads like a permutation.
  The window therefore comes from a fixed byte budget
  (``mmstore.order.WINDOW_BYTES``); the memory only decides whether two
  windows fit (else the batches read their own records);
* ``WILLNEED`` under a memory limit gives up on pages it cannot allocate at
  once: what it left out (``missing_ranges``) is read by the pass in long
  requests, not by the batches record by record;
* the ring is private memory inside the same limit as the page cache the
  reads need, hence its quarter of the budget;
* per-record ``WILLNEED`` for later batches would race the window pass with
  small requests, and many small pieces cost a Python task each: with
  windows, one piece per core and no per-record hints;
* a ``RANDOM``-advised descriptor turns a long read into requests of the
  pages asked for; the pass reads through its own ``SEQUENTIAL`` ones;
* reading windows through the page cache costs two copies and the reclaim
  of what was read; ``O_DIRECT`` into private buffers on transparent huge
  pages reaches the disk in requests of the device's largest size (a shared
  mapping has no huge pages, and its 4 KiB pages cap a request at
  ``max_segments`` pages), so both block and sequential orders that do not
  fit use them when the memory has room.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._os.memplan import memory_budget, plan_memory, widen_ring

__all__ = ["LoaderPlan", "memory_budget", "plan_memory", "widen_ring"]


@dataclass
class LoaderPlan:
    """What a Loader chose (the sizing rule above); ``str()`` of it reads as
    sentences. ``plan["fits"]`` reads the attribute of that name, as a
    mapping does (``dict(plan)`` gives every attribute).

    Attributes: ``budget`` (bytes it may fill), ``budget_source``,
    ``cgroup_limit``, ``batch_bytes``, ``prefetch``, ``hold``,
    ``ring_bytes``, ``cache_bytes`` (budget - ring, less the window pass's
    buffers), ``store_bytes`` (the fields read), ``fits``, ``window_bytes``,
    ``order`` (the order's class name), ``threads``, ``window_mode``,
    ``window_threads``, ``block`` and ``window`` (block shuffles),
    ``readahead`` (``"windows"`` or ``"per batch"``), ``window_records``,
    ``window_chunk``, ``window_direct``, ``drop_behind``, ``direct_reads``,
    ``windows_do_not_fit``, ``willneed``, ``reads`` (the epoch in progress,
    None before the first), ``warm`` (None before the first epoch, then
    ``"foreground"``, ``"background"`` or ``"none"``) and ``remote`` (a store
    opened from a URL, from its first epoch on: the replica's state, the
    fetch windows and what the order costs in fetched bytes), ``crop``
    (with ``crop=``: the field, the crop and what runs per record),
    ``process`` (``process=True``: the helper process's pid once started, else 0).
    """

    budget: int
    budget_source: str
    cgroup_limit: int | None
    batch_bytes: int
    prefetch: int
    hold: int
    ring_bytes: int
    cache_bytes: int
    store_bytes: int
    fits: bool
    window_bytes: int
    order: str = ""
    threads: int = 0
    window_mode: str | bool = False
    window_threads: int = 0
    block: int | None = None
    window: int | None = None
    readahead: str = "per batch"
    window_records: int = 0
    window_chunk: int = 0
    window_direct: bool = False
    drop_behind: bool = False
    direct_reads: bool = False
    windows_do_not_fit: bool = False
    willneed: int = 0
    reads: dict[str, Any] | None = None
    warm: str | None = None
    remote: dict[str, Any] | None = None
    crop: dict[str, Any] | None = None
    process: int | None = None

    # -- mapping access: the spelling of describe() results as dicts ---------------
    def keys(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def __getitem__(self, key: str) -> Any:
        if key not in _NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in _NAMES:
            raise KeyError(f"{key!r} is not a field of LoaderPlan")
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in _NAMES

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in _NAMES else default

    def update(self, values: dict[str, Any]) -> None:
        """Set several fields (each must be one)."""
        for k, v in values.items():
            self[k] = v

    def copy(self) -> LoaderPlan:
        """A copy whose ``reads`` is a copy too."""
        return dataclasses.replace(self, reads=None if self.reads is None else dict(self.reads))

    def __str__(self) -> str:
        d = self
        mb = lambda x: f"{x / 1e6:,.0f} MB"  # noqa: E731
        lim = f" (cgroup limit {mb(d['cgroup_limit'])})" if d.get("cgroup_limit") else ""
        lines = [
            f"memory budget {mb(d['budget'])} from {d['budget_source']}{lim}",
            f"ring: {d['prefetch']} prefetch + {d['hold']} hold buffers of {mb(d['batch_bytes'])} "
            f"= {mb(d['ring_bytes'])}",
            f"the fields read take {mb(d['store_bytes'])}: "
            + ("they fit in the page cache left" if d["fits"] else
               f"larger than the {mb(d['cache_bytes'])} left for the page cache"),
            f"order {d['order']}" + (f", block {d['block']} records, window {d['window']} blocks "
                                     f"({mb(d['window_bytes'])})" if d.get("block") else ""),
        ]
        if d["readahead"] == "windows":
            lines.append(
                f"read-ahead: windows of {d['window_records']:,} records ({mb(d['window_bytes'])}) read with "
                f"long requests in offset order by {d['window_threads']} threads one window ahead"
                + ("; into private O_DIRECT buffers on huge pages (no page cache)" if d.get("window_direct") else "")
                + ("; each window is dropped from the page cache once read" if d["drop_behind"] else "")
            )
        else:
            if d.get("windows_do_not_fit"):
                lines.append("two windows of the block shuffle do not fit in the page cache left: "
                             "no window read-ahead (pass a smaller window= to get it)")
            lines.append(f"read-ahead: per batch ({d['threads']} reader threads"
                         + (", each record read with O_DIRECT: no page cache)" if d.get("direct_reads") else
                            f", WILLNEED {d['willneed']} batches ahead)"))
        w = d.get("warm")
        if w and w != "none":
            lines.append("warm: " + ("a sequential pass read the fields' files into the page cache first"
                                     if w == "foreground" else
                                     "a sequential pass reads the fields' files into the page cache in a thread"))
        c = d.get("crop")
        if c:
            lines.append(f"crop: field {c['field']!r}, {c['crop']}: {c['path']}")
        p = d.get("process")
        if p is not None:
            lines.append("the reader threads run in a helper process" + (f" (pid {p})" if p else " (not started)")
                         + "; batches in shared memory")
        r = d.get("reads")
        if r:  # the epoch in progress (or the last one): EpochReads.state
            lines.append(
                "this epoch: " + ("records in the page cache: memory copies" if r["cached"] else
                                  "records from disk" + (" (O_DIRECT)" if r.get("direct") else ""))
                + f", {r['piece_rows']} rows a piece"
                + (f", WILLNEED {r['willneed']} batches ahead" if r["willneed"] else "")
                + (f"; switched {r['switches']} time(s) as the page cache changed" if r["switches"] else "")
            )
        return "\n".join(lines)


_NAMES = frozenset(f.name for f in dataclasses.fields(LoaderPlan))
