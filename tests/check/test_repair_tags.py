"""verify --repair of a store with ragged fields from a list (tags, captions): byte-identical."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from support.compare import assert_same_files
from support.faults import flip_bit, flip_lmdb_bits
from support.images import photo, write_image
from support.proc import run_json

import mmstore

cv2 = pytest.importorskip("cv2")
ingest_mod = pytest.importorskip("mmstore.ingest")


@pytest.fixture(scope="module")
def tagged_list(tmp_path_factory):
    d = tmp_path_factory.mktemp("tags")
    rng = np.random.default_rng(5)
    rows = []
    for k in range(12):
        write_image(str(d / f"p{k}.png"), photo(rng, 20, 18), ".png")
        rows.append(f'p{k}.png,{"ab"[k % 2]},{";".join(f"t{(k + j) % 4}" for j in range(k % 3))},"caption {k}, é"')
    (d / "l.csv").write_text("path,label,tags,caption\n" + "\n".join(rows) + "\n", encoding="utf-8")
    return str(d / "l.csv")


def _ingest(lst, dest, backend):
    ingest_mod.ingest(lst, dest, size=(16, 16), backend=backend, workers=0, quiet=True, tags_column="tags",
                      text_column="caption")
    return dest


def test_repair_a_damaged_image_keeps_tags_and_text(tmp_path, tagged_list, backend, capsys):
    dest = _ingest(tagged_list, str(tmp_path / "s"), backend)
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    with mmstore.open(dest) as s:
        slot, key = s.slot_view.slot(7), s.key(7)
        assert s[7]["tags"].tolist() == [3] and s[7]["text"] == "caption 7, é"
        loc = s.slot_view.backend.field_location("image") if backend == "memmap" else None
    if loc is not None:
        path, off, nb = loc
        flip_bit(path, off + slot * nb + 5, bit=2)
    else:
        flip_lmdb_bits(dest, [slot], 5, mask=4)
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 1 and [b["key"] for b in rep["bad_records"]] == [key]
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0, rep
    assert rep["ok"] and rep["repair"]["repaired"] == [slot]
    assert_same_files(dest, fresh)


def _damage_entry(dest, backend, slot, field):
    """Flip a bit of the first byte of ``field``'s entry of ``slot``."""
    if backend == "memmap":
        offs = np.load(f"{dest}/{field}.offsets.npy")
        flip_bit(f"{dest}/{field}.bin", int(offs[slot]), bit=1)
        return
    # an lmdb value: the raw fields, a <u8 length per variable field, the entries (format.py)
    with mmstore.open(dest) as s:
        var = [f.name for f in s.schema.variable_fields]
        rec = s[slot]
        lens = [rec[n].nbytes if n == "tags" else len(rec[n].encode()) for n in var]
        pos = s.schema.record_bytes + 8 * len(var) + sum(lens[: var.index(field)])
    flip_lmdb_bits(dest, [slot], pos, mask=2)


def test_repair_damaged_tags_and_text_from_the_list(tmp_path, tagged_list, backend, capsys):
    dest = _ingest(tagged_list, str(tmp_path / "s"), backend)
    fresh = str(tmp_path / "fresh")
    shutil.copytree(dest, fresh)
    _damage_entry(dest, backend, 5, "tags")
    _damage_entry(dest, backend, 8, "text")
    rc, rep = run_json(["verify", dest], capsys)
    assert rc == 1 and sorted(b["slot"] for b in rep["bad_records"]) == [5, 8]
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 0, rep
    assert sorted(rep["repair"]["repaired"]) == [5, 8]
    assert_same_files(dest, fresh)


def test_repair_refuses_a_changed_list(tmp_path, tagged_list, capsys):
    lst = tmp_path / "l.csv"
    shutil.copy(tagged_list, lst)
    text = lst.read_text(encoding="utf-8")
    for k in range(12):
        shutil.copy(f"{tagged_list[:-5]}p{k}.png", tmp_path / f"p{k}.png")
    dest = _ingest(str(lst), str(tmp_path / "s"), "memmap")
    _damage_entry(dest, "memmap", 5, "tags")
    lst.write_text(text.replace("p5.png,b,t1;t2", "p5.png,b,t1;t3"), encoding="utf-8")
    rc, rep = run_json(["verify", dest, "--repair"], capsys)
    assert rc == 1 and rep["repair"]["repaired"] == []
    assert [f["slot"] for f in rep["repair"]["failed"]] == [5]
    assert "other bytes" in rep["repair"]["failed"][0]["reason"]
