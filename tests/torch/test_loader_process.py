"""``Loader(process=True)``: the reads in a helper process, the batches in
shared memory. Every promise of the threaded loader holds: the same batches
(orders, subsets, DDP shares, ragged fields, crops, transforms), kept
batches, resume in another process, errors at their batch with their own
type, a killed helper, close and garbage, fork, Ctrl-C."""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cv2
import numpy as np
import pytest
import torch
from matplotlib import cbook
from support.stores import write_store

import mmstore
import mmstore.store.backends.memmap as memmap_backend
from mmstore.errors import LoaderHelperError, LoaderStateError
from mmstore.order import OrderSpec, Sequential
from mmstore.torch import Loader, LoaderTuning, RandomResizedCrop

PHOTO = cv2.imread(str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)), cv2.IMREAD_COLOR_RGB)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mmstore.__file__)))
HANG_S = 120

RAGGED_SCHEMA = {"image": ("|u1", (6, 5, 3)), "idx": ("<i8", ()), "boxes": ("<f4", (None, 4)), "cap": "str"}


def ragged_record(slot: int) -> dict:
    rng = np.random.default_rng(slot)
    return {"image": rng.integers(0, 256, (6, 5, 3), dtype=np.uint8), "idx": np.int64(slot),
            "boxes": rng.random((slot % 4, 4), dtype=np.float32), "cap": "é" * (slot % 3) + str(slot)}


