"""WebDataset tar shards read from a real S3 bucket (SeaweedFS on loopback, and over HTTP from its filer):
real photographs in real tars; the store equals a local ingest of the same shards byte for byte, whatever the
workers, after a kill and a resume (which reads no finished shard again), with a truncated shard object and a
corrupt member as the same holes; a missing shard or bucket refused before any work; an unreachable server
stops the run with a typed error and a resumable ``DEST.partial``; a damaged saved index is never used."""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
import time

import numpy as np
import pytest
from support.compare import assert_same_files
from support.proc import popen_cli, run_cli
from support.scheme_fixtures import az, azurite_server, gcs_server, gs, web  # noqa: F401 - fixtures

import mmstore
from mmstore.errors import IngestError, RemoteNotFoundError, SourceError
from mmstore.ingest import ingest

cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
SHARDS, PER_SHARD = 3, 10
FAST_FAIL = {"MMSTORE_REMOTE_RETRIES": "1", "MMSTORE_REMOTE_RETRY_TIMEOUT": "2", "MMSTORE_REMOTE_CONNECT_TIMEOUT": "2",
             "MMSTORE_REMOTE_TIMEOUT": "2"}


def _add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = 1_700_000_000
    t.addfile(ti, io.BytesIO(data))


@pytest.fixture(scope="module")
def tars():
    """Three shards of ten photo crops (jpg, txt, cls) as bytes: {file name: tar bytes}."""
    rng = np.random.default_rng(3)
    out = {}
    for s in range(SHARDS):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as t:
            for j in range(PER_SHARD):
                h, w = (int(v) for v in rng.integers(40, 120, 2))
                y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
                ok, jpg = cv2.imencode(".jpg", np.ascontiguousarray(PHOTO[y:y + h, x:x + w, ::-1]))
                assert ok
                key = f"{s:05d}{j:04d}"
                _add(t, key + ".jpg", jpg.tobytes())
                _add(t, key + ".txt", f"crop {key} of a portrait".encode())
                _add(t, key + ".cls", str(j % 4).encode())
        out[f"{s:05d}.tar"] = buf.getvalue()
    return out


def _place(tmp_path, s3, shards: dict[str, bytes]) -> tuple[str, str]:
    """The shards in a local folder and in the bucket under ``shards/``: (local pattern, URL pattern)."""
    local = tmp_path / "local"
    local.mkdir()
    store = s3.store()
    import obstore

    for name, data in shards.items():
        (local / name).write_bytes(data)
        obstore.put(store, f"shards/{name}", data)
    rng = f"{{00000..{SHARDS - 1:05d}}}.tar"
    return str(local / rng), s3.url(f"shards/{rng}")


