"""Ingest on a Ray cluster: :func:`write` a ``ray.data.Dataset`` into one
store, at a local path or an object-storage URL (``pip install mmstore[ray]``).

::

    import ray, mmstore.ray
    ds = ray.data.read_binary_files("s3://bucket/photos/", include_paths=True)
    mmstore.ray.write(ds, "s3://bucket/stores/photos.store", size=(224, 224),
                      image="bytes", root="bucket/photos")

Each write task decodes its rows exactly as ``mmstore ingest`` decodes the
same inputs (the same decode options, codecs and ``on_error``) and writes them
as one complete *part* named by its task and attempt; the driver then joins
the parts of the successful attempts, in the dataset's row order, into one
store with parts (format.py, "Parts"): the commit, manifest last. See
:mod:`mmstore.ray.sink` for what "exactly once" means here, and the docs
guide "Ingest on a Ray cluster".

``write(..., append=True)`` adds the rows to an existing store as new parts,
under the rules of ``mmstore.append`` (:mod:`mmstore.ray.append`).

:func:`read` is the other direction: one epoch of a store as a
``ray.data.Dataset``, its rows in a seeded order (a global permutation, or
a block shuffle), each read task a contiguous slice of it::

    for epoch in range(epochs):
        ds = mmstore.ray.read("s3://bucket/stores/photos.store", epoch=epoch)
        for batch in ds.iter_torch_batches(batch_size=256):
            ...

This package imports Ray only when it is used; ``import mmstore`` never does.
"""

from __future__ import annotations

from .sink import MmstoreDatasink, RayWriteResult, write
from .source import ReadJob, StoreDatasource, read

__all__ = ["MmstoreDatasink", "RayWriteResult", "ReadJob", "StoreDatasource", "read", "write"]
