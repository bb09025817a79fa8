"""One contract for every backend: the same tests run on plain memmap and
LMDB stores and on merged (segmented) stores of both, through the public
read API and the backend interface (``mmstore.store.backends.base``)."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
from support.compare import assert_reads_same, assert_same_files
from support.stores import SMALL_SCHEMA, sample, write_store

import mmstore
from mmstore.ingest import merge

KINDS = ["memmap", "lmdb", "memmap-merged", "lmdb-merged"]


def expected(slots, fields=None):
    recs = [sample(s) for s in slots]
    names = fields or list(SMALL_SCHEMA)
    return {k: np.stack([r[k] for r in recs]) if recs else None for k in names}


def default_key(s):
    return f"in/{s:05d}.jpg"


def build(path, kind, n, holes=(), order=None, schema=SMALL_SCHEMA, make=sample, key=default_key):
    """A store of ``kind`` holding ``make(s)`` under ``key(s)`` at slots
    ``0..n-1`` (``holes`` skipped), written in ``order`` (default ascending).
    A merged kind is merged from parts cut at n/3, n/3 (an empty part) and
    2n/3, so it reads like the plain store of the same records."""
    backend, merged = kind.split("-")[0], kind.endswith("-merged")
    path = str(path)
    bounds = [0, n // 3, n // 3, 2 * n // 3, n] if merged else [0, n]
    order = list(range(n)) if order is None else list(order)
    parts = []
    if merged:
        os.makedirs(path + ".parts")
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        p = os.path.join(path + ".parts", f"part{k}") if merged else path
        with mmstore.StoreWriter(p, schema, slots=hi - lo, backend=backend) as w:
            for s in (s for s in order if lo <= s < hi):
                if s in holes:
                    w.skip(s - lo, key(s), f"corrupt: test hole {s}")
                else:
                    w.write(s - lo, make(s), key=key(s))
        parts.append(p)
    return merge(parts, path) if merged else path


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


class TestBackendContract:
    """Every test runs once per kind of store (see ``KINDS``)."""

    def make(self, kind, tmp_path, n=40, holes=(), **kw):
        return build(os.path.join(tmp_path, f"{kind}.store"), kind, n, holes=holes, **kw)

    def test_reads_every_record(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        assert len(s) == 40 and s.fields == ("image", "label", "score")
        for i in range(40):
            rec = s[i]
            for k, v in sample(i).items():
                np.testing.assert_array_equal(rec[k], v)
            assert s.key(i) == f"in/{i:05d}.jpg"

    def test_batch_any_order_duplicates_negatives(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        idx = [5, 3, 3, -1, 0, 39, 5, -40]
        b = s.read_batch(idx)
        exp = expected([i % 40 for i in idx])
        for k in SMALL_SCHEMA:
            np.testing.assert_array_equal(b[k], exp[k])

    def test_slices_arrays_and_fields(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        b = s[10:20:3]
        np.testing.assert_array_equal(b["label"], expected(range(10, 20, 3))["label"])
        b = s[np.array([7, 2])]
        np.testing.assert_array_equal(b["image"], expected([7, 2])["image"])
        b = s.read_batch([4, 1], fields=["score"])
        assert list(b) == ["score"]
        np.testing.assert_array_equal(b["score"], expected([4, 1])["score"])
        np.testing.assert_array_equal(s.column("label"), np.arange(40) % 7)

    def test_out_buffers_filled_in_place(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        out = {"image": np.full((3, 8, 6, 3), 9, np.uint8), "label": np.zeros(3, np.int64)}
        got = s.read_batch([30, 1, 30], fields=["image", "label"], out=out)
        assert got["image"] is out["image"]
        np.testing.assert_array_equal(out["image"], expected([30, 1, 30])["image"])
        with pytest.raises(ValueError, match="shape"):
            s.read_batch([1, 2], fields=["label"], out={"label": np.zeros(3, np.int64)})
        with pytest.raises(ValueError, match="dtype"):
            s.read_batch([1], fields=["label"], out={"label": np.zeros(1, np.int32)})
        with pytest.raises(ValueError, match="C-contiguous"):
            s.read_batch([1, 2], fields=["label"], out={"label": np.zeros(4, np.int64)[::2]})

    def test_index_errors(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        with pytest.raises(IndexError, match="40"):
            s[40]
        with pytest.raises(IndexError):
            s.read_batch([0, -41])
        with pytest.raises(TypeError):
            s.read_batch([0.5])
        with pytest.raises(KeyError, match="nope"):
            s.read_batch([0], fields=["nope"])
        assert {k: v.shape for k, v in s.read_batch([]).items()}["image"] == (0, 8, 6, 3)

    def test_holes_are_skipped_and_reported(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path, n=12, holes=(0, 5, 11)))
        live = [i for i in range(12) if i not in (0, 5, 11)]
        assert len(s) == 9 and s.slots == 12
        np.testing.assert_array_equal(s.slot_view.index, live)
        b = s.read_batch(range(9))
        np.testing.assert_array_equal(b["image"], expected(live)["image"])
        assert [s.key(i) for i in range(9)] == [f"in/{x:05d}.jpg" for x in live]
        sk = s.skipped()
        assert [e["slot"] for e in sk] == [0, 5, 11] and sk[1]["key"] == "in/00005.jpg"
        assert sk[1]["reason"] == "corrupt: test hole 5"
        ck = s.slot_view.checksums()
        assert ck[0] == 0 and ck[5] == 0 and ck[1] != 0

    def test_empty_and_single(self, kind, tmp_path):
        s0 = mmstore.open(build(os.path.join(tmp_path, "zero"), kind, 0))
        assert len(s0) == 0 and s0.read_batch([])["label"].shape == (0,)
        with pytest.raises(IndexError):
            s0[0]
        s1 = mmstore.open(build(os.path.join(tmp_path, "one"), kind, 1))
        np.testing.assert_array_equal(s1[-1]["image"], sample(0)["image"])

    def test_pickle_reopens_by_path(self, kind, tmp_path):
        s = mmstore.open(self.make(kind, tmp_path))
        s.read_batch([1, 2])
        blob = pickle.dumps(s)
        # the path and each file's identity (a few ints), not handles or the 8 kB of data
        assert len(blob) < 500 + 200 * len(s.manifest["files"])
        assert sample(1)["image"].tobytes() not in blob
        t = pickle.loads(blob)
        np.testing.assert_array_equal(t[3]["image"], sample(3)["image"])

    def test_checksums_match_records(self, kind, tmp_path):
        from mmstore._os.io import record_checksum

        s = mmstore.open(self.make(kind, tmp_path, n=6, holes=(2,)))
        ck = s.slot_view.checksums()
        for slot, packed in s.slot_view.backend.iter_packed(0, 6):
            if slot == 2:
                assert ck[slot] == 0
                continue
            assert packed is not None
            rec = sample(slot)
            assert int(ck[slot]) == record_checksum([rec[k] for k in SMALL_SCHEMA])
            import xxhash

            assert int(ck[slot]) == xxhash.xxh3_64_intdigest(bytes(packed))

    def test_non_utf8_keys_round_trip(self, kind, tmp_path):
        raw = os.fsdecode(b"caf\xe9/\xff\xfe.jpg")
        keys = [raw, "ünïcode/猫.jpg", b"\x00bytes\x80"]
        s = mmstore.open(build(os.path.join(tmp_path, "keys"), kind, 3, key=keys.__getitem__))
        assert os.fsencode(s.key(0)) == b"caf\xe9/\xff\xfe.jpg"
        assert s.key(1) == "ünïcode/猫.jpg"
        assert s.slot_view.slot_key_bytes(2) == b"\x00bytes\x80"

    def test_order_of_writes_gives_identical_files(self, kind, tmp_path):
        a = build(os.path.join(tmp_path, "a"), kind, 30, holes=(4, 17))
        rng = np.random.default_rng(1)
        b = build(os.path.join(tmp_path, "b"), kind, 30, holes=(4, 17), order=rng.permutation(30))
        assert_same_files(a, b)

    def test_large_records_take_memmove_path(self, kind, tmp_path):
        schema = {"image": ("|u1", (64, 64, 3)), "label": ("<i8", ())}

        def make(i):
            return {"image": np.full((64, 64, 3), i % 251, np.uint8), "label": np.int64(i)}

        s = mmstore.open(self.make(kind, tmp_path, n=50, schema=schema, make=make))
        idx = np.array([49, 3, 4, 5, 6, 1, 1, 48])
        b = s.read_batch(idx)
        np.testing.assert_array_equal(b["image"][:, 0, 0, 0], idx % 251)
        np.testing.assert_array_equal(b["label"], idx)
        b = s.read_batch(np.arange(10, 30))  # one run (a single memmove per segment)
        np.testing.assert_array_equal(b["image"][:, 5, 5, 1], np.arange(10, 30))

    def test_segments_of_the_interface(self, kind, tmp_path):
        """``segment_backends`` tile the slots in order, each reading its own
        slots as the store's backend reads them at ``first + j``."""
        s = mmstore.open(self.make(kind, tmp_path, n=40, holes=(3, 20)))
        b = s.slot_view.backend
        assert (b.name, b.segmented) == (kind.split("-")[0], kind.endswith("-merged"))
        parts = b.segment_backends()
        assert [p.slots for p in parts] == (s.segments or [s.slots])
        firsts = [p.first or 0 for p in parts]
        assert firsts == np.cumsum([0] + [p.slots for p in parts])[:-1].tolist()
        assert sorted(b.data_paths()) == sorted(q for p in parts for q in p.data_paths())
        assert all(os.path.isfile(q) for q in b.data_paths()) and b.data_paths()
        holes = np.isin(np.arange(40), [3, 20])
        for p, f0 in zip(parts, firsts):
            got = [(f0 + j, None if v is None else bytes(v)) for j, v in p.iter_packed(0, p.slots)]
            want = [(j, None if v is None else bytes(v)) for j, v in b.iter_packed(f0, f0 + p.slots)]
            assert got == want
            assert not p.has_stray_entries(holes[f0 : f0 + p.slots])
        got = {j: bytes(v) for j, v in b.iter_packed(0, 40) if v is not None}
        for j in (0, 13, 14, 39):
            assert got[j] == b"".join(sample(j)[k].tobytes() for k in SMALL_SCHEMA)

    def test_positional_field_locations(self, kind, tmp_path):
        """A positional backend says where every entry is (its bytes are the
        field's, holes zero); any other refuses to, naming the capability."""
        s = mmstore.open(self.make(kind, tmp_path, n=40, holes=(3,)))
        b = s.slot_view.backend
        if not b.positional:
            for call in (b.field_segments, b.array, b.check_mapped):
                with pytest.raises(NotImplementedError, match="positional"):
                    call("image")
            assert kind.startswith("lmdb")
            return
        assert kind.startswith("memmap")
        parts = b.segment_backends()
        for f in s.schema:
            segs = b.field_segments(f.name)
            assert [(g.first, g.count) for g in segs] == [(p.first or 0, p.slots) for p in parts]
            for g, p in zip(segs, parts):
                assert g.entry_bytes == f.nbytes
                arr = p.array(f.name)  # the segment's mapping
                assert arr.shape == (g.count, *f.shape)
                p.check_mapped(f.name)
                with open(g.path, "rb") as fh:
                    for j in range(g.count):
                        fh.seek(g.offset + j * g.entry_bytes)
                        want = sample(g.first + j)[f.name]
                        want = np.zeros_like(want) if g.first + j == 3 else want
                        assert fh.read(g.entry_bytes) == want.tobytes()
                        np.testing.assert_array_equal(arr[j], want)
        if b.segmented:
            with pytest.raises(NotImplementedError, match="segment_backends"):
                b.array("image")


