"""torch ``Sampler`` wrappers around the torch-free orders of ``mmstore.order``.

``OrderSampler`` yields this rank's indices of one epoch of an
:class:`mmstore.order.Order`; ``OrderBatchSampler`` cuts them into batches.
The sampler runs in the main process (the DataLoader hands batches of indices
to its workers), so every sample of a rank's slice is read exactly once per
epoch whatever ``num_workers`` is.

Ranks: when ``rank``/``world_size`` are not given they come from
``torch.distributed`` if it is initialised, else 0 / 1. The split is the
order's: ``DistributedSampler``'s stride split for permutations (the same
indices, element for element, for the same global order) and contiguous
windows for block shuffles.

Padding: by default (``pad=True``) a sampler pads as ``DistributedSampler``
does, so that every rank yields ``ceil(n / world_size)`` indices: the
epoch's order is extended by wrap-around, and where ``world_size`` does not
divide ``n`` up to ``world_size - 1`` records are read by two ranks in the
epoch (203 records on 2 ranks: 102 indices each, one record on both). The
ranks' positions are disjoint; their records are not. ``pad=False,
batch_size=B`` (the DataLoader's batch size) reads every record once and
gives every rank the same number of batches of ``B``, as
:class:`mmstore.torch.Loader` does (where ``n // world_size`` is a multiple
of ``B``, the shorter ranks each take one record twice:
``sampler.order.repeated()`` counts them). ``drop_last=True`` gives each
rank ``n // world_size`` records, disjoint, and leaves the tail of the order
out.

NOTE [epoch rules] (shared with :class:`mmstore.torch.Loader`)
-------------------------------------------------------------
* An iteration runs the epoch given to ``set_epoch(e)``, else the one after
  the last epoch that was used (starting at 0). So a loop that
  never calls ``set_epoch`` gets a new order every epoch, and the
  ``DistributedSampler`` habit (``sampler.set_epoch(e)`` before each epoch)
  keeps working: ``set_epoch`` always wins.
* An epoch that was used moves the counter on: the next iteration runs
  ``e + 1`` unless ``set_epoch`` is called again. An epoch is used once its
  iteration went past its first batch (``OrderBatchSampler``: a second batch
  handed out; ``OrderSampler``: a second index), an epoch resumed by
  ``load_state_dict`` too (a peek at its first remaining batch keeps the
  resume: the next iteration starts there again). So a loop that stops
  early (``break``, a fixed number of steps per epoch) still gets a new
  order next time, while a peek (``next(iter(loader))``) does not use up an
  epoch. This is ``Loader``'s rule too (it counts delivered batches). A
  sampler sees what the DataLoader asks for, not what it delivered: a
  DataLoader asks for several batches ahead, so through a DataLoader a peek
  uses the epoch too.

Mid-epoch resume (torchdata ``StatefulDataLoader`` convention)
--------------------------------------------------------------
``state_dict()`` says which epoch is in progress and how many indices of it
were handed out; ``load_state_dict(state)`` makes the *next* iteration start
that epoch at that position, so it yields exactly the indices (batches) not
yet handed out, in the same order, in any process. ``StatefulDataLoader``
calls both on the sampler or batch sampler itself and keeps the count right
with worker processes. With a plain ``DataLoader`` and ``num_workers=0`` the
sampler's count is exactly the batches delivered; with workers a plain
DataLoader reads indices ahead, so save ``sampler.state_dict(consumed=k)``
with ``k`` the number of samples (``OrderSampler``) or batches
(``OrderBatchSampler``) your loop has received in this epoch. A state taken
from another dataset length, order, seed, rank split or batch size raises
:class:`mmstore.errors.StateMismatchError`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from ..errors import StateMismatchError
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
    while hasattr(data_source, "indices") and hasattr(data_source, "dataset"):  # a Subset (nested too)
        data_source = data_source.dataset
    store = getattr(data_source, "store", data_source)
    schema = getattr(store, "schema", None)
    fields = getattr(data_source, "fields", None)
    if schema is None:
        return None
    names = fields if fields is not None else schema.names
    if hasattr(store, "stored_record_bytes"):  # on disk, as Loader sizes its blocks (compact stores)
        return max(1, int(store.stored_record_bytes(list(names))))
    return max(1, sum(schema[f].nbytes for f in names))


_STATE_VERSION = 1


class _EpochCursor:
    """Which epoch the next iteration runs and how far the running one got
    (NOTE [epoch rules]); shared by an OrderSampler and its batch samplers."""

    def __init__(self) -> None:
        self.chosen: int | None = None  # from set_epoch: the next iteration runs it
        self.next = 0  # the epoch after the last one used
        self.running: int | None = None  # epoch of the latest iteration, until it ends
        self.pos = 0  # indices of ``running`` handed out (counted from the epoch's start)
        self.start = 0  # where the latest iteration started
        self.resume: tuple[int, int] | None = None  # (epoch, position) from load_state_dict
        self.resume_left = 0  # indices of the resumed epoch after that position
        self.token: object | None = None  # the latest iteration; older ones no longer count
        self.used = False  # the latest iteration went past its first batch: ``next`` moved on
        # (epoch, start, length) of the latest iteration, once it ran to its end and
        # until another begins: a DataLoader with workers exhausts the sampler
        # before the loop has received the last batches (see ``state``)
        self.ended: tuple[int, int, int] | None = None

    def set_epoch(self, epoch: int) -> None:
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self.resume is not None and self.resume[0] != epoch:
            e, pos = self.resume
            self.resume = None  # set_epoch wins over a loaded state of another epoch
            if pos and self.resume_left > 0:
                warnings.warn(
                    f"mmstore.torch sampler set_epoch({epoch}) drops the resume loaded by load_state_dict "
                    f"(epoch {e}, {pos} indices handed out): the rest of epoch {e} will not be sampled; to "
                    f"finish it, start the epoch loop at the state's epoch (set_epoch({e}))",
                    UserWarning, stacklevel=3,
                )
        self.chosen = epoch
        self.ended = None

    def upcoming(self) -> tuple[int, int]:
        """(epoch, position) the next iteration would start at."""
        if self.resume is not None:
            return self.resume
        return (self.next if self.chosen is None else self.chosen), 0

    def begin(self) -> tuple[int, int, object]:
        epoch, start = self.upcoming()
        self.ended = None  # a resume is kept until the iteration is used (a peek keeps it)
        self.running, self.pos, self.start = epoch, start, start
        self.token, self.used = object(), False
        return epoch, start, self.token

    def use(self, token: object) -> None:
        """The iteration ``token`` went past its first batch (or ended):
        the next iteration runs the next epoch unless ``set_epoch`` says
        otherwise (NOTE [epoch rules])."""
        if token is self.token and not self.used:
            self.used = True
            self.resume = None
            self.next, self.chosen = self.running + 1, None  # type: ignore[operator]

    def end(self, token: object, length: int) -> None:
        if token is self.token:
            self.use(token)
            self.ended = (self.running, self.start, length)  # type: ignore[assignment]
            self.running, self.pos, self.token = None, 0, None

    def state(self, consumed: int | None) -> tuple[int, int]:
        if consumed is not None:
            consumed = int(consumed)
            if consumed < 0:
                raise ValueError(f"consumed must be >= 0, got {consumed}")
            if self.running is not None:
                return self.running, self.start + consumed
            if self.ended is not None and consumed > 0:
                # the sampler reached the end (a DataLoader's workers read ahead):
                # ``consumed`` counts in that epoch; all of it received: the next one
                e, start, length = self.ended
                return (e, start + consumed) if start + consumed < length else self.upcoming()
            return self.upcoming()[0], self.upcoming()[1] + consumed
        if self.running is not None:
            return self.running, self.pos
        return self.upcoming()

    def load(self, epoch: int, pos: int, length: int) -> None:
        # a position at the end is kept: the next iteration yields nothing and
        # ends the epoch, so a loop that resumes with set_epoch(epoch) moves on
        self.resume = (epoch, pos)
        self.resume_left = length - pos  # indices of the resumed epoch not yet handed out
        self.chosen, self.next, self.running, self.pos, self.token = None, epoch, None, 0, None
        self.ended = None


def _check_state(state: Any, expect: dict[str, Any], what: str) -> tuple[int, int]:
    """(epoch, yielded) of a state dict after proving it was taken from a
    sampler like this one (StateMismatchError otherwise)."""
    if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or "epoch" not in state:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise StateMismatchError(
            f"{what}.load_state_dict: expected a state from {what}.state_dict() (version {_STATE_VERSION}, keys "
            f"epoch, yielded, order), found {found}; pass the dict state_dict() returned"
        )
    for key, want in expect.items():
        got = state.get(key)
        if got != want:
            if key == "order" and isinstance(got, dict):
                diffs = [f"{k}: saved {got.get(k)!r}, now {v!r}" for k, v in want.items() if got.get(k) != v]
                detail = "; ".join(diffs)
            else:
                detail = f"saved {got!r}, now {want!r}"
            raise StateMismatchError(
                f"{what}.load_state_dict: the state was taken from a sampler with another {key} ({detail}); "
                "resume with the same dataset, order, seed, rank/world_size, drop_last and batch size"
            )
    epoch, yielded = state["epoch"], state.get("yielded")
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(yielded, int) and yielded >= 0):
        raise StateMismatchError(f"{what}.load_state_dict: epoch and yielded must be ints >= 0, found "
                                 f"epoch={epoch!r} yielded={yielded!r}")
    return epoch, yielded


class OrderSampler(Sampler[int]):
    """A ``Sampler`` over an :class:`mmstore.order.Order`.

    Parameters
    ----------
    data_source : Dataset, Store or int
        What to sample from (only its length is used; a ``StoreDataset``, a
        ``Subset`` of one or a ``Store`` also gives the record size for
        ``order="block"``).
    order : Order or str, default "permutation"
        An order object, or ``"permutation"`` (a seeded uniform permutation per
        epoch: ``RandomSampler``'s coverage), ``"block"`` (block shuffle for
        data larger than RAM, sized automatically) or ``"sequential"``.
    seed : int, default 0
        The seed of the order, the same on every rank.
    rank, world_size : int, optional
        This process's rank and the number of ranks (default:
        ``torch.distributed``'s when it is initialised, else 0 and 1).
    drop_last : bool, default False
        Give each rank ``n // world_size`` records, disjoint, and leave the
        tail of the epoch's order out.
    pad : bool, default True
        With ``drop_last=False``: extend the order by wrap-around so that
        every rank yields ``ceil(n / world_size)`` indices, as
        ``DistributedSampler`` does; up to ``world_size - 1`` records are
        then read on two ranks per epoch ("Padding" in the module
        docstring). ``pad=False`` needs ``batch_size=`` (the DataLoader's):
        every record once over the ranks, and every rank the same number
        of batches.
    **kw
        More arguments of the order (``batch_size``, ``split``, ``block``,
        ``window``); see :func:`build_order` and :mod:`mmstore.order`.

    Epochs follow NOTE [epoch rules] (module docstring): each iteration to
    the end moves to the next epoch; ``set_epoch(e)`` picks one and always
    wins. ``state_dict()`` / ``load_state_dict()`` resume mid-epoch.
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
        pad: bool = True,
        **kw: Any,
    ) -> None:
        n = _n_of(data_source)
        if not isinstance(pad, (bool, np.bool_)):
            raise TypeError(f"OrderSampler: pad must be True or False, got {pad!r}")
        if not isinstance(order, Order):  # an order object carries its own padding
            if not pad and not drop_last and "batch_size" not in kw:
                raise TypeError(
                    "OrderSampler(pad=False) needs batch_size= (the DataLoader's batch size): ranks then get "
                    "every record once and the same number of batches; or pass drop_last=True (n // world_size "
                    "records on each rank, the tail left out), or keep pad=True (DistributedSampler's padding)")
            kw["pad"] = bool(pad)
        self.order = build_order(
            order, n, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
            record_bytes=_record_bytes(data_source), **kw,
        )
        self._cursor = _EpochCursor()

    @property
    def epoch(self) -> int:
        """The epoch being iterated, else the one the next iteration runs."""
        return self._cursor.state(None)[0]

    def set_epoch(self, epoch: int) -> None:
        """Run ``epoch`` in the next iteration (NOTE [epoch rules])."""
        self._cursor.set_epoch(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices of :attr:`epoch` (``int64``)."""
        return self.order.epoch(self.epoch)

    def __iter__(self) -> Iterator[int]:
        epoch, start, token = self._cursor.begin()
        return self._run(self.order.epoch(epoch), start, token)

    def _run(self, idx: np.ndarray, start: int, token: object) -> Iterator[int]:
        cur = self._cursor
        for a in range(start, len(idx), _CHUNK):
            for j, v in enumerate(idx[a : a + _CHUNK].tolist(), a + 1):
                if token is cur.token:
                    cur.pos = j
                    if not cur.used and j - start >= 2:
                        cur.use(token)
                yield v
        cur.end(token, len(idx))

    def __len__(self) -> int:
        return len(self.order)

    def _expect(self) -> dict[str, Any]:
        return {"order": self.order.describe()}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where the epoch in progress stands, as a JSON-able dict.

        Parameters
        ----------
        consumed : int, optional
            Samples the training loop received from the current iteration;
            default: the indices this sampler handed out (exact with
            ``StatefulDataLoader`` or ``num_workers=0``; a plain DataLoader
            with workers reads ahead). Counted in the epoch in progress, or,
            when the workers have already read the sampler to its end, in
            the epoch just read (its whole length: the state points at the
            start of the next epoch).

        Returns
        -------
        dict
            ``{"version", "epoch", "yielded", "order"}``: the next iteration
            after :meth:`load_state_dict` runs ``epoch`` from index ``yielded``.
        """
        epoch, pos = self._cursor.state(consumed)
        return {"version": _STATE_VERSION, "epoch": epoch, "yielded": pos, **self._expect()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next iteration continue the saved epoch where it stood.

        Raises
        ------
        StateMismatchError
            The state comes from a sampler over another length, order kind,
            seed, rank split or ``drop_last`` (nothing is changed).
        """
        epoch, pos = _check_state(state, self._expect(), type(self).__name__)
        self._cursor.load(epoch, min(pos, len(self)), len(self))


class OrderBatchSampler(Sampler[list[int]]):
    """Batches of an :class:`OrderSampler`'s indices (a ``batch_sampler``).

    Same batches as ``BatchSampler(OrderSampler(...), batch_size, drop_last)``
    but cut from the numpy epoch array without going through per-index
    Python ints. Shares the sampler's epoch counter (NOTE [epoch rules]);
    ``state_dict`` / ``load_state_dict`` as :class:`OrderSampler`'s, with
    ``consumed`` counted in batches and the batch size checked on load.
    """

    def __init__(self, sampler: OrderSampler, batch_size: int, drop_last: bool = False) -> None:
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.sampler = sampler
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start, token = self.sampler._cursor.begin()
        return self._run(self.sampler.order.epoch(epoch), start, token)

    def _run(self, idx: np.ndarray, start: int, token: object) -> Iterator[list[int]]:
        cur = self.sampler._cursor
        n = len(idx) - (len(idx) % self.batch_size if self.drop_last else 0)
        for a in range(start, n, self.batch_size):
            b = min(a + self.batch_size, n)
            if token is cur.token:
                cur.pos = b
                if not cur.used and a > start:
                    cur.use(token)
            yield idx[a:b].tolist()
        cur.end(token, n)

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _expect(self) -> dict[str, Any]:
        return {**self.sampler._expect(), "batch_size": self.batch_size, "drop_last_batch": self.drop_last}

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """As :meth:`OrderSampler.state_dict`; ``consumed`` counts batches and
        ``yielded`` stays in samples."""
        c = None if consumed is None else int(consumed) * self.batch_size
        if c is not None and consumed is not None and int(consumed) < 0:
            raise ValueError(f"consumed must be >= 0, got {consumed}")
        epoch, pos = self.sampler._cursor.state(c)
        return {"version": _STATE_VERSION, "epoch": epoch, "yielded": pos, **self._expect()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """As :meth:`OrderSampler.load_state_dict`; the batch size must match."""
        epoch, pos = _check_state(state, self._expect(), type(self).__name__)
        n = len(self.sampler)
        self.sampler._cursor.load(epoch, min(pos, n), n - (n % self.batch_size if self.drop_last else 0))
