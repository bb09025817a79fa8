"""``merge``: join the stores of ``--shard K/N`` jobs into one store.

Choice (documented honestly): format 1.0 has no multi-part store, and a hard
link cannot join several ``.npy`` files into one, so the merge writes a new,
ordinary single store whose data files are the parts' data regions laid end
to end. The bytes are moved with ``os.copy_file_range`` (kernel-side copy: no
data passes through Python or user-space buffers; on file systems with
reflinks, e.g. XFS/Btrfs, the kernel may share extents instead of copying, on
ext4/tmpfs it is a copy at disk speed). The parts are left untouched; delete
them afterwards if you want the space back.

Shard K of N covers the contiguous input range ``[K*n//N, (K+1)*n//N)`` of the
sorted listing, so the parts laid end to end in K order *are* the single-run
store: data, checksums, keys, index and ``errors.jsonl`` are byte-identical to
an ``ingest`` of the same inputs without ``--shard`` (only ``manifest.json``
differs: its store id, time and provenance).

Parts written by ``ingest --shard`` are checked to come from the same inputs
and parameters (their ``inputs_fingerprint``), to be all N of them, and are
ordered by K whatever the order given. Stores without shard provenance are
joined in the order given (same schema and labels required). Only memmap
stores can be merged this way.
"""

from __future__ import annotations

import errno
import os
from typing import Any

import numpy as np

from ..errors import IngestError
from ..format import CHECKSUMS_FILE, KEY_DTYPE, field_file
from ..reader import open_store
from ..writer import StoreWriter

__all__ = ["merge"]


def _copy_range(src_fd: int, src_off: int, dst_fd: int, dst_off: int, n: int) -> None:
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < n:
        if use_cfr:
            try:
                w = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
            except OSError as exc:
                if exc.errno in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    use_cfr = False
                    continue
                raise
            if w == 0:
                raise OSError(errno.EIO, f"copy_file_range copied nothing at offset {src_off + done} (source too short?)")
            done += w
        else:
            buf = os.pread(src_fd, min(n - done, 8 << 20), src_off + done)
            if not buf:
                raise OSError(errno.EIO, "short read while merging")
            os.pwrite(dst_fd, buf, dst_off + done)
            done += len(buf)


def _order(stores: list[Any], paths: list[str]) -> list[int]:
    infos = [s.provenance.get("ingest") or {} for s in stores]
    shards = [i.get("shard") for i in infos]
    if all(sh is not None for sh in shards):
        ns = {sh[1] for sh in shards}
        fps = {i.get("inputs_fingerprint") for i in infos}
        if len(ns) != 1 or len(fps) != 1:
            raise IngestError(
                "the parts come from different ingests (their inputs, parameters or shard counts differ): "
                + ", ".join(f"{p}: shard {sh}" for p, sh in zip(paths, shards))
            )
        n = ns.pop()
        ks = sorted(sh[0] for sh in shards)
        if ks != list(range(n)):
            missing = sorted(set(range(n)) - set(ks))
            dup = sorted({k for k in ks if ks.count(k) > 1})
            raise IngestError(
                f"expected the {n} parts 0..{n - 1} of one ingest; "
                + (f"missing shard(s) {missing}" if missing else "")
                + (f" duplicate shard(s) {dup}" if dup else "")
            )
        return sorted(range(len(stores)), key=lambda j: shards[j][0])
    if any(sh is not None for sh in shards):
        raise IngestError("some parts were written with --shard and some were not; merge the parts of one ingest")
    return list(range(len(stores)))


def merge(parts: list[str | os.PathLike[str]], dest: str | os.PathLike[str], *, overwrite: bool = False) -> str:
    """Join stores ``parts`` into one store at ``dest``; return its path.

    Raises
    ------
    IngestError
        Parts of different ingests, a missing/duplicate shard, different
        schemas or label names, or a non-memmap store.
    """
    paths = [os.fspath(p) for p in parts]
    if not paths:
        raise IngestError("merge needs at least one part")
    stores = [open_store(p) for p in paths]
    try:
        order = _order(stores, paths)
        stores = [stores[j] for j in order]
        paths = [paths[j] for j in order]
        first = stores[0]
        for p, s in zip(paths, stores):
            if s.backend_name != "memmap":
                raise IngestError(f"{p}: a {s.backend_name} store; merge joins memmap stores only")
            if s.schema != first.schema:
                raise IngestError(f"{p}: schema {s.schema!r} differs from {paths[0]}'s {first.schema!r}")
            if s.label_names != first.label_names:
                raise IngestError(f"{p}: label names differ from {paths[0]}'s")
        total = sum(s.slots for s in stores)
        prov = dict(first.provenance)
        ing = dict(prov.get("ingest") or {})
        if ing.get("shard") is not None:
            from .pipeline import _fingerprint

            # the fingerprint a single run over all inputs records
            ing["fingerprint"] = _fingerprint(
                str(ing.get("inputs_fingerprint")), {"shard": None, "range": [0, ing.get("inputs", total)]}
            )
            ing["shard"] = None
            ing["range"] = [0, ing.get("inputs", total)]
            prov["ingest"] = ing
        prov["merged_from"] = [os.path.abspath(p) for p in paths]
        prov.pop("time", None)
        prov.pop("tool", None)
        key_offsets = np.zeros(total + 1, KEY_DTYPE)
        blobs = []
        blob_len = 0
        base = 0
        for s in stores:
            offs, blob = s._keys()
            key_offsets[base + 1 : base + s.slots + 1] = np.asarray(offs[1:], dtype=np.uint64) + np.uint64(blob_len)
            blobs.append(bytes(blob[: int(offs[-1])]) if s.slots else b"")
            blob_len += int(offs[-1]) if s.slots else 0
            base += s.slots
        with StoreWriter(
            dest,
            first.schema,
            slots=total,
            backend="memmap",
            overwrite=overwrite,
            label_names=first.label_names,
            provenance=prov,
        ) as w:
            sw = w.slot_writer
            base = 0
            for s in stores:
                for i, sf in enumerate(sw.layout):
                    if sf.name == CHECKSUMS_FILE:
                        src = os.path.join(s.path, CHECKSUMS_FILE)
                        src_off = s._ck_offset
                    else:
                        (name,) = sf.fields
                        src, src_off, _ = s.backend.field_location(name)
                        assert os.path.basename(src) == field_file(name)
                    nbytes = s.slots * sf.stride
                    if nbytes:
                        fd = os.open(src, os.O_RDONLY)
                        try:
                            _copy_range(fd, src_off, sw._fds[i], sw._offsets[i] + base * sf.stride, nbytes)
                        finally:
                            os.close(fd)
                mask = np.ones(s.slots, bool)
                for e in s.skipped():
                    slot = int(e["slot"])
                    mask[slot] = False
                    w.skip(base + slot, s.slot_key_bytes(slot), e["reason"])
                ok = base + np.flatnonzero(mask).astype(np.int64)
                if len(ok):
                    w.mark_written(ok)
                base += s.slots
            w.set_keys(key_offsets, b"".join(blobs))
    finally:
        for s in stores:
            s.close()
    return os.path.abspath(os.fspath(dest))

