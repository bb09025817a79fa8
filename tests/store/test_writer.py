"""StoreWriter: validation, atomic publish, locking, resume, disk full."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.compare import assert_same_files
from support.stores import SMALL_SCHEMA, sample, write_store

import mmstore
from mmstore.errors import LockedError, SchemaError, StoreExistsError


def test_schema_validation_names_the_field(store_dir):
    with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=1) as w:
        with pytest.raises(SchemaError, match="'image'.*shape"):
            w.write(0, {**sample(0), "image": np.zeros((8, 6), np.uint8)})
        with pytest.raises(SchemaError, match="'label'.*change values"):
            w.write(0, {**sample(0), "label": 2.5})
        with pytest.raises(SchemaError, match="'image'.*change values"):
            w.write(0, {**sample(0), "image": np.full((8, 6, 3), 300, np.int64)})
        with pytest.raises(SchemaError, match="unknown field"):
            w.write(0, {**sample(0), "extra": 1})
        with pytest.raises(SchemaError, match="lacks field 'score'"):
            w.write(0, {"image": sample(0)["image"], "label": 1})
        with pytest.raises(IndexError):
            w.write(1, sample(0))
        # lossless conversions are accepted
        w.write(0, {"image": sample(0)["image"].astype(np.int64), "label": 3, "score": [0.5, 1]})
    s = mmstore.open(store_dir)
    assert s[0]["label"] == 3 and s[0]["image"].dtype == np.uint8


def test_bad_schemas():
    for bad in ({}, {"_x": ("<f4", ())}, {"a/b": ("<f4", ())}, {"a": ("O", ())}, {"a": ("<U3", ())},
                {"a": ("<f4", (-1,))}, {"a": "nonsense"}):
        with pytest.raises(SchemaError):
            mmstore.Schema(bad)


def test_big_endian_dtype_is_normalised(store_dir):
    with mmstore.StoreWriter(store_dir, {"x": (">i4", (2,))}, slots=1) as w:
        w.write(0, {"x": np.array([1, -2], ">i4")})
    s = mmstore.open(store_dir)
    assert s.schema["x"].dtype.str == "<i4"
    np.testing.assert_array_equal(s[0]["x"], [1, -2])


def test_exception_inside_with_publishes_nothing(store_dir):
    with pytest.raises(ZeroDivisionError):
        with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=2) as w:
            w.write(0, sample(0))
            _ = 1 / 0
    assert not os.path.exists(store_dir)
    assert os.path.isdir(store_dir + ".partial")
    assert not os.path.exists(os.path.join(store_dir + ".partial", "manifest.json"))


def test_unwritten_slot_refused_at_close(store_dir):
    with pytest.raises(SchemaError, match="never written"):
        with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=3) as w:
            w.write(0, sample(0))
            w.write(2, sample(2))
    assert not os.path.exists(store_dir)


def test_refuses_existing_store_unless_overwrite(store_dir):
    write_store(store_dir, 3)
    with pytest.raises(StoreExistsError, match="overwrite"):
        mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=3)
    write_store(store_dir, 5, overwrite=True)
    assert len(mmstore.open(store_dir)) == 5
    assert not [n for n in os.listdir(os.path.dirname(store_dir)) if "replaced" in n or n.endswith(".lock")]


def test_partial_needs_resume_or_overwrite(store_dir):
    with pytest.raises(RuntimeError):
        with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=4) as w:
            w.write(0, sample(0))
            w.write(1, sample(1))
            raise RuntimeError
    with pytest.raises(StoreExistsError, match="resume"):
        mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=4)
    with pytest.raises(StoreExistsError, match="another schema"):
        mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=5, resume=True)
    with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=4, resume=True) as w:
        w.mark_written([0, 1])  # kept from the first run
        w.set_key(0, "in/00000.jpg")
        w.set_key(1, "in/00001.jpg")
        w.write(2, sample(2), key="in/00002.jpg")
        w.write(3, sample(3), key="in/00003.jpg")
    assert_same_files(store_dir, write_store(store_dir + "-ref", 4))


def test_second_writer_is_refused_and_dead_lock_holder_is_not_forever(store_dir):
    w = mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=1)
    with pytest.raises(LockedError, match="another process"):
        mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=1, overwrite=True)
    w.abort()
    # a process that takes the lock and is SIGKILLed does not keep it
    code = textwrap.dedent(f"""
        import os, signal, mmstore
        w = mmstore.StoreWriter({store_dir!r}, {{"a": ("<i8", ())}}, slots=1, overwrite=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert r.returncode == -9
    with mmstore.StoreWriter(store_dir, SMALL_SCHEMA, slots=1, overwrite=True) as w2:
        w2.write(0, sample(0))
    assert len(mmstore.open(store_dir)) == 1


def test_append_without_known_size(store_dir):
    with mmstore.StoreWriter(store_dir, SMALL_SCHEMA) as w:
        for i in range(3000):
            assert w.append(sample(i % 50), key=f"in/{i:05d}.jpg") == i
    s = mmstore.open(store_dir)
    assert len(s) == 3000
    np.testing.assert_array_equal(s[2999]["image"], sample(2999 % 50)["image"])
    assert os.path.getsize(os.path.join(store_dir, "label.npy")) == 128 + 3000 * 8


def test_disk_full_is_a_clean_error_not_sigbus(tmp_path):
    """RLIMIT_FSIZE in a child: refused with EFBIG before anything is reserved
    (the file that does not fit is named, nothing is left)."""
    dest = os.path.join(tmp_path, "big")
    code = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        import mmstore
        try:
            mmstore.StoreWriter({dest!r}, {{"image": ("|u1", (224, 224, 3))}}, slots=100)
        except OSError as exc:
            print("ERR", exc.errno, exc)
            sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 3, r.stderr
    assert "ERR 27" in r.stdout and "cannot reserve" in r.stdout and "image.npy" in r.stdout
    assert "RLIMIT_FSIZE" in r.stdout and "nothing was reserved" in r.stdout
    assert os.listdir(tmp_path) == []


def test_append_mode_disk_full_mid_write(tmp_path):
    dest = os.path.join(tmp_path, "grow")
    code = textwrap.dedent(f"""
        import resource, signal, sys
        import numpy as np
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
        import mmstore
        try:
            with mmstore.StoreWriter({dest!r}, {{"image": ("|u1", (64, 64, 3))}}) as w:
                for i in range(10000):
                    w.append({{"image": np.zeros((64, 64, 3), np.uint8)}})
        except OSError as exc:
            print("ERR", exc.errno)
            sys.exit(3)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 3 and "ERR 27" in r.stdout, (r.stdout, r.stderr)
    assert not os.path.exists(dest) and os.path.isdir(dest + ".partial")


def test_label_names_and_provenance(store_dir):
    write_store(store_dir, 2, label_names=["cat", "dog"], provenance={"source": "/data/x"})
    s = mmstore.open(store_dir)
    assert s.label_names == ["cat", "dog"]
    assert s.provenance["source"] == "/data/x" and "tool" in s.provenance and "time" in s.provenance


def test_no_stray_files_in_published_store(tmp_path, backend):
    path = write_store(os.path.join(tmp_path, "s"), 5, backend, holes=(1,))
    names = set(os.listdir(path))
    base = {"manifest.json", "_checksums.npy", "_keys_offsets.npy", "_keys.bin", "_index.npy", "errors.jsonl"}
    data = {"image.npy", "label.npy", "score.npy"} if backend == "memmap" else {"records.mdb"}
    assert names == base | data
    assert not os.path.exists(path + ".lock") and not os.path.exists(path + ".partial")


def test_write_batch_equals_per_record_writes(tmp_path, backend):
    a = write_store(os.path.join(tmp_path, "a"), 20, backend, holes=(19,))
    b = os.path.join(tmp_path, "b")
    recs = [sample(i) for i in range(19)]
    cols = {k: np.stack([r[k] for r in recs]) for k in SMALL_SCHEMA}
    with mmstore.StoreWriter(b, SMALL_SCHEMA, slots=20, backend=backend) as w:
        w.write_batch(0, {k: v[:7] for k, v in cols.items()}, keys=[f"in/{i:05d}.jpg" for i in range(7)])
        w.write_batch(7, {k: v[7:] for k, v in cols.items()}, keys=[f"in/{i:05d}.jpg" for i in range(7, 19)])
        w.skip(19, "in/00019.jpg", "corrupt: test hole 19")
    assert_same_files(a, b)
    with mmstore.StoreWriter(os.path.join(tmp_path, "c"), SMALL_SCHEMA, slots=3, backend=backend) as w:
        with pytest.raises(SchemaError, match="same number of rows"):
            w.write_batch(0, {**{k: v[:3] for k, v in cols.items()}, "label": cols["label"][:2]})
        with pytest.raises(SchemaError, match="'label'.*change values"):
            w.write_batch(0, {**{k: v[:3] for k, v in cols.items()}, "label": [0.5, 1, 2]})
        with pytest.raises(IndexError):
            w.write_batch(1, {k: v[:3] for k, v in cols.items()})
        w.write_batch(0, {k: v[:3] for k, v in cols.items()})


def test_bulk_keys_with_per_slot_overrides(store_dir):
    keys = [f"bulk/{i}".encode() for i in range(6)]
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in keys])])
    with mmstore.StoreWriter(store_dir, {"a": ("<i8", ())}, slots=7) as w:
        w.set_keys(offsets, b"".join(keys))  # 6 bulk keys for 7 slots
        for i in range(7):
            w.write(i, {"a": i})
        w.set_key(2, "bulk/2")  # same as the bulk key
        w.set_key(4, "override/4")
        w.skip(5, b"\xff hole", "corrupt: x")
        w.set_key(6, "last")
    s = mmstore.open(store_dir)
    got = [s.slot_view.slot_key_bytes(i) for i in range(7)]
    assert got == [b"bulk/0", b"bulk/1", b"bulk/2", b"bulk/3", b"override/4", b"\xff hole", b"last"]
    assert s.skipped() == [{"slot": 5, "key": os.fsdecode(b"\xff hole"), "reason": "corrupt: x"}]


_MIXED_SCHEMA = {"image": ("|u1", (8, 6, 3)), "label": ("<i8", ()), "caption": (str, None),
                 "points": ("<f4", (None, 2)), "big": ("|u1", (5000,))}


def _file_bytes(d: str, name: str) -> bytes | None:
    p = os.path.join(d, name)
    if not os.path.exists(p):
        return None
    with open(p, "rb") as fh:
        return fh.read()


def _mixed(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (8, 6, 3), dtype=np.uint8), "label": np.int64(i),
            "caption": "x" * int(rng.integers(0, 40)) + f" {i}",
            "points": rng.random((int(rng.integers(0, 5)), 2), dtype=np.float32),
            "big": rng.integers(0, 256, 5000, dtype=np.uint8)}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.integers(0, 11), st.booleans(), st.integers(0, 3)), min_size=1, max_size=30),
       blocks=st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_combined_writes_make_the_same_store(tmp_path, backend, ops, blocks):
    """Writes and holes gathered by ``SlotWriter.combined`` (in blocks of any length, slots in any order,
    rewritten, small and large fixed fields, text and ragged entries) give the same files as writing each
    at once; a block left by an exception writes nothing of its small fields or entries."""
    run = os.path.join(tmp_path, f"r{len(os.listdir(tmp_path))}")
    seen: dict[int, tuple[bool, int]] = {}
    for slot, hole, version in ops:
        seen[slot] = (hole, version)

    def apply(w, op):
        slot, hole, version = op
        if hole:
            w.skip(slot, f"k{slot}", f"corrupt: hole {slot}")
        else:
            w.write(slot, _mixed(slot * 10 + version), key=f"k{slot}")

    def finish(w):
        for s in range(12):
            if s not in seen:
                w.skip(s, f"k{s}", f"corrupt: hole {s}")

    with mmstore.StoreWriter(run + "a", _MIXED_SCHEMA, slots=12, backend=backend) as w:
        for op in ops:
            apply(w, op)
        finish(w)
    with mmstore.StoreWriter(run + "b", _MIXED_SCHEMA, slots=12, backend=backend) as w:
        i = 0
        for n in blocks:
            with w.slot_writer.combined():
                for op in ops[i : i + n]:
                    apply(w, op)
            i += n
        for op in ops[i:]:
            apply(w, op)
        partial = run + "b.partial"
        def spilled():
            return sum(os.path.getsize(os.path.join(partial, n)) for n in os.listdir(partial) if "_spill" in n)

        before = spilled()
        before_label = _file_bytes(partial, "label.npy")
        with pytest.raises(KeyError), w.slot_writer.combined():  # gathered, then dropped with the block
            w.write(ops[0][0], _mixed(999), key="dropped")
            raise KeyError("stop")
        assert spilled() == before
        assert _file_bytes(partial, "label.npy") == before_label
        last = ops[0][0]
        apply(w, (last, *seen[last]))  # the slot as it was (its large field was written by the dropped block)
        finish(w)
    assert_same_files(run + "a", run + "b")
