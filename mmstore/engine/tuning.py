"""``LoaderTuning``: the :class:`~mmstore.torch.Loader`'s tuning knobs in one
frozen object (how much to read ahead, with how many threads, which read
strategy, which kernel hints). None of them changes which samples a batch
holds; the defaults are measured ones (see ``loader.py``'s docstring).

``Loader(path, 256, tuning=LoaderTuning(prefetch=2))``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["TUNING_FIELDS", "LoaderTuning", "split_tuning"]

_MiB = 1 << 20


@dataclass(frozen=True)
class LoaderTuning:
    """How a :class:`~mmstore.torch.Loader` reads; what it reads is set by its
    other arguments.

    Parameters
    ----------
    prefetch : int, optional
        Batches read ahead while the caller works on the current one.
        Default: sized from the memory budget (``mem_bytes``): the largest of
        1..4 whose ring of ``prefetch + hold`` batches takes at most a quarter
        of it (``mmstore/engine/plan.py``; ``Loader.describe()`` says what was chosen).
    hold : int, default 1
        How many yielded batches the loop may still reference while
        ``next()`` runs (the loop variable counts as one) without the loader
        allocating a fresh buffer; batches kept longer are never overwritten
        either, they cost a fresh buffer ("Kept batches" in
        ``mmstore.torch.loader``'s docstring).
    threads : int, optional
        Reader threads (default 16: queue depth for cold reads; the reads
        release the GIL).
    warm : bool, "background" or "auto", default "auto"
        True: before the first batch, read the fields' files once
        sequentially into the page cache (``mmstore._os.warm``; a warning
        when they do not fit in the available memory). ``"background"``:
        start that pass in a thread and read batches meanwhile. ``"auto"``:
        the pass before the first batch when the first epoch starts with the
        fields' files mostly out of the page cache (under half, sampled),
        they fit in the page cache left (``describe()["fits"]``), records are
        not read with ``O_DIRECT`` and the loader reads at least half of the
        store's records; otherwise nothing. One sequential pass reads a disk
        at its sequential speed where the epoch's scattered reads would not,
        and the pages it leaves make every later epoch's memory copies
        faster than the pages scattered reads leave (NOTE [sequential pages]
        in ``mmstore/_os/warmup.py``). False: never. The report of a pass
        before the first batch is ``loader.warm_report``;
        ``describe()["warm"]`` says what was done.
    hints : bool, default True
        Give the kernel access hints (fadvise RANDOM/SEQUENTIAL/WILLNEED).
    willneed : int, default 2
        Batches beyond the ones in flight whose records get ``WILLNEED``.
    method : {"auto", "pread", "mmap"}
        How memmap fields are read. "pread": ``preadv`` for fields of at
        least 2 KiB per record (a numpy gather for smaller ones); "mmap":
        ``Store.read_batch`` (memmove out of the mapping); "auto" (default):
        "mmap" for an epoch that starts with the fields' files in the page
        cache, "pread" otherwise (NOTE [warm vs cold reads] in ``mmstore/engine/reads.py``).
    piece_bytes : int, default 2 MiB
        Target size of one read task in preadv epochs (queue depth for cold
        reads); epochs read by memmove use one piece per CPU core instead.
    window_prefetch : {"read", "willneed", False}, default "read"
        For block-shuffle and sequential orders whose files are not already
        cached: bring each window's records into the page cache with long
        reads in offset order, one window ahead of the batches
        (``_reads.WindowPrefetch``). "read": ``preadv`` of each run (up to
        8 MiB a request) through the pass's own descriptors. "willneed":
        ``POSIX_FADV_WILLNEED`` per run, then the pass reads what the kernel
        left out (True means "willneed"). "read" is the default: under a
        memory limit WILLNEED's readahead left out most of the pages
        (NOTE [memory plan] in ``mmstore/engine/plan.py``).
    window_threads : int, default 2
        Concurrent long reads of the window pass (each with an 8 MiB buffer).
    mem_bytes : int, optional
        The memory the loader may fill (ring + page cache of its reads).
        Default: measured at construction, within the process's memory cgroup
        (``_os.effective_available``), divided by ``$LOCAL_WORLD_SIZE``. It
        sizes ``prefetch``, the read-ahead windows and a block shuffle's
        ``window`` built from ``order="block"`` (``mmstore/engine/plan.py``).
    """

    prefetch: int | None = None
    hold: int = 1
    threads: int | None = 16
    warm: bool | str = "auto"
    hints: bool = True
    willneed: int = 2
    method: str = "auto"
    piece_bytes: int = 2 * _MiB
    window_prefetch: bool | str | None = "read"
    window_threads: int = 2
    mem_bytes: int | None = None

    def __post_init__(self) -> None:
        if (self.prefetch is not None and int(self.prefetch) < 1) or int(self.hold) < 1:
            raise ValueError(f"prefetch and hold must be >= 1, got {self.prefetch} and {self.hold}")
        if self.method not in ("auto", "pread", "mmap"):
            raise ValueError(f"method must be 'auto', 'pread' or 'mmap', got {self.method!r}")
        if not any(self.warm is w for w in (False, True)) and self.warm not in ("background", "auto"):
            raise ValueError(f"warm must be False, True, 'background' or 'auto', got {self.warm!r}")
        window = "willneed" if self.window_prefetch is True else self.window_prefetch
        if window not in (False, None, "read", "willneed"):
            raise ValueError(f"window_prefetch must be 'read', 'willneed' or False, got {window!r}")
        self._set(
            prefetch=None if self.prefetch is None else int(self.prefetch), hold=int(self.hold),
            mem_bytes=None if self.mem_bytes is None else max(1, int(self.mem_bytes)),
            threads=16 if self.threads is None else int(self.threads),
            hints=bool(self.hints), willneed=max(0, int(self.willneed)), piece_bytes=max(1, int(self.piece_bytes)),
            window_prefetch=window or False, window_threads=max(1, int(self.window_threads)),
        )

    def _set(self, **values: Any) -> None:
        """Store normalised values (the instance is frozen to its users)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)


TUNING_FIELDS = frozenset(f.name for f in dataclasses.fields(LoaderTuning))


def split_tuning(tuning: LoaderTuning | None, kw: dict[str, Any]) -> tuple[LoaderTuning, dict[str, Any]]:
    """``(tuning with the tuning keywords of kw applied, the other keywords)``."""
    knobs = {k: v for k, v in kw.items() if k in TUNING_FIELDS}
    rest = {k: v for k, v in kw.items() if k not in TUNING_FIELDS}
    if tuning is None:
        return LoaderTuning(**knobs), rest
    if not isinstance(tuning, LoaderTuning):
        raise TypeError(f"tuning must be a mmstore.torch.LoaderTuning, got {type(tuning).__name__}")
    return dataclasses.replace(tuning, **knobs), rest
