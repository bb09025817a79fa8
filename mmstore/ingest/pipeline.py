"""The ingest pipeline: listing -> worker processes -> store, resumable.

Data flow
---------
The parent scans the source into a :class:`~.sources.Listing` (numpy arrays),
creates ``DEST.partial`` with :class:`~mmstore.writer.StoreWriter` (slot files
preallocated), then forks ``workers`` processes. Each worker opens its own
:class:`~mmstore.writer.SlotWriter` and its own source reader, receives slot
ranges (two integers) over a pipe, decodes every input of the range and
``pwrite``s the record at its slot, zeroes the slots that failed, and answers
with the range and the holes' reasons. Pixels never cross a pipe. The parent
tells the writer (``mark_written`` / ``skip``) and hands out the next range;
its committer thread fsyncs the store's files and only then appends the
finished ranges to the commit log (see ``resume.py``).

Slot ``s`` is input ``lo + s`` of the sorted listing, so the bytes do not
depend on the worker count, the chunk size, the completion order or how often
the run was interrupted.

Workers get ``PR_SET_PDEATHSIG = SIGKILL`` so a killed ingest leaves no
writers behind; they ignore SIGINT (the parent stops them). A worker that
dies while decoding (a decoder crash) makes its range be retried one input at
a time; the input that kills a worker again becomes a hole
(``corrupt: decoding crashed the worker ...``).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .. import _io
from ..errors import IngestError, ResumeMismatchError, SchemaError, StoreExistsError
from ..format import MANIFEST_FILE, PARTIAL_SUFFIX, read_manifest
from ..schema import Schema
from .._dest import check_dest
from ..writer import SlotWriter, StoreWriter, _release_lock, acquire_lock, publish
from .resume import CommitLog, pending_ranges, read_state, write_state
from .sources import DatasetSource, Source, reason_of, to_array

__all__ = ["IngestResult", "run_ingest", "parse_max_errors", "parse_shard", "parse_size"]

LABEL_DTYPE = "<i8"
ORIG_SIZE_DTYPE = "<i4"
BOX_DTYPE = "<i4"


@dataclass
class IngestResult:
    """What an ingest did."""

    path: str
    slots: int
    records: int
    skipped: int
    reasons: Counter = field(default_factory=Counter)
    elapsed: float = 0.0
    resumed: int = 0  # slots already committed when this run started
    warnings: dict[str, int] = field(default_factory=dict)
    already_complete: bool = False

    @property
    def ok(self) -> int:
        return self.records

    def summary(self) -> str:
        rate = (self.slots - self.resumed) / self.elapsed if self.elapsed > 0 else 0.0
        lines = [
            f"{self.path}: {self.records} records, {self.skipped} skipped"
            + (f" ({self.resumed} were already done)" if self.resumed else "")
            + (f", {self.elapsed:.1f} s, {rate:,.0f} inputs/s" if self.elapsed else "")
        ]
        if self.reasons:
            cats = Counter()
            for r, c in self.reasons.items():
                cats[r.split(":", 1)[0]] += c
            lines.append("skipped by reason: " + ", ".join(f"{k} {v}" for k, v in cats.most_common()))
            for r, c in self.reasons.most_common(5):
                lines.append(f"  {c:>6}  {r}")
            lines.append(f"details (slot, key, reason): {os.path.join(self.path, 'errors.jsonl')}")
        for k, v in sorted(self.warnings.items()):
            lines.append(f"note: {v} {k}")
        return "\n".join(lines)


# --------------------------------------------------------------------------
# small parsers (shared with the CLI)


def parse_size(text: str | int | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"224x224"``, ``"224"``, ``224`` or ``(h, w)`` -> ``(h, w)``."""
    if text is None:
        return None
    if isinstance(text, (tuple, list)):
        h, w = text
        return int(h), int(w)
    if isinstance(text, int):
        return text, text
    s = str(text).lower().replace("*", "x")
    try:
        if "x" in s:
            h, w = s.split("x")
            out = int(h), int(w)
        else:
            out = int(s), int(s)
    except ValueError:
        raise ValueError(f"size must be HxW such as 224x224, got {text!r}") from None
    if min(out) <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return out


