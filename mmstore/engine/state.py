"""Mid-epoch resume of a :class:`~mmstore.torch.Loader`: what its
``state_dict()`` holds and what ``load_state_dict()`` checks.

The convention is torchdata's ``StatefulDataLoader``: a state taken between
batches says how many batches of which epoch were delivered; a loader (in
this or a new process) that loads it yields exactly the batches not yet
delivered, in the same order (and with the same ``transform`` draws, which
depend on the epoch and the batch index only), then the next epochs.

The state is a plain dict of ints, strings and lists (``torch.save``,
``json`` and pickle all take it)::

    {"version": 2,
     "epoch": 3, "batches": 120,          # epoch 3, batches 0..119 delivered
     "batch_size": 256, "drop_last": False,
     "order": {"kind": "permutation", "n": ..., "seed": 0, "rank": 0,
               "world_size": 1, "drop_last": False, "split": "stride",
               "pad": False, "batch_size": 256, ...},
     "seed": 0, "rank": 0, "world_size": 1,   # the order's, for reading
     "store": {"store_id": "...", "records": 1281167},
     "subset": None or {"len": ..., "blake2b": "..."}}

A state is the position reached: taken in the loop body it counts the
batch just delivered; taken after the loop was left (``break``, an
exception) it still says how many batches of that epoch were delivered, so a
resume yields the rest; taken after the last batch of epoch ``e`` (in the
loop body or after the loop) it is ``(e, all of its batches)``. A loaded
complete epoch resumes as nothing: ``set_epoch(e)`` then an iteration yields
no batch and moves on to ``e + 1``; ``set_epoch(e + 1)``, or no
``set_epoch`` at all, runs ``e + 1``. So both checkpoint scripts are right::

    state = torch.load("ckpt.pt")
    loader.load_state_dict(state["loader"])
    for epoch in range(state["loader"]["epoch"], epochs):   # the state's epoch
        loader.set_epoch(epoch)
        for batch in loader:
            ...
            torch.save({"loader": loader.state_dict(), ...}, "ckpt.pt")

A ``set_epoch`` that drops the rest of a loaded epoch warns. Before any
iteration the state is ``(the epoch the next iteration runs, 0)``.
``load_state_dict`` refuses
(:class:`~mmstore.errors.LoaderResumeError`) a state of another store
(``store_id``, ``records``), subset, ``batch_size``, ``drop_last`` or order
(kind and every parameter, seed and rank/world_size included): resuming it
would not give the remaining batches. ``store_id`` is the manifest's, random
per store and kept by a copy of its folder: a state resumes on a copy of the
store (a node's local NVMe copy), not on a new ingest of the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..errors import LoaderResumeError, LoaderStateError
from ..order import Order

__all__ = ["STATE_VERSION", "Resumable", "check_state", "loader_identity", "order_state"]

STATE_VERSION = 2


def order_state(order: Order) -> dict[str, Any]:
    """The order's kind and parameters, as plain values."""
    out: dict[str, Any] = {"kind": order.kind or type(order).__name__}
    for f in dataclasses.fields(order):
        if f.name.startswith("_"):
            continue
        v = getattr(order, f.name)
        out[f.name] = v.item() if isinstance(v, np.generic) else v
    return out


def subset_state(indices: np.ndarray | None) -> dict[str, Any] | None:
    if indices is None:
        return None
    digest = hashlib.blake2b(np.ascontiguousarray(indices, dtype="<i8").tobytes(), digest_size=16).hexdigest()
    return {"len": len(indices), "blake2b": digest}


def loader_identity(
    *, store_id: str, records: int, subset: np.ndarray | None, batch_size: int, drop_last: bool, order: Order,
) -> dict[str, Any]:
    """What a state must match to be resumed by this loader."""
    o = order_state(order)
    return {
        "batch_size": int(batch_size), "drop_last": bool(drop_last), "order": o,
        "seed": o.get("seed"), "rank": o.get("rank"), "world_size": o.get("world_size"),
        "store": {"store_id": str(store_id), "records": int(records)}, "subset": subset_state(subset),
    }


_WHAT_TO_DO = {
    "store": "load it into a Loader over the store the state was taken from",
    "subset": "give the same indices= / Subset as the run that saved it",
    "batch_size": "build the Loader with the batch_size of the run that saved it",
    "drop_last": "build the Loader with the drop_last of the run that saved it",
    "order": "build the Loader with the same order, seed, rank and world_size as the run that saved it",
}


