"""The store fuzzer: valid small stores, structured mutations, every public
entry point run on the result in a forked child (``support.fuzz``).

``tests/faults/test_fuzz_store.py`` runs a seeded sample of cases drawn by
hypothesis; ``benchmarks/fuzz_store.py`` runs many more and prints the figures.

A case is a base store (memmap or lmdb, plain or merged from parts, with
holes; raw, or compact: a jpeg image and a zstd field, format 2.0) and one or
two mutations (``Mutation``): manifest fields, raw manifest bytes, ``.npy``
headers, index / key offset / checksum values, data and LMDB page bytes,
truncation and extension, and file types (symlink to ``/dev/zero``, dangling
symlink, FIFO, directory, removed file); on compact stores also the offsets
index (decreasing, past the end, huge values), bits flipped inside one JPEG or
zstd entry of a ``.bin``, the manifest's codec objects and version, and the
entry lengths inside lmdb 2.0 values. The child
opens the store and reads it every way there is (``[i]``, ``read_batch``,
``column``, ``key``, ``skipped``, ``checksums``, iteration, ``Loader``), then
runs ``inspect``, ``verify --decode``, ``show`` and ``convert`` through the CLI's
``main``. Required:

- no crash (the child dies of a signal) and no hang (the case timeout);
- a library call returns or raises an ``mmstore.errors.MmstoreError``;
- a CLI command exits 0, 1 or 2 (an uncaught exception counts as exit 1,
  as Python would exit, and is recorded as a traceback);
- what ``verify`` proves: when the full verify says the store is OK, every
  record and key read back equals the pristine store's.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import strategies as st

import mmstore
from mmstore.check import verify_store
from mmstore.cli import main
from mmstore.errors import MmstoreError
from mmstore.ingest.merge import merge
from mmstore.torch import LoaderTuning

from .stores import write_parts, write_store

N = 12
HOLES = (3, 7)
BASES = ("memmap", "lmdb", "memmap-merged", "lmdb-merged")
COMPACT_BASES = ("memmap-compact", "lmdb-compact", "memmap-compact-merged")
COMPACT_CODECS = ("image=jpeg:90", "score=zstd:3")
CLI_STEPS = ("inspect", "verify", "show", "convert")
# What the CLI prints for an exception it did not expect (cli._describe): on a
# damaged store that is a defect, counted like a traceback.
UNEXPECTED = "(unexpected: set MMSTORE_DEBUG=1"


# -- base stores -------------------------------------------------------------------
def make_bases(root: str) -> dict[str, str]:
    """The four pristine stores (12 slots, holes at 3 and 7) under ``root``."""
    out = {}
    os.makedirs(root, exist_ok=True)
    for backend in ("memmap", "lmdb"):
        out[backend] = write_store(os.path.join(root, backend), N, backend=backend, holes=HOLES)
        parts = write_parts(os.path.join(root, f"parts-{backend}"), N, (5, 9), backend=backend, holes=HOLES)
        out[f"{backend}-merged"] = merge(parts, os.path.join(root, f"{backend}-merged"))
    return out


def make_compact_bases(root: str) -> dict[str, str]:
    """The compact stores (format 2.0: image jpeg, score zstd; 12 slots,
    holes at 3 and 7) under ``root``."""
    from .stores import SMALL_SCHEMA

    schema = mmstore.Schema(SMALL_SCHEMA, codecs=list(COMPACT_CODECS))
    out = {}
    os.makedirs(root, exist_ok=True)
    for backend in ("memmap", "lmdb"):
        out[f"{backend}-compact"] = write_store(os.path.join(root, f"{backend}-compact"), N, backend=backend,
                                                holes=HOLES, schema=schema)
    parts = write_parts(os.path.join(root, "parts-compact"), N, (5, 9), holes=HOLES, schema=schema)
    out["memmap-compact-merged"] = merge(parts, os.path.join(root, "memmap-compact-merged"))
    return out


def make_ragged_bases(root: str) -> dict[str, str]:
    """Stores with ragged fields (format 2.1: boxes, str, zstd token ids; 12
    slots, holes at 3 and 7) under ``root``, memmap and lmdb."""
    out = {}
    os.makedirs(root, exist_ok=True)
    for backend in ("memmap", "lmdb"):  # ragged fields on the offsets layout of encoded ones
        out[f"{backend}-ragged"] = write_store(os.path.join(root, f"{backend}-ragged"), N, backend=backend,
                                               holes=HOLES, schema=RAGGED_SCHEMA, make=ragged_sample)
    return out


RAGGED_SCHEMA = {"image": ("|u1", (8, 6, 3)), "boxes": ("<f4", (None, 4)), "caption": "str",
                 "ids": ("<i8", (None,), "zstd:1")}


def ragged_sample(i: int) -> dict[str, Any]:
    """Deterministic record i of RAGGED_SCHEMA (zero boxes and empty text for some)."""
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (8, 6, 3), dtype=np.uint8),
            "boxes": rng.random((i % 4, 4), dtype=np.float32),
            "caption": "caf\u00e9 " * (i % 3), "ids": list(range(i % 5))}


def _same(got: Any, want: Any, idx: Any = None) -> bool:
    """Equal reads: arrays, or ragged batches (``want`` reordered by ``idx``)."""
    from mmstore.format.ragged import Ragged

    if isinstance(want, Ragged):
        ws = want.split()
        ws = ws if idx is None else [ws[int(i)] for i in idx]
        gs = got.split() if isinstance(got, Ragged) else None
        return gs is not None and len(gs) == len(ws) and all(
            (g == w) if isinstance(w, (str, bytes)) else (g.dtype == w.dtype and np.array_equal(g, w))
            for g, w in zip(gs, ws))
    return np.array_equal(got, want if idx is None else want[idx])


def reference(path: str) -> dict[str, Any]:
    """What a correct read of ``path`` returns (every record, key, skipped input)."""
    with mmstore.open(path) as s:
        return {
            "data": s.read_batch(np.arange(len(s))),
            "keys": [s.key(i) for i in range(len(s))],
            "records": len(s),
        }


# -- mutations ---------------------------------------------------------------------
@dataclass
class Mutation:
    """One change to a store: ``kind`` with its ``target`` file and parameters."""

    kind: str
    target: str = ""
    params: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind}({self.target}{', ' if self.params else ''}{self.params})"


MANIFEST_KEYS = (
    "records", "slots", "backend", "version", "segments", "label_names", "store_id", "checksum",
    "files", "schema.shape", "schema.dtype", "schema.name", "schema", "format", "digests",
)
TYPE_CHANGES = ("symlink-devzero", "symlink-dangling", "symlink-copy", "fifo", "directory", "remove", "empty",
                "symlink-devnull")


def _huge_int() -> str:
    return "9" * 5000


def _manifest_value(choice: int, old: Any, slots: int) -> Any:
    vals = [0, 1, -1, slots + 1, slots - 1, 2**61, 2**64, 2**32, None, "x", [], {}, [2**32, 2**32, 1],
            [1, 0], True, 1.5, "HUGE"]
    v = vals[choice % len(vals)]
    if isinstance(old, list) and old and choice % 3 == 0:
        return old[:-1]
    return v


def apply(path: str, m: Mutation) -> None:
    """Apply mutation ``m`` to the store at ``path`` (in place)."""
    p = os.path.join(path, m.target) if m.target else path
    k = m.kind
    if k != "type":  # an earlier mutation may have made it a FIFO (opening it would block here)
        for q in (p if m.target else os.path.join(path, "manifest.json"),):
            if os.path.lexists(q) and not stat.S_ISREG(os.lstat(q).st_mode):
                raise ValueError(f"{q} is no longer a regular file")
    if k == "manifest-field":
        _mutate_manifest_field(path, m.params["key"], m.params["choice"])
    elif k == "manifest-raw":
        raw = _read(os.path.join(path, "manifest.json"))
        how = m.params["how"]
        if how == "truncate":
            raw = raw[: m.params["at"] % max(1, len(raw))]
        elif how == "flip":
            at = m.params["at"] % len(raw)
            raw = raw[:at] + bytes([raw[at] ^ m.params["mask"]]) + raw[at + 1 :]
        elif how == "nested":
            raw = b"[" * 100000 + b"]" * 100000
        elif how == "not-utf8":
            raw = raw.replace(b'"mmstore"', b'"mm\xffstore"', 1)
        elif how == "huge-int":
            raw = raw.replace(b'"records": ', b'"records": ' + _huge_int().encode() + b", \"x\": ", 1)
        _write(os.path.join(path, "manifest.json"), raw)
    elif k == "npy-header":
        _mutate_npy_header(p, m.params)
    elif k == "u8-value":  # one value of _index.npy / _keys_offsets.npy / _checksums.npy
        data_off = _npy_offset(p)
        n = (os.path.getsize(p) - data_off) // 8
        if n:
            pos = data_off + 8 * (m.params["pos"] % n)
            with open(p, "r+b") as fh:
                fh.seek(pos)
                fh.write(int(m.params["value"] % 2**64).to_bytes(8, "little"))
    elif k == "flip":
        size = os.path.getsize(p)
        if size:
            at = _flip_offset(p, size, m.params)
            with open(p, "r+b") as fh:
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ (m.params["mask"] or 1)]))
    elif k == "truncate":
        size = os.path.getsize(p)
        os.truncate(p, m.params["at"] % max(1, size))
    elif k == "extend":
        with open(p, "ab") as fh:
            fh.write(b"\0" * m.params["n"])
    elif k == "type":
        _change_type(path, p, m.params["to"])
    elif k == "offsets":
        _mutate_offsets(p, m.params)
    elif k == "entry-flip":
        _flip_entry(path, m.target, m.params)
    elif k == "codec":
        _mutate_codec(path, m.params)
    elif k == "lmdb-length":
        _mutate_lmdb_length(path, m.target, m.params)
    else:
        raise ValueError(f"unknown mutation {k}")


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def _write(path: str, raw: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(raw)


def _npy_offset(path: str) -> int:
    with open(path, "rb") as fh:
        head = fh.read(10)
    return 10 + int.from_bytes(head[8:10], "little")


def _flip_offset(path: str, size: int, params: dict[str, Any]) -> int:
    at = params["at"]
    if params.get("zone") == "meta" and path.endswith(".mdb"):  # the two LMDB meta pages' fields
        return (at % 2) * 4096 + (at // 2) % 152
    if params.get("zone") == "pagehead" and path.endswith(".mdb"):  # an LMDB page header or node pointers
        pages = max(1, size // 4096)
        return (at % pages) * 4096 + (at // pages) % 64
    if params.get("zone") == "header" and path.endswith(".npy"):
        return at % min(size, _npy_offset(path))
    return at % size


def _mutate_manifest_field(path: str, key: str, choice: int) -> None:
    mp = os.path.join(path, "manifest.json")
    obj = json.loads(_read(mp))
    slots = obj["slots"]
    if key.startswith("schema."):
        sub = key.split(".", 1)[1]
        ent = obj["schema"][choice % len(obj["schema"])]
        if sub == "shape":
            ent["shape"] = [[2**32, 2**32, 1], [2**61], [], [0], [1, 2, 3], [-1], "x", [2**64]][choice % 8]
        elif sub == "dtype":
            ent["dtype"] = ["<i8", "|u1", "<f8", ">i8", "O", "<U4", "|V8", 5][choice % 8]
        else:
            ent["name"] = ["_x", "label", "a" * 70, "", 5, "image"][choice % 6]
    elif key == "files":
        names = sorted(obj["files"])
        name = names[choice % len(names)]
        v = [0, obj["files"][name] + 1, obj["files"][name] - 1, 2**63, -1, None, "../../etc/passwd"][choice % 7]
        if v == "../../etc/passwd":
            obj["files"][v] = obj["files"].pop(name)
        else:
            obj["files"][name] = v
    elif key == "segments" and obj.get("segments"):
        segs = obj["segments"]
        obj["segments"] = [[segs[0] + 1] + segs[1:], segs[::-1], [2**61, -(2**61) + slots], segs + [0], [slots]][
            choice % 5]
    else:
        v = _manifest_value(choice, obj.get(key), slots)
        if v == "HUGE":
            raw = json.dumps({**obj, key: 0}).replace(f'"{key}": 0', f'"{key}": {_huge_int()}')
            _write(mp, raw.encode())
            return
        obj[key] = v
    _write(mp, json.dumps(obj).encode())


def _mutate_npy_header(path: str, params: dict[str, Any]) -> None:
    raw = _read(path)
    off = _npy_offset(path)
    head = raw[:off].decode("latin1")
    how = params["how"]
    if how == "rows":
        head = re.sub(r"'shape': \((\d+)",
                      lambda mm: f"'shape': ({[int(mm.group(1)) + 1, 0, 2**40, 2**63][params['choice'] % 4]}", head)
    elif how == "dtype":
        head = head.replace("'descr': '", "'descr': '>" if "<" not in head else "'descr': '|", 1)
    elif how == "fortran":
        head = head.replace("False", "True ")
    elif how == "version":
        head = head[:6] + "\x02" + head[7:]
    elif how == "garbage":
        head = head[:10] + "{'descr': __import__('os'), " + head[10 + 28 :]
    # keep the length: pad or cut to the original header size
    new = head.encode("latin1")[:off].ljust(off, b" ")
    _write(path, new + raw[off:])


def _change_type(root: str, p: str, to: str) -> None:
    if os.path.lexists(p):
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            if to == "symlink-copy":
                shutil.copyfile(p, os.path.join(os.path.dirname(root), os.path.basename(root) + "-outside"))
            os.unlink(p)
    if to == "symlink-devzero":
        os.symlink("/dev/zero", p)
    elif to == "symlink-devnull":
        os.symlink("/dev/null", p)
    elif to == "symlink-dangling":
        os.symlink(os.path.join(root, "no-such-file"), p)
    elif to == "symlink-copy":
        outside = os.path.join(os.path.dirname(root), os.path.basename(root) + "-outside")
        if not os.path.exists(outside):
            _write(outside, b"")
        os.symlink(outside, p)
    elif to == "fifo":
        os.mkfifo(p)
    elif to == "directory":
        os.mkdir(p)
    elif to == "empty":
        _write(p, b"")
    elif to == "remove":
        pass


def _mutate_offsets(path: str, params: dict[str, Any]) -> None:
    """One value of an encoded field's ``.offsets.npy``: smaller than the one
    before, past the end of the ``.bin``, huge, or two swapped."""
    data_off = _npy_offset(path)
    offs = np.frombuffer(_read(path)[data_off:], "<u8").copy()
    if len(offs) < 2:
        raise ValueError("no offsets to change")
    at = params["pos"] % len(offs)
    how = params["how"]
    if how == "decrease":
        offs[at] = int(offs[at - 1]) - 1 if at and int(offs[at - 1]) else 1
    elif how == "past-end":
        offs[at] = int(offs[-1]) + 1 + params["value"] % 4096
    elif how == "huge":
        offs[at] = [2**63 - 1, 2**63, 2**64 - 1, 2**62][params["value"] % 4]
    else:  # swap with the next
        b = (at + 1) % len(offs)
        offs[at], offs[b] = offs[b], offs[at]
    with open(path, "r+b") as fh:
        fh.seek(data_off)
        fh.write(offs.astype("<u8").tobytes())


def _flip_entry(path: str, data: str, params: dict[str, Any]) -> None:
    """Flip bits inside one stored entry of ``<field>[.k].bin`` (a JPEG or
    zstd entry), found through its offsets file."""
    offs_path = os.path.join(path, data[: -len(".bin")] + ".offsets.npy")
    offs = np.frombuffer(_read(offs_path)[_npy_offset(offs_path):], "<u8")
    sizes = np.diff(offs.astype(np.int64))
    full = np.flatnonzero(sizes > 0)
    if not len(full):
        raise ValueError("no entry to flip")
    s = int(full[params["slot"] % len(full)])
    at = int(offs[s]) + params["at"] % int(sizes[s])
    with open(os.path.join(path, data), "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ (params["mask"] or 1)]))


CODEC_CHANGES = (
    {"name": "webp", "quality": 90}, {"name": "jpeg", "quality": 0}, {"name": "jpeg", "quality": 101},
    {"name": "jpeg", "quality": "90"}, {"name": "jpeg", "quality": True}, {"name": "jpeg"}, {"name": "raw"},
    {"name": "zstd", "level": 3}, {"name": "png", "level": 1}, "jpeg:90", None, {}, {"name": 5},
    {"name": "jpeg", "quality": 2**64},
)
VERSION_CHANGES = ([1, 0], [1, 1], [2, 1], [3, 0], [2], [2, 0, 0], ["2", 0])


def _mutate_codec(path: str, params: dict[str, Any]) -> None:
    """The manifest's codec object of one field (unknown name, bad
    parameters, another codec), or its version (a 2.0 store as 1.x ...)."""
    mp = os.path.join(path, "manifest.json")
    obj = json.loads(_read(mp))
    c = params["choice"]
    if params["what"] == "version":
        obj["version"] = VERSION_CHANGES[c % len(VERSION_CHANGES)]
    else:
        ent = obj["schema"][params["field"] % len(obj["schema"])]
        new = CODEC_CHANGES[c % len(CODEC_CHANGES)]
        if new is None:
            ent.pop("codec", None)
        else:
            ent["codec"] = new
    _write(mp, json.dumps(obj).encode())


def _mutate_lmdb_length(path: str, name: str, params: dict[str, Any]) -> None:
    """One entry length inside one lmdb 2.0 value (off by a little, past the
    value, huge), written with LMDB itself; the manifest then lists the
    file's new size, as a crafted store would."""
    import lmdb

    p = os.path.join(path, name)
    obj = json.loads(_read(os.path.join(path, "manifest.json")))
    schema = mmstore.Schema.from_json(obj["schema"])
    nvar = len(schema.variable_fields)
    if not nvar:
        raise ValueError("no variable-size field")
    env = lmdb.open(p, subdir=False, lock=False, map_size=64 << 20)
    try:
        with env.begin(write=True) as txn:
            keys = [bytes(k) for k, _ in txn.cursor()]
            k = keys[params["slot"] % len(keys)]
            v = bytearray(txn.get(k))
            at = schema.record_bytes + 8 * (params["field"] % nvar)
            old = int.from_bytes(v[at : at + 8], "little")
            new = [old + 1, old - 1, old + 1000, 2**63, 2**64 - 1, 0][params["how"] % 6] % 2**64
            v[at : at + 8] = int(new).to_bytes(8, "little")
            txn.put(k, bytes(v))
    finally:
        env.close()
    obj["files"][name] = os.path.getsize(p)
    _write(os.path.join(path, "manifest.json"), json.dumps(obj).encode())


