"""The ingest run: check DEST, plan, open the writer, decode every pending range, commit, publish; resumable.

Data flow
---------
The parent scans the source into a :class:`~.sources.Listing` (numpy arrays,
``plan.py``), creates ``DEST.partial`` with :class:`~mmstore.store.writer.StoreWriter`
(slot files preallocated), then forks ``workers`` processes (``workers.py``).
Each worker receives slot ranges (two integers) over a pipe, decodes every
input of the range and ``pwrite``s the record at its slot, zeroes the slots
that failed, and answers with the range and the holes' reasons
(``records.py``). The scheduler (``schedule.py``) hands out the next range and
retries the ranges of a worker that died; the tally (``committer.py``) tells
the writer (``mark_written`` / ``skip``), and its commit thread fsyncs the
store's files and only then appends the finished ranges to the commit log
(``resume.py``). A clean finish writes the manifest and publishes DEST.

A run in which every input failed (at least one input, not one record) is
not a finish: it raises :class:`~mmstore.errors.AllInputsFailedError`
(the CLI's exit code 1) naming the count, the most common reason and an
input that failed for it. No manifest is written and nothing is published,
so a DEST that existed before (``overwrite``) is unchanged; ``DEST.partial``
is kept with an ``errors.jsonl`` of every failure (a rerun with
``--overwrite`` discards it; ``--resume`` fails the same way again). A
source with no inputs at all is refused earlier (``plan.py``), and a shard
that got no inputs publishes its empty store, as before. One of several
shards (``--shard K/N``, N > 1) whose every input failed is published with a
note in the result's ``warnings`` (the merge needs every part's slots); the
merge raises the same error when the parts hold no record at all.

Slot ``s`` is input ``lo + s`` of the sorted listing, so the bytes do not
depend on the worker count, the chunk size, the completion order or how often
the run was interrupted.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._os.io import atomic_write, describe_write_error
from ..errors import (
    AllInputsFailedError,
    DestinationError,
    IngestError,
    MmstoreError,
    ResumeMismatchError,
    StoreExistsError,
    spell_option,
)
from ..format.layout import ERRORS_FILE, MANIFEST_FILE, PARTIAL_SUFFIX
from ..format.manifest import read_manifest
from ..remote.url import local_dest
from ..store.dest import check_dest, claim_empty_dest, is_store
from ..store.writer import StoreWriter, acquire_lock, errors_jsonl, publish, release_lock
from .committer import CommitThread, Tally
from .options import RUN_DEFAULTS, ErrorLimit, ResumeHint, kept_message, resume_advice
from .plan import Plan, make_plan, mismatch_message
from .progress import Progress
from .records import RecordJob
from .resume import CommitLog, pending_ranges, read_state, write_state
from .schedule import Scheduler, WorkerFailed, chunk_size
from .sources import Source
from .workers import WorkerPool, default_workers

__all__ = ["PLAN_CHECK", "IngestResult", "RunOptions", "all_failed_error", "run_ingest"]


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
            cats: Counter = Counter()
            for r, c in self.reasons.items():
                cats[r.split(":", 1)[0]] += c
            lines.append("skipped by reason: " + ", ".join(f"{k} {v}" for k, v in cats.most_common()))
            for r, c in self.reasons.most_common(5):
                lines.append(f"  {c:>6}  {r}")
            lines.append(f"details (slot, key, reason): {os.path.join(self.path, 'errors.jsonl')}")
        for k, v in sorted(self.warnings.items()):
            lines.append(f"note: {v} {k}")
        return "\n".join(lines)

    @classmethod
    def complete(cls, path: str) -> IngestResult:
        """The result of a run that found its store already finished."""
        m = read_manifest(path)
        return cls(path, m["slots"], m["records"], m["slots"] - m["records"], already_complete=True)


# A check of this context's next ingest plan, before anything is written or decoded (it raises to refuse the
# inputs): set around the ingest of an append's part, which refuses inputs the store has already.
PLAN_CHECK: ContextVar[Callable[[Plan], None] | None] = ContextVar("mmstore_plan_check", default=None)


@dataclass
class RunOptions:
    """The run options of :func:`mmstore.ingest.ingest` (see there)."""

    workers: int | None = RUN_DEFAULTS["workers"]
    chunk: int | None = RUN_DEFAULTS["chunk"]
    on_error: str = RUN_DEFAULTS["on_error"]
    max_errors: str | int | None = RUN_DEFAULTS["max_errors"]
    resume: bool = RUN_DEFAULTS["resume"]
    overwrite: bool = RUN_DEFAULTS["overwrite"]
    shard: tuple[int, int] | None = RUN_DEFAULTS["shard"]
    quiet: bool = RUN_DEFAULTS["quiet"]
    backend: str = RUN_DEFAULTS["backend"]
    codecs: dict[str, Any] | None = RUN_DEFAULTS["codecs"]
    progress_interval: float = RUN_DEFAULTS["progress_interval"]
    resume_hint: ResumeHint = RUN_DEFAULTS["resume_hint"]
    log: Callable[[str], None] | None = None
    part: bool = False  # one part of several (mmstore.ray): published even when every input failed
    threads: int = 1  # with workers=0: decode on this many threads of this process (mmstore.ray's tasks)

    def say(self, message: str) -> None:
        if self.log is not None:
            self.log(message)
        elif not self.quiet:
            print(message, file=sys.stderr, flush=True)


def run_ingest(source: Source, dest: str, spec: Any, **kw: Any) -> IngestResult:
    """Run one ingest (see :func:`mmstore.ingest.ingest` for the parameters)."""
    opts = RunOptions(**kw)
    try:
        return _run(source, dest, spec, opts)
    except OSError as exc:
        if isinstance(exc, MmstoreError):
            raise
        partial = os.path.abspath(os.fspath(dest)) + PARTIAL_SUFFIX
        kept = f"; {kept_message(partial, opts.resume_hint)}" if os.path.exists(partial) else ""
        raise IngestError(f"{dest}: {describe_write_error(exc)}{kept}") from exc


def _run(source: Source, dest: str, spec: Any, o: RunOptions) -> IngestResult:
    t_start = time.monotonic()
    dest = os.path.abspath(local_dest(dest))  # a URL is refused, never made ./s3:/...
    limit = ErrorLimit(o.on_error, o.max_errors)
    nworkers = default_workers() if o.workers is None else int(o.workers)
    if nworkers < 0:
        raise ValueError(f"workers must be >= 0, got {o.workers}")
    sources, protect = _inputs(source)
    check_dest(dest, overwrite=o.overwrite, sources=sources, protect=protect)
    if os.path.exists(dest + ".lock"):
        _probe_lock(dest)  # fail fast when another ingest is running (before a long scan)
    if _publish_pending(dest, o):
        return IngestResult.complete(dest)
    if hasattr(source, "resume_index"):  # a source that keeps its costly index in DEST.partial (tars in a bucket)
        source.resume_index(dest + PARTIAL_SUFFIX)
    plan = make_plan(source, spec, o.backend, o.shard, o.codecs)
    check = PLAN_CHECK.get()
    if check is not None:
        check(plan)
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    _probe_lock(dest)
    claim_empty_dest(dest)  # an empty directory at DEST is simply used
    if _already_complete(dest, plan, o):
        return IngestResult.complete(dest)
    resuming, overwrite = _resume_decision(dest + PARTIAL_SUFFIX, plan, o)
    writer = StoreWriter(dest, plan.schema, slots=plan.slots, backend=o.backend, overwrite=overwrite,
                         resume=resuming, label_names=plan.listing.label_names, provenance=plan.provenance,
                         inputs=sources)
    writer.annotation_errors = _annotation_errors(source, plan)
    if hasattr(source, "save_index"):
        source.save_index(dest + PARTIAL_SUFFIX)
    run = _Run(dest, source, plan.spec, plan, writer, o)  # the plan's: buckets="auto" chose its shapes there
    tally = run.execute(resuming, nworkers, limit)
    m = read_manifest(dest)
    warnings = dict(plan.listing.warnings)
    if run.part and m["slots"] and not m["records"]:
        warnings["inputs failed, every one of this shard's: the part is published so that the merge keeps the "
                 "numbering; the merge refuses parts that together hold no record"] = m["slots"]
    if hasattr(source, "geometry_counts") and "dst" in plan.schema:
        warnings.update(_geometry_counts(source, dest, plan.lo))
    return IngestResult(dest, m["slots"], m["records"], m["slots"] - m["records"], tally.reasons,
                        time.monotonic() - t_start, run.already, warnings)


def all_failed_error(dest: str, holes: list[tuple[str, str]], errors_path: str, then: str) -> AllInputsFailedError:
    """The error of an ingest (or merge) at ``dest`` whose every input failed:
    ``holes`` are (key, reason) of them all; ``then`` says what happened to
    the store and what to do."""
    n = len(holes)
    reasons: Counter = Counter(r for _, r in holes)
    cats: Counter = Counter()
    for r, c in reasons.items():
        cats[r.split(":", 1)[0]] += c
    cat, count = cats.most_common(1)[0]
    example = next(r for r, _ in reasons.most_common() if r.split(":", 1)[0] == cat)
    key = next(k for k, r in holes if r == example)
    others = ("; other reasons: " + ", ".join(f"{k} {v}" for k, v in cats.most_common()[1:4])) if len(cats) > 1 else ""
    return AllInputsFailedError(
        f"{dest}: no input became a record: all {n} inputs failed; most common reason: {cat} ({count} of {n}), "
        f"e.g. input {key!r}: {example}{others}. {then}",
        failed=n, reasons=reasons, key=key, errors_path=errors_path)


def _annotation_errors(source: Source, plan: Plan) -> list[dict[str, Any]]:
    """The skipped annotations of an annotated source (COCO) that belong in
    this store's ``errors.jsonl``: those of its slots (renumbered from the
    shard's first input), and those of no image in the first shard only."""
    out = []
    for e in getattr(source, "ann_errors", ()):
        s = e["slot"]
        if s is None:
            if plan.lo == 0:
                out.append(e)
        elif plan.lo <= s < plan.hi:
            out.append({**e, "slot": s - plan.lo})
    return out


