"""DDP under a real launcher: torchrun starts 2 processes (gloo, CPU) that train
a tiny DistributedDataParallel model through Loader and through DataLoader +
OrderSampler; every epoch covers every sample exactly once across ranks (the
Loader's default; with ``rank_pad=True`` and through OrderSampler as
DistributedSampler pads or drops) and every rank takes the same number of
steps (a rank with one step more would hang in DDP's all-reduce: the child
has a timeout). A block shuffle sized automatically is the same order on
ranks whose memory budgets differ (one rank has loaded its model, another
has not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from support.stores import IDX_BIG_SCHEMA, write_indexed

pytestmark = pytest.mark.subprocess

N, BS, WORLD, EPOCHS = 101, 8, 2, 2

_JOB = r"""
import faulthandler, json, os, sys
faulthandler.dump_traceback_later(110, exit=True)  # a hang shows where every thread of this rank waits
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
import mmstore
from mmstore.order import OrderSpec
from mmstore.torch import Loader, LoaderTuning, OrderSampler, StoreDataset


def main():
    path, out, bs, epochs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # two ranks on a small machine: no intra-op thread pool running when the DataLoader forks its
    # worker (a fork beside busy OpenMP threads can leave the worker waiting for ever)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(24 * 32 * 3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    store = mmstore.open(path)
    rec = store.stored_record_bytes(("image", "idx"))
    results = []
    for mode in ("loader", "loader-pad", "loader-mem", "dataloader"):
        for kind in ("permutation", "block"):
            for drop in (False, True):
                kw = {"block": 6, "window": 3} if kind == "block" else {}
                if mode == "loader-mem":  # the window sized automatically, each rank another memory budget
                    if kind != "block" or drop:
                        continue
                    kw = {"block": 6, "mem_bytes": (200 + 200 * rank) * rec}
                if mode.startswith("loader"):  # rank and world size from torch.distributed
                    okw = {k: v for k, v in kw.items() if k in ("block", "window")}
                    spec = OrderSpec(kind, seed=3, drop_last=drop, pad=mode == "loader-pad", **okw)
                    src = Loader(store, bs, spec, fields=("image", "idx"), drop_last=drop,
                                 tuning=LoaderTuning(mem_bytes=kw.get("mem_bytes")))
                    order = src.order
                else:
                    ds = StoreDataset(store, fields=("image", "idx"))
                    sm = OrderSampler(ds, kind, seed=3, drop_last=drop, **kw)
                    # a forkserver worker, not a fork of this process beside gloo's and the Loaders'
                    # threads (a fork there can leave the worker waiting on a lock for ever)
                    src = DataLoader(ds, batch_size=bs, sampler=sm, drop_last=drop, num_workers=1,
                                     multiprocessing_context="forkserver", persistent_workers=True)
                    order = sm.order
                for epoch in range(epochs):  # no set_epoch: both move to the next epoch by themselves
                    seen, steps = [], 0
                    for b in src:
                        x = b["image"].reshape(len(b["idx"]), -1).float() / 255
                        loss = model(x).pow(2).mean()
                        opt.zero_grad()
                        loss.backward()  # DDP all-reduce: every rank must take this step
                        opt.step()
                        seen += b["idx"].tolist()
                        steps += 1
                    want = order.epoch(epoch).tolist()
                    if drop:
                        want = want[: len(want) // bs * bs]
                    gathered = [None] * world
                    dist.all_gather_object(gathered, {"seen": seen, "steps": steps, "as_order": seen == want,
                                                      "rank": (order.rank, order.world_size)})
                    if rank == 0:
                        results.append({"mode": mode, "kind": kind, "drop": drop, "epoch": epoch, "ranks": gathered})
                if mode.startswith("loader"):
                    src.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    dist.destroy_process_group()


if __name__ == "__main__":  # the DataLoader's worker starts from a forkserver, which imports this file
    main()
"""


@pytest.mark.slow  # a whole job of many processes: CI's step for slow tests
def test_ddp_two_ranks_exactly_once(tmp_path):
    path = write_indexed(str(tmp_path / "s"), N, schema=IDX_BIG_SCHEMA)
    job, out = tmp_path / "job.py", tmp_path / "out.json"
    job.write_text(textwrap.dedent(_JOB))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--standalone",
             str(job), path, str(out), str(BS), str(EPOCHS)],
            env=env, capture_output=True, text=True, timeout=150, check=False,
        )
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else str(e.stderr)
        pytest.fail(f"the DDP job hung past the ranks' own 110 s traceback dump (torchrun itself?); "
                    f"its stderr, where the ranks' tracebacks are:\n{err[-12000:]}")
    assert r.returncode == 0, r.stderr[-4000:]
    results = json.loads(out.read_text())
    assert len(results) == (3 * 2 * 2 + 1) * EPOCHS
    per_rank = -(-N // WORLD)
    for res in results:
        ranks = res["ranks"]
        what = f"{res['mode']} {res['kind']} drop_last={res['drop']} epoch {res['epoch']}"
        assert [g["rank"] for g in ranks] == [[0, WORLD], [1, WORLD]], what
        steps = {g["steps"] for g in ranks}
        assert len(steps) == 1, f"{what}: ranks took {[g['steps'] for g in ranks]} steps"
        assert all(g["as_order"] for g in ranks), f"{what}: not the epoch's order"
        allids = sorted(i for g in ranks for i in g["seen"])
        if res["drop"]:
            assert steps == {N // WORLD // BS}, what
            assert len(set(allids)) == len(allids) == WORLD * (N // WORLD // BS * BS), what  # each at most once
        elif res["mode"] in ("loader", "loader-mem"):  # the default: every sample exactly once
            assert steps == {-(-per_rank // BS)}, what
            assert allids == list(range(N)), what
        else:
            assert steps == {-(-per_rank // BS)}, what
            assert set(allids) == set(range(N)), what  # every sample ...
            assert len(allids) == per_rank * WORLD, what  # ... once, plus DistributedSampler's padding
    for mode in ("loader", "loader-pad", "loader-mem", "dataloader"):
        e0, e1 = ([r["ranks"][0]["seen"] for r in results if r["mode"] == mode and r["epoch"] == e] for e in (0, 1))
        assert all(a != b for a, b in zip(e0, e1)), f"{mode}: epoch 1 repeated epoch 0"
