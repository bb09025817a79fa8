"""The tools side: damaged or crafted stores never crash, hang or write
outside the store; every command ends with one line and exit 1 or 2.

Anything that could kill the interpreter (SIGBUS in LMDB, OpenCV on odd text) runs in a
child process.
"""

from __future__ import annotations

import csv
import errno
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.faults import drop_dac_override, flip_bit, flip_lmdb_bits, rewrite_file, sync_manifest
from support.images import make_folder
from support.proc import cli_env, run_cli, run_json, run_sub
from support.stores import write_store

import mmstore
import mmstore.check.repair as repair_mod
import mmstore.check.verify as verify_mod
from mmstore.check.common import dumps
from mmstore.check.repair import SourceGone, check_template, repair_store
from mmstore.check.verify import verify_store
from mmstore.check.verify_lmdb import _run_child
from mmstore.decode import DecodeSpec
from mmstore.errors import FormatError
from mmstore.format.names import ascii_text
from mmstore.ingest import ingest

cv2 = pytest.importorskip("cv2")


def _one_line_error(proc, codes=(1, 2)):
    """The command failed cleanly: an expected exit code, no traceback, and
    exactly one line on stderr (the text report, if any, is on stdout)."""
    assert proc.returncode in codes, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 1, proc.stderr
    assert lines or proc.stdout.strip(), "no message at all"
    return (lines[0] if lines else proc.stdout)


# --------------------------------------------------------------------------
# a flipped byte in records.mdb never kills verify


_VERIFY_ALL = textwrap.dedent("""
    import json, sys
    from mmstore.check.verify import verify_store
    for path in sys.argv[1:]:
        print("START", path, flush=True)
        rep = verify_store(path, threads=1)
        print(json.dumps({"path": path, "ok": rep.ok, "problems": [p.kind for p in rep.problems],
                          "problem_text": [p.message for p in rep.problems],
                          "bad": [[b.slot, b.what] for b in rep.bad_records]}), flush=True)
""")


def _verify_in_child(paths):
    """verify_store of each path, in one child interpreter; the parsed
    reports (a signal death of the child fails the test, naming the store)."""
    p = subprocess.run([sys.executable, "-c", _VERIFY_ALL, *paths], capture_output=True, text=True, env=cli_env(),
                       timeout=900)
    started = [ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("START ")]
    assert p.returncode == 0, f"verify died ({p.returncode}) on {started[-1:]}: {p.stderr[-2000:]}"
    return [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]