def _geometry_counts(source: Any, dest: str, lo: int) -> dict[str, int]:
    """The boxes clipped and dropped by the stored records' transforms (read
    back from the store, so a resumed or parallel run counts them all)."""
    from ..store.reader import Store

    with Store(dest) as st:
        slots = st.slot_view.index if st.slot_view.index is not None else np.arange(st.records)
        counts: Counter = Counter()
        step = 1 << 16
        for a in range(0, st.records, step):
            idx = np.arange(a, min(st.records, a + step))
            got = st.read_batch(idx, fields=["box", "dst"])
            counts.update(source.geometry_counts(got["box"], got["dst"], np.asarray(slots[idx], np.int64) + lo))
    return dict(counts)


def _publish_pending(dest: str, o: RunOptions) -> bool:
    """Finish a run that crashed during publish (its manifest is written,
    only the rename is left); True when it was published here."""
    partial = dest + PARTIAL_SUFFIX
    if not os.path.isfile(os.path.join(partial, MANIFEST_FILE)):
        return False
    if not o.resume and not o.overwrite:
        raise StoreExistsError(
            f"{partial}: a finished ingest is waiting to be published; rerun with "
            f"{spell_option('resume=True', '--resume')} to finish it"
        )
    if not o.resume:
        return False
    fd = acquire_lock(dest)
    try:
        publish(dest)
    finally:
        release_lock(dest, fd)
    o.say(f"{dest}: published the already finished ingest")
    return True


