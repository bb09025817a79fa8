"""How much a loader slows the training loop it feeds, with only the GIL between them.

A Python-heavy training step (a forward and backward pass through 40 small
linear layers on one intra-op thread: what a GPU loop's launching thread looks
like to the CPU) runs on core 0; everything the loader runs (its threads, a
DataLoader's worker process, a helper process) is pinned to core 1. So the
cores never compete and the only thing that can slow the step is the GIL (and
for a DataLoader, the hand-over of each batch in the main process).

For each loader the step rate beside it is divided by the step rate alone,
measured in alternating rounds in the same process (this machine is shared:
the ratio, not the rate, is the figure). The time the main thread waited for
core 0 while another process held it (its run-queue delay, from
``/proc/thread-self/schedstat``) is taken out of both: what remains is the
step's own time plus what the loader made it wait. Batches are 64 x 128x128x3 uint8 with
an int64 label from an in-memory (page-cached) store; the loop takes one batch
per step and touches it (``batch["image"][0, 0, 0, 0]``), as a loop that
copies it to a device would.

    python benchmarks/bench_beside.py [--rounds 8] [--steps 400]

Needs at least 2 CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

H = W = 128


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_store(path: str, n: int) -> None:
    import mmstore


    if os.path.exists(os.path.join(path, "manifest.json")):
        return
    rng = np.random.default_rng(0)
    with mmstore.StoreWriter(path, {"image": ("|u1", (H, W, 3)), "label": ("<i8", ())}, slots=n,
                             overwrite=True) as w:
        base = rng.integers(0, 256, (16, H, W, 3), dtype=np.uint8)
        for i in range(n):
            w.write(i, {"image": base[i % 16] ^ np.uint8(i % 251), "label": i % 10})


def tids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def children() -> list[int]:
    out = []
    for t in tids():
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def pin_others(main_tid: int) -> None:
    """Every thread of this process but the main one, and every child process
    (and its threads), onto core 1; the main thread onto core 0."""
    for t in tids():
        if t != main_tid:
            try:
                os.sched_setaffinity(t, {1})
            except OSError:
                pass
    for p in children():
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                os.sched_setaffinity(int(t), {1})
        except OSError:
            pass
    os.sched_setaffinity(main_tid, {0})


class Step:
    def __init__(self, width: int, layers: int = 40) -> None:
        import torch

        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        self.x = torch.randn(32, width)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def __call__(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model(self.x).sum().backward()
        self.opt.step()


def touch(batch: Any) -> None:
    """Read one element of every tensor of a batch (as a copy to a device would touch it)."""
    for t in (batch.values() if isinstance(batch, dict) else batch):
        t.view(-1)[0].item()


def runqueue_s() -> float:
    """Seconds this thread has waited on a run queue (ready, but another
    process had the core): ``/proc/thread-self/schedstat``'s second field."""
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


class Clock:
    """Wall time of the main thread less the time it waited for a core that
    another process held: on a shared machine, what is left is the step's own
    time plus what the loader made it wait (the GIL, a batch not ready)."""

    def __enter__(self) -> Clock:
        self.t, self.q = time.perf_counter(), runqueue_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.t
        self.queued = runqueue_s() - self.q
        self.s = self.wall - self.queued


def run_alone(step: Step, steps: int) -> float:
    with Clock() as c:
        for _ in range(steps):
            step()
    return steps / c.s