@pytest.mark.soak  # a random sample whose strength is its count: CI's soak step
def test_random_byte_flips_in_records_mdb_never_kill_verify(tmp_path):
    """30 seeded single-byte changes across records.mdb (half of them in the
    page headers and node pointers, where a change makes LMDB read outside
    its map): verify reports each one, never dies of a signal."""
    clean = write_store(tmp_path / "clean", 300, backend="lmdb")
    with open(os.path.join(clean, "records.mdb"), "rb") as fh:
        orig = fh.read()
    rng = random.Random(1)
    paths = []
    for t in range(30):
        off = rng.randrange(len(orig)) if t % 2 else rng.randrange(len(orig) // 4096) * 4096 + rng.randrange(24)
        data = bytearray(orig)
        data[off] ^= rng.randrange(1, 256)
        p = str(tmp_path / f"flip{t:02d}")
        shutil.copytree(clean, p)
        with open(os.path.join(p, "records.mdb"), "wb") as fh:
            fh.write(data)
        paths.append(p)
    reps = _verify_in_child([clean, *paths])
    assert len(reps) == 31 and reps[0]["ok"]
    found = [r for r in reps[1:] if not r["ok"]]
    assert len(found) >= 15  # most flips hit live bytes; the rest land in free space
    # at least one flip made the reader die or LMDB fail: reported as damage, records named
    damaged = [r for r in found if "lmdb-damaged" in r["problems"]]
    assert damaged, [r["problems"] for r in found]
    for r in damaged:
        assert any("walking it failed" in t for t in r["problem_text"])


def _find_killing_flip(clean, tmp_path):
    """A single-byte change of records.mdb that kills a plain reader (found by
    trying node-pointer bytes of each page in a child; deterministic for a
    given file)."""
    with open(os.path.join(clean, "records.mdb"), "rb") as fh:
        orig = fh.read()
    probe = str(tmp_path / "probe.mdb")
    for page in range(2, len(orig) // 4096):
        for off in (17, 19, 21):
            data = bytearray(orig)
            data[page * 4096 + off] ^= 0x40
            with open(probe, "wb") as fh:
                fh.write(data)
            if _run_child("walk", probe, -1, -1, False).death is not None:
                return page * 4096 + off, bytes(data)
    pytest.fail("no single-byte change of records.mdb killed the reader")


def test_records_after_a_killing_page_are_narrowed_down(tmp_path):
    clean = write_store(tmp_path / "clean", 300, backend="lmdb")
    off, data = _find_killing_flip(clean, tmp_path)
    bad = str(tmp_path / "bad")
    shutil.copytree(clean, bad)
    with open(os.path.join(bad, "records.mdb"), "wb") as fh:
        fh.write(data)
    p = run_sub(["verify", bad, "--json"])
    assert p.returncode == 1, p.stderr
    rep = json.loads(p.stdout)
    kinds = [pr["kind"] for pr in rep["problems"]]
    assert "lmdb-damaged" in kinds
    assert "the reader process died" in rep["problems"][kinds.index("lmdb-damaged")]["message"]
    unreadable = [b["slot"] for b in rep["bad_records"] if b["what"] == "unreadable"]
    # narrowed down: some records named, not the whole file given up
    assert 0 < len(unreadable) < 300 and len(unreadable) == len(set(unreadable))
    assert all(b["key"] == f"in/{b['slot']:05d}.jpg" for b in rep["bad_records"] if b["slot"] >= 0)
    # the text report says the same in one run of the CLI, and repair refuses
    p = run_sub(["verify", bad, "--repair"])
    assert p.returncode == 1 and "unreadable" in p.stdout and "refused" in p.stdout, p.stdout
    with open(os.path.join(bad, "records.mdb"), "rb") as fh:
        assert fh.read() == data  # repair did not touch it


def test_verify_quick_on_a_killing_lmdb_is_exit_1(tmp_path):
    clean = write_store(tmp_path / "clean", 300, backend="lmdb")
    rc = run_sub(["verify", clean, "--quick"]).returncode
    assert rc == 0
    # a store whose meta pages point outside the file: the key count itself cannot be read
    bad = str(tmp_path / "bad")
    shutil.copytree(clean, bad)
    with open(os.path.join(bad, "records.mdb"), "r+b") as fh:
        fh.truncate(8192)  # both meta pages kept, every data page gone
    sync_manifest(bad, "records.mdb", digest=True)
    for argv in (["verify", bad, "--quick"], ["verify", bad]):
        p = run_sub(argv)
        assert p.returncode == 1 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
        assert "records.mdb" in p.stdout and "FAILED" in p.stdout


# --------------------------------------------------------------------------
# show draws any key or label name


def test_ascii_text_escapes_every_non_ascii_name():
    assert ascii_text("in/cat_01.jpg") == "in/cat_01.jpg"
    assert ascii_text(os.fsdecode(b"caf\xe9.jpg")) == "caf\\xe9.jpg"  # the byte of a Latin-1 name
    assert ascii_text("café") == "caf\\u00e9"  # a UTF-8 name: its code point
    assert ascii_text("a\\b\n\t\x00😀") == "a\\\\b\\u000a\\u0009\\u0000\\U0001f600"
    for s in (os.fsdecode(bytes(range(256))), "".join(map(chr, range(0x2000))), "\udcff\ud800"):
        t = ascii_text(s)
        assert t.isascii() and t.isprintable()


def test_show_non_utf8_key_and_label_name(tmp_path):
    """Keys and label names that are not valid UTF-8 (and emoji, controls):
    `show` runs in a child (it used to segfault in OpenCV), draws escaped
    captions, and --json gives back the names losslessly."""
    raw_keys = [b"caf\xe9/\xff\xfe.jpg", "ca\u00f1a/😀.png".encode(), b"nl\n\ttab\x00z", b"plain.png"]
    names = [os.fsdecode(b"chat-\xe9"), "\u00e9t\u00e9", "x\udcff\ud800"[:2], "ok"]
    store = str(tmp_path / "s")
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(store, {"image": ("|u1", (8, 8, 3)), "label": ("<i8", ())}, slots=4,
                             label_names=["a", "b", "c", "d"]) as w:
        for i, k in enumerate(raw_keys):
            w.write(i, {"image": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "label": i}, key=k)
    mp = os.path.join(store, "manifest.json")  # label names as a crafted (or future) manifest holds them
    with open(mp) as fh:
        m = json.load(fh)
    m["label_names"] = names
    with open(mp, "w") as fh:
        json.dump(m, fh, ensure_ascii=True)  # a lone surrogate is the JSON escape \udce9
    out = str(tmp_path / "grid.png")
    p = run_sub(["show", store, "-o", out, "--json"])
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert {os.fsencode(t["key"]) for t in rep["tiles"]} == set(raw_keys)
    assert {t["label_name"] for t in rep["tiles"]} == set(names)
    assert cv2.imread(out) is not None
    p = run_sub(["show", store, "-o", out])  # the text output prints them escaped, valid UTF-8 as it is
    assert p.returncode == 0, p.stderr
    assert "caf\\xe9/\\xff\\xfe.jpg" in p.stdout and "ca\u00f1a/😀.png" in p.stdout
    assert "nl\\n\\ttab\\x00z" in p.stdout and "(chat-\\xe9)" in p.stdout


def test_json_output_of_non_utf8_names_round_trips():
    name = os.fsdecode(b"caf\xe9")
    text = dumps({"key": name, "label": "\u00e9t\u00e9"})
    text.encode("utf-8")  # printable on any UTF-8 stream
    assert os.fsencode(json.loads(text)["key"]) == b"caf\xe9" and json.loads(text)["label"] == "\u00e9t\u00e9"
    assert "\u00e9t\u00e9" in dumps({"label": "\u00e9t\u00e9"})  # valid UTF-8 stays readable


def test_verify_names_a_bad_record_with_a_non_utf8_key(tmp_path, capsys):
    store = str(tmp_path / "s")
    with mmstore.StoreWriter(store, {"x": ("|u1", (16,))}, slots=3) as w:
        for i in range(3):
            w.write(i, {"x": np.full(16, i, np.uint8)}, key=b"r\xe9cord-%d" % i)
    with mmstore.open(store) as s:
        path, off, nb = s.slot_view.backend.field_location("x")
    flip_bit(path, off + nb + 3)
    rc, rep = run_json(["verify", store], capsys)
    assert rc == 1 and os.fsencode(rep["bad_records"][0]["key"]) == b"r\xe9cord-1"
    p = run_sub(["verify", store])
    assert p.returncode == 1 and "r\\udce9cord-1" in p.stdout, p.stdout


# --------------------------------------------------------------------------
# nothing is written outside the store; symlinks are flagged


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("src"))
    make_folder(d, ("cat", "dog"), per_class=12, exts=(".png",), name="{:03d}")
    return d


def _ingest(src, dest, backend="memmap", **kw):
    ingest(src, dest, size=(16, 16), backend=backend, workers=0, quiet=True, **kw)
    return dest


def _damage_image(store, index):
    with mmstore.open(store) as s:
        slot = s.slot_view.slot(index)
        path, off, nb = s.slot_view.backend.field_location("image")
    flip_bit(path, off + slot * nb + 5, bit=2)
    return slot


def test_verify_flags_a_symlink_even_to_identical_bytes(tmp_path, capsys):
    store = write_store(tmp_path / "s", 10)
    copy = str(tmp_path / "elsewhere.npy")
    shutil.copyfile(os.path.join(store, "image.npy"), copy)
    os.unlink(os.path.join(store, "image.npy"))
    os.symlink(copy, os.path.join(store, "image.npy"))
    rc, rep = run_json(["verify", store], capsys)
    assert rc == 1 and [(p["kind"], p["file"]) for p in rep["problems"]] == [("symlink", "image.npy")]
    assert "elsewhere.npy" in rep["problems"][0]["message"]


def test_repair_refuses_to_write_through_a_symlinked_data_file(tmp_path, folder, capsys):
    store = _ingest(folder, str(tmp_path / "s"))
    _damage_image(store, 3)
    outside = str(tmp_path / "outside.npy")
    os.rename(os.path.join(store, "image.npy"), outside)
    os.symlink(outside, os.path.join(store, "image.npy"))
    with open(outside, "rb") as fh:
        before = fh.read()
    rc, out, _ = run_cli(["verify", store, "--repair"], capsys)
    assert rc == 1 and "symlink" in out and "refused" in out
    # even when handed a report that does not mention the link, repair does not write through it
    os.unlink(os.path.join(store, "image.npy"))
    shutil.copyfile(outside, os.path.join(store, "image.npy"))
    report = verify_store(store)
    assert report.bad_count == 1 and not report.problems
    os.unlink(os.path.join(store, "image.npy"))
    os.symlink(outside, os.path.join(store, "image.npy"))
    with pytest.raises(FormatError, match="symbolic link"):
        repair_store(store, report)
    with open(outside, "rb") as fh:
        assert fh.read() == before


def test_repair_writes_nothing_next_to_the_store(tmp_path, folder, capsys):
    parent = tmp_path / "p"
    parent.mkdir()
    store = _ingest(folder, str(parent / "s"), backend="lmdb")
    fresh = str(tmp_path / "fresh")
    shutil.copytree(store, fresh)
    flip_lmdb_bits(store, [4], 9, digest=True)
    seen = []
    real_mkdir = os.mkdir

    def spy(path, *a, **kw):
        seen.append(os.fspath(path))
        return real_mkdir(path, *a, **kw)

    os.mkdir = spy
    try:
        rc, rep = run_json(["verify", store, "--repair"], capsys)
    finally:
        os.mkdir = real_mkdir
    assert rc == 0 and rep["repair"]["repaired"] == [4], rep
    assert sorted(os.listdir(parent)) == ["s"]
    assert seen and all(os.path.dirname(p) == store for p in seen)  # its work directory was inside
    assert sorted(os.listdir(store)) == sorted(os.listdir(fresh))


def _store_with_provenance(tmp_path, source, slots=4):
    """A memmap store claiming ``source`` as its provenance, record 1 damaged."""
    prov = {"source": source, "ingest": {"params": {"decode": DecodeSpec(size=(8, 8)).to_dict()}}}
    store = str(tmp_path / "s")
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(store, {"image": ("|u1", (8, 8, 3)), "label": ("<i8", ())}, slots=slots,
                             provenance=prov) as w:
        for i in range(slots):
            w.write(i, {"image": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), "label": 0},
                    key=f"{i:03d}.png" if i != 2 else "../../etc/passwd")
    _damage_image(store, 1)
    _damage_image(store, 2)
    return store


