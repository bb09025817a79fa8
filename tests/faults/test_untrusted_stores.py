"""A store from someone else, reader side: offsets proven in range, LMDB
damage read without SIGBUS, crafted bookkeeping files, and typed errors
instead of OSErrors. Whatever could
crash or hang runs in a forked child (``support.proc.in_child``)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from support.faults import drop_dac_override, edit_manifest, rewrite_file
from support.proc import cli_env, in_child
from support.stores import SMALL_SCHEMA, write_parts, write_store

import mmstore
from mmstore.errors import FormatError, IncompleteStoreError, MmstoreError
from mmstore.format.layout import npy_header
from mmstore.ingest.merge import merge
from mmstore.store.backends.base import check_npy

N = 12
HOLES = (3, 7)


def _set_manifest(path, raw):
    with open(os.path.join(path, "manifest.json"), "wb") as fh:
        fh.write(raw)


def _set_u8(path, name, pos, value):
    with open(os.path.join(path, name), "r+b") as fh:
        fh.seek(128 + 8 * pos)
        fh.write(int(value).to_bytes(8, "little"))


def _read_everything(path):
    """Every read of the library API; returns what it read."""
    with mmstore.open(path) as s:
        out = {"batch": s.read_batch(np.arange(len(s))), "keys": [s.key(i) for i in range(len(s))]}
        out["col"] = s.column("label")
        out["one"] = s[len(s) - 1]
        out["skipped"] = s.skipped()
        return out


def _typed(res, fragment=""):
    assert res.kind == "raised" and "MmstoreError" in res.value[2], res
    assert fragment in res.value[1], res.value[1]


# -- every offset proven in range ----------------------------------------------------------
@pytest.mark.parametrize("value", [N, N + 1, 2**63, 2**64 - 2, 2**64 - 1])
@pytest.mark.parametrize("kind", ["memmap", "lmdb", "merged"])
def test_index_value_past_slots_is_a_format_error_not_a_segfault(tmp_path, value, kind):
    if kind == "merged":
        path = merge(write_parts(str(tmp_path / "p"), N, (5, 9), holes=HOLES), str(tmp_path / "m"))
    else:
        path = write_store(str(tmp_path / "s"), N, backend=kind, holes=HOLES)
    _set_u8(path, "_index.npy", N - len(HOLES) - 1, value)  # the last index entry
    mmstore.open(path).close()  # open stays O(1): it reads no index
    res = in_child(_read_everything, path)
    _typed(res, "_index.npy")


def test_index_not_increasing_is_refused(tmp_path):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    _set_u8(path, "_index.npy", 4, 1)  # ... 2, 4, 1, 6 ...
    res = in_child(lambda: mmstore.open(path)[0])
    _typed(res, "not strictly increasing at index 4")


def test_key_offsets_decreasing_are_refused(tmp_path):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    _set_u8(path, "_keys_offsets.npy", 5, 2**64 - 2)
    res = in_child(lambda: mmstore.open(path).key(0))
    _typed(res, "_keys_offsets.npy")


# -- LMDB damage, read side ---------------------------------------------------------------------
META = {"last_pg": 136, "psize": 40, "magic": 16, "version": 20, "main_root": 128, "free_root": 80, "flags": 10}


@pytest.mark.parametrize("field", sorted(META))
@pytest.mark.parametrize("page", [0, 1])
def test_damaged_lmdb_meta_page_is_refused_at_open(tmp_path, field, page):
    path = write_store(str(tmp_path / "s"), N, backend="lmdb", holes=HOLES)
    mdb = os.path.join(path, "records.mdb")
    off = page * 4096 + META[field]
    with open(mdb, "r+b") as fh:
        fh.seek(off)
        fh.write(b"\xff\xff\x7f\x00" if field != "flags" else b"\x00\x00")
    res = in_child(_read_everything, path)
    if field == "psize" and page == 1:  # LMDB takes the page size from meta page 0 only
        assert res.kind in ("ok", "raised"), res
        return
    _typed(res, "records.mdb: not a valid LMDB file")


def _flip_all(path, offsets, masks):
    """In one child: flip each byte, read everything, put it back. Returns how each ended."""
    mdb = os.path.join(path, "records.mdb")
    with open(mdb, "rb") as fh:
        raw = fh.read()
    ends = {"ok": 0, "typed": 0}
    for off, mask in zip(offsets, masks):
        with open(mdb, "r+b") as fh:
            fh.seek(off)
            fh.write(bytes([raw[off] ^ mask]))
        try:
            _read_everything(path)
            ends["ok"] += 1
        except MmstoreError:
            ends["typed"] += 1
        finally:
            with open(mdb, "r+b") as fh:
                fh.seek(off)
                fh.write(raw[off : off + 1])
    return ends


def test_every_meta_byte_flipped_never_crashes_the_reader(tmp_path):
    path = write_store(str(tmp_path / "s"), N, backend="lmdb", holes=HOLES)
    offsets = [p * 4096 + b for p in (0, 1) for b in range(152)]
    res = in_child(_flip_all, path, offsets, [0xFF] * len(offsets))
    assert res.kind == "ok", res
    assert sum(res.value.values()) == len(offsets)


@pytest.mark.parametrize("big", [False, True], ids=["small-values", "overflow-pages"])
def test_random_lmdb_byte_flips_never_crash_the_reader(tmp_path, big):
    """Was: 3 SIGBUS in 30 random flips. Node offsets and value sizes inside
    pages included (the overflow-page store had a flipped value size touch 2 GB)."""
    schema = {"image": ("|u1", (40, 40, 3)), "label": ("<i8", ())} if big else SMALL_SCHEMA

    def make(i):
        r = np.random.default_rng(i)
        return {"image": r.integers(0, 256, (40, 40, 3), dtype=np.uint8), "label": np.int64(i)}

    path = write_store(str(tmp_path / "s"), 60 if big else 200, backend="lmdb", holes=(3, 50),
                                 schema=schema, **({"make": make} if big else {}))
    size = os.path.getsize(os.path.join(path, "records.mdb"))
    rng = np.random.default_rng(7)
    offsets = rng.integers(2 * 4096, size, 60).tolist()  # data pages (the meta pages: the test above)
    offsets += [4096 * int(p) + int(b) for p, b in zip(rng.integers(2, size // 4096, 40), rng.integers(0, 64, 40))]
    masks = rng.integers(1, 256, len(offsets)).tolist()
    res = in_child(_flip_all, path, offsets, masks)
    assert res.kind == "ok", res
    assert sum(res.value.values()) == len(offsets)
    assert res.value["typed"] > 0  # the flips did reach the reader


# -- crafted bookkeeping files ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["errors.jsonl", "_keys.bin", "_index.npy", "image.npy", "manifest.json"])
@pytest.mark.parametrize("to", ["/dev/zero", "fifo", "dangling", "directory"])
def test_special_files_in_a_store_are_refused_never_read(tmp_path, name, to):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    p = os.path.join(path, name)
    os.unlink(p)
    if to == "fifo":
        os.mkfifo(p)
    elif to == "directory":
        os.mkdir(p)
    else:
        os.symlink("/dev/zero" if to == "/dev/zero" else os.path.join(path, "gone"), p)
    res = in_child(_read_everything, path, timeout=60)  # a FIFO read would hang, /dev/zero fill memory
    assert res.kind == "raised" and res.value[0] in ("FormatError", "IncompleteStoreError"), res
    kind = {"/dev/zero": "symbolic link", "dangling": "symbolic link", "fifo": "FIFO", "directory": "directory"}[to]
    assert f"{name}: is a {kind}" in res.value[1] or f"{name}: is {kind}" in res.value[1], res.value[1]


def test_a_symlinked_data_file_is_refused_even_when_it_points_to_a_good_copy(tmp_path):
    path = write_store(str(tmp_path / "s"), N)
    os.rename(os.path.join(path, "image.npy"), str(tmp_path / "image.npy"))
    os.symlink(str(tmp_path / "image.npy"), os.path.join(path, "image.npy"))
    with pytest.raises(FormatError, match="image.npy: is a symbolic link; a store's files must be regular"):
        mmstore.open(path)


@pytest.mark.parametrize("change", [
    {"slots": 2**61}, {"records": 2**64}, {"slots": 2**63 + 5},
    {"schema.image": [2**32, 2**32, 1]}, {"schema.image": [2**61, 8]}, {"schema.label": [2**62]},
])
def test_sizes_that_overflow_are_refused(tmp_path, change):
    path = write_store(str(tmp_path / "s"), N)

    def apply(m):
        for k, v in change.items():
            if k.startswith("schema."):
                next(f for f in m["schema"] if f["name"] == k[7:])["shape"] = v
            else:
                m[k] = v

    edit_manifest(path, apply)
    with pytest.raises(FormatError, match="manifest"):
        mmstore.open(path)


def test_a_128_byte_file_with_an_overflowing_shape_is_not_a_store(tmp_path):
    """Was: slots 2**61 and shape [2**32, 2**32, 1] wrapped to 0 bytes; a
    128-byte .npy (its header only) opened and verify --quick said OK."""
    path = write_store(str(tmp_path / "s"), N)
    edit_manifest(path, lambda m: m["schema"][0].update(shape=[2**32, 2**32, 1]))
    hdr = npy_header(np.dtype("|u1"), (N, 2**32, 2**32, 1))
    with open(tmp_path / "x.npy", "wb") as fh:
        fh.write(hdr)
    with pytest.raises(FormatError, match="expected"):
        check_npy(str(tmp_path / "x.npy"), np.dtype("|u1"), (N, 2**32, 2**32, 1))
    with pytest.raises(FormatError):
        mmstore.open(path)


def test_huge_json_integers_are_format_errors(tmp_path):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    with open(os.path.join(path, "manifest.json"), "rb") as fh:
        raw = good = fh.read()
    raw = raw.replace(b'"records": ', b'"records": ' + b"9" * 5000 + b', "x": ', 1)
    _set_manifest(path, raw)
    with pytest.raises(FormatError, match="not valid UTF-8 JSON"):
        mmstore.open(path)
    _set_manifest(path, good)
    rewrite_file(path, "errors.jsonl", b'{"slot": ' + b"1" * 5000 + b', "key": "k", "reason": "r"}\n')
    with pytest.raises(FormatError, match="errors.jsonl: line 1 is not JSON"):
        mmstore.open(path).skipped()


@pytest.mark.parametrize("line", [b"[1, 2]", b'{"slot": "3", "key": "k", "reason": "r"}', b'{"slot": 99, "key": "k", '
                                  b'"reason": "r"}', b'{"slot": 3}', b"null", b"[" * 5000])
def test_malformed_errors_jsonl_entries_are_format_errors(tmp_path, line):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    rewrite_file(path, "errors.jsonl", line + b"\n")
    with pytest.raises(FormatError, match="errors.jsonl: line 1"):
        mmstore.open(path).skipped()


def test_errors_jsonl_is_read_only_up_to_its_listed_size(tmp_path):
    path = write_store(str(tmp_path / "s"), N, holes=HOLES)
    store = mmstore.open(path)
    with open(os.path.join(path, "errors.jsonl"), "ab") as fh:  # grows after open
        fh.write(b"x" * 100000)
    with pytest.raises(FormatError):  # the file is not the one opened (size, mtime)
        store.skipped()


# -- typed errors -------------------------------------------------------------------------
def test_store_path_is_a_regular_file(tmp_path):
    f = tmp_path / "train.store"
    f.write_bytes(b"not a store")
    with pytest.raises(IncompleteStoreError, match="is a file, not a store"):
        mmstore.open(str(f))
    with pytest.raises(IncompleteStoreError):
        mmstore.open(str(f / "inner"))


def test_dangling_symlinked_data_file(tmp_path, backend):
    path = write_store(str(tmp_path / "s"), N, backend=backend)
    name = "records.mdb" if backend == "lmdb" else "label.npy"
    os.unlink(os.path.join(path, name))
    os.symlink(os.path.join(path, "nowhere"), os.path.join(path, name))
    with pytest.raises(FormatError, match=f"{name}: is a symbolic link"):
        mmstore.open(path)


@pytest.mark.parametrize("name", ["image.npy", "manifest.json", "_keys.bin"])
def test_permission_denied_on_a_store_file_is_typed(tmp_path, name):
    path = write_store(str(tmp_path / "s"), N)
    os.chmod(os.path.join(path, name), 0)
    code = (
        "import mmstore, sys\n"
        "from mmstore.errors import StoreAccessError\n"
        "try:\n    mmstore.open(sys.argv[1])\n"
        "except StoreAccessError as e:\n    print('TYPED', e); sys.exit(0)\n"
        "print('OPENED'); sys.exit(1)\n"
    )
    pre = drop_dac_override if os.geteuid() == 0 else None
    p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=cli_env(),
                       preexec_fn=pre, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"{name}: permission denied" in p.stdout
