"""Torch-free sample orders: sequential, full permutation, block shuffle, rank split.

An :class:`Order` maps an epoch number to the dataset indices one rank reads in
that epoch, as a single ``numpy.int64`` array (no per-sample Python objects, so
the array can be handed to DataLoader workers or memory-mapped without the
copy-on-read blow-up of Python lists).  Orders are stateless, frozen
dataclasses: ``order.epoch(e)`` depends only on the constructor arguments and
``e``, so every rank and every worker that builds the same order gets the same
answer (for one numpy version: numpy may change a Generator's streams between
releases), and an order pickles as its parameters.  The torch layer keeps the
current epoch (``set_epoch``) and calls :meth:`Order.epoch`.

Kinds
-----
:class:`Sequential`
    ``0, 1, ..., n-1``.  Evaluation, and the fastest possible reads.
:class:`Permutation`
    A uniform random permutation per epoch from
    ``numpy.random.default_rng([seed, epoch])`` (PCG64), one numpy call, the
    same coverage as ``torch.utils.data.RandomSampler``.  Every read is a seek
    on a disk: use it when the store fits in the page cache, or on flash.
:class:`BlockShuffle`
    For stores larger than RAM.  The records are cut into blocks of ``block``
    consecutive records; the blocks are permuted; consecutive runs of
    ``window`` permuted blocks form a window, and the records of a window are
    shuffled together.  A window is a handful of long contiguous reads (one
    seek per block) that a loader can prefetch whole (:meth:`BlockShuffle.
    window_bounds`, :func:`contiguous_ranges`) and then serve from the page
    cache, while a batch still draws from ``window`` places spread over the
    whole store.  :meth:`BlockShuffle.auto` picks ``block`` from the disk's
    seek time and bandwidth and ``window`` from a fixed byte budget
    (:data:`WINDOW_BYTES`), the same on every rank and in every process.

Distributed split
-----------------
With ``world_size > 1`` every rank builds the same global order of the epoch
and keeps its part of it. What happens when ``n`` is not a multiple of
``world_size``:

* ``pad=True`` (default, ``drop_last=False``): as ``torch.utils.data.
  DistributedSampler``: each rank gets ``ceil(n / world_size)`` indices; the
  global order is extended by wrap-around (its first indices repeated,
  cyclically if ``world_size > n``) to ``world_size * ceil(n / world_size)``,
  so up to ``world_size - 1`` records are read twice per epoch.
* ``pad=False``: every record exactly once. Ranks ``r < n % world_size``
  get ``n // world_size + 1`` indices, the others ``n // world_size``. With
  ``batch_size`` (a loader's batch size) every rank still gets the same
  number of batches (only the last batch of a rank is short, and its size
  differs between ranks), except when ``n // world_size`` is a multiple of
  ``batch_size`` and ``n`` is not a multiple of ``world_size``: then the
  ranks with fewer indices would have one batch less, and each of them takes
  one more index by wrap-around (``world_size - n % world_size`` records read
  twice, :meth:`Order.repeated` says how many) so that no rank waits for the
  others at the last step.
* ``drop_last=True``: each rank gets ``n // world_size`` indices; the tail
  of the global order is dropped (``pad`` is not used).

The ranks' slices are disjoint and cover the (extended or truncated) global
order exactly once.  ``split`` chooses how it is cut:

* ``"stride"`` (default for :class:`Sequential` and :class:`Permutation`):
  rank ``r`` takes positions ``r, r + world_size, ...``, element for element
  what ``DistributedSampler`` yields for the same global order.
* ``"contiguous"`` (default for :class:`BlockShuffle`): rank ``r`` takes
  one run of consecutive positions (rank 0 the first, then rank 1, ...),
  i.e. whole windows of whole blocks (only the two windows at the edges of
  its slice are shared with a neighbour), so each rank's reads stay local.
  A stride split of a block shuffle would make every rank touch every block.

Every rank must compute the same global order, so an order depends only on
its parameters and the epoch: nothing measured at run time (free memory, a
thread count) enters it. :meth:`BlockShuffle.auto` sizes its window from a
fixed byte budget for that reason, not from the memory of the machine.

Splitting a rank's indices further across DataLoader workers is the torch
layer's job; :func:`split_for_worker` does it in whole batches, round-robin,
the way a map-style DataLoader hands batches to its workers.

Measuring an order
------------------
:func:`shuffle_quality` reports how well an order mixes (displacement, label
mixing within batches) and how local its reads are (contiguous runs per
batch); :func:`modelled_hdd_seconds` turns the reads into seconds on a
modelled hard disk (a seek per non-contiguous read plus bytes / bandwidth).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import numpy as np

# numpy.random is loaded now, not lazily inside a training loop: an import
# that a Ctrl-C interrupts swallows the KeyboardInterrupt
import numpy.random  # noqa: F401

from .._os.memplan import memory_budget, plan_memory
from .args import _bad, _bool, _fraction, _int, _positive_float
from .metrics import contiguous_ranges, count_seeks, modelled_hdd_seconds, shuffle_quality

__all__ = [
    "BlockShuffle",
    "Order",
    "OrderSpec",
    "Permutation",
    "Sequential",
    "WINDOW_BYTES",
    "contiguous_ranges",
    "count_seeks",
    "make_order",
    "memory_budget",
    "modelled_hdd_seconds",
    "plan_memory",
    "shuffle_quality",
    "split_for_worker",
]

_SPLITS = ("contiguous", "stride")

WINDOW_BYTES = 128 << 20
"""The default byte budget of a block shuffle's window (:meth:`BlockShuffle.auto_sizes`)."""