def plain(batch):
    """A batch as comparable Python data (tensors copied out of the ring)."""
    if isinstance(batch, tuple):
        return tuple(plain(v) for v in batch)
    if isinstance(batch, dict):
        return {f: plain(v) for f, v in batch.items()}
    if isinstance(batch, torch.Tensor):
        return batch.clone()
    if isinstance(batch, list):
        return [plain(v) for v in batch]
    if hasattr(batch, "_fields"):  # Padded
        return type(batch)(*(plain(v) for v in batch))
    return batch


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def epochs(loader, n: int = 2) -> list:
    return [[plain(b) for b in loader] for _ in range(n)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone as far as the test is concerned
        return f.read().split(")")[-1].split()[0] != "Z"


def gone_within(pid: int, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def ragged_store(tmp_path_factory):
    return write_store(tmp_path_factory.mktemp("pragged") / "s", 45, schema=RAGGED_SCHEMA, make=ragged_record,
                       holes=(4,), keys="k{}", reason="hole")


@pytest.fixture(scope="module")
def photo_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("pphotos")
    os.makedirs(root / "src" / "a")
    rng = np.random.default_rng(2)
    for k in range(12):
        h, w = int(rng.integers(40, 200)), int(rng.integers(40, 200))
        y, x = int(rng.integers(0, PHOTO.shape[0] - h)), int(rng.integers(0, PHOTO.shape[1] - w))
        cv2.imwrite(str(root / "src" / "a" / f"{k:02d}.jpg"), np.ascontiguousarray(PHOTO[y : y + h, x : x + w, ::-1]),
                    [cv2.IMWRITE_JPEG_QUALITY, 92])
    dest = str(root / "jpeg")
    mmstore.ingest(str(root / "src"), dest, max_side=96, codecs=["image=jpeg:90"], workers=0, quiet=True)
    return dest


def double(batch, epoch, batch_index):
    return {**batch, "twice": batch["label"] * 2 + epoch * 1000 + batch_index}


@pytest.mark.parametrize("case", ["big-ddp", "merged-block", "lmdb-sequential-subset"])
def test_same_batches_as_the_threaded_loader(stores, case):
    """Two epochs, batch for batch and byte for byte, with a transform that
    sees the epoch and the batch index."""
    name, kind = case.split("-")[:2]
    kw: dict = {"transform": double}
    if case.endswith("subset"):
        kw["indices"] = np.arange(0, 150, 3)[::-1]
    order: object = kind
    if kind == "ddp":
        order = OrderSpec("permutation", seed=5, rank=1, world_size=3)
    want = epochs(Loader(stores[name], 16, order, tuning=LoaderTuning(threads=2), **kw))
    L = Loader(stores[name], 16, order, tuning=LoaderTuning(threads=2), process=True, **kw)
    got = epochs(L)
    assert len(got[0]) == len(L) and same(got, want)
    assert set(got[0][0]) == {"image", "label", "idx", "twice"}
    L.close()


def test_ragged_fields_cross_with_their_batch(ragged_store):
    """Padded boxes and lists of str are sent with their batch."""
    want = epochs(Loader(ragged_store, 8, ragged="pad", as_tuple=True), 1)
    L = Loader(ragged_store, 8, ragged="pad", as_tuple=True, process=True)
    got = epochs(L, 1)
    assert same(got, want) and len(got[0]) == 6
    L.close()


def test_crops_decoded_by_the_helper(photo_store):
    """The crops (boxes drawn from the order's seed, the epoch and the record) are the same."""
    order = OrderSpec("permutation", seed=3)
    crop = RandomResizedCrop(48)
    want = epochs(Loader(photo_store, 5, order, crop=crop, chw=True))
    L = Loader(photo_store, 5, order, crop=crop, chw=True, process=True)
    got = epochs(L)
    assert same(got, want) and got[0][0]["image"].shape[1:] == (3, 48, 48)
    assert not same(got[0][0]["image"], got[1][0]["image"])  # new boxes and order each epoch
    L.close()


def test_kept_batches_stay_intact(stores):
    """Every batch of two epochs kept: none changes when its buffer comes
    round again; the ring replaces such buffers with new shared memory."""
    ref = Loader(stores["big"], 16, tuning=LoaderTuning(prefetch=2))
    want = [b for b in ref] + [b for b in ref]
    L = Loader(stores["big"], 16, tuning=LoaderTuning(prefetch=2), process=True)
    kept = [b for b in L] + [b for b in L]
    assert same(kept, want)
    assert L.fresh_buffers == ref.fresh_buffers > 0
    L.close()
    assert same(kept, want)  # the batches outlive the loader and its helper


def test_resume_in_a_new_process(stores):
    L = Loader(stores["big"], 16, OrderSpec("permutation", seed=9), process=True)
    it = iter(L)
    head = [plain(next(it)) for _ in range(5)]
    state = L.state_dict()
    del it
    code = """
    import pickle, sys
    import numpy as np
    from mmstore.order import OrderSpec
    from mmstore.torch import Loader
    L = Loader(sys.argv[1], 16, OrderSpec("permutation", seed=9), process=True)
    L.load_state_dict(pickle.load(sys.stdin.buffer))
    rest = np.concatenate([b["idx"].numpy().copy() for b in L])
    nxt = np.concatenate([b["idx"].numpy().copy() for b in L])
    sys.stdout.buffer.write(pickle.dumps((rest, nxt)))
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), stores["big"]], input=pickle.dumps(state),
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr.decode()
    rest, nxt = pickle.loads(p.stdout)
    e0 = L.order.epoch(0)
    assert np.array_equal(np.concatenate([b["idx"].numpy() for b in head]), e0[:80])
    assert np.array_equal(rest, e0[80:]) and np.array_equal(nxt, L.order.epoch(1))
    L.close()


def test_read_errors_cross_with_their_type(stores, tmp_path, monkeypatch):
    """A store truncated under an epoch: the helper's EOFError (file, offset)
    is raised by the next() of its batch, after the earlier batches."""
    dst = str(tmp_path / "big")
    shutil.copytree(stores["big"], dst)
    path = os.path.join(dst, "image.npy")
    seg = mmstore.open(dst).slot_view.backend.field_segments("image")[0]  # type: ignore[attr-defined]
    L = Loader(dst, 16, Sequential(301), tuning=LoaderTuning(method="pread", prefetch=1), process=True)
    it = iter(L)
    got = [next(it)["idx"].clone()]
    os.truncate(path, seg.offset + 150 * seg.entry_bytes)
    with pytest.raises(EOFError) as e:
        for b in it:
            got.append(b["idx"].clone())
    assert e.value.filename == path and seg.offset + 144 * seg.entry_bytes <= e.value.offset
    assert np.array_equal(torch.cat(got).numpy(), np.arange(len(got) * 16)) and len(got) * 16 <= 150
    with pytest.raises(StopIteration):
        next(it)
    L.close()


def test_break_close_a_killed_helper_and_reuse(stores):
    """A loop left early ends the epoch (the helper stops its reads), and so
    does close(); a helper killed mid-epoch ends that epoch with its own
    error; after each, the next epoch is whole."""
    L = Loader(stores["big"], 16, Sequential(301), process=True)
    for k, _ in enumerate(L):
        if k == 2:
            break
    assert np.array_equal(np.concatenate([b["idx"].numpy() for b in L]), np.arange(301))
    L.close()
    it = iter(L)
    next(it)
    pid = L._res.helper.pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(LoaderHelperError, match=f"pid {pid}.*killed by signal 9"):
        for _ in it:
            pass
    assert np.array_equal(np.concatenate([b["idx"].numpy() for b in L]), np.arange(301))
    assert L._res.helper.pid != pid
    seen = []

    def closer():
        while len(seen) < 3:
            time.sleep(0.001)
        L.close()

    t = threading.Thread(target=closer)
    t.start()
    with pytest.raises(LoaderStateError, match="closed"):
        for b in L:
            seen.append(b["idx"].clone())
            time.sleep(0.01)
    t.join(HANG_S)
    assert 3 <= len(seen) < len(L)
    assert np.array_equal(np.concatenate([b["idx"].numpy() for b in L]), np.arange(301))
    L.close()


def test_the_helper_exits_with_its_loader(stores):
    """Garbage (the last reference dropped mid-epoch), close(), and the
    parent's death each end the helper process."""
    L = Loader(stores["big"], 16, process=True)
    it = iter(L)
    next(it)
    pid = L._res.helper.pid
    del it, L
    assert gone_within(pid), "helper of a dropped loader still runs"
    L = Loader(stores["big"], 16, process=True)
    list(L)
    pid = L._res.helper.pid
    L.close()
    assert gone_within(pid), "helper of a closed loader still runs"
    code = """
    import os, sys
    from mmstore.torch import Loader
    L = Loader(sys.argv[1], 16, process=True)
    it = iter(L)
    next(it)
    print(L._res.helper.pid, flush=True)
    os._exit(0)  # the parent ends without closing anything
    """
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code), stores["big"]],
                       env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=HANG_S)
    assert p.returncode == 0, p.stderr
    assert gone_within(int(p.stdout)), "helper outlived its parent"