class TestMemmap:
    """What only a plain memmap store does."""

    def make(self, tmp_path, n=40, holes=()):
        return build(os.path.join(tmp_path, "memmap.store"), "memmap", n, holes=holes)

    def test_plain_numpy_opens_every_file(self, tmp_path):
        path = self.make(tmp_path, n=9, holes=(3,))
        for name in SMALL_SCHEMA:
            arr = np.load(os.path.join(path, f"{name}.npy"), mmap_mode="r")
            assert arr.shape[0] == 9
            for s in range(9):
                want = np.zeros_like(sample(s)[name]) if s == 3 else sample(s)[name]
                np.testing.assert_array_equal(arr[s], want)
        ck = np.load(os.path.join(path, "_checksums.npy"), mmap_mode="r")
        np.testing.assert_array_equal(ck, mmstore.open(path).slot_view.checksums())
        ix = np.load(os.path.join(path, "_index.npy"))
        np.testing.assert_array_equal(ix, [0, 1, 2, 4, 5, 6, 7, 8])


class TestLmdb:
    """What only a plain LMDB store does."""

    def make(self, tmp_path, n=40, holes=()):
        return build(os.path.join(tmp_path, "lmdb.store"), "lmdb", n, holes=holes)

    def test_one_file_no_lock_and_readahead_by_size(self, tmp_path):
        path = self.make(tmp_path, n=5)
        assert "records.mdb" in os.listdir(path)
        assert not any(n.endswith("-lock") for n in os.listdir(path))
        assert mmstore.open(path).slot_view.backend.readahead is False  # 200-byte records
        assert mmstore.open(path, lmdb_readahead=True).slot_view.backend.readahead is True

    def test_keys_are_big_endian_slots_values_packed(self, tmp_path):
        import lmdb

        path = self.make(tmp_path, n=4, holes=(2,))
        env = lmdb.open(os.path.join(path, "records.mdb"), subdir=False, readonly=True, lock=False)
        with env.begin() as txn:
            items = list(txn.cursor())
        env.close()
        assert [k for k, _ in items] == [s.to_bytes(8, "big") for s in (0, 1, 3)]
        rec = sample(3)
        assert items[2][1] == rec["image"].tobytes() + rec["label"].tobytes() + rec["score"].tobytes()

    def test_regression_environment_released_when_a_store_is_dropped(self, tmp_path):
        """Bug: a Store dropped without close() kept its LMDB environment (and
        its mapping of the whole file) open for the life of the process."""
        import gc

        import mmstore.store.backends.lmdb as lb

        path = self.make(tmp_path, n=5)
        gc.collect()  # stores of earlier tests left in reference cycles give their share back now, not below
        before = len(lb._ENVS)
        s = mmstore.open(path)
        s[1]
        t = mmstore.open(path)
        t[2]
        assert len(lb._ENVS) == before + 1  # shared
        del s
        gc.collect()
        assert len(lb._ENVS) == before + 1  # t still uses it
        np.testing.assert_array_equal(t[4]["image"], sample(4)["image"])
        del t
        gc.collect()
        assert len(lb._ENVS) == before

    def test_env_registry_threads_open_and_drop_the_same_file(self, tmp_path):
        """Stores of one LMDB file opened and dropped in two threads at once:
        a drop in one thread must never make an open in the other fail with
        py-lmdb's "already open in this process" (the registry is locked)."""
        import threading

        import mmstore.store.backends.lmdb as lb

        path = self.make(tmp_path, n=9)
        want = sample(4)["image"]
        errors, start = [], threading.Barrier(2)

        def churn():
            start.wait()
            try:
                for _ in range(300):
                    s = mmstore.open(path)
                    np.testing.assert_array_equal(s[4]["image"], want)
                    del s  # the last user's drop closes the environment
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert not any(k[1] == os.stat(os.path.join(path, "records.mdb")).st_ino for k in lb._ENVS)

    def test_env_release_from_a_finalizer_inside_the_registry_lock_is_deferred(self, tmp_path):
        """A finalizer may run while its own thread holds the registry lock:
        it queues the release instead of deadlocking, and the holder drains it."""
        import mmstore.store.backends.lmdb as lb

        path = self.make(tmp_path, n=5)
        s = mmstore.open(path)
        s[1]
        key = s.slot_view.backend._env_key
        with lb._registry():
            s.close()  # the release comes while the lock is held by this very thread
            assert key in lb._ENVS and lb._PENDING == [key]
        assert key not in lb._ENVS and lb._PENDING == []

    def test_fork_while_another_thread_holds_the_registry(self, tmp_path):
        """A child forked while another thread of the parent holds the lock
        can still open stores (the lock is renewed in the child)."""
        import threading

        import mmstore.store.backends.lmdb as lb

        path = self.make(tmp_path, n=5)
        held, done = threading.Event(), threading.Event()

        def hold():
            with lb._registry():
                held.set()
                done.wait(30)

        t = threading.Thread(target=hold)
        t.start()
        held.wait(30)
        try:
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    code = 0 if int(mmstore.open(path)[3]["label"]) == int(sample(3)["label"]) else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
        finally:
            done.set()
            t.join()
        assert os.waitstatus_to_exitcode(status) == 0

    def test_many_records_across_transactions(self, tmp_path):
        path = write_store(os.path.join(tmp_path, "many"), 2500, "lmdb", holes=(0, 1024, 2499))
        s = mmstore.open(path)
        assert len(s) == 2497
        np.testing.assert_array_equal(s.column("label"),
                                      np.array([i % 7 for i in range(2500) if i not in (0, 1024, 2499)]))


