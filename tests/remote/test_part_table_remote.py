"""A store with a part table (format 2.4) in object storage, against a real S3 server: push
uploads the table as one more store file, pull brings back the same bytes, a store opened from
its URL reads every record as the local one does, verify of the URL checks the table, and a
table damaged in the bucket is refused before any record is read."""

from __future__ import annotations

import os

import numpy as np
import pytest
from support.stores import write_many_parts

import mmstore
from mmstore.check.verify_remote import verify_remote
from mmstore.errors import FormatError
from mmstore.format.layout import PART_TABLE_FILE
from mmstore.transfer import pull, push

pytest.importorskip("obstore")

BLOCK = 64 << 10


def _tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` but the manifest, by its path below ``root``."""
    out = {}
    for dp, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dp, n), root)
            if rel != "manifest.json":
                with open(os.path.join(dp, n), "rb") as fh:
                    out[rel] = fh.read()
    return out


def test_a_store_with_a_part_table_pushes_pulls_and_reads_from_its_url(s3, tmp_path):
    src = str(tmp_path / "src.store")
    ids = write_many_parts(src, 300, per=7)
    url = s3.url("pt.store")
    rep = push(src, url, block_bytes=BLOCK)
    assert rep["uploaded_bytes"] == rep["bytes"] and push(src, url, block_bytes=BLOCK)["up_to_date"]
    back = str(tmp_path / "back.store")
    assert pull(url, back)["verified_records"] == 300
    assert _tree(back) == _tree(src)  # every file, the table and each part's, byte for byte
    with open(f"{src}/{PART_TABLE_FILE}", "rb") as fh:
        assert s3.server.get_object_raw(s3.bucket, f"pt.store/{PART_TABLE_FILE}") == fh.read()
    with mmstore.open(url, cache_dir=str(tmp_path / "cache")) as s:
        assert len(s) == 300 and s.parts == ids
        assert int(s[123]["idx"]) == 123 and s.key(299) == "k299"
        assert np.array_equal(s.read_batch(np.arange(300)[::-1])["idx"], np.arange(300)[::-1])
    assert verify_remote(url).ok


def test_a_part_table_damaged_in_the_bucket_is_refused(s3, tmp_path):
    src = str(tmp_path / "src.store")
    write_many_parts(src, 40, per=4)
    url = s3.url("bad.store")
    push(src, url, block_bytes=BLOCK)
    key = f"bad.store/{PART_TABLE_FILE}"
    data = bytearray(s3.server.get_object_raw(s3.bucket, key))
    data[40] ^= 1  # a segment end: the manifest's digest no longer matches
    s3.server.put_object_raw(s3.bucket, key, bytes(data))
    with pytest.raises(FormatError, match="its digest is"):
        mmstore.open(url, cache_dir=str(tmp_path / "cache"))
    rep = verify_remote(url)
    assert not rep.ok and [p.kind for p in rep.problems] == ["part-table"]