def run_beside(step: Step, make_iter: Any, steps: int, main_tid: int) -> float:
    """Steps/s while taking one batch per step from ``make_iter()`` (restarted at
    each epoch end); the first batches of the first epoch are not timed."""
    it = make_iter()
    next(it)
    pin_others(main_tid)
    done = 0
    clock = Clock().__enter__()
    while done < steps:
        try:
            b = next(it)
        except StopIteration:
            it = make_iter()
            b = next(it)
            pin_others(main_tid)
        touch(b)
        step()
        done += 1
    clock.__exit__()
    rate = steps / clock.s
    del it
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="records (16,384: 800 MB, 256 batches an epoch)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--width", type=int, default=256, help="the linear layers' width (sets the step's time)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--only", default=None, help="comma list of loaders: loader,labels,process,dataloader")
    ap.add_argument("--json", default=None)
    ap.add_argument("--record", default=None, help="write the docs' benchmark record (docs/benchmarks/data/NAME.json)")
    ap.add_argument("--machine", default="2 vCPU VM (the project's development machine), shared with other jobs")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("needs at least 2 CPUs")
    import torch

    from mmstore.torch import Loader, StoreDataset

    torch.set_num_threads(1)
    work = args.work or os.path.join(tempfile.gettempdir(), "mmstore-bench-beside")
    os.makedirs(work, exist_ok=True)
    path = os.path.join(work, f"beside-{args.n}.store")
    make_store(path, args.n)
    with open(os.path.join(path, "image.npy"), "rb") as f:  # into the page cache
        while f.read(1 << 24):
            pass
    main_tid = threading_main_tid()
    os.sched_setaffinity(0, {1})  # threads created from here on start on core 1
    step = Step(args.width)
    loaders: dict[str, Any] = {}
    only = set(args.only.split(",")) if args.only else {"loader", "labels", "process", "dataloader"}
    if "loader" in only:
        ld = Loader(path, args.batch)
        loaders["loader"] = lambda: iter(ld)
    if "labels" in only:  # the same loader with no image copies: what its per-batch work alone costs
        lb = Loader(path, args.batch, fields=["label"])
        loaders["labels"] = lambda: iter(lb)
    if "process" in only and "process" in Loader.__init__.__code__.co_varnames:
        lp = Loader(path, args.batch, process=True)  # type: ignore[call-arg]
        loaders["process"] = lambda: iter(lp)
    if "dataloader" in only:
        dl = torch.utils.data.DataLoader(StoreDataset(path), batch_size=args.batch, shuffle=True,
                                         num_workers=1, persistent_workers=True)
        loaders["dataloader"] = lambda: iter(dl)
    for mk in loaders.values():  # warm: threads, workers, pages
        for _ in zip(range(3), mk()):
            pass
    os.sched_setaffinity(main_tid, {0})
    for _ in range(50):
        step()
    rates: dict[str, list[float]] = {"alone": [], **{k: [] for k in loaders}}
    for r in range(args.rounds):
        pin_others(main_tid)
        rates["alone"].append(run_alone(step, args.steps))
        for name, mk in loaders.items():
            rates[name].append(run_beside(step, mk, args.steps, main_tid))
            pin_others(main_tid)
            rates["alone"].append(run_alone(step, args.steps))
        log(f"round {r}: " + "  ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()))
    alone = statistics.median(rates["alone"])
    res: dict[str, Any] = {
        "step_alone_per_s": round(alone, 1),
        "batch": f"{args.batch} x {H}x{W}x3 uint8 + label",
        "rounds": args.rounds, "steps": args.steps,
    }
    for k in loaders:
        res[k] = {"steps_per_s": round(statistics.median(rates[k]), 1),
                  "vs_alone": round(statistics.median(rates[k]) / alone, 3),
                  "per_round_vs_alone": [round(x / alone, 3) for x in rates[k]]}
    print(json.dumps(res, indent=1))
    if args.record:
        write_record(args, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


NAMES = {"loader": "Loader (threads, the default)", "labels": "the same, labels only (no image copies)",
         "process": "Loader(process=True)",
         "dataloader": "DataLoader(StoreDataset, num_workers=1)"}


def write_record(args: argparse.Namespace, res: dict[str, Any]) -> None:
    rows = [[NAMES[k], f"{v['vs_alone']:.3f}", f"{min(v['per_round_vs_alone']):.2f}-{max(v['per_round_vs_alone']):.2f}"]
            for k, v in res.items() if isinstance(v, dict)]
    cmd = (f"python benchmarks/bench_beside.py --n {args.n} --rounds {args.rounds} --steps {args.steps} "
           f"--width {args.width}")
    rec = {
        "title": "The training loop beside the loader",
        "command": cmd, "machine": args.machine, "date": time.strftime("%Y-%m-%d"),
        "conditions": (f"A step of 40 linear layers of width {args.width} (forward, backward, SGD; one intra-op "
                       f"thread; {res['step_alone_per_s']:.0f} steps/s alone) on core 0, the loader on core 1; "
                       f"one batch of {res['batch']} per step from a store in the page cache; the main "
                       "thread's run-queue delay taken out; rounds alternate with the step alone."),
        "sections": [{"table": {"columns": ["loader", "step rate vs alone (median)", "rounds"], "rows": rows}}],
    }
    with open(args.record, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")


def threading_main_tid() -> int:
    import threading

    return threading.get_native_id()


if __name__ == "__main__":
    main()