def test_memmap_equals_lmdb(tmp_path):
    a = mmstore.open(write_store(os.path.join(tmp_path, "m"), 25, "memmap", holes=(3,)))
    b = mmstore.open(write_store(os.path.join(tmp_path, "l"), 25, "lmdb", holes=(3,)))
    idx = np.random.default_rng(0).integers(-24, 24, 100)
    ra, rb = a.read_batch(idx), b.read_batch(idx)
    for k in SMALL_SCHEMA:
        np.testing.assert_array_equal(ra[k], rb[k])
    np.testing.assert_array_equal(a.slot_view.checksums(), b.slot_view.checksums())


@pytest.mark.parametrize("kind", KINDS[1:])
def test_every_kind_reads_like_plain_memmap(tmp_path, kind):

    ref = build(os.path.join(tmp_path, "ref"), "memmap", 25, holes=(3, 24))
    assert_reads_same(ref, build(os.path.join(tmp_path, "other"), kind, 25, holes=(3, 24)))


def _make_hole_non_zero(path, slot):
    """Put non-zero bytes where hole ``slot`` is (the file's own way)."""
    s = mmstore.open(path)
    if s.slot_view.backend.name == "memmap":
        seg = next(g for g in s.slot_view.backend.field_segments("image") if g.first <= slot < g.first + g.count)
        with open(seg.path, "r+b") as fh:
            fh.seek(seg.offset + (slot - seg.first) * seg.entry_bytes)
            fh.write(b"\xff" * seg.entry_bytes)
        return
    import json

    import lmdb

    part = next(p for p in s.slot_view.backend.segment_backends() if (p.first or 0) <= slot < (p.first or 0) + p.slots)
    env = lmdb.open(os.path.join(path, part.file), subdir=False, lock=False, map_size=1 << 26)
    with env.begin(write=True) as txn:
        txn.put((slot - (part.first or 0)).to_bytes(8, "big"), b"\x01" * s.schema.record_bytes)
    env.close()
    with open(os.path.join(path, "manifest.json"), "rb") as fh:
        obj = json.loads(fh.read())
    obj["files"][part.file] = os.path.getsize(os.path.join(path, part.file))
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(obj, fh)


