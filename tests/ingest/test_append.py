"""``mmstore append``: new records added to a store as a new part, on real
photographs (crops of matplotlib's ``grace_hopper.jpg`` written as JPEGs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

import mmstore
from mmstore.errors import (
    AllInputsFailedError,
    AppendMismatchError,
    DestinationError,
    DuplicateKeysError,
    SourceError,
    StoreChangedError,
)
from mmstore.ingest.append import append
from mmstore.store.reader import open_store

cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR)
FIELDS = ("image", "label", "orig_size", "box", "dst")


def photos(root: str, classes: dict[str, int], prefix: str, seed: int) -> list[str]:
    """An ImageFolder of JPEG crops of a real photograph: ``classes`` name ->
    count, files ``<class>/<prefix><k>.jpg``; returns the relative paths."""
    rng = np.random.default_rng(seed)
    rels = []
    for c, n in classes.items():
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for k in range(n):
            h, w = (int(v) for v in rng.integers(60, 200, 2))
            y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
            rel = f"{c}/{prefix}{k:03d}.jpg"
            cv2.imwrite(os.path.join(root, rel), PHOTO[y:y + h, x:x + w], [cv2.IMWRITE_JPEG_QUALITY, 90])
            rels.append(rel)
    return sorted(rels)


@pytest.fixture
def two(tmp_path):
    """Folders ``a`` (cat, dog) and ``b`` (dog, fish: a class the store lacks),
    and the store of ``a`` at 32x32."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    photos(a, {"cat": 3, "dog": 3}, "a", 1)
    photos(b, {"dog": 2, "fish": 2}, "b", 2)
    dest = str(tmp_path / "s.store")
    mmstore.ingest(a, dest, size=32, workers=0, quiet=True)
    return a, b, dest


def records(path: str) -> dict[str, dict[str, bytes]]:
    """key -> {field: bytes} (labels as names) of every record of a store."""
    with open_store(path) as s:
        out = {}
        for i in range(len(s)):
            r = s[i]
            rec = {f: np.asarray(r[f]).tobytes() for f in FIELDS if f != "label"}
            rec["label"] = s.label_names[int(r["label"])].encode()
            out[s.key(i)] = rec
        return out


def test_append_reads_as_one_ingest_of_both_sources(two, tmp_path):
    a, b, dest = two
    before = records(dest)
    res = append(dest, b, workers=0, quiet=True)
    assert (res.added, res.skipped, res.records, res.new_labels) == (4, 0, 10, ["fish"])
    # one ingest of both sources: an ImageFolder holding both folders' files
    both = str(tmp_path / "both")
    shutil.copytree(a, both)
    shutil.copytree(b, both, dirs_exist_ok=True)
    ref = str(tmp_path / "ref.store")
    mmstore.ingest(both, ref, size=32, workers=0, quiet=True)
    got, want = records(dest), records(ref)
    assert got == want  # the same bytes for every record, the same label names
    with open_store(dest) as s:
        keys = [s.key(i) for i in range(len(s))]
        assert keys == sorted(before) + sorted(k for k in want if k not in before)  # old records first, then new
        assert s.parts is not None and len(s.parts) == 2 and s.segments == [6, 4]
        assert tuple(s.manifest["version"]) == (2, 2) and "parts" in s.manifest["requires"]
    # the old data files were linked, not copied: no file of the store but the parts' directories
    assert sorted(os.listdir(dest)) == ["_checksums.npy", "_keys.bin", "_keys_offsets.npy", "manifest.json", "parts"]
    assert not os.path.exists(dest + ".partial")


def test_labels_merged_old_numbers_kept(two):
    _, b, dest = two
    with open_store(dest) as s:
        old = s.column("label")
        assert s.label_names == ["cat", "dog"]
    append(dest, b, workers=0, quiet=True)
    with open_store(dest) as s:
        assert s.label_names == ["cat", "dog", "fish"]
        lab = s.column("label")
        assert lab[:6].tolist() == old.tolist()
        assert lab[6:].tolist() == [1, 1, 2, 2]  # b's dog -> the store's dog, fish -> a new number
        assert s.schema["label"].classes == ((0, "cat"), (1, "dog"), (2, "fish"))