def parse_shard(text: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"K/N"`` (0 <= K < N) -> ``(K, N)``."""
    if text is None:
        return None
    if isinstance(text, (tuple, list)):
        k, n = (int(v) for v in text)
    else:
        try:
            k_s, n_s = str(text).split("/")
            k, n = int(k_s), int(n_s)
        except ValueError:
            raise ValueError(f"--shard must be K/N such as 0/8, got {text!r}") from None
    if not (n >= 1 and 0 <= k < n):
        raise ValueError(f"--shard K/N needs 0 <= K < N (K counts from 0), got {k}/{n}")
    return k, n


def parse_max_errors(text: str | int | float | None) -> tuple[str, float] | None:
    """``"10"`` -> ("count", 10); ``"1.5%"`` -> ("percent", 1.5); None: no limit."""
    if text is None:
        return None
    s = str(text).strip()
    try:
        if s.endswith("%"):
            v = float(s[:-1])
            if not 0 <= v <= 100:
                raise ValueError
            return "percent", v
        v = int(s)
        if v < 0:
            raise ValueError
        return "count", float(v)
    except ValueError:
        raise ValueError(f"--max-errors must be a count N or a percentage P%, got {text!r}") from None


def shard_range(n: int, shard: tuple[int, int] | None) -> tuple[int, int]:
    if shard is None:
        return 0, n
    k, m = shard
    return k * n // m, (k + 1) * n // m


# --------------------------------------------------------------------------
# the per-record work (runs in workers)


class _Job:
    """Everything a worker needs; inherited by fork, never pickled."""

    def __init__(self, source: Source, spec: Any, schema: Schema, lo: int, partial: str) -> None:
        self.source = source
        self.spec = spec
        self.schema = schema
        self.lo = lo
        self.partial = partial
        self.labels = source.listing.labels
        self.label_errors = source.listing.label_errors  # input -> hole reason (a list's bad label cells)
        self.has_label = "label" in schema
        self.full = "box" in schema  # image fields with orig_size / box

    def checked(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
        """``rec`` as the schema's arrays: a cheap exact check when every value
        already has its field's dtype, shape and layout, else ``Schema.validate``
        (lossless conversions, ``SchemaError`` otherwise)."""
        if len(rec) == len(self.schema):
            for f in self.schema:
                v = rec.get(f.name)
                if not (isinstance(v, np.ndarray) and v.dtype == f.dtype and v.shape == f.shape
                        and v.flags.c_contiguous):
                    break
            else:
                return rec
        return self.schema.validate(rec)

    def record(self, reader: Any, slot: int) -> dict[str, Any]:
        i = self.lo + slot
        if i in self.label_errors:
            raise _input(self.label_errors[i])
        label = None
        if isinstance(self.source, DatasetSource):
            img, label = self.source.split(reader.load(i))
            if img is None:
                raise _input("wrong-shape: dataset item has no image")
            img = to_array(img)
        else:
            img = reader.load(i)
        out: dict[str, Any] = {}
        if self.source.decoded:
            if self.spec is not None:
                from ..decode import fit_array

                d = fit_array(img, self.spec)
            else:
                d = None
                out["image"] = img
        else:
            from ..decode import decode_image

            d = decode_image(img, self.spec)
        if d is not None:
            out["image"] = d.image
        if self.has_label:
            if label is None:
                label = self.labels[i] if self.labels is not None else None
            if label is None:
                raise _input("wrong-shape: item has no label")
            if hasattr(label, "item"):
                label = label.item()
            try:
                out["label"] = np.array(label, LABEL_DTYPE) if float(label) == int(label) else label
            except (TypeError, ValueError, OverflowError):
                out["label"] = label  # validate() reports it
        if self.full:
            out["orig_size"] = np.array(d.orig_size, ORIG_SIZE_DTYPE)
            out["box"] = np.array(d.box, BOX_DTYPE)
        return out


def _input(reason: str) -> Exception:
    from .sources import InputError

    return InputError(reason)


def _describe_oserror(exc: OSError) -> str:
    import errno as _e

    if exc.errno in (_e.ENOSPC, getattr(_e, "EDQUOT", -1)):
        cause = "the disk is full (or over quota)"
    elif exc.errno == _e.EFBIG:
        cause = "a file grew past the allowed size (File too large: RLIMIT_FSIZE or the file system's limit)"
    else:
        return f"I/O error: {exc}"
    return f"writing the store failed: {cause} [{exc}]"


def process_range(job: _Job, sw: SlotWriter, reader: Any, a: int, b: int) -> list[tuple[int, str]]:
    """Decode and write slots ``a..b``; return the holes (slot, reason).

    The data is not fsynced here: the parent's committer fsyncs the store's
    files (one fsync covers every chunk reported before it started) and only
    then appends the chunks to the commit log, off the decoders' path.
    """
    errs: list[tuple[int, str]] = []
    for s in range(a, b):
        try:
            rec = job.record(reader, s)
            arrays = job.checked(rec)
        except OSError as exc:  # a reading error that is not a decode error
            errs.append((s, f"unreadable: [Errno {exc.errno}] {exc.strerror or exc}"))
            sw.zero(s)
            continue
        except SchemaError as exc:
            errs.append((s, f"wrong-shape: {exc}"))
            sw.zero(s)
            continue
        except MemoryError:
            errs.append((s, "too-large: out of memory while decoding"))
            sw.zero(s)
            continue
        except Exception as exc:  # noqa: BLE001 - a bad input must never stop the run
            r = reason_of(exc)
            if r is None:
                r = f"corrupt: {type(exc).__name__}: {str(exc)[:200]}"
            errs.append((s, r))
            sw.zero(s)
            continue
        sw.write_arrays(s, arrays)
    return errs


def _set_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # noqa: BLE001 - not Linux: the pipe EOF still ends the worker
        pass


def _worker_main(conn: Any, job: _Job, parent: int) -> None:
    _set_pdeathsig()
    if os.getppid() != parent:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import cv2

        cv2.setNumThreads(1)  # one process per core already
        # decode failures are reported in errors.jsonl; keep OpenCV's own
        # warnings ("PNG input buffer is incomplete" ...) off the progress bar
        cv2.utils.logging.setLogLevel(cv2.utils.logging.LOG_LEVEL_ERROR)
    except Exception:  # noqa: BLE001
        pass
    try:
        sw = SlotWriter(job.partial)
        reader = job.source.reader()
    except OSError as exc:
        conn.send(("fatal", -1, -1, _describe_oserror(exc)))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            break
        if msg is None:
            break
        a, b = msg
        try:
            errs = process_range(job, sw, reader, a, b)
        except OSError as exc:
            conn.send(("fatal", a, b, _describe_oserror(exc)))
            break
        conn.send(("ok", a, b, errs))
    sw.close()


class _Pool:
    """``n`` forked worker processes, each fed ranges over its own pipe."""

    DEPTH = 2  # ranges queued per worker

    def __init__(self, n: int, job: _Job) -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context("fork")
        self.job = job
        if not job.source.decoded or job.spec is not None:
            try:  # import the decoder once here: every worker inherits it by fork
                importlib.import_module("cv2")
            except ImportError:
                pass
        self.procs: list[Any] = [None] * n
        self.conns: list[Any] = [None] * n
        self.tasks: list[deque] = [deque() for _ in range(n)]
        for i in range(n):
            self._start(i)

    def _start(self, i: int) -> None:
        parent_conn, child_conn = self.ctx.Pipe(duplex=True)
        p = self.ctx.Process(target=_worker_main, args=(child_conn, self.job, os.getpid()), daemon=True)
        # NOTE [OpenCV and fork]: a child forked while OpenCV's thread pool
        # exists in this process inherits the pool's condition variables with
        # waiters that do not exist in the child, and its first
        # cv2.setNumThreads() hangs forever in pthread_cond_destroy (found by
        # running the demo inside the test suite). Wind the pool down for the
        # fork and restore the caller's setting afterwards.
        cv2 = sys.modules.get("cv2")
        threads = cv2.getNumThreads() if cv2 is not None else 1
        if threads != 1:
            cv2.setNumThreads(1)
        try:
            p.start()
        finally:
            if threads != 1:
                cv2.setNumThreads(threads)
        child_conn.close()
        self.procs[i] = p
        self.conns[i] = parent_conn
        self.tasks[i] = deque()

    def send(self, i: int, rng: tuple[int, int]) -> None:
        self.tasks[i].append(rng)
        try:
            self.conns[i].send(rng)
        except OSError:  # the worker died; its sentinel reports it and the range is retried
            pass

    def busy(self) -> bool:
        return any(self.tasks)

    def wait(self, timeout: float) -> list[tuple[str, int, Any]]:
        """Events: ("msg", worker, message) or ("died", worker, exitcode)."""
        from multiprocessing.connection import wait

        objs: dict[Any, tuple[str, int]] = {}
        for i, (c, p) in enumerate(zip(self.conns, self.procs)):
            objs[c] = ("conn", i)
            objs[p.sentinel] = ("proc", i)
        out = []
        ready = wait(list(objs), timeout)
        seen_dead = set()
        for r in ready:
            kind, i = objs[r]
            if kind == "conn":
                try:
                    while self.conns[i].poll():
                        out.append(("msg", i, self.conns[i].recv()))
                except (EOFError, OSError):
                    seen_dead.add(i)
            else:
                seen_dead.add(i)
        for i in sorted(seen_dead):
            p = self.procs[i]
            p.join(timeout=5)
            # drain what it sent before dying
            try:
                while self.conns[i].poll():
                    out.append(("msg", i, self.conns[i].recv()))
            except (EOFError, OSError):
                pass
            out.append(("died", i, p.exitcode))
        return out

    def restart(self, i: int) -> None:
        try:
            self.conns[i].close()
        except OSError:
            pass
        self._start(i)

    def close(self, kill: bool = False) -> None:
        for i, (c, p) in enumerate(zip(self.conns, self.procs)):
            if p is None:
                continue
            if not kill and p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else 10)
        for p in self.procs:
            if p is None:
                continue
            if kill:
                p.kill()
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


# --------------------------------------------------------------------------
# progress


class _Progress:
    def __init__(self, total: int, initial: int, errors: int, quiet: bool, interval: float, label: str) -> None:
        self.total = total
        self.done = initial
        self.errors = errors
        self.quiet = quiet
        self.interval = interval
        self.label = label
        self.t0 = time.monotonic()
        self.start_done = initial
        self.last_log = self.t0
        self.bar = None
        if not quiet:
            tty = False
            try:
                tty = sys.stderr.isatty()
            except (AttributeError, ValueError):
                pass
            if tty:
                try:
                    from tqdm import tqdm

                    self.bar = tqdm(total=total, initial=initial, unit="img", file=sys.stderr, dynamic_ncols=True, desc=label)
                    self.bar.set_postfix(errors=errors, refresh=False)
                except ImportError:
                    self.bar = None

    def update(self, n: int, errs: int) -> None:
        self.done += n
        self.errors += errs
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.update(n)
            if errs:
                self.bar.set_postfix(errors=self.errors, refresh=False)
            return
        now = time.monotonic()
        if now - self.last_log >= self.interval:
            self.last_log = now
            self.log()

    def log(self) -> None:
        now = time.monotonic()
        el = max(now - self.t0, 1e-9)
        rate = (self.done - self.start_done) / el
        left = self.total - self.done
        eta = f"{left / rate:,.0f} s" if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"{self.label}: {self.done}/{self.total} ({pct:.1f}%), {rate:,.0f}/s, ETA {eta}, {self.errors} errors",
            file=sys.stderr,
            flush=True,
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _Committer:
    """Background thread: fsync the store's files, then commit the chunks.

    A chunk is handed over after its worker finished writing it; an fsync that
    starts after that covers its pages (fsync flushes a file's dirty pages
    whoever wrote them), so the commit that follows is safe. Batching every
    chunk that arrived during the previous fsync keeps fsyncs off the decoders'
    path and their number small.
    """

    # NOTE [Ctrl-C and locks]: the main thread talks to this thread only
    # through a queue.SimpleQueue, whose put() holds no Python-level lock. A
    # threading.Condition here deadlocked on Ctrl-C: KeyboardInterrupt can
    # land between a `with cv:` acquiring the lock and its body starting, so
    # the main thread kept the lock while it then waited for this thread,
    # which needed the lock to stop (seen once under heavy load; a hung
    # `mmstore ingest` after SIGINT).
    _STOP = None

    def __init__(self, sync: Callable[[], None], log: CommitLog) -> None:
        import queue
        import threading

        self.sync = sync
        self.log = log
        self.q: Any = queue.SimpleQueue()
        self.abandon = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="mmstore-commit", daemon=True)
        self.thread.start()

    def put(self, a: int, b: int, errs: list[tuple[int, str]]) -> None:
        self.q.put((a, b, errs))

    def _run(self) -> None:
        import queue

        while True:
            batch = [self.q.get()]
            while True:  # everything that arrived during the previous fsync
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            stop = self._STOP in batch
            batch = [x for x in batch if x is not self._STOP]
            if batch and not self.abandon:
                try:
                    self.sync()
                    for a, b, errs in batch:
                        if self.abandon:
                            break
                        self.log.commit(a, b, errs)
                except BaseException as exc:  # noqa: BLE001 - reported by check()
                    self.error = exc
                    return
            if stop:
                return

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def finish(self, drain: bool = True) -> None:
        if not drain:
            self.abandon = True
        self.q.put(self._STOP)
        self.thread.join()
        if drain:
            self.check()


# --------------------------------------------------------------------------
# the run


def _fingerprint(listing_fp: str, params: dict[str, Any]) -> str:
    import xxhash

    return xxhash.xxh3_128(listing_fp.encode() + json.dumps(params, sort_keys=True).encode()).hexdigest()


def _default_workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


def _schema_for(source: Source, spec: Any, first_item: Any) -> Schema:
    fields: dict[str, Any] = {}
    if spec is not None:
        fields["image"] = ("|u1", spec.record_shape())
    else:
        arr = np.asarray(first_item)
        fields["image"] = (arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype, arr.shape)
    has_label = source.listing.labels is not None or getattr(source, "has_labels", False)
    if has_label:
        fields["label"] = (LABEL_DTYPE, ())
    if spec is not None:
        fields["orig_size"] = (ORIG_SIZE_DTYPE, (2,))
        fields["box"] = (BOX_DTYPE, (4,))
    return Schema(fields)


def _probe_lock(dest: str) -> None:
    _release_lock(dest, acquire_lock(dest))  # no DEST.lock is left behind


def _inputs(source: Source) -> tuple[list[str], list[str]]:
    """The paths DEST must stay clear of: the source itself (DEST may not be,
    contain or lie inside it) and a list's image root (DEST may not be or
    contain it; a store next to its list is fine)."""
    if not source.path:
        return [], []
    root = getattr(source, "root", None)
    return [source.path], [root] if isinstance(root, str) else []


def run_ingest(source: Source, dest: str, spec: Any, **kw: Any) -> IngestResult:
    """Run one ingest (see :func:`mmstore.ingest.ingest` for the parameters)."""
    try:
        return _run(source, dest, spec, **kw)
    except OSError as exc:
        from ..errors import MmstoreError

        if isinstance(exc, MmstoreError):
            raise
        partial = os.path.abspath(os.fspath(dest)) + PARTIAL_SUFFIX
        hint = kw.get("resume_hint") or "rerun the same ingest with resume=True (CLI: --resume)"
        kept = f"; {_kept(partial, hint)}" if os.path.exists(partial) else ""
        raise IngestError(f"{dest}: {_describe_oserror(exc)}{kept}") from exc


def _run(
    source: Source,
    dest: str,
    spec: Any,
    *,
    workers: int | None = None,
    chunk: int | None = None,
    on_error: str = "skip",
    max_errors: str | int | None = None,
    resume: bool = False,
    overwrite: bool = False,
    shard: tuple[int, int] | None = None,
    quiet: bool = False,
    backend: str = "memmap",
    progress_interval: float = 10.0,
    resume_hint: str | None = None,
    log: Callable[[str], None] | None = None,
) -> IngestResult:
    t_start = time.monotonic()
    dest = os.path.abspath(os.fspath(dest))
    partial = dest + PARTIAL_SUFFIX
    say = log or (lambda m: None if quiet else print(m, file=sys.stderr, flush=True))
    hint = resume_hint or "rerun the same ingest with resume=True (CLI: --resume)"
    if on_error not in ("skip", "fail"):
        raise ValueError(f"on_error must be 'skip' or 'fail', got {on_error!r}")
    limit = ("count", 0.0) if on_error == "fail" else parse_max_errors(max_errors)
    nworkers = _default_workers() if workers is None else int(workers)
    if nworkers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    sources, protect = _inputs(source)
    check_dest(dest, overwrite=overwrite, sources=sources, protect=protect)
    if os.path.exists(dest + ".lock"):
        _probe_lock(dest)  # fail fast when another ingest is running (before a long scan)

    # a crash during publish: the manifest is written, only the rename is left
    if os.path.isfile(os.path.join(partial, MANIFEST_FILE)):
        if not resume and not overwrite:
            raise StoreExistsError(
                f"{partial}: a finished ingest is waiting to be published; rerun with --resume to finish it"
            )
        if resume:
            fd = acquire_lock(dest)
            try:
                publish(dest)
            finally:
                _release_lock(dest, fd)
            m = read_manifest(dest)
            say(f"{dest}: published the already finished ingest")
            return IngestResult(dest, m["slots"], m["records"], m["slots"] - m["records"], already_complete=True)

    listing = source.scan()
    n_total = len(listing)
    if n_total == 0:
        raise IngestError(f"{source.path or 'the dataset'}: no inputs found (empty source); nothing was created")
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    _probe_lock(dest)
    lo, hi = shard_range(n_total, shard)
    nslots = hi - lo
    first_item = None
    if source.decoded and spec is None:
        first_item = source.reader().load(lo if nslots else 0)
        if isinstance(source, DatasetSource):
            img, lab = source.split(first_item)
            source.has_labels = lab is not None
            first_item = to_array(img)
    elif isinstance(source, DatasetSource):
        _, lab = source.split(source.reader().load(lo if nslots else 0))
        source.has_labels = lab is not None
    schema = _schema_for(source, spec, first_item)
    desc = source.describe()
    params = {
        "source": {k: v for k, v in desc.items() if k not in ("path", "root")},
        "decode": spec.to_dict() if spec is not None else None,
        "schema": schema.to_json(),
        "backend": backend,
        "inputs": n_total,
        "label_names": listing.label_names,
    }
    inputs_fp = _fingerprint(listing.fingerprint, params)
    fingerprint = _fingerprint(inputs_fp, {"shard": list(shard) if shard else None, "range": [lo, hi]})
    state = {
        "fingerprint": fingerprint,
        "inputs_fingerprint": inputs_fp,
        "listing_fingerprint": listing.fingerprint,
        "params": params,
        "shard": list(shard) if shard else None,
        "range": [lo, hi],
        "slots": nslots,
    }
    provenance = {
        "source": desc,
        "resize": spec.resize if spec is not None else None,
        "size": list(spec.size) if spec is not None else None,
        "ingest": {
            "fingerprint": fingerprint,
            "inputs_fingerprint": inputs_fp,
            "inputs": n_total,
            "shard": list(shard) if shard else None,
            "range": [lo, hi],
            "params": params,
        },
    }

    if os.path.exists(dest) and not overwrite:
        try:
            m = read_manifest(dest)
            same = m["provenance"].get("ingest", {}).get("fingerprint") == fingerprint
        except Exception:  # noqa: BLE001
            same = False
        if resume and same and not os.path.exists(partial):
            say(f"{dest}: already complete (same inputs and parameters); nothing to do")
            return IngestResult(dest, m["slots"], m["records"], m["slots"] - m["records"], already_complete=True)
        raise StoreExistsError(f"{dest}: already exists; pass --overwrite to replace it")

    resuming = False
    if os.path.exists(partial):
        old = read_state(partial)
        if overwrite:
            pass
        elif not resume:
            raise StoreExistsError(
                f"{partial}: an interrupted ingest is here; {hint} to continue it, or pass --overwrite to start over"
            )
        elif old is None or not os.path.exists(os.path.join(partial, "_writer.json")):
            overwrite = True  # it died before its first commit could exist: start over
        elif old.get("fingerprint") != fingerprint:
            raise ResumeMismatchError(_mismatch(partial, old, state))
        else:
            resuming = True

    writer = StoreWriter(
        dest,
        schema,
        slots=nslots,
        backend=backend,
        overwrite=overwrite,
        resume=resuming,
        label_names=listing.label_names,
        provenance=provenance,
        inputs=sources,
    )
    log_ = CommitLog(partial)
    done = np.zeros(nslots, bool)
    reasons: Counter = Counter()
    nerr = 0
    pool: _Pool | None = None
    prog: _Progress | None = None
    committer: _Committer | None = None
    stopped: str | None = None
    try:
        if resuming:
            for a, b, errs in log_.entries():
                if not (0 <= a <= b <= nslots) or any(not a <= s < b for s, _ in errs):
                    break
                _apply(writer, listing, lo, a, b, errs, reasons)
                done[a:b] = True
                nerr += len(errs)
        else:
            write_state(partial, state)
        log_.open()
        already = int(done.sum())
        if resuming:
            say(f"{dest}: resuming: {already} of {nslots} inputs already committed")
        offsets, blob = listing.sub(lo, hi)
        writer.set_keys(offsets, blob)

        def too_many() -> bool:
            if limit is None:
                return False
            kind, v = limit
            if kind == "count":
                return nerr > v
            return nerr > v / 100.0 * nslots

        if too_many():
            stopped = _too_many_msg(nerr, limit, reasons)
        chunk_n = _chunk_size(chunk, schema, nslots, max(1, nworkers))
        ranges = pending_ranges(done, chunk_n)
        retry: deque = deque()

        def next_range() -> tuple[int, int] | None:
            if retry:
                return retry.popleft()
            return next(ranges, None)

        def on_done(a: int, b: int, errs: list[tuple[int, str]]) -> None:
            nonlocal nerr
            committer.check()
            committer.put(a, b, errs)
            _apply(writer, listing, lo, a, b, errs, reasons)
            done[a:b] = True
            nerr += len(errs)
            prog.update(b - a, len(errs))

        job = _Job(source, spec, schema, lo, partial)
        if stopped is None and nworkers > 0:
            todo = nslots - already
            nworkers = max(1, min(nworkers, -(-todo // chunk_n)))  # no idle processes on small inputs
            pool = _Pool(nworkers, job)  # fork before any helper thread exists
        committer = _Committer(writer.slot_writer.sync, log_)
        prog = _Progress(nslots, already, nerr, quiet, progress_interval, "ingest")
        if stopped is None and nworkers == 0:
            reader = source.reader()
            sw = writer.slot_writer
            while stopped is None:
                r = next_range()
                if r is None:
                    break
                try:
                    errs = process_range(job, sw, reader, *r)
                except OSError as exc:
                    raise IngestError(f"{dest}: {_describe_oserror(exc)}; {_kept(partial, hint)}") from None
                on_done(r[0], r[1], errs)
                if too_many():
                    stopped = _too_many_msg(nerr, limit, reasons)
        elif stopped is None:
            assert pool is not None
            exhausted = False
            crashed_once: set[int] = set()
            for i in range(nworkers):
                for _ in range(_Pool.DEPTH):
                    r = next_range()
                    if r is None:
                        exhausted = True
                        break
                    pool.send(i, r)
            while pool.busy() and stopped is None:
                for ev, i, payload in pool.wait(timeout=1.0):
                    if ev == "msg":
                        kind, a, b, body = payload
                        if kind == "fatal":
                            raise IngestError(f"{dest}: {body}; {_kept(partial, hint)}")
                        if pool.tasks[i] and pool.tasks[i][0] == (a, b):
                            pool.tasks[i].popleft()
                        on_done(a, b, body)
                        if too_many():
                            stopped = _too_many_msg(nerr, limit, reasons)
                            break
                        if not exhausted:
                            r = next_range()
                            if r is None:
                                exhausted = True
                            else:
                                pool.send(i, r)
                    else:  # a worker died
                        lost = list(pool.tasks[i])
                        code = payload
                        if code == 77 and (os.environ.get("MMSTORE_CRASH_AT") or _io._CRASH):
                            # a fault-injection crash point fired in the worker: the
                            # whole ingest "crashes" there, as a power cut would
                            pool.close(kill=True)
                            os._exit(77)
                        if lost:
                            a, b = lost[0]
                            if b - a == 1 and a in crashed_once:
                                why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                                on_done(a, b, [(a, f"corrupt: decoding crashed the worker process ({why})")])
                                lost = lost[1:]
                            elif b - a == 1:
                                crashed_once.add(a)
                            else:
                                # retry the first range one input at a time to find the culprit
                                retry.extendleft(reversed([(s, s + 1) for s in range(a, b)]))
                                lost = lost[1:]
                            retry.extendleft(reversed(lost))
                        pool.restart(i)
                        for _ in range(_Pool.DEPTH):
                            r = next_range()
                            if r is None:
                                exhausted = True
                                break
                            exhausted = False
                            pool.send(i, r)
                        if too_many():
                            stopped = _too_many_msg(nerr, limit, reasons)
                            break
                # an idle worker (after a restart drained the queue) picks up retries
                if retry:
                    for i in range(nworkers):
                        while len(pool.tasks[i]) < _Pool.DEPTH and retry:
                            pool.send(i, retry.popleft())
        if pool is not None:
            pool.close(kill=stopped is not None)
            pool = None
        prog.close()
        committer.finish(drain=True)
        committer = None
        if stopped is not None:
            raise IngestError(f"{dest}: {stopped}; {_kept(partial, hint)}")
        missing = np.flatnonzero(~done)
        if len(missing):  # pragma: no cover - a bug guard
            raise IngestError(f"{dest}: {len(missing)} slots were not processed (first {missing[:5].tolist()})")
        log_.close()
        writer.close()
    except BaseException:
        if pool is not None:
            pool.close(kill=True)
        if committer is not None:
            committer.finish(drain=False)
        if prog is not None:
            prog.close()
        log_.close()
        writer.abort()
        raise
    m = read_manifest(dest)
    res = IngestResult(
        dest,
        m["slots"],
        m["records"],
        m["slots"] - m["records"],
        reasons,
        time.monotonic() - t_start,
        already,
        listing.warnings,
    )
    return res


def _apply(writer: StoreWriter, listing: Any, lo: int, a: int, b: int, errs: list[tuple[int, str]], reasons: Counter) -> None:
    bad = {s for s, _ in errs}
    if bad:
        ok = np.array([s for s in range(a, b) if s not in bad], np.int64)
        for s, r in errs:
            writer.skip(s, listing.key(lo + s), r)
            reasons[r] += 1
    else:
        ok = np.arange(a, b, dtype=np.int64)
    if len(ok):
        writer.mark_written(ok)


def _chunk_size(chunk: int | None, schema: Schema, nslots: int, workers: int) -> int:
    if chunk is not None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        return int(chunk)
    by_bytes = (32 << 20) // max(1, schema.record_bytes)
    c = max(8, min(1024, by_bytes))
    # at least 16 chunks per worker: the last chunks leave workers idle while
    # one finishes (measured: 4 per worker cost ~5% of a 2,000-image ingest)
    balance = max(1, math.ceil(nslots / (workers * 16)))
    return max(1, min(c, balance))


def _kept(partial: str, hint: str) -> str:
    return f"the work done so far is kept in {partial}; {hint} to continue"


def _too_many_msg(nerr: int, limit: tuple[str, float] | None, reasons: Counter) -> str:
    kind, v = limit  # type: ignore[misc]
    lim = f"{int(v)}" if kind == "count" else f"{v:g}%"
    top = "; ".join(f"{c}x {r}" for r, c in reasons.most_common(3))
    return f"stopped: {nerr} inputs failed, more than --max-errors {lim} allows (--on-error fail stops at the first); most common: {top}"


def _mismatch(partial: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    diffs = []
    op, np_ = old.get("params", {}), new["params"]
    for k in sorted(set(op) | set(np_)):
        if op.get(k) != np_.get(k):
            diffs.append(f"{k}: then {json.dumps(op.get(k))[:200]}, now {json.dumps(np_.get(k))[:200]}")
    if old.get("shard") != new["shard"] or old.get("range") != new["range"]:
        diffs.append(f"shard: then {old.get('shard')} {old.get('range')}, now {new['shard']} {new['range']}")
    if not diffs and old.get("listing_fingerprint") != new["listing_fingerprint"]:
        diffs.append("the input files changed (names, sizes, modification times or labels differ)")
    what = "; ".join(diffs) or "the fingerprint differs"
    return (
        f"{partial}: cannot resume: the interrupted ingest used other inputs or parameters ({what}); "
        "rerun with exactly the original inputs and options, or pass --overwrite to start over"
    )

