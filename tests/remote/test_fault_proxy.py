"""An epoch over a store in object storage under each fault the proxy in front of the real S3
server (SeaweedFS on loopback) can inject: storms of ``503 SlowDown``, reset connections, answers
cut in their body, answers that stall, bodies dripped slowly, range requests answered with the
whole object. Each epoch ends with exactly the local store's batches, its retries counted in the
replica's ``describe()``, or fails with a typed error within a bounded time: never a wrong batch,
never a hang. (Kills, a stopped server and damaged objects: ``test_remote_faults.py``.)"""

from __future__ import annotations

import threading
import time

import pytest
from remote.helpers import BLOCK, assert_same_epoch, batches, finish, image_store, json_lines, python_child

import mmstore
from mmstore.errors import RemoteUnavailableError
from mmstore.order import OrderSpec
from mmstore.transfer import push

pytest.importorskip("obstore")
pytest.importorskip("torch")
from mmstore.torch import Loader  # noqa: E402

SPEC = OrderSpec("block", seed=5, block=16, window=1)
BATCH = 16
N = 300  # 900 KiB of images: 14 blocks of 64 KiB, fetched in a handful of requests
EPOCH_S = 60  # an epoch that has not ended by then hangs


@pytest.fixture
def pushed(s3_faulty, tmp_path):
    src = image_store(tmp_path / "src.store", n=N)
    url = s3_faulty.url("faults/matrix.store")
    push(src, url, block_bytes=BLOCK)
    with Loader(src, BATCH, SPEC) as loader:
        want = batches(loader)
    return url, want


def _epoch(store) -> tuple[list | None, BaseException | None, dict, float]:
    """One epoch of ``store`` (opened from its URL), in a thread that may not outlive ``EPOCH_S``:
    (its batches or None, the error or None, the replica's describe(), seconds)."""
    out: dict = {}

    def run() -> None:
        try:
            with Loader(store, BATCH, SPEC) as loader:
                out["batches"] = batches(loader)
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(EPOCH_S)
    assert not t.is_alive(), f"the epoch hangs (more than {EPOCH_S} s)"
    return out.get("batches"), out.get("error"), store.replica.describe(), time.monotonic() - t0


def _inject(proxy, fault: str) -> None:
    image = r"/image\.npy"  # the record data, fetched by the epoch (the open fetches the small files)
    if fault == "slowdown-storms":
        proxy.storm(2, 5, method="GET", path=image)
    elif fault == "resets":
        proxy.reset_next(3, method="GET", path=image)
    elif fault == "cut-bodies":
        proxy.cut_next(3, keep=0.4, method="GET", path=image)
    elif fault == "stalls":
        proxy.cut_next(1, keep=0.3, stall=30, method="GET", path=image)
    elif fault == "drips":
        proxy.drip_next(None, chunk=16 << 10, pause=0.002, method="GET", path=image)
    elif fault == "whole-objects":
        proxy.whole_next(2, method="GET", path=image)
    else:
        raise AssertionError(fault)


# fault -> the retry kind describe() counts for it (None: no retry: slow, not failed)
RIDDEN_OUT = {"slowdown-storms": "throttled", "resets": "connection", "cut-bodies": "connection",
              "stalls": "connection", "drips": None, "whole-objects": "not_partial"}


@pytest.mark.parametrize("fault", sorted(RIDDEN_OUT))
def test_an_epoch_under_a_passing_fault_gives_the_local_batches_and_counts_its_retries(
        fault, pushed, s3_faulty, tmp_path, monkeypatch):
    url, want = pushed
    monkeypatch.setenv("MMSTORE_REMOTE_TIMEOUT", "2")  # a stalled answer is given up after 2 s, and retried
    proxy = s3_faulty.proxy
    _inject(proxy, fault)
    store = mmstore.open(url, cache_dir=tmp_path / "cache")  # under the fault too
    try:
        got, err, desc, _ = _epoch(store)
    finally:
        store.close()
    assert err is None, repr(err)
    assert_same_epoch(got, want)
    retries = desc["remote_retries"]
    kind = RIDDEN_OUT[fault]
    if kind is None:
        assert retries["total"] == 0, retries
        assert proxy.drips > 0
    else:
        assert retries[kind] > 0 and retries["total"] == retries[kind], retries