# --------------------------------------------------------------------------
# the rank split (shared by every kind)


def _rank_lengths(n: int, world_size: int, drop_last: bool, pad: bool, batch_size: int) -> np.ndarray:
    """Indices each rank takes (the "Distributed split" rules), as an array of ``world_size``."""
    q, extra = divmod(n, world_size)
    if drop_last:
        return np.full(world_size, q, dtype=np.int64)
    if pad:
        return np.full(world_size, q + (extra > 0), dtype=np.int64)
    lengths = np.full(world_size, q, dtype=np.int64)
    lengths[:extra] += 1
    if extra and q % batch_size == 0:  # the shorter ranks would have one batch less: one more each
        lengths[extra:] += 1
    return lengths


def _rank_positions(
    n: int, world_size: int, drop_last: bool, pad: bool, batch_size: int, rank: int, split: str
) -> np.ndarray:
    """Positions in the extended (or truncated) global order that ``rank``
    takes, increasing; a position ``p >= n`` is ``p % n`` of the global order
    (wrap-around)."""
    lengths = _rank_lengths(n, world_size, drop_last, pad, batch_size)
    length = int(lengths[rank])
    if split == "stride":
        return np.arange(rank, rank + length * world_size, world_size, dtype=np.int64)[:length]
    if drop_last or pad:
        return np.arange(rank * length, (rank + 1) * length, dtype=np.int64)
    q, extra = divmod(n, world_size)
    base = q + (rank < extra)  # the rank's own records, then (maybe) one by wrap-around
    start = rank * q + min(rank, extra)
    pos = np.arange(start, start + length, dtype=np.int64)
    if length > base:
        pos[base:] = n + (rank - extra)
    return pos


