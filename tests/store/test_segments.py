"""Segmented stores (format 1.1) made by ``merge``: they read exactly like the
single store of the same records, share the parts' inodes, and every tool
handles them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compare import BOOKKEEPING, assert_reads_same
from support.faults import CRASHED, run_forked
from support.stores import write_parts, write_store

import mmstore
from mmstore.check.verify import verify_store
from mmstore.errors import DestinationError, FormatError, IngestError, LockedError, StoreExistsError
from mmstore.format.manifest import parse_manifest
from mmstore.ingest import merge
from mmstore.store.writer import acquire_lock

BACKENDS = ["memmap", "lmdb"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data_region(path: str) -> bytes:
    with open(path, "rb") as fh:
        raw = fh.read()
    return raw[int.from_bytes(raw[8:10], "little") + 10 :]


@st.composite
def layouts(draw):
    n = draw(st.integers(0, 40))
    cuts = draw(st.lists(st.integers(0, n), max_size=5))
    holes = draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n // 3)) if n else set()
    return n, sorted(cuts), holes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts(), backend=st.sampled_from(["memmap", "lmdb"]))
def test_merged_reads_like_single_store(layout, backend):
    """Any cut of any store (empty parts, holes at the edges) merges into a
    store that reads like the single one, bookkeeping byte-identical."""
    n, cuts, holes = layout
    with tempfile.TemporaryDirectory() as tmp:
        ref = write_store(os.path.join(tmp, "ref"), n, backend=backend, holes=holes)
        parts = write_parts(tmp, n, cuts, backend=backend, holes=holes)
        out = merge(parts, os.path.join(tmp, "merged"))
        assert_reads_same(ref, out)
        s = mmstore.open(out)
        assert s.segments == [mmstore.open(p).slots for p in parts]
        assert s.manifest["version"] == (1, 1)
        if backend == "memmap":
            # each segment is the same slot range of the single store's file
            for f in s.fields:
                joined = b"".join(_data_region(os.path.join(out, f"{f}.{k:05d}.npy")) for k in range(len(parts)))
                assert joined == _data_region(os.path.join(ref, f"{f}.npy"))
        assert verify_store(out).ok


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_record_data_is_copied(tmp_path, backend):
    """The segments are the parts' inodes; only bookkeeping is new; deleting the
    parts leaves the merged store whole."""
    parts = write_parts(tmp_path, 30, [9, 20], backend=backend, holes={3, 20})
    ref = write_store(tmp_path / "ref", 30, backend=backend, holes={3, 20})
    out = merge(parts, tmp_path / "m")
    names = sorted(os.listdir(out))
    data_names = [n for n in names if n not in BOOKKEEPING and n != "manifest.json"]
    assert len(data_names) == 3 * (3 if backend == "memmap" else 1)
    for k, p in enumerate(parts):
        for src in mmstore.open(p).slot_view.backend.data_paths():
            base = os.path.basename(src)
            dst = os.path.join(out, base.replace(".npy", f".{k:05d}.npy").replace(".mdb", f".{k:05d}.mdb"))
            assert os.stat(src).st_ino == os.stat(dst).st_ino and os.stat(dst).st_nlink == 2
    for name in BOOKKEEPING:
        if os.path.exists(os.path.join(out, name)):
            assert os.stat(os.path.join(out, name)).st_nlink == 1
    for p in parts:
        import shutil

        shutil.rmtree(p)
    assert_reads_same(ref, out)
    assert verify_store(out).ok


def test_merged_stores_merge_again(tmp_path):
    """A part that is itself merged contributes its segments."""
    a = write_parts(tmp_path / "a", 20, [5, 12], holes={0})
    ab = merge(a, tmp_path / "ab")
    b = write_parts(tmp_path / "b", 0, [])  # an empty store
    c = mmstore.StoreWriter(tmp_path / "c", mmstore.open(ab).schema, slots=0)
    c.close()
    out = merge([ab, b[0], str(tmp_path / "c")], tmp_path / "all")
    assert mmstore.open(out).segments == [5, 7, 8, 0, 0]
    assert_reads_same(write_store(tmp_path / "ref", 20, holes={0}), out)


def test_manifest_segments_validated(tmp_path):
    parts = write_parts(tmp_path, 10, [4])
    out = merge(parts, tmp_path / "m")
    with open(os.path.join(out, "manifest.json"), "rb") as fh:
        obj = json.loads(fh.read())
    assert obj["version"] == [1, 1] and obj["segments"] == [4, 6]
    with open(os.path.join(parts[0], "manifest.json"), "rb") as fh:
        plain = json.loads(fh.read())
    assert plain["version"] == [1, 0] and "segments" not in plain
    for bad, msg in [([4, 5], "add up to 9"), ([], "non-empty"), ([4, -1, 7], "non-empty list"), ("10", "list")]:
        o = dict(obj, segments=bad)
        with pytest.raises(FormatError, match=msg):
            parse_manifest(json.dumps(o).encode())
    with pytest.raises(FormatError, match="needs format version 1.1"):
        parse_manifest(json.dumps(dict(obj, version=[1, 0])).encode())
    # a segment file missing or of the wrong size: refused on open, named
    os.truncate(os.path.join(out, "image.00001.npy"), 100)
    with pytest.raises(FormatError, match="image.00001.npy"):
        mmstore.open(out)


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_finds_damage_in_a_segment_at_its_global_slot(tmp_path, backend):
    parts = write_parts(tmp_path, 40, [13, 25], backend=backend, holes={14})
    out = merge(parts, tmp_path / "m")
    assert verify_store(out).ok
    s = mmstore.open(out)
    if backend == "memmap":
        seg = s.slot_view.backend.field_segments("image")[2]
        assert (seg.first, seg.count) == (25, 15)
        with open(seg.path, "r+b") as fh:  # slot 30 = row 5 of segment 2
            fh.seek(seg.offset + 5 * seg.entry_bytes + 3)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x10]))
        rep = verify_store(out)
        assert [(r.slot, r.key, r.what) for r in rep.bad_records] == [(30, "in/00030.jpg", "checksum")]
        # the part shares the inode: it is damaged the same way, at its local slot
        assert [r.slot for r in verify_store(parts[2]).bad_records] == [5]
    else:
        import lmdb

        env = lmdb.open(os.path.join(out, "records.00001.mdb"), subdir=False, lock=False, map_size=1 << 26)
        with env.begin(write=True) as txn:  # a new value for local slot 2 (= slot 15); a stray key
            txn.put((2).to_bytes(8, "big"), bytes(s.schema.record_bytes))
            txn.put((99).to_bytes(8, "big"), bytes(s.schema.record_bytes))
        env.close()
        files = dict(s.manifest["files"])
        files["records.00001.mdb"] = os.path.getsize(os.path.join(out, "records.00001.mdb"))
        _rewrite_manifest(out, files=files)
        rep = verify_store(out)
        got = sorted((r.slot, r.what) for r in rep.bad_records)
        assert got == [(-1, "extra-key"), (15, "checksum")], got
        assert any("records.00001.mdb" in r.found for r in rep.bad_records if r.what == "extra-key")


def _rewrite_manifest(store: str, **changes) -> None:
    p = os.path.join(store, "manifest.json")
    with open(p, "rb") as fh:
        obj = json.loads(fh.read())
    obj.update(changes)
    with open(p, "w") as fh:
        json.dump(obj, fh)


def test_refusals(tmp_path):
    parts = write_parts(tmp_path, 10, [5])
    with pytest.raises(DestinationError, match="is the input"):
        merge(parts, parts[0])
    out = merge(parts, tmp_path / "m")
    with pytest.raises(StoreExistsError, match="already exists"):
        merge(parts, out)
    merge(parts, out, overwrite=True)
    lm = write_parts(tmp_path / "l", 10, [], backend="lmdb")
    with pytest.raises(IngestError, match="lmdb store, but"):
        merge([parts[0], lm[0]], tmp_path / "mixed")
    other = write_store(tmp_path / "other", 5, schema={"x": ("<f4", (2,))},
                        make=lambda i: {"x": np.zeros(2, np.float32)})
    with pytest.raises(IngestError, match="schema"):
        merge([parts[0], other], tmp_path / "x")
    # a writer holds the destination
    fd = acquire_lock(str(tmp_path / "busy"))
    try:
        with pytest.raises(LockedError):
            merge(parts, tmp_path / "busy")
    finally:
        os.close(fd)
    # an unfinished ingest's .partial is not thrown away
    os.makedirs(tmp_path / "inflight.partial")
    (tmp_path / "inflight.partial" / "_ingest.json").write_text("{}")
    with pytest.raises(StoreExistsError, match="unfinished ingest"):
        merge(parts, tmp_path / "inflight")
    assert (tmp_path / "inflight.partial" / "_ingest.json").exists()
    # a destination in folders that do not exist yet, like ingest
    assert mmstore.open(merge(parts, tmp_path / "new" / "dir" / "m")).records == 10


def _other_device_dir() -> str | None:
    here = tempfile.gettempdir()
    for cand in ("/dev/shm", "/run/shm"):
        if os.path.isdir(cand) and os.access(cand, os.W_OK) and os.stat(cand).st_dev != os.stat(here).st_dev:
            return cand
    return None


def test_across_file_systems_refused_then_copied(tmp_path):
    """Parts on another file system: hard links fail with EXDEV; merge says so
    and leaves nothing; --copy copies the files (separate inodes)."""
    other = _other_device_dir()
    if other is None:
        pytest.skip("no second writable file system (tmpfs /dev/shm) on this machine")
    with tempfile.TemporaryDirectory(dir=other) as remote:
        parts = write_parts(remote, 25, [10], holes={11})
        dest = tmp_path / "m"
        with pytest.raises(IngestError, match="--copy"):
            merge(parts, dest)
        assert not dest.exists() and not os.path.exists(str(dest) + ".partial")
        out = merge(parts, dest, copy=True)
        assert (os.stat(os.path.join(out, "image.00000.npy")).st_ino
                != os.stat(os.path.join(parts[0], "image.npy")).st_ino)
        assert_reads_same(write_store(tmp_path / "ref", 25, holes={11}), out)
        assert verify_store(out).ok


def test_killed_merge_leaves_no_store_and_reruns(tmp_path):
    """Die at every crash point (each fsync, link step and rename) of a merge:
    no DEST, or a complete one; rerunning the merge gives the full store."""
    parts = write_parts(tmp_path, 30, [8, 8, 21], holes={2, 29})
    ref = write_store(tmp_path / "ref", 30, holes={2, 29})
    k = 0
    while True:
        k += 1
        dest = str(tmp_path / f"m{k}")
        # a forked child (no new interpreter per crash point) dies at the k-th point
        rc = run_forked(["merge", *parts, dest, "--quiet"], crash=f"any:{k}")
        if rc == 0:
            break
        assert rc == CRASHED, f"crash point {k}: exit {rc} (MMSTORE_FAULT_DEBUG=FILE keeps the traceback)"
        assert not os.path.exists(os.path.join(dest, "manifest.json")) or os.path.exists(dest)
        if os.path.exists(dest):  # died after the rename: it is complete
            assert_reads_same(ref, dest)
            continue
        merge(parts, dest)  # the rerun clears its own left-over .partial
        assert_reads_same(ref, dest)
        assert not os.path.exists(dest + ".partial")
    assert k > 8  # the walk really passed the link, bookkeeping and publish steps
    assert_reads_same(ref, dest)


_FD_CHILD = r"""
import os, resource, sys
soft, hard = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
import numpy as np
import mmstore
from mmstore.errors import ResourceLimitError
from mmstore.ingest import merge
from mmstore.check.verify import verify_store
parts = [os.path.join(sys.argv[3], n) for n in sorted(os.listdir(sys.argv[3]), key=lambda n: int(n[4:]))]
out = merge(parts, sys.argv[4])          # streams the parts: a few descriptors at a time
print("verify", verify_store(out).ok)    # one segment's files open at a time
s = mmstore.open(out)
try:
    got = s.read_batch(np.arange(len(s)))  # all 3 fields of every segment mapped
    print("read", len(got["image"]), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
except ResourceLimitError as exc:
    print("limit", exc)
"""


@pytest.mark.parametrize("hard", [200, 4096])
def test_many_segments_and_the_open_files_limit(tmp_path, hard):
    """120 segments x 3 fields = 360 mapped files under a soft limit of 200:
    merge and verify work anyway; reading raises the soft limit when the
    hard one allows, and otherwise says which limit and how to raise it."""
    n = 240
    write_parts(tmp_path / "parts", n, list(range(2, n, 2)))
    r = subprocess.run([sys.executable, "-c", _FD_CHILD, "200", str(hard), str(tmp_path / "parts"),
                        str(tmp_path / "m")], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "verify True"
    if hard == 200:
        assert lines[1].startswith("limit ") and "120 segments" in lines[1] and "ulimit -n" in lines[1]
        assert "mmstore convert" in lines[1] and "PLAIN.store --backend memmap" in lines[1]
    else:
        assert lines[1].split()[:2] == ["read", str(n)] and int(lines[1].split()[2]) > 360
    assert_reads_same(write_store(tmp_path / "ref", n), str(tmp_path / "m"))


def test_a_part_recreated_during_the_merge_is_caught(tmp_path, monkeypatch):
    """A part re-written by another process while the merge runs (its new data
    would sit under its old checksums) stops the merge; nothing is published."""
    import importlib

    M = importlib.import_module("mmstore.ingest.merge")  # the module (the package exports the function)
    parts = write_parts(tmp_path, 20, [10])
    real = M._copy_range
    done = []

    def racing(*a, **kw):
        if not done:
            done.append(1)
            write_store(parts[1], 10, overwrite=True)  # a concurrent re-ingest of part 1
        return real(*a, **kw)

    monkeypatch.setattr(M, "_copy_range", racing)
    with pytest.raises(IngestError, match="changed while it was being merged"):
        merge(parts, tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_left_over_partials(tmp_path):
    """An empty DEST.partial, or one a killed merge was discarding, is cleared."""
    parts = write_parts(tmp_path, 12, [6])
    os.makedirs(tmp_path / "m.partial")
    os.makedirs(tmp_path / "m.partial.discard-1234abcd" / "sub")
    assert_reads_same(write_store(tmp_path / "ref", 12), merge(parts, tmp_path / "m"))
    assert sorted(os.listdir(tmp_path)) == ["m", "part0", "part1", "ref"]


def test_provenance_of_unrelated_parts_names_no_source(tmp_path):
    """Stores that are not the shards of one ingest: the merged store does not
    claim the first part's source or fingerprint (resume/repair would use it)."""
    a = write_store(tmp_path / "a", 5, provenance={"source": {"kind": "folder", "path": "/x"},
                                                    "ingest": {"fingerprint": "f" * 16}})
    b = write_store(tmp_path / "b", 5, provenance={"source": {"kind": "folder", "path": "/y"}})
    prov = mmstore.open(merge([a, b], tmp_path / "m")).provenance
    assert "source" not in prov and "ingest" not in prov
    assert prov["merged_from"] == [a, b] and len(prov["merged_store_ids"]) == 2


def test_lmdb_segment_errors_name_the_global_slot(tmp_path):
    import lmdb

    out = merge(write_parts(tmp_path, 30, [13], backend="lmdb"), tmp_path / "m")
    env = lmdb.open(os.path.join(out, "records.00001.mdb"), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.delete((2).to_bytes(8, "big"))  # slot 15
    env.close()
    with open(os.path.join(out, "manifest.json"), "rb") as fh:
        files = json.loads(fh.read())["files"]
    files["records.00001.mdb"] = os.path.getsize(os.path.join(out, "records.00001.mdb"))
    _rewrite_manifest(out, files=files)
    with pytest.raises(FormatError, match=r"records.00001.mdb: no record for slot 15 \(key 2 of this segment\)"):
        mmstore.open(out)[15]
    assert mmstore.open(out)[14]["image"].shape == (8, 6, 3)


def test_lmdb_repair_rebuilds_only_the_damaged_segment(tmp_path):
    """Keys that are not records (a stray key, a record in a hole) in one
    segment: repair drops them by rebuilding that segment's file only; the
    others stay shared with their parts."""
    import lmdb

    from mmstore.check.repair import repair_store

    parts = write_parts(tmp_path, 30, [10, 20], backend="lmdb", holes={12})
    ref = write_store(tmp_path / "ref", 30, backend="lmdb", holes={12})
    out = merge(parts, tmp_path / "m")
    rb = mmstore.open(out).schema.record_bytes
    env = lmdb.open(os.path.join(out, "records.00001.mdb"), subdir=False, lock=False, map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put((2).to_bytes(8, "big"), bytes(rb))   # slot 12 is a hole
        txn.put((77).to_bytes(8, "big"), bytes(rb))  # no such slot
    env.close()
    with open(os.path.join(out, "manifest.json"), "rb") as fh:
        files = json.loads(fh.read())["files"]
    files["records.00001.mdb"] = os.path.getsize(os.path.join(out, "records.00001.mdb"))
    _rewrite_manifest(out, files=files)
    rep = verify_store(out)
    assert sorted((r.slot, r.what) for r in rep.bad_records) == [(-1, "extra-key"), (12, "hole-has-record")]
    rr = repair_store(out, rep)
    assert "dropped 2" in rr.message, rr.message
    assert verify_store(out).ok
    assert_reads_same(ref, out)
    nl = [os.stat(os.path.join(out, f"records.{k:05d}.mdb")).st_nlink for k in range(3)]
    assert nl == [2, 1, 2]


def test_disk_full_during_merge(tmp_path):
    """The bookkeeping write fails (RLIMIT_FSIZE in the child: EFBIG, as a full
    disk gives ENOSPC): a clear message, exit 1, no DEST and no .partial;
    the same merge succeeds once there is room."""
    parts = write_parts(tmp_path, 3000, [1000, 2000])
    dest = str(tmp_path / "m")
    code = ("import resource, sys, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (16384, 16384)); "
            "from mmstore.cli import main; sys.exit(main(['merge', *sys.argv[1:]]))")
    r = subprocess.run([sys.executable, "-c", code, *parts, dest], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "File too large" in r.stderr and "nothing was created" in r.stderr and "run the merge again" in r.stderr
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")
    assert_reads_same(write_store(tmp_path / "ref", 3000), merge(parts, dest))
