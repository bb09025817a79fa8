"""Memory: DataLoader workers over a 1,000,000-record store keep a flat PSS for
the whole epoch (no copy-on-read growth of per-sample Python objects)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import mmstore

torch = pytest.importorskip("torch")

N = 1_000_000


def _pss_kb(pid):
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    raise AssertionError("no Pss line")


@pytest.mark.soak  # a measurement over a million records: CI's soak step
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps_rollup")
def test_worker_pss_stays_flat_over_an_epoch_of_a_million_records(tmp_path):
    from torch.utils.data import DataLoader

    from mmstore.torch import StoreDataset

    path = str(tmp_path / "m")
    with mmstore.StoreWriter(path, {"x": ("<u2", (2,)), "label": ("<i8", ())}, slots=N) as w:
        w.write_batch(0, {"x": np.zeros((N, 2), np.uint16), "label": np.arange(N) % 1000})
    ds = StoreDataset(path)
    dl = DataLoader(ds, batch_size=1000, shuffle=True, num_workers=4, persistent_workers=False,
                    prefetch_factor=2, generator=torch.Generator().manual_seed(0))
    it = iter(dl)
    seen = 0
    first, last = {}, {}
    pids = [w.pid for w in it._workers]
    t_end = time.monotonic() + 120
    for i, batch in enumerate(it):
        seen += len(batch["label"])
        if i == 20:
            first = {p: _pss_kb(p) for p in pids}
        if i % 100 == 0 and first:
            last = {p: _pss_kb(p) for p in pids}
        assert time.monotonic() < t_end
    assert seen == N
    growth_mb = {p: (last[p] - first[p]) / 1024 for p in pids}
    assert max(growth_mb.values()) < 50, growth_mb