@pytest.mark.parametrize("kind", KINDS)
def test_a_backend_without_capabilities_is_served_by_the_interface_alone(tmp_path, kind, monkeypatch):
    """A new backend that declares no capability (neither positional nor
    read in child processes): verify checks it through its own ``check`` and
    ``iter_packed``, repair rebuilds its segments through ``write_layout`` and
    ``finalize``, doctor measures it by file reads. Simulated by switching the
    two backends' capabilities off."""
    import mmstore.check.repair as repair_mod
    import mmstore.check.verify as verify_mod
    import mmstore.check.verify_structure as structure_mod
    from mmstore.check.doctor import doctor_store
    from mmstore.check.repair import repair_store
    from mmstore.check.verify import verify_store
    from mmstore.store.backends import LmdbBackend, MemmapBackend

    monkeypatch.setattr(MemmapBackend, "positional", False)
    monkeypatch.setattr(LmdbBackend, "crashes_on_damage", False)
    calls = []
    for mod, name in ((verify_mod, "_content_packed"), (structure_mod, "_check_with_backend"),
                      (repair_mod, "_rebuild_segments")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    path = build(os.path.join(tmp_path, "s"), kind, 30, holes=(4, 21))
    ref = build(os.path.join(tmp_path, "ref"), kind.split("-")[0], 30, holes=(4, 21))
    rep = verify_store(path)
    assert rep.ok and rep.content_checked and rep.problems == []
    rb = mmstore.open(path).schema.record_bytes
    assert rep.checked_bytes == (30 if kind.startswith("memmap") else 28) * rb  # memmap holes are zero entries
    _make_hole_non_zero(path, 21)
    rep = verify_store(path)
    assert [(b.slot, b.what) for b in rep.bad_records] == [(21, "hole-not-zero")] and rep.problems == []
    rr = repair_store(path, rep)
    assert rr.attempted and rr.repaired == [21], rr.message
    assert verify_store(path).ok
    assert calls == ["_check_with_backend", "_content_packed"] * 2 + ["_rebuild_segments"] + \
        ["_check_with_backend", "_content_packed"]

    assert_reads_same(ref, path)
    assert not any(n.startswith(".repair-") for n in os.listdir(path))
    doc = doctor_store(path, samples=8, threads=2, budget_s=0.5, seq_bytes=1 << 16)
    assert doc.backend == kind.split("-")[0] and doc.cold_sample == 8
    assert any("random record-sized reads" in n for n in doc.notes), doc.notes


@pytest.mark.parametrize("kind", ["memmap", "memmap-merged", "lmdb", "lmdb-merged"])
def test_stored_entry_bytes_is_known_from_the_manifest_or_measured(tmp_path, kind):
    """``BackendReader.stored_entry_bytes``: the entries' total from the file
    sizes where the backend knows it (memmap, also merged), None where the
    entries must be measured (lmdb); the Store's mean stored bytes agree
    with the entries' own sizes either way (one record in 3 a hole)."""
    from support.stores import compact_store

    n = 30
    cuts = [10, 20] if kind.endswith("merged") else None
    path = compact_store(str(tmp_path / "s"), n, backend=kind.split("-")[0], holes=range(0, n, 3), cuts=cuts)
    with mmstore.open(path) as s:
        sizes = s.slot_view.entry_sizes("image")
        total = s.slot_view.backend.stored_entry_bytes("image")
        assert total == (int(sizes.sum()) if kind.startswith("memmap") else None)
        assert s.stored_record_bytes("image") == round(sizes.mean())
        assert s.stored_record_bytes() == round(sizes.mean()) + s.schema["label"].nbytes + s.schema["box"].nbytes