@pytest.mark.parametrize("fault", ["slowdown", "resets", "whole-objects", "stalls"])
def test_a_fault_that_persists_is_a_typed_error_within_a_bounded_time(fault, pushed, s3_faulty, tmp_path,
                                                                      monkeypatch):
    url, want = pushed
    monkeypatch.setenv("MMSTORE_REMOTE_RETRIES", "2")
    monkeypatch.setenv("MMSTORE_REMOTE_TIMEOUT", "1")
    proxy = s3_faulty.proxy
    image = r"/image\.npy"
    store = mmstore.open(url, cache_dir=tmp_path / "cache")  # before the fault: the epoch meets it
    if fault == "slowdown":
        proxy.fail_rate(1.0, method="GET", path=image)
    elif fault == "resets":
        proxy.reset_next(10_000, method="GET", path=image)
    elif fault == "whole-objects":
        proxy.whole_next(None, method="GET", path=image)
    else:
        proxy.set_delay(30, method="GET", path=image)
    try:
        got, err, desc, secs = _epoch(store)
    finally:
        proxy.clear()
        store.close()
    assert got is None and isinstance(err, RemoteUnavailableError), (fault, repr(err))
    assert url in str(err) and "image.npy" in str(err)
    if fault == "whole-objects":
        assert "whole object" in str(err)
    assert desc["remote_retries"]["total"] >= 2, desc["remote_retries"]
    assert secs < 30, secs


_FORKED_CHILD = """
import hashlib, json, multiprocessing, os, sys, time
import numpy as np
import mmstore
url, cache, go = sys.argv[1], sys.argv[2], sys.argv[3]
store = mmstore.open(url, cache_dir=cache)  # this process's requests made obstore's runtime: a fork reads without it
before = store.replica.describe()["remote_retries"]["total"]
print(json.dumps({"opened": True}), flush=True)
while not os.path.exists(go):
    time.sleep(0.01)

def work(q):
    rep = store.replica
    rep.fill()
    got = store.read_batch(np.arange(len(store)))
    q.put({"before": before, "retries": rep.describe()["remote_retries"], "complete": rep.complete(),
           "bad": rep.verify_present(),
           "digest": hashlib.sha256(np.ascontiguousarray(got["image"]).tobytes()).hexdigest()})

ctx = multiprocessing.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=work, args=(q,))
p.start()
print(json.dumps(q.get(timeout=60)), flush=True)
p.join(30)
"""


def test_a_process_forked_after_the_client_ran_retries_whole_object_answers_too(s3_faulty, tmp_path):
    import hashlib

    src = image_store(tmp_path / "src.store", n=N)
    url = s3_faulty.url("faults/forked.store")
    push(src, url, block_bytes=BLOCK)
    want = hashlib.sha256(mmstore.open(src).read_batch(list(range(N)))["image"].tobytes()).hexdigest()
    go = tmp_path / "go"
    proc = python_child(_FORKED_CHILD, url, str(tmp_path / "cache"), str(go))
    assert json_lines(proc.stdout.readline()) == [{"opened": True}], proc.stderr.read()[-3000:] if proc.poll() else ""
    s3_faulty.proxy.whole_next(2, method="GET", path=r"/image\.npy")  # met by the forked child's reads alone
    go.touch()
    out, err = finish(proc, timeout=90)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    got = json_lines(out)[-1]
    assert got["digest"] == want and got["complete"] and got["bad"] == 0
    assert got["before"] == 0 and got["retries"]["not_partial"] == 2 and s3_faulty.proxy.wholes == 2, got
