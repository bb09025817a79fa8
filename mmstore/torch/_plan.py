"""How a :class:`~mmstore.torch.Loader` sizes its ring and its read-ahead
window from the memory it may use, and how it says what it chose
(``Loader.describe()``). The rule itself is torch-free
(:func:`mmstore._memplan.plan_memory`, re-exported by ``mmstore.order``;
``doctor`` uses it too).

The sizing rule (NOTE [memory plan]; every figure is in ``describe()``)
------------------------------------------------------------------------
``budget``
    The memory the loader may fill: ``LoaderTuning.mem_bytes`` when given,
    else :func:`mmstore._sys.effective_available` (``min(MemAvailable,
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
    ``cache / 4``: the read-ahead pass keeps the window being served and the
    next one in the page cache (half of ``cache``), the rest is headroom for
    the training process. A block shuffle built from the kind name gets
    ``window = clamp(window_bytes // block_bytes, 1, blocks)`` (so a store
    that fits is one window: a uniform permutation); a sequential order is
    read ahead in windows of ``max(batch_size, window_bytes // record_bytes)``
    records.
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
    reads] in ``_reads.py``). Not there before the first epoch.
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
    in ``_aio.py``; one ``preadv`` per record where AIO is missing). No
    ``WILLNEED``: no record is read twice in an epoch, so the page cache
    only costs its inserts and reclaim (NOTE [direct record reads]).
``window_direct``
    A block shuffle or a sequential order, the store does not fit,
    ``window_prefetch="read"`` and ``cache`` is at least 64 MiB: the windows
    are read with ``O_DIRECT`` into private buffers on transparent huge pages
    (at most ``2 * window_bytes`` of them, more only for the windows the next
    batch reads) and the batches copy their records out of them
    (``_direct.py``): no page cache, one copy per record, disk requests of
    the device's largest size. Otherwise, when the store does not fit, the
    pass reads through the page cache and drops each window from it once its
    batches are read (``drop_behind``).

NOTE [memory plan]: what was measured (2 vCPU VM shared with other jobs, a
v1 memory cgroup of 1/4 of a 2.4 GB store of 150 KB records; and
``../shared/sim/hdd_sim.py``'s throttled loop device):

* the block shuffle's window came from the host's ``MemAvailable`` (23 GB):
  one window held the whole store, so its ``WILLNEED`` pass asked for 2.4 GB
  inside a 600 MB limit and the block order read like a permutation (HDD:
  98-107 records/s, as the permutation's 99-115);
* ``WILLNEED`` under the limit left out 64 % (block) and 78 % (sequential)
  of the pages (``missing_ranges`` right after it; 97 % on the simulated
  HDD), which the batches then read record by record;
* a ring of 4 + 1 batches of 256 x 150 KB is 193 MB of the 600 MB limit;
* per-record ``WILLNEED`` hints for later batches raced the window pass
  with small requests; 2 MiB pieces made ~1,200 Python tasks an epoch
  (user CPU 0.75 s -> 0.3 s with one piece per core);
* a ``RANDOM``-advised descriptor turns a long read into requests of the
  pages asked for; the pass's own ``SEQUENTIAL`` descriptors read long runs
  in requests of the device's size;
* reading the windows through the page cache cost ~3.5 s of system CPU for
  2.4 GB against 0.9 s for one ``dd``-like read (two copies, reclaim); with
  O_DIRECT window buffers the block shuffle took 1.8 s of CPU (0.6 s
  system) instead of 3.3-3.6 s and read at 2.1x the page-cache pass in the
  same run (351 vs 166 MB/s, load 7-11); a sequential order read slower that
  way (282 vs 374 MB/s) while the buffers were 4 KiB pages;
* those buffers were a shared anonymous mapping (shmem: no transparent huge
  pages), so an ``O_DIRECT`` read reached the disk as requests of
  ``max_segments`` 4 KiB pages: 589 KB on average here (virtio, 254
  segments; ``/sys/block/vda/stat``), 512 KB on the simulated HDD (loop
  device, 128), where 120 requests/s then cap any pass at ~64 MB/s
  (0.43x its 150 MB/s). Private buffers on huge pages (2026-12-01, load
  3.5-4.5): requests of 2.4 MB (vda) and 1.17 MB (loop device, its
  ``max_sectors_kb`` 1280); the HDD model's block shuffle 963 records/s
  (was 444-493; ``dd`` 997), its sequential order 948 (656-671 through the
  page cache); here block 1,007-1,015 MB/s against ``dd``'s 754-815 in the
  same runs, and a sequential order as fast as the page-cache pass with a
  third of its system CPU (0.4 vs 1.2 s an epoch): both orders use it.
  Where a block-shuffle epoch's time goes now (671 MB cgroup, 12:50, load
  6.5): the window pass reads for 2.19-2.25 s of the 2.30-2.37 s epoch
  (1,017-1,047 MB/s, ``dd`` 658-732 in the same run), the batches wait for
  it 2.2 s of it, the pass waited for buffer room 0.19 s; 0.7-0.8 s of CPU
  an epoch. The disk is the limit.
* where the simulators' time goes (``../shared/sim``, 2026-12-01, machine
  shared, load 4-7): they time a pass from before ``from mmstore.torch
  import Loader``, and importing torch takes 1.5-2.7 s in the cgroup (up to
  5 s under load): as long as ``dd`` reads the whole 2.4 GB store. Timed in
  fresh processes in the same 602 MB cgroup, the same epochs read at
  1,296-1,546 MB/s (sequential), 957-990 (block), 750-852 (permutation)
  from the Loader's construction, against ``dd``'s 941-970: 1.3-1.6x, 1.0x
  and 0.8-0.9x the disk; the simulator's own figures for the same passes
  were 543-567, 514-585 and 457-497 MB/s (0.55-0.6x), and a loader that read
  at exactly the disk's speed would score ``dd / (dd + import)`` ~ 0.5x
  there. The first batch comes 0.13-0.3 s after the construction.
"""

from __future__ import annotations

from .._memplan import memory_budget, plan_memory, widen_ring

__all__ = ["LoaderPlan", "memory_budget", "plan_memory", "widen_ring"]

class LoaderPlan(dict):  # type: ignore[type-arg]
    """What a Loader chose (a dict); ``str()`` of it reads as sentences."""

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