def _already_complete(dest: str, plan: Plan, o: RunOptions) -> bool:
    """True when DEST is this very ingest, finished, and ``resume`` asks to
    continue it; a DEST in the way is an error unless ``overwrite``."""
    if not os.path.exists(dest) or o.overwrite:
        return False
    try:
        same = read_manifest(dest)["provenance"].get("ingest", {}).get("fingerprint") == plan.fingerprint
    except Exception:  # noqa: BLE001 - any unreadable DEST is simply not this ingest
        same = False
    if o.resume and same and not os.path.exists(dest + PARTIAL_SUFFIX):
        o.say(f"{dest}: already complete (same inputs and parameters); nothing to do")
        return True
    if not is_store(dest):  # --overwrite would refuse it too: say what to do instead
        kind = "a directory" if os.path.isdir(dest) else "a file"
        raise DestinationError(f"{dest}: exists and is {kind} that is not an mmstore store (nor empty); it is never "
                               "written into or replaced: choose another DEST, or move it away yourself")
    raise StoreExistsError(f"{dest}: already exists; pass {spell_option('overwrite=True', '--overwrite')} to "
                           "replace it")


def _resume_decision(partial: str, plan: Plan, o: RunOptions) -> tuple[bool, bool]:
    """``(resuming, overwrite)`` for an existing ``DEST.partial``: continue it,
    start over, or refuse (another run's work, or no ``resume``)."""
    if not os.path.exists(partial) or o.overwrite:
        return False, o.overwrite
    old = read_state(partial)
    if not o.resume:
        raise StoreExistsError(
            f"{partial}: an interrupted ingest is here; {resume_advice(o.resume_hint)} to continue it, or pass "
            f"{spell_option('overwrite=True', '--overwrite')} to start over"
        )
    if old is None or not os.path.exists(os.path.join(partial, "_writer.json")):
        return False, True  # it died before its first commit could exist: start over
    if old.get("fingerprint") != plan.fingerprint:
        raise ResumeMismatchError(mismatch_message(partial, old, plan.state))
    return True, False