def test_option_mismatch_is_refused_naming_it(two):
    _, b, dest = two
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        manifest = fh.read()
    for kw, named in (({"size": 64}, "size"), ({"resize": "pad"}, "resize"),
                      ({"codecs": ["image=jpeg:90"]}, "codecs"), ({"backend": "lmdb"}, "backend"),
                      ({"channels": 1}, "channels"), ({"max_side": 32}, "resize")):
        with pytest.raises(AppendMismatchError, match=named):
            append(dest, b, workers=0, quiet=True, **kw)
        with open(os.path.join(dest, "manifest.json"), "rb") as fh:
            assert fh.read() == manifest
        assert not os.path.exists(dest + ".partial")
    # an option equal to the store's is taken
    append(dest, b, size="32x32", resize="center-crop", workers=0, quiet=True)
    assert len(mmstore.open(dest)) == 10


def test_a_source_of_only_broken_inputs_is_refused_in_the_append_s_terms(two, tmp_path):
    """Every new input broken: the error names the store (not the part being
    written), says it is unchanged and where the failures are; fixed inputs
    then append with the same call."""
    _, _, dest = two
    bad = tmp_path / "bad" / "cat"
    bad.mkdir(parents=True)
    (bad / "x.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        manifest = fh.read()
    with pytest.raises(AllInputsFailedError) as e:
        append(dest, str(tmp_path / "bad"), workers=0, quiet=True)
    msg = str(e.value)
    assert msg.startswith(f"{dest}: nothing appended: all 1 inputs") and "the store is unchanged" in msg
    assert os.path.exists(e.value.errors_path) and "run the same append again" in msg
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        assert fh.read() == manifest
    assert mmstore.verify(dest).ok
    photos(str(tmp_path / "bad"), {"cat": 1}, "x", 3)  # the broken file replaced by a photo
    append(dest, str(tmp_path / "bad"), workers=0, quiet=True)
    assert len(mmstore.open(dest)) == 7


def test_a_source_lacking_a_field_of_the_store_names_it(two, tmp_path):
    """The store has a caption field the new source does not make: the
    refusal names the missing field and the options that make fields."""
    a, b, _ = two
    lst = tmp_path / "list.csv"
    names = sorted(os.listdir(os.path.join(a, "cat")))
    rows = [f"{os.path.join(a, 'cat', r)},cat,caption {i}" for i, r in enumerate(names)]
    lst.write_text("path,label,text\n" + "\n".join(rows) + "\n")
    capt = str(tmp_path / "c.store")
    mmstore.ingest(str(lst), capt, size=32, text_column="text", workers=0, quiet=True)
    with pytest.raises(AppendMismatchError, match=r"lack \['text'\].*--text-column"):
        append(capt, b, workers=0, quiet=True)


def test_duplicate_keys_refused_then_kept_by_option(two, monkeypatch):
    a, _, dest = two
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        manifest = fh.read()
    from mmstore.ingest.records import RecordJob

    decoded = []
    record = RecordJob.record
    monkeypatch.setattr(RecordJob, "record", lambda self, *a: decoded.append(a) or record(self, *a))
    with pytest.raises(DuplicateKeysError, match="6 of the 6 new records.*duplicate_keys='keep'"):
        append(dest, a, workers=0, quiet=True)
    assert decoded == []  # refused from the source's listing, before any input is decoded
    monkeypatch.undo()
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        assert fh.read() == manifest
    assert not os.path.exists(dest + ".partial")
    append(dest, a, workers=0, quiet=True, duplicate_keys="keep")
    assert len(mmstore.open(dest)) == 12


def test_two_appends_verify_and_inspect(two, tmp_path, capsys):
    from mmstore.cli import main

    _, b, dest = two
    c = str(tmp_path / "c")
    photos(c, {"bird": 2}, "c", 3)
    assert main(["append", dest, b, "--workers", "0", "-q"]) == 0
    assert main(["append", dest, c, "--workers", "0", "--size", "32x32"]) == 0
    assert "2 records appended" in capsys.readouterr().err
    with open_store(dest) as s:
        assert len(s) == 12 and s.segments == [6, 4, 2] and s.label_names == ["cat", "dog", "fish", "bird"]
        assert s.column("label")[10:].tolist() == [3, 3]
    report = mmstore.verify(dest)
    assert report.ok, report
    assert main(["verify", dest]) == 0
    capsys.readouterr()
    assert main(["inspect", dest, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["records"] == 12
    assert main(["inspect", dest]) == 0
    assert "segments     3 (the first ingest, grown by 2 append(s); 2 to 6 slots each)" in capsys.readouterr().out
    # a refused CLI append exits 2 with the option named
    assert main(["append", dest, c, "--workers", "0", "--size", "48"]) == 2
    assert "size" in capsys.readouterr().err


def test_reader_of_the_old_store_keeps_reading_while_the_append_commits(two):
    _, b, dest = two
    old = open_store(dest)
    want = old.read_batch(np.arange(6))
    want_keys = [old.key(i) for i in range(6)]
    stop, seen, bad = threading.Event(), [0, 0], []

    def read_old() -> None:  # the Store opened before the append
        while not stop.is_set():
            got = old.read_batch(np.arange(6))
            if any(not np.array_equal(got[f], want[f]) for f in FIELDS) or len(old) != 6:
                bad.append("old reader saw other bytes")
            seen[0] += 1

    def open_new() -> None:  # opens during the append: the old store or the new one, never a mix
        while not stop.is_set():
            try:
                with open_store(dest) as s:
                    n = len(s)
                    got = s.read_batch(np.arange(6))
                    if n not in (6, 10) or any(not np.array_equal(got[f], want[f]) for f in FIELDS):
                        bad.append(f"an open saw {n} records / other bytes")
            except Exception as exc:  # noqa: BLE001 - reported by the test (opened just before the exchange,
                # read first after it: the old records, through the grown store)
                bad.append(repr(exc))
            seen[1] += 1

    threads = [threading.Thread(target=read_old), threading.Thread(target=open_new)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.05)
        append(dest, b, workers=0, quiet=True)
        time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not bad, bad[:3]
    assert seen[0] > 0 and seen[1] > 0
    assert [old.key(i) for i in range(6)] == want_keys  # its key files stay mapped
    assert len(mmstore.open(dest)) == 10
    old.close()


def _kill_mid(proc: subprocess.Popen, partial: str, timeout: float = 60) -> None:
    """SIGKILL ``proc`` once the new part's ingest has committed a chunk."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        parts = os.path.join(partial, "parts")
        logs = [os.path.join(parts, n, "_ingest_commits.log") for n in os.listdir(parts)] \
            if os.path.isdir(parts) else []
        if any(os.path.exists(p) and os.path.getsize(p) > 0 for p in logs):
            break
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_sigkill_mid_append_leaves_the_old_store_then_the_rerun_completes(two, tmp_path, h):
    a, _, dest = two
    big = str(tmp_path / "big")
    photos(big, {"dog": 12, "fish": 12}, "k", 4)
    ref = str(tmp_path / "ref.store")
    shutil.copytree(dest, ref)
    append(ref, big, workers=0, quiet=True)
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        manifest = fh.read()
    argv = ["append", dest, big, "--workers", "0", "-q", "--chunk", "1"]
    p = h.cli_subprocess(*argv, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_mid(p, dest + ".partial")
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        assert fh.read() == manifest  # the old store, untouched
    assert mmstore.verify(dest).ok
    assert len(mmstore.open(dest)) == 6
    assert os.path.isdir(dest + ".partial")
    q = h.cli_subprocess(*argv[:-3], stderr=subprocess.PIPE)  # not quiet: its summary
    _, err = q.communicate(timeout=120)
    assert q.returncode == 0, err.decode()
    assert "done by an earlier run" in err.decode()  # resumed, not started again
    assert records(dest) == records(ref)
    assert mmstore.verify(dest).ok
    assert not os.path.exists(dest + ".partial")


@pytest.mark.parametrize("at", ["append:1", "append:2", "append:3", "append:4"])
def test_killed_at_each_step_old_or_new_store_and_the_rerun_finishes(two, tmp_path, h, at):
    _, b, dest = two
    ref = str(tmp_path / "ref.store")
    shutil.copytree(dest, ref)
    append(ref, b, workers=0, quiet=True)
    argv = ["append", dest, b, "--workers", "0", "-q"]
    p = h.cli_subprocess(*argv, env={"MMSTORE_CRASH_AT": at}, stderr=subprocess.PIPE)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 77, err.decode()
    n = len(mmstore.open(dest))
    assert mmstore.verify(dest).ok
    assert n == (10 if at == "append:4" else 6)  # points 1-3 before the exchange, 4 after
    if n == 6:  # killed before the exchange: the old store; the rerun finishes the append
        q = h.cli_subprocess(*argv, stderr=subprocess.PIPE)
        _, err = q.communicate(timeout=120)
        assert q.returncode == 0, err.decode()
    else:  # killed after it: the append is complete, and a rerun is refused (its keys are there)
        assert h.cli("append", dest, b, "--workers", "0", "-q") == 2
    assert records(dest) == records(ref)
    assert not os.path.exists(dest + ".partial")


def test_push_after_append_uploads_only_the_new_part(two, tmp_path, s3):
    from mmstore.remote.client import Remote
    from mmstore.remote.url import parse_url
    from mmstore.transfer import pull, push

    _, b, dest = two
    c = str(tmp_path / "c")
    photos(c, {"bird": 3}, "c", 3)
    append(dest, b, workers=0, quiet=True)  # a store with parts
    url = s3.url("grown.store")
    push(dest, url)
    remote = Remote(parse_url(url))
    before = remote.list()
    old = mmstore.open(dest).manifest["files"]
    append(dest, c, workers=0, quiet=True)
    new = mmstore.open(dest).manifest
    added = sorted(n for n in new["files"] if n.startswith(f"parts/{new['parts'][-1]}/"))
    rep = push(dest, url)  # no overwrite needed: the URL holds the store this one grew from
    # the old parts' objects stay (they are the same bytes); the new part and the bookkeeping go up
    kept = sorted(n for n in old if n.startswith("parts/"))
    assert rep["skipped_files"] == len(kept) > 0
    small = [n for n in new["files"] if not n.startswith("parts/")]
    with open(os.path.join(dest, "manifest.json"), "rb") as fh:
        want = sum(new["files"][n] for n in added + small) + len(fh.read())
    assert rep["uploaded_bytes"] == want, rep
    after = remote.list()
    for n in kept:
        assert after[n]["etag"] == before[n]["etag"] and after[n].get("last_modified") == before[n].get(
            "last_modified"), n
    got = str(tmp_path / "pulled.store")
    pull(url, got)
    assert records(got) == records(dest)
    assert mmstore.verify(got).ok


@pytest.mark.parametrize("kw", [{"size": 32, "backend": "lmdb"}, {"size": 32, "codecs": ["image=jpeg:90"]},
                                {"max_side": 40}, {"buckets": "32x32,24x40,40x24"}],
                         ids=["lmdb", "jpeg", "max_side", "buckets"])
def test_other_layouts_and_holes(tmp_path, kw):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    photos(a, {"cat": 2, "dog": 2}, "a", 5)
    photos(b, {"dog": 2}, "b", 6)
    with open(os.path.join(b, "dog", "broken.jpg"), "wb") as fh:
        fh.write(b"not a JPEG")  # a hole in the new part
    dest, ref = str(tmp_path / "s.store"), str(tmp_path / "ref.store")
    mmstore.ingest(a, dest, workers=0, quiet=True, **kw)
    res = append(dest, b, workers=0, quiet=True)
    assert (res.added, res.skipped) == (2, 1)
    both = str(tmp_path / "both")
    shutil.copytree(a, both)
    shutil.copytree(b, both, dirs_exist_ok=True)
    mmstore.ingest(both, ref, workers=0, quiet=True, **kw)
    assert mmstore.verify(dest).ok
    with open_store(dest) as s, open_store(ref) as r:
        assert (len(s), s.slots, s.backend_name) == (6, 7, r.backend_name)
        assert [e["key"] for e in s.skipped()] == ["dog/broken.jpg"]
        got = {s.key(i): s[i] for i in range(len(s))}
        for i in range(len(r)):
            want = r[i]
            assert all(np.array_equal(got[r.key(i)][f], want[f]) for f in want), r.key(i)


def test_store_that_does_not_record_its_decode_takes_the_options_given(tmp_path):
    """A store written by ``StoreWriter`` says nothing of a decode: the options given are used as they are,
    and the new records' schema must be the store's."""
    rng = np.random.default_rng(0)
    dest = str(tmp_path / "w.store")
    with mmstore.StoreWriter(dest, {"image": ("|u1", (8, 8, 3))}, slots=2) as w:
        for i in range(2):
            w.write(i, {"image": rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)}, key=f"w{i}")
    arr = str(tmp_path / "more.npy")
    np.save(arr, rng.integers(0, 255, (3, 8, 8, 3), dtype=np.uint8))
    append(dest, arr, workers=0, quiet=True)
    with open_store(dest) as s:
        assert len(s) == 5 and np.array_equal(s.read_batch(np.arange(2, 5))["image"], np.load(arr))
    np.save(arr, rng.integers(0, 255, (3, 4, 4, 3), dtype=np.uint8))
    with pytest.raises(AppendMismatchError, match="schema"):
        append(dest, arr, workers=0, quiet=True, duplicate_keys="keep")
    assert len(mmstore.open(dest)) == 5 and mmstore.verify(dest).ok


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_reader_that_read_one_record_reads_batches_of_the_old_store_after_an_append(tmp_path, backend):
    """A Store that has read one record (its per-record descriptors) and maps the fields only later, for
    its first batch, maps the files it opened: the append moved them into a part of the new store."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    photos(a, {"cat": 3, "dog": 3}, "a", 1)
    photos(b, {"dog": 2, "fish": 2}, "b", 2)
    dest = str(tmp_path / "s.store")
    mmstore.ingest(a, dest, size=32, workers=0, quiet=True, backend=backend)
    with open_store(dest) as s:
        want = s.read_batch(np.arange(6))
    old = open_store(dest)
    old[0]
    append(dest, b, workers=0, quiet=True)
    got = old.read_batch(np.arange(6))
    assert all(np.array_equal(got[f], want[f]) for f in FIELDS) and len(old) == 6
    old.close()
    assert len(mmstore.open(dest)) == 10


def _store_bytes(s) -> tuple:
    """Everything a reader of ``s`` sees: its records' bytes, keys, label names and holes."""
    got = s.read_batch(np.arange(len(s)))
    return (len(s), s.slots, {f: got[f].tobytes() for f in FIELDS}, [s.key(i) for i in range(len(s))],
            s.label_names, [(e["slot"], e["key"]) for e in s.skipped()])


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_reader_opened_before_appends_reads_its_own_records_through_the_grown_store(tmp_path, backend):
    """A Store opened (not read) before two appends, one pickled before them (a DataLoader worker started
    later), one pickled from a reader that followed (a worker of such a reader): each reads exactly the
    records, keys, label names and holes of the store it opened, through the grown store; a fresh open
    sees every record. Before, their first read raised StoreChangedError."""
    import pickle

    a, b, c = (str(tmp_path / n) for n in "abc")
    photos(a, {"cat": 2, "dog": 3}, "a", 1)
    photos(b, {"dog": 2, "fish": 2}, "b", 2)
    photos(c, {"bird": 2}, "c", 3)
    for d in (a, b):  # a hole in the old store and one in the first append
        with open(os.path.join(d, "dog", "broken.jpg"), "wb") as fh:
            fh.write(b"not a JPEG")
    dest, ref = str(tmp_path / "s.store"), str(tmp_path / "ref.store")
    mmstore.ingest(a, dest, size=32, workers=0, quiet=True, backend=backend)
    shutil.copytree(dest, ref)  # the store as the readers opened it
    with open_store(ref) as r:
        want = _store_bytes(r)
    assert want[0] == 5 and want[1] == 6 and want[5] == [(5, "dog/broken.jpg")]
    old = open_store(dest)
    pickled = pickle.dumps(old)
    append(dest, b, workers=0, quiet=True)
    append(dest, c, workers=0, quiet=True)
    assert _store_bytes(old) == want
    worker = pickle.loads(pickled)
    assert _store_bytes(worker) == want
    assert _store_bytes(pickle.loads(pickle.dumps(worker))) == want
    with open_store(dest) as s:
        assert (len(s), s.label_names) == (11, ["cat", "dog", "fish", "bird"])
    for st in (old, worker):
        st.close()


def test_a_reader_of_a_store_replaced_by_another_is_still_told_to_reopen(two, tmp_path):
    """Only an append of the store it opened is read through: a store overwritten by another ingest at
    its path is another store, and a reader that had not read yet raises StoreChangedError."""
    import pickle

    a, b, dest = two
    old = open_store(dest)
    pickled = pickle.dumps(old)
    mmstore.ingest(b, dest, size=32, workers=0, quiet=True, overwrite=True)
    with pytest.raises(StoreChangedError, match="(?i)reopen"):
        old[0]
    with pytest.raises(StoreChangedError, match="(?i)reopen"):
        pickle.loads(pickled)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_of_the_next_epoch_read_the_store_they_were_given_after_an_append(two, method):
    """A torch DataLoader whose workers start again each epoch (fork or spawn), its store appended to
    between two epochs: the second epoch gives the same batches as the first (before, its workers
    failed: StoreChangedError, or under spawn a worker that died unpickling its dataset)."""
    torch = pytest.importorskip("torch")
    from mmstore.torch import StoreDataset

    _, b, dest = two
    ds = StoreDataset(dest)
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=method)
    first = [{f: v.numpy().tobytes() for f, v in batch.items()} for batch in dl]
    append(dest, b, workers=0, quiet=True)
    second = [{f: v.numpy().tobytes() for f, v in batch.items()} for batch in dl]
    assert second == first and sum(len(x["label"]) for x in first) // 8 == 6
    assert len(mmstore.open(dest)) == 10


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_reader_that_read_some_of_the_store_reads_the_rest_after_appends(tmp_path, backend):
    """A Store that read only the labels, then two appends in a row (the second store may get the first
    one's directory inode back): images, keys and holes (twice: the list is read anew each call) are the
    old store's; one that read nothing asks for the holes first."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    photos(a, {"cat": 2, "dog": 3}, "a", 1)
    photos(b, {"dog": 2}, "b", 2)
    photos(c, {"fish": 1}, "c", 3)
    with open(os.path.join(a, "dog", "broken.jpg"), "wb") as fh:
        fh.write(b"not a JPEG")
    dest, ref = str(tmp_path / "s.store"), str(tmp_path / "ref.store")
    mmstore.ingest(a, dest, size=32, workers=0, quiet=True, backend=backend)
    shutil.copytree(dest, ref)
    with open_store(ref) as r:
        want = _store_bytes(r)
    some, none = open_store(dest), open_store(dest)
    assert some.column("label").tolist() == [0, 0, 1, 1, 1]
    append(dest, b, workers=0, quiet=True)
    append(dest, c, workers=0, quiet=True)
    assert [(e["slot"], e["key"]) for e in none.skipped()] == want[5]
    assert some.skipped() == some.skipped() and _store_bytes(some) == want
    assert _store_bytes(none) == want
    for st in (some, none):
        st.close()


@pytest.mark.parametrize("process", [False, True])
def test_a_loader_made_before_an_append_gives_the_same_epochs_after_it(two, process):
    """mmstore.torch.Loader (threads, or its helper process) made before the append, one epoch before
    and two after: the same records each epoch (every record once), the old store's."""
    pytest.importorskip("torch")
    from mmstore.torch import Loader

    _, b, dest = two
    store = open_store(dest)
    with open_store(dest) as s:
        want = sorted(s.read_batch(np.arange(6))["image"].reshape(6, -1).tobytes()[i * 3072:(i + 1) * 3072]
                      for i in range(6))
    loader = Loader(store, 4, "sequential", process=process)

    def epoch() -> list[bytes]:
        got = [bytes(img) for batch in loader for img in batch["image"].numpy().reshape(-1, 3072)]
        return sorted(got)

    assert epoch() == want
    append(dest, b, workers=0, quiet=True)
    assert epoch() == want and epoch() == want
    if hasattr(loader, "close"):
        loader.close()
    store.close()


@pytest.mark.slow  # one append process per crash point: CI's step for slow tests
def test_killed_at_each_rename_the_rerun_finishes_and_leaves_nothing_beside_the_store(two, tmp_path, h):
    """Every rename of an append's publish (the part's, the exchange, the old store set aside) killed in
    turn: the store is the old one or the new one, and the same command run again finishes the append (or
    says it is done), leaving no ``.partial`` and no store set aside next to it."""
    _, b, dest = two
    ref = str(tmp_path / "ref.store")
    shutil.copytree(dest, ref)
    append(ref, b, workers=0, quiet=True)
    want = records(ref)
    for k in range(1, 40):
        d = str(tmp_path / f"k{k}" / "s.store")
        shutil.copytree(dest, d)
        argv = ["append", d, b, "--workers", "0", "-q"]
        p = h.cli_subprocess(*argv, env={"MMSTORE_CRASH_AT": f"rename:{k}"}, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=120)
        if p.returncode == 0:
            break  # past the last rename: every one was walked
        assert p.returncode == 77, (k, err.decode())
        assert mmstore.verify(d).ok and len(mmstore.open(d)) in (6, 10)
        q = h.cli_subprocess(*argv, stderr=subprocess.PIPE)
        _, err = q.communicate(timeout=120)
        assert q.returncode in (0, 2), (k, err.decode())  # 2: published before the kill, its keys are there
        assert records(d) == want, k
        left = sorted(n for n in os.listdir(os.path.dirname(d)) if n != "s.store")
        assert left == [], (k, left)
    else:
        pytest.fail("the append kept crashing at rename points")
    assert k > 3


def test_a_source_no_ingest_takes_is_refused_before_any_work(two):
    _, _, dest = two
    for call in (lambda: append(dest, [(np.zeros((8, 8, 3), np.uint8), 0)], workers=0, quiet=True),
                 lambda: mmstore.ingest([(np.zeros((8, 8, 3), np.uint8), 0)], dest + "2", size=8, quiet=True)):
        with pytest.raises(SourceError, match=r"the source is a list; it takes a path.*from_dataset"):
            call()
    assert not os.path.exists(dest + ".partial") and not os.path.exists(dest + "2")
    assert len(mmstore.open(dest)) == 6


def test_a_link_to_the_store_is_refused_before_any_work_naming_the_store(two, tmp_path, h):
    _, b, dest = two
    link = str(tmp_path / "link.store")
    os.symlink(dest, link)
    with pytest.raises(DestinationError, match="is a symbolic link.*append to the store itself"):
        append(link, b, workers=0, quiet=True)
    assert not os.path.exists(link + ".partial") and os.path.islink(link)
    assert h.cli("append", os.path.realpath(dest), b, "--workers", "0", "-q") == 0  # what it says to do
    assert len(mmstore.open(link)) == 10


def test_a_merge_of_stores_decoded_alike_keeps_their_decode_for_appends(two, tmp_path):
    """Two stores ingested apart with the same options, merged: the merge records that decode, so an append
    takes it as the store's (no size needed; another resize refused) and its records decode alike."""
    _, _, dest = two
    c, d = str(tmp_path / "c"), str(tmp_path / "d")
    photos(c, {"bird": 2}, "c", 3)
    photos(d, {"cat": 2, "dog": 2}, "d", 4)  # the classes of the store: a merge needs the same label names
    other = str(tmp_path / "d.store")
    mmstore.ingest(d, other, size=32, workers=0, quiet=True)
    merged = mmstore.merge([dest, other], str(tmp_path / "m.store"))
    with pytest.raises(AppendMismatchError, match="resize 'stretch'"):
        append(merged, c, workers=0, quiet=True, resize="stretch")
    append(merged, c, workers=0, quiet=True)
    ref = str(tmp_path / "ref.store")
    mmstore.ingest(c, ref, size=32, workers=0, quiet=True)
    with open_store(merged) as s, open_store(ref) as r:
        assert len(s) == 12
        assert all(np.array_equal(s[10 + i]["image"], r[i]["image"]) for i in range(2))


def test_an_ingest_over_an_unfinished_append_names_it(two, h):
    a, b, dest = two
    p = h.cli_subprocess("append", dest, b, "--workers", "0", "-q", env={"MMSTORE_CRASH_AT": "append:1"},
                         stderr=subprocess.PIPE)
    p.communicate(timeout=120)
    assert p.returncode == 77 and os.path.isdir(dest + ".partial")
    with pytest.raises(DestinationError, match="an unfinished `mmstore append`.*run the same append again"):
        mmstore.ingest(a, dest, size=32, workers=0, quiet=True, overwrite=True)
    assert h.cli("append", dest, b, "--workers", "0", "-q") == 0  # what it says to do
    assert len(mmstore.open(dest)) == 10


def test_labels_none_against_the_store_s_labels_is_refused_naming_it(two, tmp_path):
    a, b, dest = two
    with pytest.raises(AppendMismatchError, match="the store's records have labels: leave out --labels none"):
        append(dest, b, workers=0, quiet=True, labels="none")
    plain = str(tmp_path / "plain.store")
    mmstore.ingest(a, plain, size=32, workers=0, quiet=True, labels="none")
    with pytest.raises(AppendMismatchError, match=r"the store's records have no label: pass --labels none"):
        append(plain, b, workers=0, quiet=True)
    append(plain, b, workers=0, quiet=True, labels="none")  # what it says to do
    assert len(mmstore.open(plain)) == 10 and len(mmstore.open(dest)) == 6


def test_a_list_of_integer_labels_is_refused_in_the_store_s_terms_leaving_nothing(two, tmp_path):
    _, b, dest = two
    rels = sorted(os.path.relpath(os.path.join(r, f), b) for r, _, fs in os.walk(b) for f in fs)
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\n" + "".join(f"{r},1\n" for r in rels))
    with pytest.raises(AppendMismatchError, match=r"labels its inputs with integers.*class names \(cat, dog\)"):
        append(dest, str(lst), root=b, workers=0, quiet=True)
    assert not os.path.exists(dest + ".partial") and len(mmstore.open(dest)) == 6
    arr = str(tmp_path / "arr.npy")
    np.save(arr, np.zeros((2, 32, 32, 3), np.uint8))
    with pytest.raises(AppendMismatchError, match=r"is an array file, whose labels name no class"):
        append(dest, arr, workers=0, quiet=True)
    assert not os.path.exists(dest + ".partial") and len(mmstore.open(dest)) == 6


def test_a_bucket_loader_reads_its_store_across_an_append_and_never_another_store(tmp_path):
    """A BucketLoader (its own reads of raw entries by descriptor) over an aspect-bucketed store: the
    epoch after an append gives the old records (it raised FileNotFoundError); after the store is
    replaced by another one, StoreChangedError, never that store's bytes (its raw open read them)."""
    pytest.importorskip("torch")
    from mmstore.torch import BucketLoader

    a, b, c = (str(tmp_path / n) for n in "abc")
    photos(a, {"cat": 4, "dog": 4}, "a", 1)
    photos(b, {"dog": 2}, "b", 2)
    photos(c, {"emu": 8}, "c", 3)
    dest = str(tmp_path / "s.store")
    mmstore.ingest(a, dest, buckets="32x32,24x40,40x24", workers=0, quiet=True)

    def epoch(loader) -> list[bytes]:
        return sorted(np.asarray(img).tobytes() for batch in loader for img in batch["image"])

    store = open_store(dest)
    loader = BucketLoader(store, 2, as_tuple=False)
    want = epoch(loader)
    assert len(want) == 8
    append(dest, b, workers=0, quiet=True)
    assert epoch(loader) == want
    loader.close()
    store.close()
    plain = str(tmp_path / "plain.store")  # one segment: its raw entries read by descriptor, opened each epoch
    mmstore.ingest(a, plain, buckets="32x32,24x40,40x24", workers=0, quiet=True)
    store = open_store(plain)
    loader = BucketLoader(store, 2, as_tuple=False)
    assert epoch(loader) == want
    mmstore.ingest(c, plain, buckets="32x32,24x40,40x24", workers=0, quiet=True, overwrite=True)
    with pytest.raises(StoreChangedError):
        epoch(loader)
    loader.close()
    store.close()


def test_threads_reading_one_store_while_appends_follow_each_other(tmp_path):
    """Four threads reading records, keys and holes of one Store while three appends replace the store
    one after the other: every read gives the old store's answer, none raises (threads that met the
    same replaced file follow it once, together; a follow is tried again if the store was replaced
    once more meanwhile), and the Store never shows the grown store's length or labels."""
    a = str(tmp_path / "a")
    photos(a, {"cat": 3, "dog": 3}, "a", 1)
    with open(os.path.join(a, "dog", "broken.jpg"), "wb") as fh:
        fh.write(b"not a JPEG")
    dest, ref = str(tmp_path / "s.store"), str(tmp_path / "ref.store")
    mmstore.ingest(a, dest, size=32, workers=0, quiet=True)
    shutil.copytree(dest, ref)
    with open_store(ref) as r:
        want = _store_bytes(r)
    srcs = []
    for k in range(3):
        srcs.append(str(tmp_path / f"b{k}"))
        photos(srcs[-1], {"emu": 2}, f"b{k}", 5 + k)
    store = open_store(dest)
    stop, bad = threading.Event(), []

    def reader(kind: int) -> None:
        while not stop.is_set():
            try:
                if len(store) != 6 or store.label_names != ["cat", "dog"]:
                    bad.append(f"len {len(store)} labels {store.label_names}")
                if kind == 0:
                    got = store.read_batch(np.arange(6))["image"].tobytes()
                    if got != want[2]["image"]:
                        bad.append("other image bytes")
                elif kind == 1:
                    if [store.key(i) for i in range(6)] != want[3]:
                        bad.append("other keys")
                elif kind == 2:
                    if [(e["slot"], e["key"]) for e in store.skipped()] != want[5]:
                        bad.append("other holes")
                elif np.asarray(store[int(np.random.randint(6))]["image"]).dtype != np.uint8:
                    bad.append("other record")
            except Exception as exc:  # noqa: BLE001 - reported by the test
                bad.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        for src in srcs:
            append(dest, src, workers=0, quiet=True, duplicate_keys="keep")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not bad, bad[:3]
    assert _store_bytes(store) == want
    store.close()
