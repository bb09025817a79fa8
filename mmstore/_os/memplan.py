"""A loader's memory plan, torch-free (``doctor`` uses it too): the memory a
process may fill (:func:`memory_budget`, within its memory cgroup), and how a
:class:`~mmstore.torch.Loader` splits it between its ring of batch buffers
and the page cache its reads need (:func:`plan_memory`). The rule is written
out in ``mmstore/engine/plan.py``; ``mmstore.order`` re-exports the public
names."""

from __future__ import annotations

import os
from typing import Any

from . import effective_available, mem_available, memory_limit

__all__ = ["local_world_size", "memory_budget", "plan_memory", "widen_ring"]

_GiB = 1 << 30
RING_SHARE = 4  # the ring takes at most 1 / RING_SHARE of the budget
PER_BATCH_RING_SHARE = 2  # ... of an order read per batch whose store does not fit
WINDOW_SHARE = 4  # a read-ahead window is 1 / WINDOW_SHARE of the cache
FIT_SHARE = 0.9  # the store fits when it takes at most this share of the cache
MAX_PREFETCH = 4


def _mem_available() -> int:
    """The memory this process can fill with page cache, in bytes: within its
    memory cgroup's limit (``effective_available``, cgroup v1 and v2) and
    ``MemAvailable`` (Linux), else free physical memory, else 1 GiB."""
    avail = effective_available()
    if avail is not None:
        return max(1, avail)
    avail = mem_available()
    if avail is not None:
        return avail
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return _GiB


def local_world_size() -> int:
    """``$LOCAL_WORLD_SIZE`` (set by torchrun), else 1."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(env) if env.isdigit() and int(env) > 0 else 1


def memory_budget(mem_bytes: int | None = None) -> tuple[int, str, int | None]:
    """``(budget, where it came from, the cgroup limit or None)``."""
    limit = memory_limit()
    if mem_bytes is not None:
        return int(mem_bytes), "given (mem_bytes=)", limit
    ranks = local_world_size()
    avail = effective_available()
    if avail is None:
        return _GiB // ranks, "unknown: 1 GiB assumed", limit
    src = "cgroup limit - working set" if limit is not None else "MemAvailable"
    if ranks > 1:
        src += f", / {ranks} local ranks"
    return max(1, int(avail) // ranks), src, limit


def _prefetch(budget: int, batch_bytes: int, hold: int, share: int) -> int:
    """The largest prefetch of 1..MAX_PREFETCH whose ring takes at most ``budget / share``."""
    return int(min(MAX_PREFETCH, max(1, budget // share // batch_bytes - hold)))


def plan_memory(
    *, batch_bytes: int, record_bytes: int, records: int, hold: int, prefetch: int | None,
    mem_bytes: int | None,
) -> dict[str, Any]:
    """A loader's ring and read-ahead window sized from its memory budget
    (``mem_bytes``, else :func:`memory_budget`): the rule is written out in
    ``mmstore/engine/plan.py`` and reported by ``Loader.describe()``."""
    budget, source, limit = memory_budget(mem_bytes)
    batch_bytes = max(1, int(batch_bytes))
    if prefetch is None:
        prefetch = _prefetch(budget, batch_bytes, hold, RING_SHARE)
    ring = (prefetch + hold) * batch_bytes
    cache = max(0, budget - ring)
    store = int(records) * int(record_bytes)
    return {
        "budget": budget, "budget_source": source, "cgroup_limit": limit,
        "batch_bytes": batch_bytes, "prefetch": prefetch, "hold": hold, "ring_bytes": ring,
        "cache_bytes": cache, "store_bytes": store, "fits": store <= FIT_SHARE * cache,
        "window_bytes": max(int(record_bytes), cache // WINDOW_SHARE),
    }


def widen_ring(plan: dict[str, Any]) -> dict[str, Any]:
    """The ring of a plan (default ``prefetch``) for an order read per batch
    (a permutation) whose store does not fit: no record is read twice in an
    epoch, so the page cache gains it nothing and the ring may take up to
    ``1 / PER_BATCH_RING_SHARE`` of the budget (more batches in flight: the
    random reads keep their queue depth across batch boundaries). The keys
    of ``plan`` that change."""
    if plan["fits"]:
        return {}
    prefetch = max(plan["prefetch"], _prefetch(plan["budget"], plan["batch_bytes"], plan["hold"],
                                               PER_BATCH_RING_SHARE))
    ring = (prefetch + plan["hold"]) * plan["batch_bytes"]
    return {"prefetch": prefetch, "ring_bytes": ring, "cache_bytes": max(0, plan["budget"] - ring)}