class _Run:
    """One run's moving parts once the writer exists: commit log, tally,
    worker pool, commit thread and progress; :meth:`execute` drives them."""

    def __init__(self, dest: str, source: Source, spec: Any, plan: Plan, writer: StoreWriter, o: RunOptions) -> None:
        self.dest, self.source, self.spec, self.plan, self.writer, self.o = dest, source, spec, plan, writer, o
        self.partial = dest + PARTIAL_SUFFIX
        self.log = CommitLog(self.partial)
        self.tally = Tally(writer, plan.listing, plan.lo, plan.slots)
        self.already = 0
        self.pool: WorkerPool | None = None
        self.committer: CommitThread | None = None
        self.progress: Progress | None = None
        self.job = RecordJob(source, spec, plan.schema, plan.lo, self.partial)

    def execute(self, resuming: bool, nworkers: int, limit: ErrorLimit) -> Tally:
        """Decode every pending slot, then close the writer (which publishes
        DEST); on any failure, stop everything and keep ``DEST.partial``."""
        self.limit = limit
        try:
            sched = self._start(resuming, nworkers, limit)
            self._decode_all(sched)
            self._finish(sched.stopped)
        except BaseException:
            self._abort()
            raise
        return self.tally

    def _start(self, resuming: bool, nworkers: int, limit: ErrorLimit) -> Scheduler:
        plan, tally = self.plan, self.tally
        if resuming:
            tally.replay(self.log.entries())
        else:
            write_state(self.partial, plan.state)
        self.log.open()
        self.already = tally.already
        if resuming:
            self.o.say(f"{self.dest}: resuming: {self.already} of {plan.slots} inputs already committed")
        self.writer.set_keys(*plan.listing.sub(plan.lo, plan.hi))
        decoded = sum(f.nbytes for f in plan.schema)  # the work per record, encoded fields included
        decoders = nworkers or max(1, self.o.threads)  # processes, else threads of this one
        chunk_n = chunk_size(self.o.chunk, decoded, plan.slots, decoders)
        units = None  # a source read in blocks (row groups): whole blocks a range, unless told the chunk
        if self.o.chunk is None and hasattr(self.source, "read_units"):
            units = self.source.read_units()
        if units is not None:
            units = np.asarray(units, np.int64) - plan.lo
        taper = decoders if self.o.chunk is None and units is None else 0  # a chunk asked for is kept
        sched = Scheduler(pending_ranges(tally.done, chunk_n, units, taper), tally, limit)
        if sched.stopped is None and nworkers > 0:
            todo = plan.slots - self.already
            nworkers = max(1, min(nworkers, -(-todo // chunk_n)))  # no idle processes on small inputs
            self.pool = WorkerPool(nworkers, self.job)  # fork before any helper thread exists
        self.committer = CommitThread(self.writer.slot_writer.sync, self.log)
        self.progress = Progress(plan.slots, self.already, tally.nerr, self.o.quiet, self.o.progress_interval,
                                 "ingest")
        tally.start(self.committer, self.progress)
        return sched

    def _decode_all(self, sched: Scheduler) -> None:
        if sched.stopped is not None:
            return
        if self.pool is not None:
            try:
                sched.run_pool(self.pool)
            except WorkerFailed as exc:  # a worker could not write (its message says why)
                raise IngestError(f"{self.dest}: {exc}; {self._kept()}") from None
            return
        try:
            if self.o.threads > 1:
                sched.run_threads(self.job, self.o.threads)
            else:
                sched.run_inline(self.job, self.writer.slot_writer, self.source.reader())
        except OSError as exc:  # writing failed here (a bad input is a hole, never an OSError)
            raise IngestError(f"{self.dest}: {describe_write_error(exc)}; {self._kept()}") from None

    def _finish(self, stopped: str | None) -> None:
        if self.pool is not None:
            self.pool.close(kill=stopped is not None)
            self.pool = None
        progress, committer = self.progress, self.committer
        if progress is None or committer is None:  # pragma: no cover - a bug guard (both set by _start)
            raise IngestError(f"{self.dest}: the run finished before it started")
        progress.close()
        committer.finish(drain=True)
        self.committer = None
        if stopped is not None:
            changes = self.limit.raised(self.tally.nerr)
            raise IngestError(f"{self.dest}: {stopped}; {kept_message(self.partial, self.o.resume_hint, changes)}")
        missing = np.flatnonzero(~self.tally.done)
        if len(missing):  # pragma: no cover - a bug guard
            raise IngestError(f"{self.dest}: {len(missing)} slots were not processed (first {missing[:5].tolist()})")
        if self.plan.slots and self.tally.nerr >= self.plan.slots and not self.part:
            raise self._all_failed()  # execute() keeps DEST.partial, unpublished
        self.log.close()
        self.writer.close()

    def _all_failed(self) -> AllInputsFailedError:
        """Every input failed: write ``DEST.partial/errors.jsonl`` (every
        hole, from the commit log) and the error that says what happened."""
        holes = sorted({s: r for _, _, errs in self.log.entries() for s, r in errs}.items())
        key_of = self.plan.listing.key
        lo = self.plan.lo
        path = os.path.join(self.partial, ERRORS_FILE)
        atomic_write(path, errors_jsonl([(s, key_of(lo + s), r) for s, r in holes], self.writer.annotation_errors))
        before = (f"{self.dest} (the store there before) is unchanged" if os.path.exists(self.dest)
                  else f"no store was created at {self.dest}")
        return all_failed_error(
            self.dest, [(os.fsdecode(key_of(lo + s)), r) for s, r in holes], path,
            f"Nothing was published ({before}); every failure (slot, key, reason) is listed in {path}. Fix the "
            f"inputs or options, then rerun with {spell_option('overwrite=True', '--overwrite')}, which discards "
            f"{self.partial}, "
            "or remove it")

    @property
    def part(self) -> bool:
        """This run writes one of several shards (a part a merge joins)."""
        return self.o.part or (self.o.shard is not None and self.o.shard[1] > 1)

    def _abort(self) -> None:
        if self.pool is not None:
            self.pool.close(kill=True)
        if self.committer is not None:
            self.committer.finish(drain=False)
        if self.progress is not None:
            self.progress.close()
        self.log.close()
        self.writer.abort()

    def _kept(self) -> str:
        return kept_message(self.partial, self.o.resume_hint)


def _probe_lock(dest: str) -> None:
    release_lock(dest, acquire_lock(dest))  # no DEST.lock is left behind


def _inputs(source: Source) -> tuple[list[str], list[str]]:
    """The paths DEST must stay clear of: the source itself (DEST may not be,
    contain or lie inside it) and a list's image root (DEST may not be or
    contain it; a store next to its list is fine)."""
    if not source.path:
        return [], []
    root = getattr(source, "root", None)
    return [source.path], [root] if isinstance(root, str) else []