def test_fork_and_pickle(stores):
    """A forked child starts its own helper for a new epoch (the parent's
    epoch goes on); a pickled loader keeps process=True."""
    L = Loader(stores["big"], 16, Sequential(301), process=True)
    it = iter(L)
    first = next(it)["idx"].clone()
    pid = os.fork()
    if pid == 0:  # the child: exit status says what it saw
        try:
            ok = np.array_equal(np.concatenate([b["idx"].numpy() for b in L]), np.arange(301))
            os._exit(0 if ok else 3)
        except BaseException:  # noqa: BLE001
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rest = [b["idx"].clone() for b in it]
    assert np.array_equal(torch.cat([first, *rest]).numpy(), np.arange(301))
    L2 = pickle.loads(pickle.dumps(L))
    assert L2.process and np.array_equal(np.concatenate([b["idx"].numpy() for b in L2]),
                                         L.order.epoch(1))
    L2.close()
    L.close()


SIGINT = """
import sys
from mmstore.torch import Loader
L = Loader(sys.argv[1], 16, process=True)
n = 0
while True:
    for b in L:
        if n == 0:
            print(L._res.helper.pid, flush=True)
        n += 1
"""


def test_ctrl_c_stops_the_loop_and_the_helper(stores):
    p = subprocess.Popen([sys.executable, "-c", SIGINT, stores["big"]], env=dict(os.environ, PYTHONPATH=ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        helper = int(p.stdout.readline())
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=HANG_S)
    except (subprocess.TimeoutExpired, ValueError):
        p.kill()
        pytest.fail("the loop did not exit on SIGINT")
    assert p.returncode != 0 and "KeyboardInterrupt" in err
    assert gone_within(helper)


def test_refusals(stores, tmp_path):
    with pytest.raises(ValueError, match="pin_memory"):
        Loader(stores["big"], 16, pin_memory=True, process=True)
    with pytest.raises(TypeError, match="process"):
        Loader(stores["big"], 16, process="yes")

    class Local(Sequential):  # defined here: the helper cannot import it
        pass

    L = Loader(stores["big"], 16, Local(301), process=True)
    with pytest.raises(TypeError, match="cannot be pickled"):
        iter(L)
    L.close()


def test_truncated_before_the_epoch_is_refused_by_the_helper(stores, tmp_path, monkeypatch):
    """The helper's own checks at the start of an epoch reach the parent typed."""
    dst = str(tmp_path / "big")
    shutil.copytree(stores["big"], dst)
    L = Loader(dst, 16, process=True)
    list(L)
    with open(os.path.join(dst, "image.npy"), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(dst, "image.npy")) - 1000)
    with pytest.raises(mmstore.errors.MmstoreError):
        list(L)
    L.close()
    assert memmap_backend is not None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("name", ["big", "holes", "merged"])
def test_cuda_batches_come_through_pinned_shared_memory(stores, name):
    """``device='cuda'`` with ``process=True``: the memory shared with the helper is page-locked
    (``cudaHostRegister``), so the copies to the GPU are DMA out of it; the GPU batches equal the
    thread path's, over two epochs of a permutation; a kept batch renews a buffer (the new one pinned
    too, the old one unregistered before its mapping can go); closing gives every registration back."""
    order = OrderSpec("permutation", seed=3)
    want = [{f: v.cpu() for f, v in b.items()} for b in Loader(stores[name], 16, order, device="cuda")]
    ld = Loader(stores[name], 16, order, device="cuda", process=True)
    kept = None
    for _ in range(2):
        ld.set_epoch(0)
        got = []
        for b in ld:
            got.append({f: v.cpu() for f, v in b.items()})
            kept = kept or b
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and all(torch.equal(g[f], w[f]) for f in w)
    ring = ld._res.ring
    assert ring is not None and all(f is not None and f.pinned for f in ring.fds)
    assert all(t.is_pinned() for slot in ring.slots for t in slot.values())
    ld.close()
    del kept, ring
    torch.cuda.synchronize()  # no error left behind by an unregistration


@cuda
def test_cpu_batches_with_pin_memory_are_refused_in_process_mode(stores):
    with pytest.raises(ValueError, match="pin_memory"):
        Loader(stores["big"], 16, pin_memory=True, process=True)
    ld = Loader(stores["big"], 16, device="cuda", process=True, pin_memory=False)  # unpinned: allowed
    n = sum(len(b["idx"]) for b in ld)
    assert n == 301
    ld.close()