def store_files(path: str) -> list[str]:
    return sorted(os.listdir(path))


# -- the child: every entry point ------------------------------------------------------
def _lib_step(rec: list, name: str, fn: Any) -> Any:
    """Run one library call; an exception other than MmstoreError is a violation."""
    _progress(name)
    try:
        out = fn()
        rec.append((name, "ok", ""))
        return out
    except MmstoreError as exc:
        rec.append((name, "typed", f"{type(exc).__name__}: {str(exc)[:300]}"))
    except Exception as exc:  # noqa: BLE001 - that is the finding
        rec.append((name, "VIOLATION", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"))
    return None


_PIPE = [-1]


def _progress(step: str) -> None:
    if _PIPE[0] >= 0:
        os.write(_PIPE[0], f"step {step}\n".encode())


def _cli(rec: list, name: str, argv: list[str], log: str) -> None:
    _progress(name)
    rc: Any
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    start = os.fstat(fd).st_size
    saved = os.dup(1), os.dup(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    tb = ""
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # noqa: BLE001 - python -m mmstore would print a traceback, exit 1
        rc = 1
        tb = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(fd)
        os.close(saved[0])
        os.close(saved[1])
    if not tb:
        with open(log, "rb") as f:
            f.seek(start)
            said = f.read().decode("utf-8", "replace")
        if UNEXPECTED in said:
            tb = next(line for line in said.splitlines() if UNEXPECTED in line)[:300]
    if rc not in (0, 1, 2):
        rec.append((name, "VIOLATION", f"exit code {rc}"))
    else:
        rec.append((name, "traceback" if tb else f"exit {rc}", tb))


def exercise(path: str, work: str, ref: dict[str, Any], loader: bool = True) -> dict[str, Any]:
    """Every entry point on the (mutated) store at ``path``; returns the record."""
    rec: list = []
    reads: dict[str, Any] = {}
    s = _lib_step(rec, "open", lambda: mmstore.open(path))
    if s is not None:
        n = len(s)
        idx = np.random.default_rng(0).permutation(n)
        if n:
            _lib_step(rec, "[0]", lambda: s[0])
            _lib_step(rec, "[-1]", lambda: s[-1])
        reads["batch"] = _lib_step(rec, "read_batch", lambda: s.read_batch(idx))
        for f in s.fields:
            reads[f"column:{f}"] = _lib_step(rec, f"column:{f}", lambda f=f: s.column(f))
        reads["keys"] = _lib_step(rec, "key", lambda: [s.key(i) for i in range(n)])
        _lib_step(rec, "skipped", lambda: s.skipped())
        _lib_step(rec, "checksums", lambda: np.array(s.slot_view.checksums()))
        _lib_step(rec, "iter", lambda: sum(1 for _ in s))
        if loader and not s.schema.has_ragged:  # the torch side of ragged fields is not built yet
            reads["loader"] = _lib_step(rec, "Loader", lambda: _loader_epoch(s))
        _lib_step(rec, "close", s.close)
        reads["idx"] = idx
        reads["n"] = n
    log = os.path.join(work, "cli.log")
    _cli(rec, "inspect", ["inspect", path, "--json"], log)
    _cli(rec, "verify", ["verify", path, "--no-progress", "--threads", "1", "--decode"], log)
    _cli(rec, "show", ["show", path, "-o", os.path.join(work, "grid.png"), "-n", "4"], log)
    _cli(rec, "convert", ["convert", path, os.path.join(work, "converted"), "--backend", "memmap", "--no-progress"],
         log)
    _progress("oracle")
    _oracle(path, rec, reads, ref)
    return {"steps": rec}


def _loader_epoch(s: Any) -> int:
    import torch

    from mmstore.torch import Loader

    torch.set_num_threads(1)
    total = 0
    ld = Loader(s, batch_size=5, order="sequential", tuning=LoaderTuning(threads=2, prefetch=2, hints=False))
    try:
        for batch in ld:
            total += len(next(iter(batch.values())))
    finally:
        close = getattr(ld, "close", None)
        if close is not None:
            close()
    if total != len(s):
        raise AssertionError(f"Loader gave {total} samples for {len(s)} records")
    return total


def _oracle(path: str, rec: list, reads: dict[str, Any], ref: dict[str, Any]) -> None:
    """What verify proves: a store it passes reads back exactly as the pristine one."""
    try:
        rep = verify_store(path, threads=1)
    except MmstoreError:
        return
    except Exception as exc:  # noqa: BLE001 - the CLI's verify shows the same as a traceback
        rec.append(("verify_store", "traceback", f"{type(exc).__name__}: {str(exc)[:300]}"))
        return
    if not rep.ok or "n" not in reads:
        return
    bad = []
    if reads["n"] != ref["records"]:
        bad.append(f"{reads['n']} records, pristine {ref['records']}")
    batch = reads.get("batch")
    if batch is not None and reads["n"] == ref["records"]:
        for f, arr in batch.items():
            if not _same(arr, ref["data"][f], reads["idx"]):
                bad.append(f"read_batch field {f} differs")
        for f in ref["data"]:
            col = reads.get(f"column:{f}")
            if col is not None and not _same(col, ref["data"][f]):
                bad.append(f"column {f} differs")
    if reads.get("keys") is not None and reads["keys"] != ref["keys"]:
        bad.append("keys differ")
    if bad:
        rec.append(("oracle", "VIOLATION", f"verify says OK but {'; '.join(bad)}"))


# -- running a case in a child ------------------------------------------------------------
@dataclass
class Outcome:
    case: str
    status: str  # ok | crash | hang | violation
    detail: str = ""
    steps: list = field(default_factory=list)

    @property
    def tracebacks(self) -> list:
        return [s for s in self.steps if s[1] == "traceback"]


def run_case(base: str, ref: dict[str, Any], muts: list[Mutation], work: str, timeout: float = 120.0,
             loader: bool = True) -> Outcome:
    """Copy ``base`` to ``work``, apply ``muts``, exercise it in a forked child."""
    name = " + ".join(map(str, muts))
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    path = os.path.join(work, "s.store")
    shutil.copytree(base, path, symlinks=True)
    try:
        for m in muts:
            apply(path, m)
    except (OSError, ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
        return Outcome(name, "ok", f"mutation not applicable ({type(exc).__name__}: {exc})")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            _PIPE[0] = w
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            res = exercise(path, work, ref, loader=loader)
            os.write(w, ("result " + json.dumps(res, default=str) + "\n").encode())
        except BaseException:  # noqa: BLE001
            try:
                os.write(w, ("error " + json.dumps(traceback.format_exc()[-2000:]) + "\n").encode())
            except BaseException:  # noqa: BLE001
                pass
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    out = _collect(r, pid, timeout)
    os.close(r)
    kind, status, lines = out
    last_step = next((ln[5:] for ln in reversed(lines) if ln.startswith("step ")), "?")
    if kind == "timeout":
        _cleanup(work)
        return Outcome(name, "hang", f"no result after {timeout:.0f} s, in step {last_step}")
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status)).name
        _cleanup(work)
        return Outcome(name, "crash", f"killed by {sig} in step {last_step}")
    res = next((ln for ln in lines if ln.startswith("result ")), None)
    if res is None:
        err = next((ln for ln in lines if ln.startswith("error ")), "no result")
        _cleanup(work)
        return Outcome(name, "violation", f"the case harness failed in step {last_step}: {err[:2000]}")
    steps = json.loads(res[7:])["steps"]
    bad = [s for s in steps if s[1] == "VIOLATION"]
    _cleanup(work)
    if bad:
        return Outcome(name, "violation", "; ".join(f"{s[0]}: {s[2]}" for s in bad), steps)
    return Outcome(name, "ok", "", steps)


def _cleanup(work: str) -> None:
    # the mutations may have made files unreadable or turned them into FIFOs: rmtree copes
    for dirpath, dirnames, _ in os.walk(work):
        for d in dirnames:
            try:
                os.chmod(os.path.join(dirpath, d), stat.S_IRWXU)
            except OSError:
                pass
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(work + "-outside", ignore_errors=True)


def _collect(r: int, pid: int, timeout: float) -> tuple[str, int, list[str]]:
    buf = b""
    deadline = time.monotonic() + timeout
    eof = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout", 0, buf.decode(errors="replace").splitlines()
        if not eof:
            ready, _, _ = select.select([r], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(r, 1 << 16)
                if chunk:
                    buf += chunk
                    continue
                eof = True
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if not eof:  # drain what is left
                while True:
                    ready, _, _ = select.select([r], [], [], 0)
                    chunk = os.read(r, 1 << 16) if ready else b""
                    if not chunk:
                        break
                    buf += chunk
            return "exited", status, buf.decode(errors="replace").splitlines()
        if eof:
            time.sleep(0.01)


# -- drawing cases ------------------------------------------------------------------------------
def mutation_strategy(files: list[str]) -> Any:
    """A hypothesis strategy of one mutation of a store holding ``files``."""
    npys = [f for f in files if f.endswith(".npy")]
    mdbs = [f for f in files if f.endswith(".mdb")]
    u8s = [f for f in ("_index.npy", "_keys_offsets.npy", "_checksums.npy") if f in files]
    u8s += [f for f in files if f.endswith(".offsets.npy")]
    data = [f for f in files if f != "manifest.json"]
    big = st.sampled_from([0, 1, 2, 11, 12, 13, 2**32, 2**63 - 1, 2**64 - 2, 2**64 - 1]) | st.integers(0, 2**64 - 1)
    opts = [
        st.builds(lambda k, c: Mutation("manifest-field", "", {"key": k, "choice": c}),
                  st.sampled_from(MANIFEST_KEYS), st.integers(0, 200)),
        st.builds(lambda h, a, m: Mutation("manifest-raw", "", {"how": h, "at": a, "mask": m}),
                  st.sampled_from(["truncate", "flip", "nested", "not-utf8", "huge-int"]), st.integers(0, 10**6),
                  st.integers(1, 255)),
        st.builds(lambda t, h, c: Mutation("npy-header", t, {"how": h, "choice": c}),
                  st.sampled_from(npys), st.sampled_from(["rows", "dtype", "fortran", "version", "garbage"]),
                  st.integers(0, 3)),
        st.builds(lambda t, a, m, z: Mutation("flip", t, {"at": a, "mask": m, "zone": z}),
                  st.sampled_from(data), st.integers(0, 10**6), st.integers(1, 255),
                  st.sampled_from(["any", "header"])),
        st.builds(lambda t, a: Mutation("truncate", t, {"at": a}), st.sampled_from(files), st.integers(0, 10**6)),
        st.builds(lambda t, n: Mutation("extend", t, {"n": n}), st.sampled_from(data), st.integers(1, 9000)),
        st.builds(lambda t, to: Mutation("type", t, {"to": to}),
                  st.sampled_from(files), st.sampled_from(TYPE_CHANGES)),
    ]
    if u8s:
        opts.append(st.builds(lambda t, p, v: Mutation("u8-value", t, {"pos": p, "value": v}),
                              st.sampled_from(u8s), st.integers(0, 100), big))
    if mdbs:
        opts.append(st.builds(lambda t, a, m, z: Mutation("flip", t, {"at": a, "mask": m, "zone": z}),
                              st.sampled_from(mdbs), st.integers(0, 10**6), st.integers(1, 255),
                              st.sampled_from(["meta", "pagehead", "any"])))
    return st.one_of(*opts)


def compact_mutation_strategy(files: list[str]) -> Any:
    """A mutation aimed at what compact stores add (offsets, entries, codecs,
    lmdb 2.0 lengths), or, one time in three, any mutation."""
    offsets = [f for f in files if f.endswith(".offsets.npy")]
    bins = [f for f in files if f.endswith(".bin")]
    mdbs = [f for f in files if f.endswith(".mdb")]
    opts = [
        st.builds(lambda w, f, c: Mutation("codec", "", {"what": w, "field": f, "choice": c}),
                  st.sampled_from(["codec", "codec", "version"]), st.integers(0, 2), st.integers(0, 100)),
        mutation_strategy(files),
    ]
    if offsets:
        opts.append(st.builds(lambda t, h, p, v: Mutation("offsets", t, {"how": h, "pos": p, "value": v}),
                              st.sampled_from(offsets), st.sampled_from(["decrease", "past-end", "huge", "swap"]),
                              st.integers(0, 20), st.integers(0, 10**6)))
    if bins:
        opts.append(st.builds(lambda t, s, a, m: Mutation("entry-flip", t, {"slot": s, "at": a, "mask": m}),
                              st.sampled_from(bins), st.integers(0, 20), st.integers(0, 10**6),
                              st.integers(1, 255)))
    if mdbs:
        opts.append(st.builds(lambda t, s, f, h: Mutation("lmdb-length", t, {"slot": s, "field": f, "how": h}),
                              st.sampled_from(mdbs), st.integers(0, 20), st.integers(0, 1), st.integers(0, 5)))
    return st.one_of(*opts)


def case_strategy(bases: dict[str, str], compact: bool = False) -> Any:
    """(base name, [1-2 mutations]) for the stores of ``make_bases`` (or,
    ``compact``, of ``make_compact_bases``, with the mutations they add)."""
    make = compact_mutation_strategy if compact else mutation_strategy
    per_base = [
        st.tuples(st.just(name), st.lists(make(store_files(path)), min_size=1, max_size=2))
        for name, path in sorted(bases.items())
    ]
    return st.one_of(*per_base)