def _limited_sub(argv, limit_bytes=1 << 30):
    """The CLI in a child whose address space is capped (a 3 GB request fails)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes * 3, limit_bytes * 3))

    return run_sub(argv, timeout=300, preexec_fn=cap)


def test_repair_refuses_a_crafted_path_template(tmp_path):
    csv = tmp_path / "list.csv"
    csv.write_text("id\n000\n")
    store = _store_with_provenance(tmp_path, {"kind": "list", "path": str(csv), "root": str(tmp_path),
                                              "path_template": "{id:>3000000000}"})
    p = _limited_sub(["verify", store, "--repair"])
    assert p.returncode == 1 and "refused" in p.stdout and "path_template" in p.stdout, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stdout


@pytest.mark.parametrize("tmpl", ["{id.__class__}", "{id!r}", "{id[0]:>99999}", "{0[1]:{id}}", "{", "{x}"])
def test_repair_allows_only_key_indexing_in_a_path_template(tmpl):
    with pytest.raises(SourceGone):
        check_template(tmpl)
    for ok in ("{id}", "{id[0]}/{id[1]}/{id}.jpg", "{}.png", "{0:0>8}.jpg", None):
        assert check_template(ok) == ok


def test_repair_refuses_a_decode_spec_that_does_not_fit_the_store(tmp_path):
    store = _store_with_provenance(tmp_path, {"kind": "folder", "path": str(tmp_path)})
    with open(os.path.join(store, "manifest.json")) as fh:
        m = json.load(fh)
    m["provenance"]["ingest"]["params"]["decode"] = DecodeSpec(size=(40000, 40000)).to_dict()
    with open(os.path.join(store, "manifest.json"), "w") as fh:
        json.dump(m, fh)
    p = _limited_sub(["verify", store, "--repair"])
    assert p.returncode == 1 and "refused" in p.stdout and "(40000, 40000, 3)" in p.stdout, (p.stdout, p.stderr)


def test_repair_keys_do_not_leave_the_source_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    store = _store_with_provenance(tmp_path, {"kind": "folder", "path": str(src)})
    p = run_sub(["verify", store, "--repair", "--json"])
    rep = json.loads(p.stdout)
    assert p.returncode == 1
    reasons = {f["slot"]: f["reason"] for f in rep["repair"]["failed"]}
    assert "leads outside the source folder" in reasons[2]
    assert "unreadable" in reasons[1]  # 001.png is not there: an honest miss


# --------------------------------------------------------------------------
# one line and exit 1 or 2, never a traceback


@pytest.mark.parametrize("cmd", ["verify", "inspect", "show", "warm", "evict", "doctor", "bench", "convert"])
def test_store_is_a_regular_file(tmp_path, cmd):
    f = tmp_path / "file.store"
    f.write_text("not a store")
    extra = {"show": ["-o", tmp_path / "g.png"], "convert": [tmp_path / "out", "--backend", "lmdb"],
             "bench": ["--max-seconds", "0.1"]}
    p = run_sub([cmd, f, *extra.get(cmd, [])])
    line = _one_line_error(p, codes=(2,))
    assert "not a store" in line and str(f) in line


def test_permission_denied_on_a_store_file(tmp_path):
    store = write_store(tmp_path / "s", 10)
    os.chmod(os.path.join(store, "_keys.bin"), 0)
    os.chmod(os.path.join(store, "image.npy"), 0)
    as_user = drop_dac_override if os.geteuid() == 0 else None  # root ignores permissions otherwise
    try:
        for argv in (["verify", store], ["inspect", store], ["show", store, "-o", tmp_path / "g.png"]):
            p = run_sub(argv, preexec_fn=as_user)
            if argv[0] == "verify":
                assert p.returncode == 1 and "permission denied" in p.stdout.lower() and "Traceback" not in p.stderr
            else:
                assert "permission denied" in _one_line_error(p, codes=(1,)).lower()
    finally:
        os.chmod(os.path.join(store, "_keys.bin"), 0o644)
        os.chmod(os.path.join(store, "image.npy"), 0o644)


def test_dangling_symlinked_data_file(tmp_path):
    store = write_store(tmp_path / "s", 10)
    os.unlink(os.path.join(store, "image.npy"))
    os.symlink(str(tmp_path / "gone.npy"), os.path.join(store, "image.npy"))
    p = run_sub(["verify", store])
    assert p.returncode == 1 and "[symlink] image.npy" in p.stdout and "Traceback" not in p.stderr
    for argv in (["inspect", store], ["show", store, "-o", tmp_path / "g.png"], ["warm", store]):
        _one_line_error(run_sub(argv), codes=(1,))


def test_show_into_a_missing_folder_or_into_the_store(tmp_path):
    store = write_store(tmp_path / "s", 10)
    line = _one_line_error(run_sub(["show", store, "-o", "/nonexistent/dir/x.png"]), codes=(2,))
    assert "/nonexistent/dir" in line and "does not exist" in line
    line = _one_line_error(run_sub(["show", store, "-o", os.path.join(store, "grid.png")]), codes=(2,))
    assert "inside the store" in line and not os.path.exists(os.path.join(store, "grid.png"))


@pytest.mark.parametrize("argv", [["inspect", "--image-field", "nosuch"], ["inspect", "--label-field", "nosuch"],
                                  ["show", "--image-field", "nosuch"], ["show", "--label-field", "score"]])
def test_unknown_or_unfit_field_is_a_usage_error(tmp_path, argv):
    store = write_store(tmp_path / "s", 10)
    extra = ["-o", tmp_path / "g.png"] if argv[0] == "show" else []
    line = _one_line_error(run_sub([argv[0], store, *argv[1:], *extra]), codes=(2,))
    assert repr(argv[2]) in line


def test_manifest_integer_over_4300_digits(tmp_path):
    store = write_store(tmp_path / "s", 10)
    mp = os.path.join(store, "manifest.json")
    with open(mp) as fh:
        text = fh.read()
    with open(mp, "w") as fh:
        fh.write(text.replace('"slots": 10', '"slots": ' + "9" * 5000))
    p = run_sub(["verify", store])
    assert p.returncode == 1 and "[manifest]" in p.stdout and "Traceback" not in p.stderr
    for cmd in ("inspect", "warm", "doctor"):
        line = _one_line_error(run_sub([cmd, store]), codes=(1,))
        assert f"mmstore {cmd}: {mp}: " in line and "manifest is damaged" in line, line


@pytest.mark.parametrize("line", [b"[1, 2]", b"42", b'{"slot": "3"}', b"[" * 100_000, b"\xff\xfe",
                                  b'{"slot": ' + b"9" * 5000 + b', "key": "k", "reason": "r"}'])
def test_malformed_errors_jsonl_entries(tmp_path, line, capsys):
    store = write_store(tmp_path / "s", 10, holes=(3,))
    rewrite_file(store, "errors.jsonl", line + b"\n", digest=True)
    rc, rep = run_json(["verify", store], capsys)
    assert rc == 1 and [p["kind"] for p in rep["problems"]] == ["errors"], rep["problems"]
    assert len(rep["problems"][0]["message"]) < 400
    line = _one_line_error(run_sub(["inspect", store]), codes=(1,))
    assert "errors.jsonl: line 1" in line and line.endswith("the file is damaged"), line


def test_csv_field_over_128_kib(tmp_path):
    """A cell over the csv module's default 128 KiB limit is read (a long
    caption is a caption): here a 200 KiB path, which no file system takes,
    so its input is a hole whose reason says so, and the run says it."""
    csv = tmp_path / "list.csv"
    cv2.imwrite(str(tmp_path / "b.png"), np.zeros((8, 8, 3), np.uint8))
    csv.write_text("path,label\n" + "a" * (200 * 1024) + ",1\nb.png,2\n")
    p = run_sub(["ingest", csv, tmp_path / "out", "--size", "8x8", "--workers", "0"])
    assert p.returncode == 0, p.stderr
    assert "unreadable: [Errno 36]" in p.stdout + p.stderr
    with open(tmp_path / "out" / "errors.jsonl", encoding="utf-8") as fh:
        (err,) = [json.loads(line) for line in fh]
    assert err["slot"] == 0 and err["key"] == "a" * (200 * 1024) and err["reason"].startswith("unreadable: [Errno 36]")


def test_repair_whose_lmdb_source_lacks_data_mdb(tmp_path):
    import lmdb

    src = str(tmp_path / "src_lmdb")
    env = lmdb.open(src, map_size=1 << 24)
    rng = np.random.default_rng(0)
    with env.begin(write=True) as txn:
        for i in range(6):
            ok, buf = cv2.imencode(".png", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8))
            txn.put(b"img%03d" % i, buf.tobytes())
    env.close()
    store = _ingest(src, str(tmp_path / "s"))
    _damage_image(store, 2)
    os.unlink(os.path.join(src, "data.mdb"))
    p = run_sub(["verify", store, "--repair"])
    assert p.returncode == 1 and "refused" in p.stdout and "Traceback" not in p.stderr, (p.stdout, p.stderr)


def test_any_exception_is_one_line_and_debug_shows_the_traceback(tmp_path, monkeypatch, capsys):
    store = write_store(tmp_path / "s", 4)
    for exc, code in ((OSError(errno.EIO, "Input/output error", "x.npy"), 1), (csv.Error("field larger"), 1),
                      (MemoryError(), 1), (RuntimeError("boom\nsecond line"), 1),
                      (NotADirectoryError(errno.ENOTDIR, "Not a directory", str(store)), 2)):
        def fail(*a, _exc=exc, **kw):
            raise _exc

        monkeypatch.setattr(verify_mod, "verify_store", fail)
        monkeypatch.delenv("MMSTORE_DEBUG", raising=False)
        rc, out, err = run_cli(["verify", store], capsys)
        assert rc == code and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        monkeypatch.setenv("MMSTORE_DEBUG", "1")
        rc, out, err = run_cli(["verify", store], capsys)
        assert rc == code and "Traceback" in err


def test_demo_workdir_never_replaces_what_it_did_not_make(tmp_path, capsys):
    """`demo --workdir DIR` used to delete DIR/photos and DIR/photos.store
    whatever they were; now it refuses (exit 2) and touches nothing."""
    work = tmp_path / "w"
    (work / "photos").mkdir(parents=True)
    (work / "photos" / "holiday.jpg").write_bytes(b"my photo")
    (work / "grid.png").write_bytes(b"my grid")
    rc, out, err = run_cli(["demo", "--images", "20", "--size", "16", "--quick", "--workdir", work], capsys)
    assert rc == 2 and "photos" in err and "did not make" in err
    assert (work / "photos" / "holiday.jpg").read_bytes() == b"my photo"
    assert (work / "grid.png").read_bytes() == b"my grid"
    assert sorted(os.listdir(work)) == ["grid.png", "photos"]


def test_verify_text_escapes_names_found_in_the_store(tmp_path):
    """A stray file named with a terminal escape sequence and a non-UTF-8 byte
    is reported, escaped (a crafted store cannot drive the terminal)."""
    store = write_store(tmp_path / "s", 4)
    name = b"\x1b]0;owned\x07\x1b[2J-caf\xe9"
    with open(os.path.join(os.fsencode(store), name), "wb") as fh:
        fh.write(b"x")
    p = run_sub(["verify", store])
    assert p.returncode == 1 and "[stray]" in p.stdout
    assert "\x1b" not in p.stdout and "\\x1b]0;owned\\x07\\x1b[2J-caf\\xe9" in p.stdout, p.stdout


def test_repair_label_search_is_bounded(tmp_path, folder, monkeypatch, capsys):
    """A record whose source decodes to other bytes makes repair try every
    label; the bytes it may hash for that are capped per repair."""
    src = str(tmp_path / "src")
    shutil.copytree(folder, src)
    store = _ingest(src, str(tmp_path / "s"))
    _damage_image(store, 3)
    with mmstore.open(store) as s:
        key = s.key(3)
    cv2.imwrite(os.path.join(src, key), np.zeros((20, 24, 3), np.uint8))
    monkeypatch.setattr(repair_mod, "LABEL_SEARCH_BYTES", 1)
    rc, rep = run_json(["verify", store, "--repair"], capsys)
    assert rc == 1 and "label search" in rep["repair"]["failed"][0]["reason"], rep["repair"]
    monkeypatch.setattr(repair_mod, "LABEL_SEARCH_BYTES", 2 << 30)
    rc, rep = run_json(["verify", store, "--repair"], capsys)
    assert rc == 1 and "other bytes" in rep["repair"]["failed"][0]["reason"]


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_output_file_that_links_into_the_store_is_replaced_not_written_through(tmp_path, link):
    """`show -o` and `bench --plot` given a name that is a link to a store file:
    the link is replaced by the new file; the store's
    files keep every byte."""
    store = write_store(tmp_path / "s", 10)
    def files():
        return {n: (tmp_path / "s" / n).read_bytes() for n in os.listdir(store)}

    before = files()
    for k, (target, argv) in enumerate([
        ("manifest.json", ["show", store, "-n", "2", "-o"]),
        ("image.npy", ["bench", store, "--paths", "read_batch", "--samples", "10", "--max-seconds", "0.1",
                       "--plot"]),
    ]):
        out = tmp_path / f"out{k}.png"
        (os.symlink if link == "symlink" else os.link)(os.path.join(store, target), out)
        p = run_sub([*argv, out])
        assert p.returncode == 0, p.stderr
        assert not out.is_symlink() and out.read_bytes()[:4] == b"\x89PNG"
    assert files() == before
    assert verify_store(store).ok