def _damaged(tars: dict[str, bytes]) -> dict[str, bytes]:
    """Shard 1 cut in the middle of sample 4's JPEG, shard 2 with sample 6's JPEG garbled."""
    out = dict(tars)
    for name, key, how in (("00001.tar", "000010004.jpg", "cut"), ("00002.tar", "000020006.jpg", "garble")):
        with tarfile.open(fileobj=io.BytesIO(out[name])) as t:
            m = t.getmember(key)
        data = bytearray(out[name])
        if how == "cut":
            del data[m.offset_data + m.size // 2:]
        else:
            data[m.offset_data + 150:m.offset_data + m.size - 100] = b"\0" * (m.size - 250)
        out[name] = bytes(data)
    return out


def test_url_ingest_equals_local_ingest_whatever_the_workers(tmp_path, s3, tars):
    local, url = _place(tmp_path, s3, tars)
    a, b, c, g = (str(tmp_path / n) for n in "abcg")
    opts = {"size": (40, 32), "quiet": True}
    ingest(local, a, workers=0, **opts)
    r = ingest(url, b, workers=0, **opts)
    assert r.records == SHARDS * PER_SHARD
    assert_same_files(a, b)
    ingest(url, c, workers=2, chunk=3, **opts)  # ranges that straddle shards
    assert_same_files(a, c)
    ingest(s3.url("shards/*.tar"), g, workers=0, **opts)  # a glob lists the folder
    assert_same_files(a, g)
    q = str(tmp_path / "q")
    ingest(s3.url("shards/000?[0-9].tar"), q, workers=0, **opts)  # ? and [...] are glob characters in a URL too
    assert_same_files(a, q)
    s = mmstore.open(b)
    assert os.fsdecode(s.key(11)) == "00001.tar/000010001"
    assert mmstore.open(b).manifest["provenance"]["source"]["path"] == url


def test_kill_and_resume_reads_no_finished_shard(tmp_path, s3_faulty, tars):
    local, url = _place(tmp_path, s3_faulty, tars)
    args = ["--size", "32x32", "-q"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ingest(local, a, size=32, workers=0, quiet=True)
    # one range a shard, killed before its third commit: the shards of the two committed ranges are done
    p = popen_cli(["ingest", url, b, "--workers", "1", "--chunk", str(PER_SHARD), *args],
                  env={"MMSTORE_CRASH_AT": "commit:3"})
    assert p.wait(120) == 77 and os.path.isdir(b + ".partial")
    with open(os.path.join(b + ".partial", "_ingest_commits.log")) as fh:
        done = {json.loads(line.rsplit(" ", 1)[0])["a"] // PER_SHARD for line in fh}
    assert len(done) == 2
    proxy = s3_faulty.proxy
    proxy.settle()
    proxy.events.clear()
    assert popen_cli(["ingest", url, b, "--workers", "2", "--resume", *args]).wait(120) == 0  # ranges cut at shards
    assert_same_files(a, b)
    proxy.settle()
    gets = [e.target.rsplit("/", 1)[-1] for e in proxy.events if e.method == "GET" and ".tar" in e.target]
    todo = {f"{k:05d}.tar" for k in range(SHARDS) if k not in done}
    assert gets and set(gets) == todo and len(gets) == len(todo), gets  # one GET a shard left, none of the others


def test_sigkill_mid_ingest_then_resume_is_identical(tmp_path, s3, tars):
    local, url = _place(tmp_path, s3, tars)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ingest(local, a, size=32, workers=0, quiet=True)
    p = popen_cli(["ingest", url, b, "--size", "32x32", "--workers", "1", "--chunk", "1", "-q"])
    log = os.path.join(b + ".partial", "_ingest_commits.log")
    deadline = time.monotonic() + 60
    while p.poll() is None and time.monotonic() < deadline:
        if os.path.isfile(log) and os.path.getsize(log) > 0:
            break
        time.sleep(0.005)
    p.kill()
    p.wait(60)
    assert popen_cli(["ingest", url, b, "--size", "32x32", "--workers", "2", "--resume", "-q"]).wait(120) == 0
    assert_same_files(a, b)


def test_truncated_shard_object_and_corrupt_member_are_holes(tmp_path, s3, tars):
    local, url = _place(tmp_path, s3, _damaged(tars))
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ingest(local, a, size=32, workers=0, quiet=True)
    r = ingest(url, b, size=32, workers=2, chunk=4, quiet=True)
    assert_same_files(a, b)
    assert r.slots == PER_SHARD + 5 + PER_SHARD
    holes = {e["key"]: e["reason"] for e in mmstore.open(b).skipped()}
    assert set(holes) == {"00001.tar/000010004", "00002.tar/000020006"}
    assert holes["00001.tar/000010004"].startswith("truncated: member '000010004.jpg'")
    assert "(shard 00001.tar)" in holes["00001.tar/000010004"]
    assert holes["00002.tar/000020006"].split(":")[0] in ("corrupt", "truncated")


def test_missing_shard_or_bucket_is_refused_before_work(tmp_path, s3, tars):
    _, url = _place(tmp_path, s3, tars)
    dest = str(tmp_path / "d")
    with pytest.raises(SourceError, match=r"1 shard\(s\) it names do not exist \(the first: s3://.*/shards/00003.tar"):
        ingest(url.replace(f"{SHARDS - 1:05d}}}", f"{SHARDS:05d}}}"), dest, size=16, quiet=True)
    with pytest.raises(SourceError, match="matches no object"):
        ingest(s3.url("shards/x*.tar"), dest, size=16, quiet=True)
    with pytest.raises(RemoteNotFoundError, match="no-such-bucket-0"):
        ingest("s3://no-such-bucket-0/shards/{0..1}.tar", dest, size=16, quiet=True)
    with pytest.raises(SourceError, match="cannot be listed"):
        ingest("https://example.invalid/shards/*.tar", dest, size=16, quiet=True)
    assert not os.path.exists(dest) and not os.path.exists(dest + ".partial")


@pytest.mark.parametrize("workers", [0, 2])
def test_unreachable_server_stops_with_a_typed_error_then_resumes(tmp_path, s3_faulty, tars, monkeypatch, workers):
    local, url = _place(tmp_path, s3_faulty, tars)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    ingest(local, a, size=32, workers=0, quiet=True)
    for k, v in FAST_FAIL.items():
        monkeypatch.setenv(k, v)
    proxy = s3_faulty.proxy
    # the last shard's GETs are held: its range is still being read when the first ranges are committed
    proxy.set_delay(1.5, method="GET", path=r"00002\.tar")
    log = os.path.join(b + ".partial", "_ingest_commits.log")

    def stop_after_a_commit() -> None:  # the index is read and a range committed: the server goes away
        deadline = time.monotonic() + 30
        while not (os.path.isfile(log) and os.path.getsize(log)) and time.monotonic() < deadline:
            time.sleep(0.002)
        proxy.stop()

    t = threading.Thread(target=stop_after_a_commit)
    t.start()
    try:
        with pytest.raises(IngestError, match=r"shards/0000[12].tar: could not read .*resume=True"):
            ingest(url, b, size=32, workers=workers, chunk=PER_SHARD, quiet=True)
    finally:
        t.join()
    assert os.path.isdir(b + ".partial")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_faulty.server.endpoint)
    ingest(url, b, size=32, workers=0, quiet=True, resume=True)
    assert_same_files(a, b)


def test_a_saved_index_is_used_only_when_it_is_exactly_these_shards(tmp_path, tars):
    from mmstore.ingest.remote_shards import IndexLog, ShardObjects, load_index, save_index
    from mmstore.ingest.webdataset import TarIndexError, scan_tar

    walks = [scan_tar(lambda n, o, d=data: d[o:o + n], len(data)) for data in tars.values()]
    names = sorted(tars)
    sizes = [len(tars[n]) for n in names]
    objects = ShardObjects(None, "s3://b/shards", names, sizes, ["e0", "e1", "e2"])
    log = IndexLog()
    for k, w in enumerate(walks):
        log.add(names[k], sizes[k], f"e{k}", w)
    path = str(tmp_path / "index.npz")
    save_index(path, objects.folder_url, log, {"json_keys": []})
    got = load_index(path, objects, TarIndexError)
    assert got is not None and [w[0] for w in got[0]] == [w[0] for w in walks]
    other = ShardObjects(None, "s3://b/shards", names, sizes, ["e0", "changed", "e2"])
    assert load_index(path, other, TarIndexError) is None  # a shard replaced since: indexed again
    shorter = ShardObjects(None, "s3://b/shards", names, [sizes[0], 100, sizes[2]], ["e0", "e1", "e2"])
    assert load_index(path, shorter, TarIndexError) is None
    with open(path, "rb") as fh:
        raw = fh.read()
    rng = np.random.default_rng(0)
    for i in range(300):  # a damaged file is ignored, never trusted: no exception, no other index
        bad = bytearray(raw[:int(rng.integers(0, len(raw)))] if i % 2 else raw)
        if not i % 2:
            for at in rng.integers(0, len(raw), int(rng.integers(1, 9))).tolist():
                bad[at] = int(rng.integers(0, 256))
        with open(path, "wb") as fh:
            fh.write(bad)
        got = load_index(path, objects, TarIndexError)
        assert got is None or [w[0] for w in got[0]] == [w[0] for w in walks]


def test_shards_over_http_equal_local_and_need_workers_0(tmp_path, web, tars):  # noqa: F811 - the fixture
    local, _ = _place(tmp_path, web.s3, tars)
    a, b, c = (str(tmp_path / n) for n in "abc")
    ingest(local, a, size=32, workers=0, quiet=True)
    url = web.url(f"shards/{{00000..{SHARDS - 1:05d}}}.tar")  # looked up by HEAD: an HTTP server has no listing
    ingest(url, b, size=32, workers=0, quiet=True)
    assert_same_files(a, b)
    with pytest.raises(IngestError, match=r"http:// shards are read by the ingest's own process only.*--workers 0"):
        ingest(url, c, size=32, workers=2, quiet=True)
    with pytest.raises(SourceError, match=r"1 shard\(s\) it names do not exist"):
        ingest(web.url(f"shards/{{00000..{SHARDS:05d}}}.tar"), c, size=32, workers=0, quiet=True, overwrite=True)


def test_shards_in_azure_blob_storage_equal_local(tmp_path, az, tars):  # noqa: F811 - the fixture
    """``az://`` shards (Azurite on loopback): listed, indexed by ranged GETs and read by the ingest's own
    process, the same store as the local shards; a glob matches by listing; workers > 0 is refused with what
    to do."""
    local = tmp_path / "local"
    local.mkdir()
    for name, data in tars.items():
        (local / name).write_bytes(data)
        az.write(f"shards/{name}", data)
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    ingest(str(local / f"{{00000..{SHARDS - 1:05d}}}.tar"), a, size=32, workers=0, quiet=True)
    ingest(az.url(f"shards/{{00000..{SHARDS - 1:05d}}}.tar"), b, size=32, workers=0, quiet=True)
    assert_same_files(a, b)
    ingest(az.url("shards/*.tar"), c, size=32, workers=0, quiet=True)
    assert_same_files(a, c)
    with pytest.raises(IngestError, match=r"az:// shards are read by the ingest's own process only.*--workers 0"):
        ingest(az.url("shards/*.tar"), d, size=32, workers=2, quiet=True)


def test_shards_in_google_cloud_storage_equal_local(tmp_path, gs, tars, capsys):  # noqa: F811 - the fixture
    """``gs://`` shards (fake-gcs-server on loopback): ``mmstore ingest 'gs://BUCKET/shards/{..}.tar' DEST``
    lists them, indexes them by ranged GETs and reads them in the ingest's own process, the same store as the
    local shards; a glob matches by listing; workers > 0 is refused with what to do."""
    local = tmp_path / "local"
    local.mkdir()
    for name, data in tars.items():
        (local / name).write_bytes(data)
        gs.write(f"shards/{name}", data)
    gs.write("shards/readme.txt", b"not a shard")  # listed beside the shards, matched by neither pattern
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    ingest(str(local / f"{{00000..{SHARDS - 1:05d}}}.tar"), a, size=32, workers=0, quiet=True)
    rc, _, err = run_cli(["ingest", gs.url(f"shards/{{00000..{SHARDS - 1:05d}}}.tar"), b, "--size", "32",
                          "--workers", "0", "-q"], capsys)
    assert rc == 0, err
    assert_same_files(a, b)
    ingest(gs.url("shards/*.tar"), c, size=32, workers=0, quiet=True)
    assert_same_files(a, c)
    with pytest.raises(IngestError, match=r"gs:// shards are read by the ingest's own process only.*--workers 0"):
        ingest(gs.url("shards/*.tar"), d, size=32, workers=2, quiet=True)
    with pytest.raises(SourceError, match=r"1 shard\(s\) it names do not exist"):
        ingest(gs.url(f"shards/{{00000..{SHARDS:05d}}}.tar"), d, size=32, workers=0, quiet=True, overwrite=True)
