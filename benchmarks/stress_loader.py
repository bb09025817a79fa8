#!/usr/bin/env python3
"""Randomized training-loop behaviours against ``mmstore.torch.Loader``.

    python benchmarks/stress_loader.py [--trials 300] [--seed 0] [--time 600] [--mmap-truncation]

Each trial draws a loader configuration (store, batch size, prefetch, hold,
threads, order kind, read method, drop_last, rank/world size) and one
behaviour, the way real training code uses a loader:

  full        a whole epoch
  break       ``break`` after a few batches (a capped validation loop)
  peek        ``next(iter(loader))``, then a whole epoch (must be the same epoch)
  exception   an exception raised in the loop body, caught outside
  sigint      SIGINT to the process while the loop runs (KeyboardInterrupt)
  fork        ``fork`` mid-epoch; the child continues the inherited iterator
              (must raise), runs a new epoch, or closes; the parent goes on
  gc          the collector forced very often, loaders abandoned in cycles
  abandon     several loaders dropped mid-epoch, never closed
  evict       the store's pages evicted before and during the epoch (cold paths)
  truncate    a copy of the store truncated mid-epoch (``method="pread"``: the
              typed error, at its batch; ``--mmap-truncation`` also runs the
              memory-mapped path in a child: ``StoreChangedError`` or no
              error, never SIGBUS or a wrong batch)
  close       ``Loader.close()`` from another thread while the loop runs
  threads     a second thread calls ``iter()`` / ``next()`` on the same loader

Every delivered batch is checked against the epoch's order and the store's
records (pixel exact). Trials run in a worker process under a watchdog; one
that does not finish within ``--hang`` seconds is a hang (its threads' stacks
are printed, the worker restarted). After each trial the worker reports its
threads, descriptors and RSS.

Prints per-behaviour counts, hangs, wrong batches, failed expectations,
leaks (threads/fds/RSS first vs. last trial) and SIGINT latency. Exits 1 if
any hang, wrong batch or failed expectation occurred, or threads/fds leaked.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

BEHAVIOURS = ["full", "break", "peek", "exception", "sigint", "fork", "gc", "abandon", "evict", "truncate",
              "close", "threads"]
SHAPE = (24, 32, 3)  # 2,304 bytes per record: the preadv path is used
STORES = {"main": (1500, "memmap"), "lmdb": (300, "lmdb")}


def image_of(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SHAPE, dtype=np.uint8)


def build_stores(work: str) -> None:
    import mmstore

    schema = {"image": ("|u1", SHAPE), "label": ("<i8", ()), "idx": ("<i8", ())}
    for name, (n, backend) in STORES.items():
        path = os.path.join(work, name)
        if os.path.exists(os.path.join(path, "manifest.json")):
            continue
        with mmstore.StoreWriter(path, schema, slots=n, backend=backend) as w:
            for s in range(n):
                w.write(s, {"image": image_of(s), "label": np.int64(s % 10), "idx": np.int64(s)}, key=f"k{s}")


# ---------------------------------------------------------------------------------
# worker: runs trials, one JSON line per trial


class Expectation(Exception):
    """The loader did not do what the contract says (not a wrong batch)."""


class Trial:
    def __init__(self, work: str, rng: np.random.Generator, behaviour: str) -> None:
        self.work, self.rng, self.behaviour = work, rng, behaviour
        self.batches = self.wrong = 0
        self.notes: list[str] = []
        self.sigint_ms: float | None = None
        self.store = "lmdb" if (behaviour not in ("truncate", "evict") and rng.random() < 0.2) else "main"
        self.path = os.path.join(work, self.store)

    # -- configuration and checks ------------------------------------------------------
    def loader(self, path: str | None = None, **over: Any) -> Any:
        from mmstore.order import OrderSpec
        from mmstore.torch import Loader, LoaderTuning

        r = self.rng
        n = STORES[self.store][0]
        world = int(r.choice([1, 1, 2, 3]))
        kind = str(r.choice(["permutation", "block", "sequential"]))
        kw: dict[str, Any] = dict(
            batch_size=int(r.integers(1, 97)), order=kind, prefetch=int(r.integers(1, 6)),
            hold=int(r.integers(1, 4)), threads=int(r.integers(1, 7)), drop_last=bool(r.random() < 0.3),
            rank=int(r.integers(0, world)), world_size=world, seed=int(r.integers(0, 1000)),
            method=str(r.choice(["auto", "pread", "mmap"])), copy=bool(r.random() < 0.1),
            window_prefetch=["willneed", "read", False][int(r.integers(0, 3))],
        )
        if kind == "block":
            kw.update(block=int(r.integers(1, 40)), window=int(r.integers(1, 6)))
        kw.update(over)
        if self.store == "lmdb" or kw["batch_size"] > n:
            kw["batch_size"] = min(kw["batch_size"], max(1, n // 4))
        # drawn flat (the draws, and so a trial's seed, stay those of earlier runs), passed as the Loader takes them
        tuning = LoaderTuning(**{k: kw.pop(k) for k in ("prefetch", "hold", "threads", "method", "window_prefetch")
                                 if k in kw})
        order = OrderSpec(kw.pop("order"), **{k: kw.pop(k) for k in ("rank", "world_size", "seed", "block", "window")
                                              if k in kw})
        return Loader(path or self.path, order=order, tuning=tuning, **kw)

    def checker(self, L: Any, epoch: int) -> Checker:
        return Checker(self, L, epoch)

    def expect(self, cond: bool, what: str) -> None:
        if not cond:
            raise Expectation(what)


class Checker:
    """Checks the batches of one iteration of epoch ``epoch``, in order."""

    def __init__(self, t: Trial, L: Any, epoch: int) -> None:
        self.t, self.L, self.epoch = t, L, epoch
        self.want = L.order.epoch(epoch)
        self.k = 0
        self.exhausted = False

    def __call__(self, b: dict) -> None:
        bs = self.L.batch_size
        want = self.want[self.k * bs : (self.k + 1) * bs]
        idx = b["idx"].numpy()
        ok = len(idx) == len(want) and np.array_equal(idx, want)
        if ok:
            ok = np.array_equal(b["label"].numpy(), want % 10) and all(
                np.array_equal(b["image"][j].numpy(), REF[int(i)]) for j, i in enumerate(want)
            )
        self.t.batches += 1
        if not ok:
            self.t.wrong += 1
            self.t.notes.append(f"wrong batch {self.k}")
        self.k += 1

    def complete(self) -> bool:
        return self.exhausted and self.k == len(self.L)

    def next_epoch(self) -> int:
        """The epoch the loader runs next: this one is used once a second
        batch was yielded or the iterator was exhausted (a peek uses none)."""
        return self.epoch + 1 if (self.k >= 2 or self.exhausted) else self.epoch


REF: dict[int, np.ndarray] = {}


def run_epoch(t: Trial, L: Any, epoch: int, stop_at: int | None = None, body: Any = None) -> Checker:
    c = t.checker(L, epoch)
    it = iter(L)
    for b in it:
        c(b)
        if body is not None:
            body(c)
        if stop_at is not None and c.k >= stop_at:
            return c
    c.exhausted = True
    return c


def full_epoch(t: Trial, L: Any, epoch: int) -> Checker:
    c = run_epoch(t, L, epoch)
    t.expect(c.complete(), f"epoch {epoch}: {c.k} batches, len(loader) = {len(L)}")
    return c


def b_full(t: Trial) -> None:
    L = t.loader()
    full_epoch(t, L, 0)
    full_epoch(t, L, 1)
    L.close()


def b_break(t: Trial) -> None:
    L = t.loader()
    c = run_epoch(t, L, 0, stop_at=int(t.rng.integers(1, 5)))
    full_epoch(t, L, c.next_epoch())
    L.close()


def b_peek(t: Trial) -> None:
    L = t.loader()
    e = 0
    if t.rng.random() < 0.5:
        e = 4
        L.set_epoch(4)
    if len(L):
        c = t.checker(L, e)
        c(next(iter(L)))
    full_epoch(t, L, e)  # the same epoch, from its first batch
    L.close()


def b_exception(t: Trial) -> None:
    L = t.loader()
    j = int(t.rng.integers(1, 4))
    c = t.checker(L, 0)
    try:
        for b in L:
            c(b)
            if c.k == j:
                raise ZeroDivisionError("in the loop")
        c.exhausted = True
    except ZeroDivisionError:
        pass
    full_epoch(t, L, c.next_epoch())
    L.close()


def b_sigint(t: Trial) -> None:
    import threading

    L = t.loader()
    delay = float(t.rng.uniform(0, 0.03))
    main = threading.main_thread().ident
    sent: list[float] = []
    got: list[float] = []

    def fire() -> None:
        time.sleep(delay)
        for _ in range(5):  # a signal handled inside a finalizer is lost (Python prints it): send again
            sent.append(time.monotonic())
            signal.pthread_kill(main, signal.SIGINT)  # type: ignore[arg-type]
            for _ in range(200):
                if got:
                    return
                time.sleep(0.01)

    th = threading.Thread(target=fire)
    try:
        th.start()
        while True:  # epochs until the signal arrives
            it = iter(L)
            c = t.checker(L, it.epoch)
            for b in it:
                c(b)
            del it
    except KeyboardInterrupt:
        got.append(time.monotonic())
        it = None  # the interrupted epoch ends when its iterator goes (as a `for` loop's does)
    th.join()
    t.expect(bool(got), "no KeyboardInterrupt")
    if len(sent) > 1:
        t.notes.append("SIGINT had to be sent again")
    t.sigint_ms = (got[0] - sent[-1]) * 1e3
    n = sum(1 for _ in L)  # usable after the interrupt
    t.expect(n == len(L), "epoch after SIGINT incomplete")
    L.close()


def b_fork(t: Trial) -> None:
    from mmstore.errors import LoaderStateError

    L = t.loader(threads=int(t.rng.integers(1, 5)))
    it = iter(L)
    c = t.checker(L, 0)
    for _ in range(min(int(t.rng.integers(0, 3)), len(L))):
        c(next(it))
    case = str(t.rng.choice(["continue", "new-epoch", "close"]))
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if case == "continue":  # the inherited iterator: a clear error
                try:
                    next(it)
                    code = 3
                except LoaderStateError:
                    pass
            elif case == "new-epoch":  # starts clean
                L.set_epoch(9)
                before = t.wrong
                full_epoch(t, L, 9)
                code = 5 if t.wrong > before else 0
            else:
                L.close()
                code = 0 if sum(1 for _ in L) == len(L) else 6
        except BaseException:  # noqa: BLE001
            code = 9
        os._exit(code)
    for b in it:
        c(b)
    c.exhausted = True
    t.expect(c.complete(), "parent epoch incomplete after fork")
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
            break
        time.sleep(0.005)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        t.notes.append(f"HANG: forked child ({case})")
        raise Expectation(f"forked child hung ({case})")
    t.expect(status == 0, f"forked child ({case}) exited {status}")
    t.notes.append(f"fork: {case} ok")
    L.close()


def b_gc(t: Trial) -> None:
    import gc

    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        junk: list[Any] = []
        for _ in range(int(t.rng.integers(2, 6))):
            L = t.loader()
            it = iter(L)
            c = t.checker(L, 0)
            for _ in range(min(int(t.rng.integers(0, 3)), len(L))):
                c(next(it))
                if t.rng.random() < 0.5:
                    gc.collect()
            cyc = [L, it]
            cyc.append(cyc)  # only the collector frees these
            junk.append(cyc)
        del junk, L, it, cyc
        L = t.loader()
        full_epoch(t, L, 0)
        del L
    finally:
        gc.set_threshold(*old)


def b_abandon(t: Trial) -> None:
    for _ in range(int(t.rng.integers(2, 8))):
        L = t.loader()
        run_epoch(t, L, 0, stop_at=int(t.rng.integers(1, 4)))
        del L


def evict(path: str) -> None:
    from mmstore import _os

    for f in os.listdir(path):
        if f.endswith((".npy", ".mdb")):
            _os.evict(os.path.join(path, f))


def b_evict(t: Trial) -> None:
    evict(t.path)
    L = t.loader(method=str(t.rng.choice(["auto", "pread"])))
    mid = int(t.rng.integers(1, 4))
    c = run_epoch(t, L, 0, body=lambda c: evict(t.path) if c.k == mid else None)
    t.expect(c.complete(), "epoch incomplete after eviction")
    L.close()


def b_truncate(t: Trial, mmap: bool = False) -> None:
    import mmstore
    from mmstore.errors import StoreChangedError

    dst = tempfile.mkdtemp(prefix="trunc-", dir=t.work)
    try:
        shutil.copytree(t.path, os.path.join(dst, "s"))
        path = os.path.join(dst, "s")
        L = t.loader(path, method="mmap" if mmap else "pread")
        seg = mmstore.open(path).slot_view.backend.field_segments("image")[0]
        n = STORES["main"][0]
        cut = int(t.rng.integers(0, n))
        at = int(t.rng.integers(1, 4))
        it = iter(L)
        c = t.checker(L, 0)
        err = None
        try:
            for b in it:
                c(b)
                if c.k == at:
                    size = seg.offset + cut * seg.entry_bytes + int(t.rng.integers(0, seg.entry_bytes))
                    os.truncate(seg.path, size)
        except (OSError, StoreChangedError) as e:
            err = e
        if err is not None:
            # pread: a short read (EOFError naming the file); the mapping: the size check
            # before each batch or a fault in the copy (StoreChangedError naming the file)
            typed = (isinstance(err, EOFError) and err.filename == seg.path) or (
                isinstance(err, StoreChangedError) and seg.path in str(err))
            t.expect(typed, f"untyped error {type(err).__name__}: {err}")
            try:
                next(it)
                raise Expectation("batches after the error")
            except StopIteration:
                pass
            t.notes.append("truncation: typed error")
        L.close()
    finally:
        shutil.rmtree(dst, ignore_errors=True)


def b_truncate_mmap(t: Trial) -> None:
    """The memory-mapped path in a child (where a SIGBUS would show)."""
    log = os.path.join(t.work, f"mmap-child-{os.getpid()}.txt")
    pid = os.fork()
    if pid == 0:
        import faulthandler

        fh = open(log, "w")  # noqa: SIM115 - lives as long as the child
        faulthandler.dump_traceback_later(20, exit=True, file=fh)  # a hang prints its stacks and ends
        sub = Trial(t.work, t.rng, "truncate")
        try:
            b_truncate(sub, mmap=True)
            code = 7 if sub.wrong else 0
        except BaseException:  # noqa: BLE001
            code = 8
        os._exit(code)
    _, st = os.waitpid(pid, 0)
    if os.WIFSIGNALED(st) and os.WTERMSIG(st) == signal.SIGBUS:
        t.notes.append("mmap truncation: SIGBUS")
        t.expect(False, "the memory-mapped path died of SIGBUS")
    code = os.waitstatus_to_exitcode(st)
    with open(log) as fh:
        stacks = fh.read()
    os.unlink(log)
    t.expect(code == 0, f"mmap truncation child exited {code} (7: wrong batches, 8: untyped error); "
                        f"stacks:\n{stacks[:3000]}")
    t.notes.append("mmap truncation: " + ("typed error or no error" if code == 0 else f"exit {code}"))


def b_close(t: Trial) -> None:
    import threading

    from mmstore.errors import LoaderStateError

    L = t.loader()
    delay = float(t.rng.uniform(0, 0.02))
    th = threading.Thread(target=lambda: (time.sleep(delay), L.close()))
    c = t.checker(L, 0)
    th.start()
    try:
        for b in L:
            c(b)
        c.exhausted = True
    except LoaderStateError:
        t.notes.append("close: the loop raised")
    th.join()
    t.expect(c.exhausted == (c.k == len(L)) or not c.exhausted, "a short epoch that looks complete")
    t.expect(not c.exhausted or c.k == len(L), f"short epoch without an error ({c.k} of {len(L)})")
    full_epoch(t, L, c.next_epoch())
    L.close()


def b_threads(t: Trial) -> None:
    """Two threads each run a loop over the same loader: each either runs its
    epoch completely and correctly, or gets LoaderStateError from iter()."""
    import threading

    from mmstore.errors import LoaderStateError

    L = t.loader()
    outcome: list[str] = []

    def loop() -> None:
        try:
            it = iter(L)
        except LoaderStateError:
            outcome.append("refused")
            return
        c = t.checker(L, it.epoch)
        for b in it:
            c(b)
        outcome.append("complete" if c.k == len(L) else f"short {c.k}")

    ths = [threading.Thread(target=loop) for _ in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    t.expect(all(o in ("refused", "complete") for o in outcome) and "complete" in outcome, str(outcome))
    t.notes.append("threads: " + "+".join(sorted(outcome)))
    L.close()


def trial(work: str, seed: int, behaviour: str) -> dict[str, Any]:
    t = Trial(work, np.random.default_rng(seed), behaviour)
    fn = globals()["b_" + behaviour]
    failed = ""
    try:
        fn(t)
        if behaviour == "truncate" and ARGS.mmap_truncation:
            b_truncate_mmap(t)
    except Expectation as e:
        failed = str(e)
    except Exception as e:  # noqa: BLE001
        failed = f"{type(e).__name__}: {e}"
    return {"batches": t.batches, "wrong": t.wrong, "failed": failed, "notes": t.notes,
            "sigint_ms": t.sigint_ms,
            "store": t.store}


def counts() -> tuple[int, int, int]:
    import gc
    import threading

    gc.collect()
    for _ in range(300):  # reader threads exit after their current read
        if threading.active_count() == 1:
            break
        time.sleep(0.01)
    with open("/proc/self/statm") as fh:
        rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return threading.active_count(), len(os.listdir("/proc/self/fd")), rss


def worker(work: str) -> None:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import mmstore

    st = mmstore.open(os.path.join(work, "main"))
    for i in range(len(st)):
        REF[i] = np.ascontiguousarray(st[i]["image"])
    st.close()
    import mmstore.torch  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        cmd = json.loads(line)
        res = trial(work, cmd["seed"], cmd["behaviour"])
        res["threads"], res["fds"], res["rss"] = counts()
        res["id"] = cmd["id"]
        print(json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------
# driver


class Worker:
    def __init__(self, work: str, args: argparse.Namespace) -> None:
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--workdir", work]
        if args.mmap_truncation:
            argv.append("--mmap-truncation")
        self.errlog = tempfile.TemporaryFile()
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errlog,
                                  text=True, bufsize=1)
        self.read(600)

    def read(self, timeout: float) -> dict | None:
        assert self.p.stdout is not None
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            return None
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError("the worker died: " + self.stderr_tail())
        return json.loads(line)

    def run(self, cmd: dict, timeout: float) -> dict | None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read(timeout)

    def stderr_tail(self, n: int = 4000) -> str:
        self.errlog.seek(0)
        return self.errlog.read().decode(errors="replace")[-n:]

    def kill(self, dump: bool) -> str:
        if dump:
            self.p.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        self.p.kill()
        self.p.wait()
        return self.stderr_tail()


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", type=float, default=600, help="stop starting trials after this many seconds")
    ap.add_argument("--hang", type=float, default=60, help="a trial running longer than this is a hang")
    ap.add_argument("--behaviours", default=",".join(BEHAVIOURS))
    ap.add_argument("--mmap-truncation", action="store_true",
                    help="also truncate under the memory-mapped path (in a child, so a SIGBUS is "
                         "counted, not fatal)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ARGS = args = ap.parse_args()
    if args.worker:
        worker(args.workdir)
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="stress_loader-")
    os.makedirs(work, exist_ok=True)
    build_stores(work)
    kinds = args.behaviours.split(",")
    rng = np.random.default_rng(args.seed)
    t0 = time.monotonic()
    w = Worker(work, args)
    stats: dict[str, Counter] = defaultdict(Counter)
    hangs: list[str] = []
    fails: list[str] = []
    notes: Counter = Counter()
    sig_ms: list[float] = []
    first = last = mid = None
    done = 0
    for i in range(args.trials):
        if time.monotonic() - t0 > args.time:
            break
        kind = kinds[int(rng.integers(0, len(kinds)))]
        cmd = {"id": i, "seed": int(rng.integers(0, 2**31)), "behaviour": kind}
        res = w.run(cmd, args.hang)
        b = cmd["behaviour"]
        stats[b]["trials"] += 1
        done += 1
        if res is None:
            tail = w.kill(dump=True)
            hangs.append(f"trial {i} {b} seed {cmd['seed']}")
            print(f"HANG: trial {i} ({b}, seed {cmd['seed']}); stacks:\n{tail}", flush=True)
            w = Worker(work, args)
            first = last = mid = None  # a new process: leak figures restart
            continue
        stats[b]["batches"] += res["batches"]
        stats[b]["wrong"] += res["wrong"]
        for n in res["notes"]:
            notes[n] += 1
        if res["failed"]:
            stats[b]["failed"] += 1
            fails.append(f"trial {i} {b} seed {cmd['seed']} ({res['store']}): {res['failed']}")
        if res["sigint_ms"] is not None:
            sig_ms.append(res["sigint_ms"])
        snap = (res["threads"], res["fds"], res["rss"])
        first = first or snap
        last = snap
        if i == args.trials // 2:
            mid = snap
    w.kill(dump=False)
    elapsed = time.monotonic() - t0
    print(f"stress_loader: {done} trials in {elapsed:.0f} s (seed {args.seed})")
    print(f"{'behaviour':<10} {'trials':>6} {'batches':>8} {'wrong':>6} {'failed':>6}")
    for b in kinds:
        s = stats[b]
        print(f"{b:<10} {s['trials']:>6} {s['batches']:>8} {s['wrong']:>6} {s['failed']:>6}")
    wrong = sum(s["wrong"] for s in stats.values())
    print(f"hangs: {len(hangs)}   wrong batches: {wrong}   failed expectations: {len(fails)}")
    leak = False
    if first and last:
        leak = last[0] > first[0] or last[1] > first[1]
        rss = " / ".join(f"{x[2] / 2**20:.0f}" for x in (first, mid, last) if x)
        print(f"after the first / last trial: threads {first[0]} / {last[0]}, fds {first[1]} / {last[1]}; "
              f"RSS after the first / middle / last trial: {rss} MiB")
    if sig_ms:
        print(f"SIGINT to KeyboardInterrupt in the loop: median {np.median(sig_ms):.1f} ms, "
              f"max {max(sig_ms):.1f} ms ({len(sig_ms)} trials)")
    for n, k in sorted(notes.items()):
        print(f"  {n}: {k}")
    for f in fails[:20]:
        print("  FAILED:", f)
    for h in hangs:
        print("  HANG:", h)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if (hangs or wrong or fails or leak) else 0


ARGS: argparse.Namespace


if __name__ == "__main__":
    sys.exit(main())