def _take_rank(glob: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """This rank's part of the global order ``glob`` at positions ``pos``; a
    fresh array unless the rank takes all of ``glob`` (so the global order can
    be freed)."""
    n = glob.shape[0]
    if pos.shape[0] == n and (n == 0 or (pos[0] == 0 and pos[-1] == n - 1)):
        return glob
    if pos.shape[0] and pos[-1] >= n:  # wrap-around padding
        return glob[np.remainder(pos, n)]
    return glob[pos]


def _rank_bounds(glob_bounds: np.ndarray, n: int, pos: np.ndarray) -> np.ndarray:
    """Map segment bounds of the global order (0 = b0 < ... < bk = n) to bounds
    in this rank's array (its positions ``pos``): ``[0, ..., len(pos)]``,
    strictly increasing."""
    length = pos.shape[0]
    if length == 0:
        return np.zeros(1, dtype=np.int64)
    reps = int(pos[-1] // n) + 1  # copies of the global order the positions span
    ext = (glob_bounds[None, :-1] + n * np.arange(reps, dtype=np.int64)[:, None]).ravel()
    local = np.searchsorted(pos, ext, side="left")
    return np.unique(np.concatenate([local, [0, length]])).astype(np.int64)


# --------------------------------------------------------------------------
# orders


@dataclass(frozen=True)
class Order(ABC):
    """Base class: an epoch number -> this rank's dataset indices (int64).

    Parameters
    ----------
    n : int
        Number of samples in the dataset (>= 0).
    seed : int, keyword-only
        Seed (>= 0) shared by all ranks; the epoch's generator is
        ``numpy.random.default_rng([seed, epoch])``.
    rank, world_size : int, keyword-only
        This process's rank in ``[0, world_size)``.
    drop_last : bool, keyword-only
        As ``DistributedSampler``: drop the tail of the global order so it
        divides evenly (True), else keep every record (False).
    pad : bool, keyword-only
        With ``drop_last=False``: pad the global order by wrap-around to equal
        rank lengths, as ``DistributedSampler`` does (True, default), or give
        every record exactly once (False; see "Distributed split").
    batch_size : int, keyword-only
        With ``pad=False``: the batch size whose batch count every rank must
        share (default 1: lengths differ by at most one).
    split : {"stride", "contiguous"} or None, keyword-only
        How the global order is cut between ranks (see the module docstring);
        None picks the kind's default.

    Notes
    -----
    Orders are frozen, hashable, comparable and picklable; they hold no index
    data.  ``len(order)`` is the per-rank length.
    """

    n: int
    _: KW_ONLY
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    split: str | None = None
    pad: bool = True
    batch_size: int = 1

    kind: ClassVar[str] = ""
    _default_split: ClassVar[str] = "stride"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "n", _int("n", self.n, 0))
        set_(self, "seed", _int("seed", self.seed, 0))
        set_(self, "world_size", _int("world_size", self.world_size, 1))
        rank = _int("rank", self.rank, 0)
        if rank >= self.world_size:
            raise _bad("rank", self.rank, f"in [0, world_size) = [0, {self.world_size})")
        set_(self, "rank", rank)
        set_(self, "drop_last", _bool("drop_last", self.drop_last))
        split = self._default_split if self.split is None else self.split
        if split not in _SPLITS:
            raise _bad("split", self.split, f"one of {_SPLITS} or None")
        set_(self, "split", split)
        set_(self, "pad", _bool("pad", self.pad))
        set_(self, "batch_size", _int("batch_size", self.batch_size, 1))

    # -- public ------------------------------------------------------------

    def __len__(self) -> int:
        """Indices per rank and epoch: ``ceil(n / world_size)``, or
        ``n // world_size`` with ``drop_last``."""
        return int(self._lengths()[self.rank])

    def repeated(self) -> int:
        """Records read twice per epoch over all ranks (wrap-around padding;
        0 with ``pad=False`` unless the equal batch count needs it)."""
        return max(0, int(self._lengths().sum()) - self.n)

    def epoch(self, epoch: int) -> np.ndarray:
        """This rank's dataset indices for ``epoch``.

        Parameters
        ----------
        epoch : int
            Epoch number (>= 0).

        Returns
        -------
        numpy.ndarray
            ``int64`` array of length ``len(self)``.
        """
        epoch = _int("epoch", epoch, 0)
        return _take_rank(self.global_order(epoch), self._positions())

    @abstractmethod
    def global_order(self, epoch: int) -> np.ndarray:
        """The whole epoch's order (length ``n``, every index once), before
        the rank split; identical on every rank."""

    def describe(self) -> dict[str, Any]:
        """JSON-able parameters; ``make_order(**order.describe()) == order``."""
        return {
            "kind": self.kind,
            "n": self.n,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "drop_last": self.drop_last,
            "split": self.split,
            "pad": self.pad,
            "batch_size": self.batch_size,
        }

    # -- helpers -----------------------------------------------------------

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch])

    def _lengths(self) -> np.ndarray:
        return _rank_lengths(self.n, self.world_size, self.drop_last, self.pad, self.batch_size)

    def _positions(self) -> np.ndarray:
        return _rank_positions(self.n, self.world_size, self.drop_last, self.pad, self.batch_size,
                               self.rank, self.split)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Sequential(Order):
    """``0, 1, ..., n-1`` every epoch; ``seed`` is ignored.

    With the default stride split a rank gets exactly what
    ``DistributedSampler(shuffle=False)`` gives it; ``split="contiguous"``
    gives each rank one contiguous range instead (best locality).
    """

    kind: ClassVar[str] = "sequential"

    def global_order(self, epoch: int) -> np.ndarray:
        _int("epoch", epoch, 0)
        return np.arange(self.n, dtype=np.int64)

    def epoch(self, epoch: int) -> np.ndarray:
        _int("epoch", epoch, 0)
        pos = self._positions()
        if pos.shape[0] and pos[-1] >= self.n:  # wrap-around padding
            np.remainder(pos, self.n, out=pos)
        return pos


