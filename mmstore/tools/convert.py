"""``convert``: rewrite a store in the other backend.

The records' packed bytes are the same in both backends, so the checksums
file of the result is byte-identical to the source's; each record's checksum
is recomputed on the way and compared with the stored one, so a damaged
source record stops the conversion instead of being copied.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._dest import check_dest
from ..errors import ChecksumError
from ..format import SUPPORTED_BACKENDS
from ..reader import open_store
from ..writer import StoreWriter

__all__ = ["ConvertReport", "convert_store"]


@dataclass
class ConvertReport:
    source: str
    dest: str
    source_backend: str
    backend: str
    records: int
    slots: int
    holes: int
    bytes_written: int
    seconds: float
    store_id: str

    _json_extra = ("mb_per_s",)

    @property
    def mb_per_s(self) -> float:
        return self.bytes_written / self.seconds / 1e6 if self.seconds > 0 else 0.0


def convert_store(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    backend: str,
    *,
    overwrite: bool = False,
    progress: Callable[[int], Any] | None = None,
) -> ConvertReport:
    """Write the store ``src`` again at ``dest`` with ``backend``.

    Slots, holes (with their keys and reasons), keys, label names and
    provenance carry over; the provenance gains ``converted_from``.

    Raises
    ------
    ValueError
        Unknown backend.
    DestinationError
        ``dest`` is, contains or lies inside ``src``, or exists and is not a
        store (only a store is ever replaced, with ``overwrite``).
    ChecksumError
        A source record does not match its stored checksum (run ``mmstore
        verify`` on the source); the partial output is discarded.
    """
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"backend must be one of {SUPPORTED_BACKENDS}, got {backend!r}")
    t0 = time.perf_counter()
    store = open_store(src)
    try:
        check_dest(dest, overwrite=overwrite, sources=[store.path])
        schema = store.schema
        slots = store.slots
        holes = {int(e["slot"]): e for e in store.skipped()}
        prov = store.provenance
        note = {"path": store.path, "store_id": store.store_id, "backend": store.backend_name,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        prov["converted_from"] = note
        stored = np.array(store.checksums())
        offsets, blob = store._keys()
        rb = schema.record_bytes
        fields = list(schema)
        w = StoreWriter(dest, schema, slots=slots, backend=backend, overwrite=overwrite,
                        label_names=store.label_names, provenance=prov, inputs=[store.path])
        try:
            sw = w.slot_writer
            w.set_keys(np.array(offsets), bytes(blob))
            written = []
            step = 4096
            for a in range(0, slots, step):
                b = min(slots, a + step)
                for s, packed in store.backend.iter_packed(a, b):
                    if s in holes:
                        e = holes[s]
                        w.skip(s, store.slot_key_bytes(s), e.get("reason", "skipped"))
                        continue
                    if packed is None or len(packed) != rb:
                        raise ChecksumError(
                            f"{store.path}: slot {s} is not a hole but has no record; the source is "
                            "damaged: run `mmstore verify` on it"
                        )
                    arrays = {}
                    pos = 0
                    for f in fields:
                        arrays[f.name] = np.frombuffer(packed, f.dtype, count=int(np.prod(f.shape, dtype=np.int64)),
                                                       offset=pos).reshape(f.shape)
                        pos += f.nbytes
                    ck = sw.write_arrays(s, arrays)
                    if ck != int(stored[s]):
                        raise ChecksumError(
                            f"{store.path}: slot {s} (key {store.slot_key_bytes(s).decode('utf-8', 'replace')!r}) "
                            f"has checksum {ck:016x} but the store says {int(stored[s]):016x}: the source is "
                            "damaged; run `mmstore verify --repair` on it first"
                        )
                    written.append(s)
                if written:
                    w.mark_written(written)
                    written = []
                if progress is not None:
                    progress((b - a) * rb)
            w.close()
        except BaseException:
            w.abort()
            import shutil

            shutil.rmtree(w.partial, ignore_errors=True)
            raise
        out = open_store(dest)
        rep = ConvertReport(store.path, out.path, store.backend_name, backend, out.records, out.slots,
                            out.slots - out.records, sum(out.manifest["files"].values()),
                            time.perf_counter() - t0, out.store_id)
        out.close()
        return rep
    finally:
        store.close()
