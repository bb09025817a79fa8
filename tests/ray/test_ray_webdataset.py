"""WebDataset tar shards on Ray: ``ray.data.read_webdataset(paths, decoder=None)`` mapped by
``WebDatasetRows`` and written by ``mmstore.ray.write`` reads exactly as ``mmstore ingest`` of the same
real-photo shards (records, keys, labels, captions, .json keys, holes); Ray's own decoding
(``decoder=True``) fails the job on a bad JPEG."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest
from support.compare import assert_reads_same

from mmstore.ingest.webdataset import WebDatasetRows, expand_pattern

cv2 = pytest.importorskip("cv2")
cbook = pytest.importorskip("matplotlib.cbook")

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)


def _add(t: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    t.addfile(ti, io.BytesIO(data))


def _shards(d) -> str:
    """Two shards of six photo crops (jpg, txt, cls, json); sample 3 of shard 1 has a garbled JPEG."""
    rng = np.random.default_rng(11)
    for s in range(2):
        with tarfile.open(os.path.join(d, f"{s:05d}.tar"), "w", format=tarfile.USTAR_FORMAT) as t:
            for j in range(6):
                h, w = (int(v) for v in rng.integers(40, 120, 2))
                y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
                ok, jpg = cv2.imencode(".jpg", np.ascontiguousarray(PHOTO[y:y + h, x:x + w, ::-1]))
                data = jpg.tobytes()
                if (s, j) == (1, 3):
                    data = data[:200] + b"\0" * (len(data) - 200)
                key = f"{s:05d}{j:04d}"
                _add(t, key + ".jpg", data)
                _add(t, key + ".txt", f"crop {key} \u00e9".encode())
                _add(t, key + ".cls", str(j % 3).encode())
                _add(t, key + ".json", json.dumps({"width": w, "similarity": j / 7}).encode())
    return os.path.join(str(d), "{00000..00001}.tar")


@pytest.mark.slow  # a whole job of several processes: CI's step for slow tests
def test_read_webdataset_rows_equal_ingest(ray_cluster, tmp_path):
    import ray.data

    import mmstore.ray

    pattern = _shards(tmp_path)
    a, b, c = (str(tmp_path / n) for n in "abc")
    mmstore.ingest(pattern, a, size=(40, 32), json_keys="width,similarity", workers=0, quiet=True)
    paths = expand_pattern(pattern)
    ds = ray.data.read_webdataset(paths, decoder=None).map_batches(
        WebDatasetRows(json_keys="width,similarity"), batch_format="numpy")
    r = mmstore.ray.write(ds, b, size=(40, 32), fields={"text": str, "width": ("<i8", ()), "similarity": ("<f8", ())},
                          part_rows=5, quiet=True)
    assert (r.records, r.skipped) == (11, 1)
    assert_reads_same(a, b)
    assert os.fsdecode(mmstore.open(b).key(7)) == "00001.tar/000010001"
    # Ray's own decoding (decoder=True, its default) decodes every JPEG in the read task, by other rules:
    # one bad JPEG fails the whole job there, where the mapped rows make it a hole
    with pytest.raises(Exception, match="cannot load this image|image file is truncated|cannot identify"):
        mmstore.ray.write(ray.data.read_webdataset(paths), c, size=(40, 32), image="jpg", quiet=True)
