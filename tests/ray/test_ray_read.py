"""``mmstore.ray.read`` on a local Ray cluster: every record exactly once per epoch, in the
order of ``mmstore.order`` for the seed and epoch whatever the number of read tasks; fields of
every kind as Arrow columns; projection and ``limit`` pushed into the reads; each task's
metadata exact; a store in object storage read through the node's cache; a read task whose
worker is killed mid-read retried, and still every record once."""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest
from support.stores import write_many_parts, write_store

import mmstore
from mmstore.errors import EntryDecodeError, StoreChangedError
from mmstore.order import BlockShuffle, Permutation

pytestmark = pytest.mark.usefixtures("ray_cluster")

N = 60
HOLES = {3, 17}
SCHEMA = {"image": ("|u1", (4, 3, 2)), "idx": ("<i8", ()), "flag": ("|b1", ()), "caption": "str", "blob": "bytes",
          "tokens": ("<i4", (None,)), "boxes": ("<f4", (None, 4)), "pic": ("|u1", (None, None, 3))}


def _make(s):
    k = s % 4
    return {"image": np.full((4, 3, 2), s % 256, np.uint8), "idx": np.int64(s), "flag": np.bool_(s % 2),
            "caption": "é" * k + str(s), "blob": bytes([s % 256]) * k, "tokens": np.arange(k, dtype=np.int32) + s,
            "boxes": np.full((k, 4), s, np.float32), "pic": np.full((1 + k, 2 + s % 3, 3), s % 256, np.uint8)}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A store of every kind of field, with holes (dataset index != slot); ``idx`` is the slot."""
    return write_store(str(tmp_path_factory.mktemp("read") / "all.store"), N, schema=SCHEMA, make=_make, holes=HOLES)


def _ids(ds):
    return [int(r["idx"]) for r in ds.take_all()]


def _slots(path, order):
    return [int(v) for v in mmstore.open(path).read_batch(order, ["idx"])["idx"]]


@pytest.mark.parametrize("tasks", [1, 3, 7])
def test_the_epoch_order_for_any_number_of_tasks(store, tasks):
    import mmstore.ray

    n = len(mmstore.open(store))
    for epoch in (0, 1):
        got = _ids(mmstore.ray.read(store, seed=5, epoch=epoch, fields=["idx"], override_num_blocks=tasks))
        assert got == _slots(store, Permutation(n, seed=5).epoch(epoch))
        assert sorted(got) == sorted(set(range(N)) - HOLES)  # every record exactly once
    a = _ids(mmstore.ray.read(store, seed=5, epoch=0, fields=["idx"], override_num_blocks=tasks))
    b = _ids(mmstore.ray.read(store, seed=5, epoch=1, fields=["idx"], override_num_blocks=tasks))
    assert a != b  # two epochs differ


def test_block_and_sequential_orders(store):
    import mmstore.ray

    n = len(mmstore.open(store))
    ds = mmstore.ray.read(store, order="block", block=4, window=2, seed=2, epoch=3, fields=["idx"],
                          override_num_blocks=3)
    want = BlockShuffle(n, 4, 2, seed=2).epoch(3)
    assert _ids(ds) == _slots(store, want)
    src = mmstore.ray.StoreDatasource(store, order="block", block=4, window=2, seed=2, epoch=3, fields=["idx"])
    bounds = set(BlockShuffle(n, 4, 2, seed=2).window_bounds(3).tolist())
    starts = np.cumsum([0] + [t.metadata.num_rows for t in src.get_read_tasks(3)])
    assert set(starts.tolist()) <= bounds  # each task reads whole windows
    assert _ids(mmstore.ray.read(store, order="sequential", fields=["idx"], override_num_blocks=4)) == \
        sorted(set(range(N)) - HOLES)


def test_ranks_take_disjoint_parts_of_the_epoch(store):
    import mmstore.ray

    n = len(mmstore.open(store))
    parts = [_ids(mmstore.ray.read(store, seed=1, epoch=2, rank=r, world_size=3, fields=["idx"],
                                   override_num_blocks=2)) for r in range(3)]
    for r in range(3):
        assert parts[r] == _slots(store, Permutation(n, seed=1, rank=r, world_size=3).epoch(2))
    every = sum(parts, [])
    # 58 records on 3 ranks of 20: padded by wrap-around (DistributedSampler's rule), 2 records read twice
    assert len(every) == 60 and set(every) == set(range(N)) - HOLES
    dropped = [_ids(mmstore.ray.read(store, seed=1, epoch=2, rank=r, world_size=3, drop_last=True, fields=["idx"]))
               for r in range(3)]
    assert [len(p) for p in dropped] == [19] * 3 and len(set(sum(dropped, []))) == 57


def test_every_kind_of_field_as_arrow_columns(store):
    import pyarrow as pa

    import mmstore.ray

    s = mmstore.open(store)
    order = Permutation(len(s), seed=9).epoch(0)
    want = s.read_batch(order)
    ds = mmstore.ray.read(store, seed=9, override_num_blocks=3)
    schema = ds.schema().base_schema
    assert schema.field("caption").type == pa.large_string() and schema.field("blob").type == pa.large_binary()
    assert schema.field("tokens").type == pa.large_list(pa.int32()) and schema.field("idx").type == pa.int64()
    rows = ds.take_all()
    assert len(rows) == len(s)
    for j, r in enumerate(rows):
        assert np.array_equal(r["image"], want["image"][j]) and r["image"].dtype == np.uint8
        assert r["idx"] == want["idx"][j] and bool(r["flag"]) == bool(want["flag"][j])
        assert r["caption"] == want["caption"][j] and r["blob"] == want["blob"][j]
        assert np.array_equal(r["tokens"], want["tokens"][j])
        assert r["boxes"].shape == want["boxes"][j].shape and np.array_equal(r["boxes"], want["boxes"][j])
        assert r["pic"].shape == want["pic"][j].shape and np.array_equal(r["pic"], want["pic"][j])
    batch = next(iter(ds.select_columns(["image", "idx"]).iter_torch_batches(batch_size=8)))
    assert tuple(batch["image"].shape) == (8, 4, 3, 2) and tuple(batch["idx"].shape) == (8,)


def test_each_task_says_its_exact_rows_and_bytes(ray_cluster, store):
    from ray.data.block import BlockAccessor

    import mmstore.ray

    small = ray_cluster.data.DataContext.get_current().copy()
    small.target_max_block_size = 700  # a few rows a block: a read cut into several blocks
    for kw, ctx in (({}, None), ({}, small), ({"order": "block", "block": 4, "window": 2}, None),
                    ({"order": "block", "block": 4, "window": 2}, small)):
        src = mmstore.ray.StoreDatasource(store, seed=4, **kw)
        tasks = src.get_read_tasks(4, data_context=ctx)
        assert sum(t.metadata.num_rows for t in tasks) == len(mmstore.open(store))
        got = []
        for t in tasks:
            blocks = list(t())
            assert len(blocks) > 1 or ctx is None
            assert t.metadata.num_rows == sum(BlockAccessor.for_block(b).num_rows() for b in blocks)
            assert t.metadata.size_bytes == sum(BlockAccessor.for_block(b).size_bytes() for b in blocks)
            got += [r for b in blocks for r in BlockAccessor.for_block(b).iter_rows(public_row_format=True)]
        want = mmstore.open(store).read_batch(src.order.epoch(0))
        assert [r["caption"] for r in got] == list(want["caption"])
        assert all(np.array_equal(r["boxes"], w) for r, w in zip(got, want["boxes"]))
        assert all(np.array_equal(r["tokens"], w) for r, w in zip(got, want["tokens"]))
        assert src.estimate_inmemory_data_size() > 0


def test_projection_reads_only_the_fields_asked(store, tmp_path):
    """The caption's bytes overwritten with bytes that are not UTF-8: a read of the caption
    fails, a read without it (``fields=``, ``select_columns``) does not touch them."""
    import mmstore.ray

    bad = str(tmp_path / "bad.store")
    shutil.copytree(store, bad)
    data = [n for n in os.listdir(bad) if n.startswith("caption") and not n.endswith("offsets.npy")]
    assert len(data) == 1
    path = os.path.join(bad, data[0])
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(b"\xff" * size)
    assert _ids(mmstore.ray.read(bad, fields=["idx", "image"], override_num_blocks=2)) == \
        _slots(bad, Permutation(N - len(HOLES), seed=0).epoch(0))
    ds = mmstore.ray.read(bad, override_num_blocks=2).select_columns(["idx", "tokens"])
    rows = ds.take_all()
    assert sorted(rows[0]) == ["idx", "tokens"] and len(rows) == N - len(HOLES)
    with pytest.raises(Exception, match="not valid UTF-8") as info:
        mmstore.ray.read(bad, fields=["caption"]).take_all()
    assert isinstance(info.value, EntryDecodeError) or "EntryDecodeError" in str(info.value)
    with pytest.raises(KeyError, match="nope"):
        mmstore.ray.read(bad, fields=["nope"])


def _source_of(kind, path, **attrs):
    """A ``StoreDatasource`` whose tasks run a read job of ``kind`` (classes made here are sent
    to Ray's workers by value): ``"counting"`` logs how many records each read asks for (a
    line per read, in ``attrs["log"]``); ``"killing"``: the first task to reach its second
    block SIGKILLs its own worker there (once: the first to create ``attrs["marker"]`` does).
    Every read is the real one."""
    import mmstore.ray

    if kind == "counting":
        log = attrs.pop("log")

        class Job(mmstore.ray.ReadJob):
            def read_unit(self, store, indices):
                with open(log, "a") as f:
                    f.write(f"{len(indices)}\n")
                return super().read_unit(store, indices)
    else:
        marker = attrs.pop("marker")

        class Job(mmstore.ray.ReadJob):  # type: ignore[no-redef]
            def blocks(self, order_ref, start, stop, units, rows_per_block):
                for k, block in enumerate(super().blocks(order_ref, start, stop, units, rows_per_block)):
                    if k == 1:
                        try:
                            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                        except FileExistsError:
                            pass
                        else:
                            os.close(fd)
                            os.kill(os.getpid(), signal.SIGKILL)
                    yield block

    class Source(mmstore.ray.StoreDatasource):
        job_type = Job

    return Source(path, **attrs)


def _small_blocks(ray, rows_bytes):
    ctx = ray.data.DataContext.get_current()
    before = ctx.target_max_block_size
    ctx.target_max_block_size = rows_bytes
    return ctx, before


def test_limit_reads_no_more_than_it_needs(ray_cluster, store, tmp_path):
    """A task streams its rows a block at a time, so ``limit`` stops the reads soon after it
    has its rows (the tasks Ray ends), and a row limit that Ray gives the tasks is kept."""
    import mmstore.ray

    log = str(tmp_path / "reads.log")
    n = N - len(HOLES)
    want = _slots(store, Permutation(n, seed=3).epoch(0))
    ctx, before = _small_blocks(ray_cluster, 40)  # a row a block (idx 8 + image 32 bytes)
    try:
        src = _source_of("counting", store, log=log, fields=["idx", "image"], seed=3)
        ds = ray_cluster.data.read_datasource(src, override_num_blocks=3)
        ds.context.execution_options.preserve_order = True
        assert _ids(ds.limit(4)) == want[:4]
        tasks = src.get_read_tasks(3, per_task_row_limit=2)
        assert [t.metadata.num_rows for t in tasks] == [2, 2, 2]
        blocks = [b for t in tasks for b in t()]
    finally:
        ctx.target_max_block_size = before
    first = [0, 19, 38]  # 58 rows in 3 tasks: 19, 19, 20
    assert [int(v) for b in blocks for v in b["idx"].to_numpy()] == [want[i + k] for i in first for k in range(2)]
    with open(log) as f:
        reads = [int(x) for x in f.read().split()]
    assert sum(reads) <= 4 + 6 + 3 * 3  # the limit's rows, those of the row limit, and
    # at most a few blocks read ahead by each of the three tasks: never the store's 58
    assert mmstore.ray.read(store, fields=["idx"], override_num_blocks=3).limit(10).count() == 10


def test_a_worker_killed_mid_read_is_retried_and_every_record_is_read_once(ray_cluster, store, tmp_path):
    marker = str(tmp_path / "killed")
    ctx, before = _small_blocks(ray_cluster, 5 * 40)
    try:
        src = _source_of("killing", store, marker=marker, fields=["idx", "image"], seed=8, epoch=1)
        ds = ray_cluster.data.read_datasource(src, override_num_blocks=3)
        ds.context.execution_options.preserve_order = True
        got = _ids(ds)
    finally:
        ctx.target_max_block_size = before
    assert os.path.exists(marker)  # a worker was killed after it had emitted a block
    assert got == _slots(store, Permutation(N - len(HOLES), seed=8).epoch(1))


def test_a_replaced_store_is_refused_by_the_tasks(tmp_path):
    import mmstore.ray

    path = write_store(str(tmp_path / "s.store"), 10, schema=SCHEMA, make=_make)
    ds = mmstore.ray.read(path, fields=["idx"])
    shutil.rmtree(path)
    write_store(path, 10, schema=SCHEMA, make=_make)  # the same records, another store
    with pytest.raises(Exception, match="replaced") as info:
        ds.take_all()
    assert isinstance(info.value, StoreChangedError) or "StoreChangedError" in str(info.value)


def test_bad_arguments_are_refused(store):
    import mmstore.ray

    with pytest.raises(ValueError, match="order must be one of"):
        mmstore.ray.read(store, order="random")
    with pytest.raises(ValueError, match="block shuffle"):
        mmstore.ray.read(store, block=4)
    with pytest.raises(ValueError, match="epoch"):
        mmstore.ray.read(store, epoch=-1)
    with pytest.raises(TypeError, match="cache_dir"):
        mmstore.ray.read(store, cache_dir="x")
    with pytest.raises(ValueError, match="not read task options"):
        mmstore.ray.read(store, ray_remote_args={"max_retries": 2})


def test_a_store_in_s3_read_through_the_node_cache(ray_cluster, s3, tmp_path, store):
    import mmstore.ray
    from mmstore.transfer import push

    url = s3.url("stores/all.store")
    push(store, url, block_bytes=64 << 10)
    cache = str(tmp_path / "cache")
    args = {"runtime_env": {"env_vars": dict(s3.env)}}  # the workers reach the bucket with the test's environment
    n = N - len(HOLES)
    for order, want in (("permutation", Permutation(n, seed=6).epoch(1)),
                        ("block", BlockShuffle(n, 3, 2, seed=6).epoch(1))):
        kw = {"block": 3, "window": 2} if order == "block" else {}
        ds = mmstore.ray.read(url, order=order, seed=6, epoch=1, cache_dir=cache, override_num_blocks=3,
                              ray_remote_args=args, **kw)
        rows = ds.take_all()
        assert [int(r["idx"]) for r in rows] == _slots(store, want)
        local = mmstore.open(store).read_batch(want, ["caption", "pic"])
        assert [r["caption"] for r in rows] == list(local["caption"])
        assert all(np.array_equal(r["pic"], p) for r, p in zip(rows, local["pic"]))
    assert os.listdir(cache)  # read through the cache on this node


def test_the_default_read_tasks(store, monkeypatch):
    """One task for a store under 4 MiB; two per CPU of the cluster (2 here) when each still
    gets its minimum; never more than the rows; and the epoch's order whatever the count."""
    import importlib

    mod = importlib.import_module("mmstore.ray.source")
    src = mod.StoreDatasource(store, fields=["idx"])
    assert mod.default_tasks(src) == 1
    monkeypatch.setattr(mod, "MIN_TASK_BYTES", 16)
    assert mod.default_tasks(src) == 4
    monkeypatch.setattr(mod, "MIN_TASK_BYTES", 1)
    ds = mod.read(store, fields=["idx"], seed=2)
    assert _ids(ds) == _slots(store, Permutation(N - len(HOLES), seed=2).epoch(0))


def test_a_store_with_a_part_table(tmp_path):
    """A store of many parts listed in a part table (format 2.4): its tasks open it lazily and
    read every record once, in the epoch's order."""
    import mmstore.ray

    path = str(tmp_path / "pt.store")
    write_many_parts(path, 200, per=9)
    got = _ids(mmstore.ray.read(path, seed=3, epoch=1, fields=["idx"], override_num_blocks=3))
    assert got == Permutation(200, seed=3).epoch(1).tolist()
