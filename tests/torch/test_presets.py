"""Presets: ``classification_loader`` and the guide's
"Porting from ImageFolder / torchvision" snippet, run on a tiny ImageFolder."""

from __future__ import annotations

import argparse
import os
import re

import numpy as np
import pytest
import torch
from PIL import Image
from support.stores import write_store

import mmstore
from mmstore.cli import main as cli_main
from mmstore.errors import SchemaError
from mmstore.order import OrderSpec
from mmstore.torch import ClassificationTransform, Loader, augment, classification_loader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_batches_are_the_imagenet_train_pipeline(stores):
    """``(images, target)``: float32 NCHW normalised crops equal to
    ``imagenet_train`` applied to the raw batch with (seed, epoch, batch); int64 labels."""
    path = stores["big"]
    st = mmstore.open(path)
    L = classification_loader(path, 16, size=20, seed=4)
    assert isinstance(L.transform, ClassificationTransform) and L.fields == ("image", "label")
    raw = Loader(path, 16, OrderSpec("permutation", seed=4), fields=("image", "label"), as_tuple=True)
    pipe = augment.imagenet_train(20, seed=4, image=0)
    L.set_epoch(1)
    raw.set_epoch(1)
    targets = []
    for k, ((images, target), (rx, ry)) in enumerate(zip(L, raw)):
        assert images.dtype == torch.float32 and images.shape == (len(rx), 3, 20, 20)
        assert target.dtype == torch.int64
        torch.testing.assert_close(images, pipe(rx, epoch=1, batch_index=k), rtol=0, atol=0)
        assert torch.equal(target, ry)
        targets.append(target)
    assert np.array_equal(torch.cat(targets).numpy(), st.read_batch(L.order.epoch(1))["label"])


def test_eval_batches_in_order(stores):
    path = stores["big"]
    st = mmstore.open(path)
    L = classification_loader(path, 50, train=False, size=16)
    got = [(x.clone(), y.clone()) for x, y in L]
    x = torch.cat([g[0] for g in got])
    y = torch.cat([g[1] for g in got])
    assert x.shape == (301, 3, 16, 16) and np.array_equal(y.numpy(), st.read_batch(np.arange(301))["label"])
    want = augment.imagenet_eval(16, image=0)(torch.from_numpy(st.read_batch(np.arange(50))["image"]))
    torch.testing.assert_close(x[:50], want, rtol=0, atol=0)
    assert abs(float(x.mean())) < 1.0  # normalised, not 0..255


def _gray(i):
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (10, 8, 1), dtype=np.uint8), "label": np.int32(i % 3)}


def test_one_channel_and_field_errors(tmp_path):
    path = write_store(tmp_path / "gray", 20, schema={"image": ("|u1", (10, 8, 1)), "label": ("<i4", ())},
                       make=_gray)
    L = classification_loader(path, 8, size=6, train=False, indices=np.arange(10))
    x, y = next(iter(L))
    assert x.shape == (8, 1, 6, 6) and y.dtype == torch.int64 and y.tolist() == [i % 3 for i in range(8)]
    assert len(L) == 2
    two = write_store(tmp_path / "two", 4, schema={"a": ("|u1", (4, 4, 3)), "b": ("|u1", (4, 4, 3)),
                                                    "label": ("<i8", ())},
                      make=lambda i: {"a": np.zeros((4, 4, 3), np.uint8), "b": np.zeros((4, 4, 3), np.uint8),
                                      "label": np.int64(0)})
    with pytest.raises(SchemaError, match="one image field"):
        classification_loader(two, 2)
    assert classification_loader(two, 2, image="b", size=4).fields == ("b", "label")
    nolabel = write_store(tmp_path / "nolabel", 4, schema={"image": ("|u1", (4, 4, 3))},
                          make=lambda i: {"image": np.zeros((4, 4, 3), np.uint8)})
    with pytest.raises(SchemaError, match="integer label field"):
        classification_loader(nolabel, 2)
    with pytest.raises(TypeError, match="sets fields"):
        classification_loader(path, 2, fields=("image",))
    rgba = write_store(tmp_path / "rgba", 4, schema={"image": ("|u1", (4, 4, 4)), "label": ("<i8", ())},
                       make=lambda i: {"image": np.zeros((4, 4, 4), np.uint8), "label": np.int64(0)})
    with pytest.raises(SchemaError, match=r"\(4, 4, 4\).*--alpha black\|white\|drop.*transform=f"):
        classification_loader(rgba, 2)


def _image_folder(root, n_per_class, seed):
    rng = np.random.default_rng(seed)
    for c in ("cat", "dog"):
        os.makedirs(os.path.join(root, c))
        for i in range(n_per_class):
            h, w = rng.integers(20, 40, 2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(root, c, f"{i}.png"))


def _snippet():
    with open(os.path.join(ROOT, "docs/guides/porting.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"<!-- test: porting -->\n```python\n(.*?)```", text, re.DOTALL)
    assert m, "the guide's porting snippet is missing"
    return m.group(1)


def test_readme_porting_snippet_runs(tmp_path):
    """The README's loop, unchanged, on a tiny ImageFolder ingested with the CLI."""
    data = tmp_path / "data"
    for split, n, seed in (("train", 6, 0), ("val", 3, 1)):
        _image_folder(str(tmp_path / "src" / split), n, seed)
        rc = cli_main(["ingest", str(tmp_path / "src" / split), str(data / f"{split}.store"), "--size", "32x32",
                       "--workers", "1"])
        assert rc == 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 8, stride=8), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(4, 2))
    ns = {
        "args": argparse.Namespace(data=str(data), batch_size=4, seed=None, resume=False, start_epoch=0, epochs=2),
        "model": model, "criterion": torch.nn.CrossEntropyLoss(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.01),
    }
    exec(compile(_snippet(), "docs/guides/porting.md", "exec"), ns)  # noqa: S102 - the README snippet is the test
    assert ns["images"].shape[1:] == (3, 224, 224) and ns["target"].dtype == torch.int64
    assert (ns["checkpoint"]["loader"]["epoch"], ns["checkpoint"]["loader"]["batches"]) == (1, len(ns["train_loader"]))
    assert 0 <= ns["correct"] <= 6
    val = [t for _, t in ns["val_loader"]]
    assert torch.cat(val).tolist() == [0, 0, 0, 1, 1, 1]  # the sorted class folders
    # resumed mid-epoch: the rest of epoch 1
    mid = classification_loader(str(data / "train.store"), 4, seed=0)
    mid.set_epoch(1)
    it = iter(mid)
    next(it)
    state = mid.state_dict()
    del it
    ns["args"].resume, ns["checkpoint"], ns["args"].start_epoch = True, {"loader": state}, 1
    exec(compile(_snippet(), "docs/guides/porting.md", "exec"), ns)  # noqa: S102 - the README snippet is the test
    assert ns["i"] == 1  # 12 records, batches of 4: one delivered, two left (i = 0, 1)
