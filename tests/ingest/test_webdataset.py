"""WebDataset tar shards as a source: real photographs written into real tars (img2dataset layout) with
``tarfile``; records pixel-equal to a folder ingest of the same JPEGs; captions, .json keys and .cls labels;
brace ranges and globs; truncated shards, corrupt members and hostile headers as holes; byte-identical
whatever the workers and after SIGKILL + resume; GNU long names and pax headers."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compare import assert_same_files
from support.proc import popen_cli, run_cli

import mmstore
from mmstore.errors import AllInputsFailedError, SourceError, StoreURLError
from mmstore.ingest import ingest
from mmstore.ingest.webdataset import expand_pattern, scan_tar, split_name

cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
SHARDS, PER_SHARD = 3, 8


def _add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = 1_700_000_000
    t.addfile(ti, io.BytesIO(data))


def _jpeg(rng: np.random.Generator) -> tuple[bytes, int, int]:
    h, w = (int(v) for v in rng.integers(40, 160, 2))
    y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
    ok, buf = cv2.imencode(".jpg", np.ascontiguousarray(PHOTO[y:y + h, x:x + w, ::-1]),
                           [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes(), h, w


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """``shards/0000{0,1,2}.tar`` in img2dataset's layout (jpg, txt, json, cls) and ``folder/`` holding the
    same JPEG bytes as ``KEY.jpg``; returns (dir, {key: (caption, json, cls)})."""
    d = str(tmp_path_factory.mktemp("wds"))
    os.makedirs(os.path.join(d, "shards"))
    os.makedirs(os.path.join(d, "folder"))
    rng = np.random.default_rng(0)
    meta = {}
    for s in range(SHARDS):
        with tarfile.open(os.path.join(d, "shards", f"{s:05d}.tar"), "w", format=tarfile.USTAR_FORMAT) as t:
            for j in range(PER_SHARD):
                key = f"{s:05d}{j:04d}"
                jpg, h, w = _jpeg(rng)
                with open(os.path.join(d, "folder", key + ".jpg"), "wb") as fh:
                    fh.write(jpg)
                cap = f"a woman in uniform, crop {key} \u00e9"
                doc = {"key": key, "width": w, "height": h, "similarity": 0.25 + j / 8, "url": f"http://x/{key}",
                       "exif": None}
                meta[key] = (cap, doc, j % 3)
                _add(t, key + ".jpg", jpg)
                _add(t, key + ".txt", cap.encode())
                _add(t, key + ".json", json.dumps(doc).encode())
                _add(t, key + ".cls", str(j % 3).encode())
    return d, meta


def _pattern(d: str) -> str:
    return os.path.join(d, "shards", "{00000..00002}.tar")


@pytest.mark.parametrize("mode", [{"size": (48, 40)}, {"max_side": 56}, {"buckets": "48x48,32x64"}])
def test_records_equal_a_folder_ingest_and_fields(tmp_path, shards, mode):
    d, meta = shards
    a, b = str(tmp_path / "tar"), str(tmp_path / "folder")
    r = ingest(_pattern(d), a, workers=0, quiet=True, json_keys="width,height,similarity,url", **mode)
    ingest(os.path.join(d, "folder"), b, workers=0, quiet=True, **mode)
    assert r.records == SHARDS * PER_SHARD and r.skipped == 0
    sa, sb = mmstore.open(a), mmstore.open(b)
    assert len(sa) == len(sb) == SHARDS * PER_SHARD
    sch = sa.schema
    assert [f.name for f in sch][-5:] == ["text", "width", "height", "similarity", "url"]
    assert sch["width"].dtype == np.dtype("<i8") and sch["similarity"].dtype == np.dtype("<f8")
    assert sch["label"].dtype == np.dtype("<i8")
    for i in range(len(sa)):
        ra, rb = sa[i], sb[i]
        key = os.fsdecode(sa.key(i))
        shard, k = key.split("/")
        assert shard == f"{k[:5]}.tar" and os.fsdecode(sb.key(i)) == k + ".jpg"
        for f in ("image", "orig_size", "box", "dst"):
            assert np.array_equal(ra[f], rb[f]), (i, f)
        cap, doc, cls = meta[k]
        assert ra["text"] == cap and int(ra["label"]) == cls
        assert int(ra["width"]) == doc["width"] and int(ra["height"]) == doc["height"]
        assert float(ra["similarity"]) == doc["similarity"] and ra["url"] == doc["url"]
        assert tuple(ra["orig_size"]) == (doc["height"], doc["width"])
    assert mmstore.verify(a).ok


def test_expand_pattern(tmp_path):
    for name in ("0.tar", "1.tar", "2.tar", "10.tar", "00001.tar", "00002.tar", "b.tar"):
        (tmp_path / name).write_bytes(b"")
    p = str(tmp_path)
    assert expand_pattern(f"{p}/{{00001..00002}}.tar") == [f"{p}/00001.tar", f"{p}/00002.tar"]
    assert expand_pattern(f"{p}/{{0..2}}.tar") == [f"{p}/0.tar", f"{p}/1.tar", f"{p}/2.tar"]
    assert expand_pattern(f"{p}/{{2..1}}.tar") == [f"{p}/2.tar", f"{p}/1.tar"]
    assert expand_pattern(f"{p}/{{10,b,0}}.tar") == [f"{p}/10.tar", f"{p}/b.tar", f"{p}/0.tar"]
    assert expand_pattern(f"{p}/?.tar") == [f"{p}/{n}" for n in ("0.tar", "1.tar", "2.tar", "b.tar")]
    # a glob after the braces, and a shard named twice read once
    assert expand_pattern(f"{p}/{{0000,1}}*.tar") == [f"{p}/00001.tar", f"{p}/00002.tar", f"{p}/1.tar",
                                                       f"{p}/10.tar"]
    assert expand_pattern(f"{p}/{{1,1}}.tar") == [f"{p}/1.tar"]
    with pytest.raises(SourceError, match=r"1 shard\(s\) it names do not exist \(the first: .*3.tar"):
        expand_pattern(f"{p}/{{0..3}}.tar")
    with pytest.raises(SourceError, match="matches no file"):
        expand_pattern(f"{p}/x*.tar")
    # URLs: a scheme mmstore does not read is named with those it reads; a glob needs a listing
    with pytest.raises(StoreURLError, match="ftp:// is not a scheme mmstore reads.*s3://"):
        expand_pattern("ftp://host/shards/{00000..00009}.tar")
    with pytest.raises(SourceError, match="cannot be listed"):
        ingest("https://example.invalid/shards/*.tar", str(tmp_path / "s"), size=8, quiet=True)


def test_brace_range_and_glob_give_the_same_store(tmp_path, shards, capsys):
    d, _ = shards
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    rc, _, err = run_cli(["ingest", _pattern(d), a, "--size", "32x32", "--workers", "0", "-q"], capsys)
    assert rc == 0, err
    ingest(os.path.join(d, "shards", "*.tar"), b, size=32, workers=0, quiet=True)
    assert_same_files(a, b)
    one = str(tmp_path / "one")
    ingest(os.path.join(d, "shards", "00001.tar"), one, size=32, workers=0, quiet=True)
    s = mmstore.open(one)
    assert [os.fsdecode(s.key(i)) for i in range(len(s))] == [f"00001.tar/00001{j:04d}" for j in range(PER_SHARD)]


def _copy_shards(d: str, dst: str) -> None:
    os.makedirs(dst)
    for s in range(SHARDS):
        with open(os.path.join(d, "shards", f"{s:05d}.tar"), "rb") as fh:
            data = fh.read()
        with open(os.path.join(dst, f"{s:05d}.tar"), "wb") as fh:
            fh.write(data)


def test_truncated_shard_and_corrupt_member_are_listed(tmp_path, shards):
    d, _ = shards
    src = str(tmp_path / "src")
    _copy_shards(d, src)
    # shard 1: cut in the middle of sample 3's JPEG; shard 2: sample 5's JPEG bytes garbled
    with tarfile.open(os.path.join(src, "00001.tar")) as t:
        m = t.getmember("000010003.jpg")
    with open(os.path.join(src, "00001.tar"), "r+b") as fh:
        fh.truncate(m.offset_data + m.size // 2)
    with tarfile.open(os.path.join(src, "00002.tar")) as t:
        m = t.getmember("000020005.jpg")
    with open(os.path.join(src, "00002.tar"), "r+b") as fh:
        fh.seek(m.offset_data + 200)
        fh.write(b"\xff\xd9" + b"\0" * (m.size - 300))
    dest = str(tmp_path / "s")
    r = ingest(os.path.join(src, "{00000..00002}.tar"), dest, size=32, workers=0, quiet=True)
    assert r.slots == PER_SHARD + 4 + PER_SHARD  # shard 1 keeps samples 0-2 and lists sample 3
    holes = {e["key"]: e["reason"] for e in mmstore.open(dest).skipped()}
    assert set(holes) == {"00001.tar/000010003", "00002.tar/000020005"}
    cut = holes["00001.tar/000010003"]
    assert cut.startswith("truncated: member '000010003.jpg'") and "(shard 00001.tar)" in cut
    assert holes["00002.tar/000020005"].split(":")[0] in ("corrupt", "truncated")
    assert any("shards cut short" in k for k in r.warnings)
    with open(os.path.join(dest, "errors.jsonl")) as fh:
        rows = [json.loads(x) for x in fh]
    assert {x["key"] for x in rows} == set(holes)


def test_missing_members_and_json_keys_follow_the_rule(tmp_path, shards):
    d, _ = shards
    src = str(tmp_path / "s.tar")
    rng = np.random.default_rng(5)
    with tarfile.open(src, "w") as t:
        for j, doc in enumerate([{"w": 3, "s": "x"}, {"w": None, "s": "y"}, {"s": "z"}, {"w": 2.0, "s": "q"},
                                 {"w": 2.5, "s": "q"}, {"w": 1, "s": 7}]):
            jpg, _, _ = _jpeg(rng)
            _add(t, f"k{j}.jpg", jpg)
            _add(t, f"k{j}.json", json.dumps(doc).encode())
            if j != 3:
                _add(t, f"k{j}.txt", b"cap")
        _add(t, "k9.json", b"{}")  # a sample without an image
    dest = str(tmp_path / "out")
    r = ingest(src, dest, size=16, workers=0, quiet=True, json_keys=["w", "s"])
    holes = {e["key"]: e["reason"] for e in mmstore.open(dest).skipped()}
    assert r.records == 1 and holes.keys() == {f"s.tar/k{j}" for j in (1, 2, 3, 4, 5, 9)}
    assert holes["s.tar/k1"] == "missing-field: the .json has no value for 'w'"
    assert holes["s.tar/k2"] == "missing-field: the .json has no value for 'w'"
    assert holes["s.tar/k3"] == "missing-field: the sample has no .txt member (shard s.tar)"
    assert holes["s.tar/k4"].startswith("bad-field: .json key 'w' is 2.5")
    assert holes["s.tar/k5"].startswith("bad-field: .json key 's' is 7")
    assert holes["s.tar/k9"] == ("missing-field: the sample has no image member (.jpg, .jpeg, .png or .webp) "
                                 "(shard s.tar)")
    with pytest.raises(SourceError, match=r"key\(s\) \['nope'\] have no value"):
        ingest(src, str(tmp_path / "n"), size=16, workers=0, quiet=True, json_keys="nope")
    assert not os.path.exists(str(tmp_path / "n.partial"))
    with pytest.raises(SourceError, match="do.*not apply"):
        ingest(src, str(tmp_path / "n"), size=16, workers=0, quiet=True, text_column="x")


def test_workers_and_sigkill_resume_give_the_same_bytes(tmp_path, shards):
    d, _ = shards
    pat = _pattern(d)
    args = ["--size", "40x40", "--json-keys", "width,similarity", "--codec", "image=jpeg:90", "-q"]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert popen_cli(["ingest", pat, a, "--workers", "0", *args]).wait(120) == 0
    assert popen_cli(["ingest", pat, b, "--workers", "2", "--chunk", "1", *args]).wait(120) == 0
    assert_same_files(a, b)
    c = str(tmp_path / "c")
    p = popen_cli(["ingest", pat, c, "--workers", "1", "--chunk", "1", *args], env={"MMSTORE_CRASH_AT": "commit:3"})
    assert p.wait(120) == 77 and os.path.isdir(c + ".partial")
    assert popen_cli(["ingest", pat, c, "--workers", "2", "--resume", *args]).wait(120) == 0
    assert_same_files(a, c)
    e = str(tmp_path / "e")
    p = popen_cli(["ingest", pat, e, "--workers", "1", "--chunk", "1", *args])
    deadline = time.monotonic() + 60
    while not os.path.isdir(e + ".partial") and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    p.send_signal(signal.SIGKILL)
    p.wait(60)
    assert popen_cli(["ingest", pat, e, "--workers", "2", "--resume", *args]).wait(120) == 0
    assert_same_files(a, e)


def test_resume_refuses_a_changed_shard(tmp_path, shards):
    d, _ = shards
    src = str(tmp_path / "src")
    _copy_shards(d, src)
    pat = os.path.join(src, "{00000..00002}.tar")
    dest = str(tmp_path / "s")
    p = popen_cli(["ingest", pat, dest, "--size", "16", "--workers", "0", "--chunk", "1", "-q"],
                  env={"MMSTORE_CRASH_AT": "commit:2"})
    assert p.wait(120) == 77
    shard = os.path.join(src, "00002.tar")
    with tarfile.open(shard) as t:
        m = t.getmember("000020001.txt")
    st0 = os.stat(shard)
    with open(shard, "r+b") as fh:  # a caption edited in place: same names, offsets and sizes
        fh.seek(m.offset_data)
        fh.write(b"A")
    os.utime(shard, ns=(st0.st_atime_ns, st0.st_mtime_ns + 10**9))
    with pytest.raises(mmstore.errors.ResumeMismatchError, match="input files changed"):
        ingest(pat, dest, size=16, workers=0, quiet=True, resume=True)


def test_gnu_long_names_and_pax_headers(tmp_path):
    rng = np.random.default_rng(1)
    long_dir = "d" * 120 + "/sub"
    names = []
    for fmt, tag in ((tarfile.GNU_FORMAT, "gnu"), (tarfile.PAX_FORMAT, "pax")):
        with tarfile.open(str(tmp_path / f"{tag}.tar"), "w", format=fmt) as t:
            for j in range(2):
                key = f"{long_dir}/{tag}_{'k' * 90}{j}"
                jpg, _, _ = _jpeg(rng)
                _add(t, key + ".jpg", jpg)
                _add(t, key + ".txt", f"{tag} {j}".encode())
                names.append(key)
    with open(str(tmp_path / "gnu.tar"), "rb") as fh:
        assert b"././@LongLink" in fh.read(2048)  # the GNU long-name member is really there
    dest = str(tmp_path / "s")
    r = ingest(str(tmp_path / "*.tar"), dest, size=16, workers=0, quiet=True)
    s = mmstore.open(dest)
    assert r.records == 4
    got = [os.fsdecode(s.key(i)) for i in range(4)]
    assert got == [f"gnu.tar/{n}" for n in names[:2]] + [f"pax.tar/{n}" for n in names[2:]]
    assert [s[i]["text"] for i in range(4)] == ["gnu 0", "gnu 1", "pax 0", "pax 1"]
    assert split_name(b"a.b/c/000.tar.jpg") == (b"a.b/c/000", b"tar.jpg")


def _header(name: bytes, size_field: bytes) -> bytes:
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b"0000644\0"
    h[108:116] = b"0000000\0"
    h[116:124] = b"0000000\0"
    h[124:136] = size_field
    h[136:148] = b"00000000000\0"
    h[156:157] = b"0"
    h[257:263] = b"ustar\0"
    h[263:265] = b"00"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


@pytest.mark.parametrize("size_field, reason", [
    (b"12x45\0     ", "bad-tar: header at offset {at}: size field is not an octal number"),
    (b"\xff" * 12, "bad-tar: header at offset {at}: negative size (base-256)"),
    (b"77777777777\0", "truncated: member 'evil.jpg' at offset {at} needs 8,589,934,591 bytes"),
    (b"\x80" + b"\xff" * 11, "truncated: member 'evil.jpg' at offset {at} needs"),
])
def test_hostile_headers_are_holes_not_crashes(tmp_path, size_field, reason):
    jpg, _, _ = _jpeg(np.random.default_rng(2))
    ok = _header(b"ok.jpg", b"%011o\0" % len(jpg)) + jpg + b"\0" * (-len(jpg) % 512)
    with open(str(tmp_path / "b.tar"), "wb") as fh:
        fh.write(ok + _header(b"evil.jpg", size_field) + b"\0" * 1024)
    dest = str(tmp_path / "s")
    r = ingest(str(tmp_path / "b.tar"), dest, size=16, workers=0, quiet=True)
    holes = {e["key"]: e["reason"] for e in mmstore.open(dest).skipped()}
    assert r.records == 1 and list(holes) == ["b.tar/evil"]
    assert holes["b.tar/evil"].startswith(reason.format(at=len(ok))), holes
    # a file that is no tar at all: its one hole, and a typed error as every input failed
    (tmp_path / "c.tar").write_bytes(b"not a tar " * 100)
    with pytest.raises(AllInputsFailedError, match="bad-tar: header at offset 0: checksum mismatch"):
        ingest(str(tmp_path / "c.tar"), str(tmp_path / "t"), size=16, workers=0, quiet=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3583), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(0, 3584))
def test_scan_tar_survives_any_damage(tmp_path_factory, edits, cut):
    path = tmp_path_factory.getbasetemp() / "fuzz.tar"
    if not path.exists():
        with tarfile.open(str(path) + ".src", "w", format=tarfile.GNU_FORMAT) as t:
            _add(t, "x" * 120 + ".jpg", b"\1" * 700)
            _add(t, "b.txt", b"hello")
        os.replace(str(path) + ".src", path)
    data = bytearray(path.read_bytes())[:3584]
    for pos, val in edits:
        if pos < len(data):
            data[pos] = val
    data = data[:cut]
    out = tmp_path_factory.getbasetemp() / "fuzz_case.tar"
    out.write_bytes(bytes(data))
    fd = os.open(out, os.O_RDONLY)
    try:
        members, problem, _ = scan_tar(fd, len(data))
    finally:
        os.close(fd)
    for _, off, size in members:
        assert 0 <= off and off + size <= len(data)
    if problem is not None:
        assert problem.reason.split(":")[0] in ("truncated", "bad-tar")


def test_a_range_of_a_shard_not_in_the_page_cache_is_read_ahead(tmp_path):
    """Before a worker decodes a range of local samples, the kernel is asked to read that range's span of
    the shard in one request: the span becomes resident without a single member read."""
    from mmstore._os.cache import evict, resident_bytes
    from mmstore.ingest.webdataset import WebDatasetSource

    dst = tmp_path / "shards"
    dst.mkdir()
    big = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with tarfile.open(dst / "00000.tar", "w", format=tarfile.USTAR_FORMAT) as t:  # 24 samples of 1 MiB
        for j in range(24):
            _add(t, f"k{j:03d}.jpg", big[j:] + big[:j])
    src = WebDatasetSource(str(dst / "00000.tar"))
    src.scan()
    path = str(dst / "00000.tar")
    evict(path, sync=True)
    before = resident_bytes(path)[0]
    src.prepare_range(4, 12)
    want = int(src.span_hi[11] - src.span_lo[4])
    deadline = time.monotonic() + 10  # the kernel reads it asynchronously (a hint: most of it, not a promise)
    while resident_bytes(path)[0] - before < want // 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert resident_bytes(path)[0] - before >= want // 2
