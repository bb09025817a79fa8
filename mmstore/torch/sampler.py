"""torch ``Sampler`` wrappers around the torch-free orders of ``mmstore.order``.

``OrderSampler`` yields this rank's indices of one epoch of an
:class:`mmstore.order.Order`; ``set_epoch(e)`` picks the epoch (as with
``DistributedSampler``). The sampler runs in the main process (the
DataLoader hands batches of indices to its workers), so every sample of a
rank's slice is read exactly once per epoch whatever ``num_workers`` is.

Ranks: when ``rank``/``world_size`` are not given they come from
``torch.distributed`` if it is initialised, else 0 / 1. The split is the
order's: ``DistributedSampler``'s stride split for permutations (the same
indices, element for element, for the same global order) and contiguous
windows for block shuffles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ..order import Order, make_order

__all__ = ["OrderBatchSampler", "OrderSampler", "build_order", "dist_rank_world"]

_CHUNK = 8192


def dist_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)``: the given values, else ``torch.distributed``'s
    when it is initialised, else ``(0, 1)``."""
    if rank is None or world_size is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world_size = dist.get_world_size() if world_size is None else world_size
    return (0 if rank is None else int(rank)), (1 if world_size is None else int(world_size))


def build_order(
    order: Order | str,
    n: int,
    *,
    seed: int = 0,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    record_bytes: int | None = None,
    **kw: Any,
) -> Order:
    """An :class:`Order` from an order object or a kind name.

    A kind (``"sequential"``, ``"permutation"``, ``"block"``) is built with
    ``make_order`` for ``n`` samples and this rank (see
    :func:`dist_rank_world`); ``"block"`` without ``block=``/``window=`` is
    sized by ``BlockShuffle.auto`` from ``record_bytes``. An order object is
    used as is, except that when ``rank``/``world_size`` are given explicitly
    or ``torch.distributed`` says ``world_size > 1`` and the order was built
    for one process, it is re-made for this rank (``dataclasses.replace``).
    """
    if isinstance(order, Order):
        if order.n != n:
            raise ValueError(f"the order is for {order.n} samples but the dataset has {n}")
        r, w = dist_rank_world(rank, world_size)
        explicit = rank is not None or world_size is not None
        if (explicit or order.world_size == 1) and (r, w) != (order.rank, order.world_size):
            order = dataclasses.replace(order, rank=r, world_size=w)
        return order
    if not isinstance(order, str):
        raise TypeError(f"order must be an mmstore.order.Order or a kind name, got {type(order).__name__}")
    r, w = dist_rank_world(rank, world_size)
    if order == "block" and "block" not in kw and "window" not in kw:
        if record_bytes is None:
            raise ValueError("order='block' needs block= and window=, or a store to size them from")
        kw["record_bytes"] = int(record_bytes)
    if order == "sequential":
        kw.pop("seed", None)
        return make_order(order, n, rank=r, world_size=w, drop_last=drop_last, **kw)
    return make_order(order, n, seed=seed, rank=r, world_size=w, drop_last=drop_last, **kw)


def _n_of(data_source: Any) -> int:
    return data_source if isinstance(data_source, int) else len(data_source)


def _record_bytes(data_source: Any) -> int | None:
    store = getattr(data_source, "store", data_source)
    schema = getattr(store, "schema", None)
    fields = getattr(data_source, "fields", None)
    if schema is None:
        return None
    names = fields if fields is not None else schema.names
    return max(1, sum(schema[f].nbytes for f in names))


class OrderSampler(Sampler[int]):
    """A ``Sampler`` over an :class:`mmstore.order.Order`.

    Parameters
    ----------
    data_source : Dataset, Store or int
        What to sample from (only its length is used; a ``StoreDataset`` or
        ``Store`` also gives the record size for ``order="block"``).
    order : Order or str, default "permutation"
        An order object, or ``"permutation"`` (a seeded uniform permutation per
        epoch: ``RandomSampler``'s coverage), ``"block"`` (block shuffle for
        data larger than RAM, sized automatically) or ``"sequential"``.
    seed, rank, world_size, drop_last, **kw
        See :func:`build_order`.

    ``set_epoch(e)`` selects the epoch; iterating twice without it repeats
    the same epoch (as ``DistributedSampler`` does).
    """

    def __init__(
        self,
        data_source: Any,
        order: Order | str = "permutation",
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        **kw: Any,
    ) -> None:
        n = _n_of(data_source)
        self.order = build_order(
            order, n, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
            record_bytes=_record_bytes(data_source), **kw,
        )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices of the current epoch (``int64``)."""
        return self.order.epoch(self.epoch)

    def __iter__(self) -> Iterator[int]:
        idx = self.indices()
        for a in range(0, len(idx), _CHUNK):
            yield from idx[a : a + _CHUNK].tolist()

    def __len__(self) -> int:
        return len(self.order)


class OrderBatchSampler(Sampler[list[int]]):
    """Batches of an :class:`OrderSampler`'s indices (a ``batch_sampler``).

    Same batches as ``BatchSampler(OrderSampler(...), batch_size, drop_last)``
    but cut from the numpy epoch array without going through per-index
    Python ints.
    """

    def __init__(self, sampler: OrderSampler, batch_size: int, drop_last: bool = False) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        idx = self.sampler.indices()
        n = len(idx) - (len(idx) % self.batch_size if self.drop_last else 0)
        for a in range(0, n, self.batch_size):
            yield idx[a : min(a + self.batch_size, n)].tolist()

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