@dataclass(frozen=True)
class Permutation(Order):
    """A uniform random permutation per epoch.

    ``global_order(e)`` is ``numpy.random.default_rng([seed, e]).permutation(n)``:
    one numpy call, ``8 n`` bytes.  Its coverage per epoch is that of
    ``torch.utils.data.RandomSampler`` (each index once); under DDP the split
    is ``DistributedSampler``'s.
    """

    kind: ClassVar[str] = "permutation"

    def global_order(self, epoch: int) -> np.ndarray:
        epoch = _int("epoch", epoch, 0)
        return self._rng(epoch).permutation(self.n).astype(np.int64, copy=False)


@dataclass(frozen=True)
class BlockShuffle(Order):
    """Shuffle blocks of consecutive records, then records within windows of blocks.

    Parameters
    ----------
    n : int
        Number of records.
    block : int
        Records per block (>= 1): consecutive slots read with one seek.  The
        last block holds ``n - (ceil(n / block) - 1) * block`` records.
    window : int
        Blocks per window (>= 1): the records of ``window`` blocks are
        shuffled together, so a loader must hold about ``window * block``
        records in memory to serve a window from cache.  ``window >=
        ceil(n / block)`` gives a uniform permutation of all records.
    seed, rank, world_size, drop_last, split
        See :class:`Order`.  ``split`` defaults to ``"contiguous"``, which keeps
        whole windows on one rank.

    Notes
    -----
    Epoch ``e``: ``rng = default_rng([seed, e])``; the blocks are put in the
    order ``rng.permutation(ceil(n / block))``; windows are consecutive runs of
    ``window`` blocks of that order; each window's records are shuffled
    (``rng.permuted`` on a ``(windows, window * block)`` view, so the cost is
    O(n) and the memory ``8 n`` bytes).  Every record appears once per epoch;
    the block order, and the record order within each window, are uniform.

    Use :meth:`auto` to size ``block`` and ``window`` from the record size and
    the memory, :meth:`window_bounds` and :func:`contiguous_ranges` to prefetch
    a window's blocks as a few long reads.  The locality is only realised by a
    loader that does so: read batch by batch (each batch's slots sorted, no
    window prefetch) a batch of a wide window touches ~``batch_size`` blocks
    and costs about as many seeks as a permutation; only windows of about one
    batch (``window * block <= batch_size``) are local batch by batch, at the
    price of batches drawn from ``window`` places.
    """

    block: int
    window: int

    kind: ClassVar[str] = "block"
    _default_split: ClassVar[str] = "contiguous"

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "block", _int("block", self.block, 1))
        object.__setattr__(self, "window", _int("window", self.window, 1))

    # -- sizing ------------------------------------------------------------

    @staticmethod
    def auto_sizes(
        n: int,
        record_bytes: int,
        mem_bytes: int | None = None,
        *,
        block: int | None = None,
        local_world_size: int | None = None,
        seek_s: float = 0.008,
        bandwidth: float = 150e6,
        seek_fraction: float = 0.2,
        mem_fraction: float = 0.2,
    ) -> dict[str, Any]:
        """Choose ``block`` and ``window``; return them with the inputs used.

        Formulas
        --------
        ``block_bytes = seek_s * bandwidth * (1 - seek_fraction) / seek_fraction``
            A block costs one seek plus ``block_bytes / bandwidth`` of
            transfer; this size makes the seek ``seek_fraction`` of the time
            of reading a block.  Defaults (HDD: 8 ms seek, 150 MB/s, 20 %):
            4.8 MB, i.e. a 4-5 MiB read, 32 ms of transfer per 8 ms seek, so a
            block-shuffled epoch reads at ~80 % of the disk's sequential
            bandwidth where a permutation of 150 KB records reads at ~11 %
            (8 ms seek per 1 ms of transfer).  Larger blocks read faster but
            leave fewer, larger runs of neighbouring records per window (worse
            mixing for the same memory); on an SSD (``seek_s=1e-4``,
            ``bandwidth=2e9``) the same rule gives 0.8 MB.
        ``block = clamp(ceil(block_bytes / record_bytes), 1, n)``
        ``window_bytes = WINDOW_BYTES`` (128 MiB) by default
            The window is part of the order, so it must not depend on
            anything that differs between ranks or between a run and its
            resume (free memory, the machine): ranks that sized it from
            their own free memory would build different global orders and
            read some records twice and others never. A loader holds the
            window it serves and reads the next one ahead, so two windows
            per rank on a node must fit in its page cache; the Loader says
            so when they do not (``window=`` then sets a smaller one, the
            same on every rank). ``mem_bytes``, when given, sizes it
            instead: ``mem_fraction * mem_bytes / local_world_size``
            (``local_world_size`` default 1: pass the ranks that share the
            memory), a choice the caller makes the same everywhere.
        ``window = clamp(floor(window_bytes / (block * record_bytes)), 1, ceil(n / block))``
            A wider window mixes better (a batch draws from ``window``
            places): with memory to spare, pass a larger ``window=`` (the
            same on every rank and in every resumed run); when the whole
            store fits, the window is every block and the order is a uniform
            permutation.

        Returns
        -------
        dict
            ``block``, ``window``, ``block_bytes`` (of one block),
            ``window_bytes`` (of one window), ``mem_bytes`` (None: the
            fixed budget was used),
            ``local_world_size``, ``blocks``, ``windows``.  ``block``, when
            given, is used as is and only ``window`` is computed.
        """
        n = _int("n", n, 0)
        record_bytes = _int("record_bytes", record_bytes, 1)
        if mem_bytes is not None:
            mem_bytes = _int("mem_bytes", mem_bytes, 1)
        local_world_size = _int("local_world_size", 1 if local_world_size is None else local_world_size, 1)
        seek_s = _positive_float("seek_s", seek_s)
        bandwidth = _positive_float("bandwidth", bandwidth)
        seek_fraction = _fraction("seek_fraction", seek_fraction)
        mem_fraction = _fraction("mem_fraction", mem_fraction)

        if block is None:
            target = seek_s * bandwidth * (1 - seek_fraction) / seek_fraction
            block = min(max(1, math.ceil(target / record_bytes)), max(n, 1))
        else:
            block = _int("block", block, 1)
        blocks = -(-n // block)
        budget = WINDOW_BYTES if mem_bytes is None else mem_fraction * mem_bytes / local_world_size
        window = min(max(1, int(budget // (block * record_bytes))), max(blocks, 1))
        return {
            "block": block,
            "window": window,
            "block_bytes": block * record_bytes,
            "window_bytes": window * block * record_bytes,
            "mem_bytes": mem_bytes,
            "local_world_size": local_world_size,
            "blocks": blocks,
            "windows": -(-blocks // window),
        }

    @classmethod
    def auto(
        cls,
        n: int,
        record_bytes: int,
        mem_bytes: int | None = None,
        *,
        block: int | None = None,
        window: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        split: str | None = None,
        pad: bool = True,
        batch_size: int = 1,
        local_world_size: int | None = None,
        seek_s: float = 0.008,
        bandwidth: float = 150e6,
        seek_fraction: float = 0.2,
        mem_fraction: float = 0.2,
    ) -> BlockShuffle:
        """A block shuffle sized by :meth:`auto_sizes`.

        ``block`` or ``window``, when given, override the computed value (the
        other one is then computed for the given one).
        """
        _int("record_bytes", record_bytes, 1)
        if block is None or window is None:
            sizes = cls.auto_sizes(
                n, record_bytes, mem_bytes, block=block, local_world_size=local_world_size,
                seek_s=seek_s, bandwidth=bandwidth, seek_fraction=seek_fraction,
                mem_fraction=mem_fraction,
            )
            block, window = sizes["block"], sizes["window"] if window is None else window
        return cls(n, block, window, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last, split=split,
                   pad=pad, batch_size=batch_size)

    # -- orders ------------------------------------------------------------

    def _layout(self, rng: np.random.Generator) -> tuple[np.ndarray, int, int]:
        """Block order, the position of the short (last) block in it, and its size."""
        nb = -(-self.n // self.block)
        perm = rng.permutation(nb).astype(np.int64, copy=False)
        short = int(np.flatnonzero(perm == nb - 1)[0])
        return perm, short, self.n - (nb - 1) * self.block

    def _window_bounds(self, nb: int, short: int, last: int) -> np.ndarray:
        """Bounds of the windows in the global order (0, ..., n)."""
        nw = -(-nb // self.window)
        blocks_per = np.full(nw, self.window, dtype=np.int64)
        blocks_per[-1] = nb - (nw - 1) * self.window
        sizes = blocks_per * self.block
        sizes[short // self.window] -= self.block - last
        return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def global_order(self, epoch: int) -> np.ndarray:
        epoch = _int("epoch", epoch, 0)
        n, b, w = self.n, self.block, self.window
        out = np.empty(n, dtype=np.int64)
        if n == 0:
            return out
        rng = self._rng(epoch)
        perm, short, last = self._layout(rng)
        # 1. records of the blocks, block after block in the permuted order
        ramp = np.arange(b, dtype=np.int64)
        head = short * b
        np.add(perm[:short, None] * b, ramp, out=out[:head].reshape(short, b))
        out[head : head + last] = perm[short] * b + ramp[:last]
        np.add(perm[short + 1 :, None] * b, ramp,
               out=out[head + last :].reshape(-1, b))
        # 2. shuffle within windows: the window holding the short block and the
        # final window may be irregular; the others are rows of one view
        span = w * b
        ws = short // w  # window with the short block
        lo = ws * span
        hi = min(lo + span - (b - last), n)
        if ws:
            rows = out[:lo].reshape(ws, span)
            rng.permuted(rows, axis=1, out=rows)
        rng.shuffle(out[lo:hi])
        full = (n - hi) // span
        if full:
            rows = out[hi : hi + full * span].reshape(full, span)
            rng.permuted(rows, axis=1, out=rows)
        rng.shuffle(out[hi + full * span :])
        return out

    def window_bounds(self, epoch: int) -> np.ndarray:
        """Where windows start and end in this rank's ``epoch(epoch)`` array.

        Returns
        -------
        numpy.ndarray
            Strictly increasing ``int64`` bounds ``[0, ..., len(self)]``:
            segment ``i`` is ``epoch(e)[bounds[i]:bounds[i + 1]]`` and holds
            records of at most ``window`` blocks (of one window of the global
            order; with wrap-around padding the padded tail is a copy of the
            first windows).  A loader can prefetch segment ``i + 1`` with
            :func:`contiguous_ranges` while it serves segment ``i``.
        """
        epoch = _int("epoch", epoch, 0)
        length = len(self)
        if self.n == 0 or length == 0:
            return np.zeros(1, dtype=np.int64)
        perm, short, last = self._layout(self._rng(epoch))
        glob = self._window_bounds(perm.shape[0], short, last)
        return _rank_bounds(glob, self.n, self._positions())

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "block": self.block, "window": self.window}


_KINDS: dict[str, type[Order]] = {
    "sequential": Sequential,
    "permutation": Permutation,
    "block": BlockShuffle,
}


def make_order(kind: str, n: int, **kw: Any) -> Order:
    """Build an order by name.

    Parameters
    ----------
    kind : {"sequential", "permutation", "block"}
    n : int
        Number of samples.
    **kw
        The kind's keyword arguments (``seed``, ``rank``, ``world_size``,
        ``drop_last``, ``split``).  For ``"block"``: ``block=`` and
        ``window=``, or ``record_bytes=`` (and optionally ``mem_bytes=`` and
        the other arguments of :meth:`BlockShuffle.auto`) to size them.

    Notes
    -----
    ``make_order(**order.describe())`` rebuilds ``order``.
    """
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise _bad("kind", kind, f"one of {sorted(_KINDS)}")
    if cls is BlockShuffle:
        if "record_bytes" in kw:
            return BlockShuffle.auto(n, **kw)
        missing = [k for k in ("block", "window") if k not in kw]
        if missing:
            raise ValueError(
                f"kind='block' needs block= and window=, or record_bytes= to size "
                f"them automatically; missing {', '.join(missing)}"
            )
    try:
        return cls(n, **kw)
    except TypeError as exc:  # unknown keyword
        raise ValueError(f"bad argument for kind={kind!r}: {exc}") from None


@dataclass(frozen=True)
class OrderSpec:
    """An order before the dataset's size is known: what a loader takes as
    ``order=`` to build the :class:`Order` of its records for its rank.

    ``Loader(store, 256, OrderSpec("block", seed=3))`` reads a block shuffle
    with seed 3; ``order="block"`` is ``OrderSpec("block")``.

    Parameters
    ----------
    kind : {"permutation", "block", "sequential"}
    seed : int, keyword-only
        Shared by all ranks (ignored by ``"sequential"``).
    rank, world_size : int or None, keyword-only
        This process's rank and the number of ranks; None: those of
        ``torch.distributed`` when it is initialised, else 0 and 1.
    drop_last : bool, keyword-only
        Drop records so that every rank gets the same number (as
        ``DistributedSampler(drop_last=True)``).
    pad : bool, keyword-only
        Pad by wrap-around so that every rank gets the same number, one
        record read twice where the count does not divide
        (``DistributedSampler``'s default); False (default): every record
        exactly once, ranks' last batches differ in size, not in count.
    block, window : int or None, keyword-only
        A block shuffle's records per block and blocks per window; None:
        sized by :meth:`BlockShuffle.auto_sizes` (the block from the
        record size, the window from ``WINDOW_BYTES``).
    split : {"stride", "contiguous"} or None, keyword-only
        How the epoch is cut between ranks (None: the kind's default).
    """

    kind: str = "permutation"
    _: KW_ONLY
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False
    pad: bool = False
    block: int | None = None
    window: int | None = None
    split: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in _KINDS:
            raise _bad("kind", self.kind, f"one of {sorted(_KINDS)}")
        _int("seed", self.seed, 0)
        for name in ("rank", "world_size", "block", "window"):
            v = getattr(self, name)
            if v is not None:
                _int(name, v, 0 if name == "rank" else 1)
        _bool("drop_last", self.drop_last)
        _bool("pad", self.pad)
        if self.kind != "block" and (self.block is not None or self.window is not None):
            raise ValueError(f"block= and window= are a block shuffle's; this order is {self.kind!r}")
        if self.split is not None and self.split not in _SPLITS:
            raise _bad("split", self.split, f"one of {_SPLITS} or None")

    def order_kw(self) -> dict[str, Any]:
        """The keywords of :func:`make_order` this spec sets (block and
        window only where given; rank and world size left to the caller)."""
        kw: dict[str, Any] = {"drop_last": self.drop_last, "pad": self.pad}
        if self.kind != "sequential":
            kw["seed"] = self.seed
        if self.split is not None:
            kw["split"] = self.split
        kw.update({k: v for k, v in (("block", self.block), ("window", self.window)) if v is not None})
        return kw


# --------------------------------------------------------------------------
# utilities for loaders


def split_for_worker(
    indices: np.ndarray, worker_id: int, num_workers: int, batch_size: int = 1
) -> np.ndarray:
    """The indices one DataLoader worker reads: whole batches, round-robin.

    Worker ``k`` gets batches ``k, k + num_workers, ...`` of ``indices`` cut
    into batches of ``batch_size`` (the last one may be short), which is how a
    map-style DataLoader distributes batches; taking the workers' batches in
    turn gives back ``indices`` exactly.

    Returns
    -------
    numpy.ndarray
        ``int64`` concatenation of this worker's batches.
    """
    indices = np.asarray(indices)
    if indices.ndim != 1:
        raise _bad("indices", f"<array of shape {indices.shape}>", "a 1-D array")
    num_workers = _int("num_workers", num_workers, 1)
    worker_id = _int("worker_id", worker_id, 0)
    if worker_id >= num_workers:
        raise _bad("worker_id", worker_id, f"in [0, num_workers) = [0, {num_workers})")
    batch_size = _int("batch_size", batch_size, 1)
    length = indices.shape[0]
    batches = np.arange(worker_id, -(-length // batch_size), num_workers, dtype=np.int64)
    pos = (batches[:, None] * batch_size + np.arange(batch_size, dtype=np.int64)).ravel()
    return indices[pos[pos < length]].astype(np.int64, copy=False)
