"""gpu helpers on CPU tensors; CUDA paths (skipped without a GPU)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import mmstore
from mmstore.order import Permutation
from mmstore.torch import Loader, LoaderTuning, gpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_normalize_cpu():
    x = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    y = gpu.normalize(x, mean, std)
    assert y.shape == (4, 3, 5, 6) and y.dtype == torch.float32
    ref = ((x.permute(0, 3, 1, 2).float() / 255 - torch.tensor(mean).view(1, 3, 1, 1))
           / torch.tensor(std).view(1, 3, 1, 1))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    y2 = gpu.normalize(x.permute(0, 3, 1, 2).contiguous(), mean, std, layout="NCHW")
    torch.testing.assert_close(y2, ref, rtol=1e-5, atol=1e-5)
    y3 = gpu.normalize(x, 0.5, 0.5, dtype=torch.float16)
    assert y3.dtype == torch.float16
    with pytest.raises(ValueError):
        gpu.normalize(x, (1, 2), (1, 2))
    with pytest.raises(ValueError):
        gpu.normalize(x[0], mean, std)
    with pytest.raises(ValueError):
        gpu.normalize(x, mean, (0, 1, 1))


def test_random_flip_cpu():
    x = torch.arange(2 * 3 * 4 * 3, dtype=torch.uint8).view(2, 3, 4, 3).repeat(8, 1, 1, 1)
    g = torch.Generator().manual_seed(0)
    y = gpu.random_flip(x, 0.5, g)
    flipped = [torch.equal(y[i], x[i].flip(1)) for i in range(len(x))]
    kept = [torch.equal(y[i], x[i]) for i in range(len(x))]
    assert all(a or b for a, b in zip(flipped, kept)) and any(flipped) and any(kept)
    g2 = torch.Generator().manual_seed(0)
    assert torch.equal(gpu.random_flip(x, 0.5, g2), y)  # reproducible
    assert torch.equal(gpu.random_flip(x, 0.0), x)
    assert torch.equal(gpu.random_flip(x, 1.0), x.flip(2))
    assert torch.equal(gpu.random_flip(x, 1.0, dim="vertical"), x.flip(1))
    xc = x.permute(0, 3, 1, 2)
    assert torch.equal(gpu.random_flip(xc, 1.0, layout="NCHW"), xc.flip(3))
    with pytest.raises(ValueError):
        gpu.random_flip(x, 2.0)
    assert gpu.to_chw(x).shape == (16, 3, 3, 4)


@cuda
@pytest.mark.cuda
def test_gpu_helpers_on_cuda():
    x = torch.randint(0, 256, (4, 5, 6, 3), dtype=torch.uint8)
    y = gpu.normalize(x.cuda(), (0.5,) * 3, (0.25,) * 3)
    torch.testing.assert_close(y.cpu(), gpu.normalize(x, (0.5,) * 3, (0.25,) * 3))
    g = torch.Generator(device="cuda").manual_seed(1)
    z = gpu.random_flip(x.cuda(), 0.5, g)
    assert z.device.type == "cuda"
    g = torch.Generator().manual_seed(1)  # a CPU generator works for a GPU batch too
    assert gpu.random_flip(x.cuda(), 0.5, g).device.type == "cuda"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", ["big", "lmdb", "merged"])
def test_cuda_loader_stream_sync(stores, name):
    """GPU batches equal CPU reads over several epochs, prefetch >= 3, slow consumer."""
    path = stores[name]
    st = mmstore.open(path)
    n = len(st)
    all_slots = st.slot_view.slots_of(np.arange(n))
    order = Permutation(n, seed=3)
    L = Loader(path, 16, order, device="cuda", tuning=LoaderTuning(prefetch=3, threads=4))
    assert L.pin_memory
    for epoch in range(3):
        L.set_epoch(epoch)
        seen = []
        for b in L:
            assert b["image"].is_cuda
            # work on the current stream that depends on the copy having landed
            s = b["image"].float().sum()
            torch.cuda._sleep(2_000_000)  # a slow training step on the GPU
            time.sleep(0.002)  # and on the host
            ids = b["idx"].cpu().numpy()
            ref = st.read_batch(np.searchsorted(all_slots, ids))
            np.testing.assert_array_equal(b["image"].cpu().numpy(), ref["image"])
            assert float(s) == float(ref["image"].astype(np.float64).sum())
            seen.append(ids)
        assert np.array_equal(np.concatenate(seen), all_slots[order.epoch(epoch)])  # idx holds the slot
    L.close()


@cuda
@pytest.mark.cuda
def test_cuda_batches_survive_later_batches(stores):
    """GPU tensors belong to the caller: keeping all of them is safe."""
    path = stores["big"]
    L = Loader(path, 8, Permutation(301, seed=0), device="cuda", tuning=LoaderTuning(prefetch=4, threads=4))
    kept = list(L)
    torch.cuda.synchronize()
    ids = torch.cat([b["idx"] for b in kept]).cpu().numpy()
    assert np.array_equal(ids, Permutation(301, seed=0).epoch(0))
    st = mmstore.open(path)
    for b in kept:
        np.testing.assert_array_equal(b["image"].cpu().numpy(), st.read_batch(b["idx"].cpu().numpy())["image"])
    L.close()


@cuda
@pytest.mark.cuda
def test_cuda_pinned_loader_cpu_output(stores):
    L = Loader(stores["big"], 8, "permutation", pin_memory=True, tuning=LoaderTuning(threads=2))
    b = next(iter(L))
    assert b["image"].is_pinned()
    L.close()
