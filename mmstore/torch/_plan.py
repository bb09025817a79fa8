"""How a :class:`~mmstore.torch.Loader` sizes its ring and its read-ahead
window from the memory it may use, and how it says what it chose
(``Loader.describe()``). The rule itself is torch-free
(:func:`mmstore.order.plan_memory`, which ``doctor`` uses too).

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
    cache the reads need.
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
    next window in offset order, ahead of the batches; when the store does
    not fit, each window is dropped from the page cache once its batches are
    read: ``drop_behind``); ``"per batch"`` for a permutation (every record
    is a random read at queue depth ``threads``; ``WILLNEED`` on the
    records of later batches).
"""

from __future__ import annotations

from ..order import memory_budget, plan_memory

__all__ = ["LoaderPlan", "memory_budget", "plan_memory"]

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
                + ("; each window is dropped from the page cache once read" if d["drop_behind"] else "")
            )
        else:
            lines.append(f"read-ahead: per batch ({d['threads']} reader threads, WILLNEED "
                         f"{d['willneed']} batches ahead)")
        return "\n".join(lines)