def check_state(state: Mapping[str, Any], mine: Mapping[str, Any]) -> tuple[int, int]:
    """``(epoch, batches)`` of ``state`` after checking it against this
    loader's identity ``mine``; :class:`LoaderResumeError` when it differs."""
    if not isinstance(state, Mapping):
        raise LoaderResumeError(f"Loader.load_state_dict takes the dict of Loader.state_dict(), got "
                                f"{type(state).__name__}")
    version = state.get("version")
    if version != STATE_VERSION:
        raise LoaderResumeError(
            f"Loader state version {version!r} is not the one this mmstore reads ({STATE_VERSION}); "
            "it was saved by another mmstore version (or is not a Loader state); resume with that version"
        )
    for key, todo in _WHAT_TO_DO.items():
        if key not in state:
            raise LoaderResumeError(f"the Loader state has no {key!r} entry; it is not a Loader.state_dict()")
        got, want = _plain(state[key]), _plain(mine[key])
        if got != want:
            raise LoaderResumeError(
                f"the Loader state was taken with {key}={got!r} but this loader has {key}={want!r}; "
                f"its remaining batches would not be the ones not yet delivered: {todo}"
            )
    try:
        epoch, batches = int(state["epoch"]), int(state["batches"])
    except (KeyError, TypeError, ValueError):
        raise LoaderResumeError("the Loader state has no integer 'epoch' and 'batches'") from None
    if epoch < 0 or batches < 0:
        raise LoaderResumeError(f"the Loader state has epoch={epoch}, batches={batches}; both must be >= 0")
    return epoch, batches


def _plain(v: Any) -> Any:
    """Tuples as lists, recursively (a state that went through json compares equal)."""
    if isinstance(v, Mapping):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


class Resumable:
    """``Loader.state_dict`` / ``load_state_dict`` (the Loader's attributes
    they use: ``store``, ``indices``, ``batch_size``, ``drop_last``,
    ``order``, ``_active``, ``_epoch``, ``_next_epoch``, ``_resume``)."""

    store: Any
    indices: np.ndarray | None
    batch_size: int
    drop_last: bool
    order: Order
    _active: Any
    _epoch: int | None
    _next_epoch: int
    _resume: tuple[int, int] | None
    _pos: tuple[int, int] | None
    _pos_used: bool

    def __len__(self) -> int:
        raise NotImplementedError

    def _identity(self) -> dict[str, Any]:
        return loader_identity(
            store_id=self.store.store_id, records=len(self.store), subset=self.indices,
            batch_size=self.batch_size, drop_last=self.drop_last, order=self.order,
        )

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch and the batches of it delivered
        (torchdata's ``StatefulDataLoader`` convention: the position reached,
        also after a ``break`` or an exception left the loop; after the last
        batch of epoch ``e``, ``e`` with all its batches), with what a resume
        must match (store, subset, batch size, order, seed, rank/world size).
        The layout and the checkpoint recipe are in ``mmstore/engine/state.py``."""
        run = self._active() if self._active is not None else None
        live = run is not None and run.live()
        if self._pos is not None and (live or self._pos_used):
            # the latest iteration's position, also after its loop was left (a peek,
            # next(iter(loader)), used nothing: the state stays where it was)
            epoch, done = self._pos
        elif self._resume is not None:
            epoch, done = self._resume
        else:
            epoch, done = (self._next_epoch if self._epoch is None else self._epoch), 0
        return {"version": STATE_VERSION, "epoch": int(epoch), "batches": int(done), **self._identity()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields the
        batches of its epoch not yet delivered (same order, same
        ``transform`` draws), later ones the next epochs (a complete epoch:
        see the module docstring). A state of another
        store, subset, batch size or order raises
        :class:`~mmstore.errors.LoaderResumeError`."""
        epoch, done = check_state(state, self._identity())
        run = self._active() if self._active is not None else None
        if run is not None and run.live():
            raise LoaderStateError(
                f"mmstore.torch.Loader.load_state_dict: epoch {run.epoch} is being iterated; end that loop "
                "(or load the state before iterating)"
            )
        if done > len(self):
            raise LoaderResumeError(
                f"the Loader state says {done} batches of epoch {epoch} were delivered, but an epoch of this "
                f"loader has {len(self)}; it was not taken from a loader like this one"
            )
        self._epoch = None
        self._pos = None
        # a complete epoch: the next iteration runs the one after it, unless set_epoch(epoch)
        # asks for it again (then it yields nothing and moves on)
        self._next_epoch = epoch + 1 if done == len(self) else epoch
        self._resume = (epoch, done) if done else None
