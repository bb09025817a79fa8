"""Writing a ``ray.data.Dataset`` as one mmstore store: :func:`write`, and
the Ray Data ``Datasink`` :class:`MmstoreDatasink`.

Tasks. :func:`write` streams the dataset's blocks out of Ray Data
(``Dataset.iter_internal_ref_bundles``, so whatever reads or maps them runs
in Ray Data as usual), cuts them into parts of ``part_rows`` rows
(:mod:`mmstore.ray.plan`) and runs one Ray task per part, a bounded number
in flight (the dataset then waits for the writer: back-pressure). Ray starts those tasks as soon as the cluster
has the CPUs; the streaming executor that ``write_datasink`` runs holds a new
job to one task per operator until it has learned the cluster's resources
(about a second in Ray Data 2.60), which is most of a short job on a few
CPUs. ``ds.write_datasink(MmstoreDatasink(...))`` writes the same store
through Ray Data's own write operator, for a pipeline that ends in one.

Order. The store's slots follow the dataset's row order: the blocks are
taken with ``preserve_order`` (set by :func:`write`; for the ``Datasink``,
set ``DataContext.execution_options.preserve_order`` yourself), the tasks
are numbered in that order, each writes its rows in the order it got them,
and the driver joins the parts by task number. So the store is the same
whatever the number of blocks, tasks or retries, and it equals, record for
record and checksum for checksum, ``mmstore ingest`` of the same inputs
listed in the same order (for a folder: rows sorted as the folder scan sorts
them, see ``mmstore.ingest.sources``).

Exactly once. A task writes its rows as a complete part under
``parts/<task>-<attempt>`` (an attempt id is random, so two attempts of one
task never share files) and returns the part's id. Only the driver commits:
it joins the parts that Ray reports as the successful attempts (one per
task), removes every other part (of a failed, killed or duplicate attempt)
and writes the store's bookkeeping and manifest last. A local destination is
built in ``DEST.partial`` (marked as a distributed write's) and published by
one rename; in object storage the parts are uploaded under ``URL/parts/`` and
the manifest is the last object written (the URL is not a store before it).
A driver killed before the commit leaves ``DEST.partial`` (or objects with no
manifest under the URL); the next write to the same destination removes them
first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    import ray
    from ray.data import Datasink
    from ray.data.block import BlockAccessor
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("mmstore.ray needs Ray Data: pip install 'mmstore[ray]'") from exc

from .._os.io import atomic_write, fsync_dir
from .._os.lock import acquire_lock, release_lock
from .._version import __version__
from ..errors import DestinationError, IngestError, SourceError, StoreExistsError, spell_option
from ..format.codecs import parse_codec_specs
from ..format.layout import (
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    PARTIAL_SUFFIX,
    PARTS_DIR,
    REMOTE_INDEX_FILE,
    part_file,
)
from ..ingest.options import ErrorLimit, make_spec, split_options
from ..ingest.parts import BOOKKEEPING_FILES, PartBook, commit_parts, join_parts
from ..ingest.pipeline import run_ingest
from ..ingest.rows import RowsSource
from ..remote.client import Remote
from ..remote.index import index_max_bytes, parse_index
from ..remote.url import is_url, parse_url
from ..store.dest import PARTIAL_MARK, RAY_MARK, check_dest, is_own_partial, is_store
from ..transfer.push import check_destination, push
from .append import AppendTarget
from .plan import Part, PartPlan

__all__ = ["MmstoreDatasink", "RayWriteResult", "write"]

@dataclass
class RayWriteResult:
    """What :func:`write` did: the store, its counts, the parts joined, the
    bad inputs by reason, and the time (the job's, and Ray's start apart
    when :func:`write` started it)."""

    path: str
    slots: int
    records: int
    skipped: int
    parts: int
    reasons: Counter = field(default_factory=Counter)
    elapsed: float = 0.0
    removed_parts: int = 0  # parts of failed, killed or duplicate attempts that were removed

    def summary(self) -> str:
        rate = self.slots / self.elapsed if self.elapsed > 0 else 0.0
        lines = [f"{self.path}: {self.records} records, {self.skipped} skipped, from {self.parts} parts"
                 + (f", {self.elapsed:.1f} s, {rate:,.0f} inputs/s" if self.elapsed else "")]
        if self.removed_parts:
            lines.append(f"note: {self.removed_parts} parts of failed or repeated task attempts were removed")
        if self.reasons:
            cats: Counter = Counter()
            for r, c in self.reasons.items():
                cats[r.split(":", 1)[0]] += c
            lines.append("skipped by reason: " + ", ".join(f"{k} {v}" for k, v in cats.most_common()))
            for r, c in self.reasons.most_common(5):
                lines.append(f"  {c:>6}  {r}")
            lines.append(f"details (slot, key, reason): {self.path.rstrip('/')}/errors.jsonl (top reasons: mmstore "
                         f"inspect {self.path}; every one: mmstore.open(path).skipped())")
        return "\n".join(lines)


def _columns(blocks: Iterable[Any]) -> dict[str, list[Any]]:
    """The rows of a task's blocks, as lists per column (in block order)."""
    out: dict[str, list[Any]] = {}
    for block in blocks:
        acc = BlockAccessor.for_block(block)
        if not acc.num_rows():
            continue
        batch = acc.to_batch_format("numpy")
        for name, col in batch.items():
            out.setdefault(name, []).extend(list(col))
    return out


_STAGING_PREFIX = "mmstore-part-"  # + the writing process's pid + "-": a task's local part before upload
_ATTEMPT_ID = re.compile(r"^[0-9]{6,}-[0-9a-f]{12}$")  # a task attempt's part id: <task>-<random>
_CANCEL_WAIT_S = 60.0  # how long a failed write waits for the tasks it cancelled to end


def _remove_dead_staging(base: str) -> None:
    """Remove what killed tasks on this node left in ``base``: the staging
    folders of processes that no longer exist (a task removes its own)."""
    for name in os.listdir(base):
        pid = name[len(_STAGING_PREFIX):].split("-", 1)[0]
        if not (name.startswith(_STAGING_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        except OSError:
            pass  # alive (another user's process): not ours to remove



def _committed(returns: list[dict[str, Any]]) -> list[str]:
    """The part ids to join, in task order: one per task that wrote rows (two
    successful attempts of one task wrote the same rows: the first id wins)."""
    by_task: dict[int, str] = {}
    for r in sorted(returns, key=lambda r: (r["task"], r["id"] or "")):
        if r["id"] is not None:
            by_task.setdefault(int(r["task"]), str(r["id"]))
    return [by_task[t] for t in sorted(by_task)]


def _prepare_local(dest: str, overwrite: bool) -> str:
    """``DEST.partial`` made afresh, with our mark (what a killed write left there is removed)."""
    check_dest(dest, overwrite=overwrite)
    if os.path.lexists(dest) and not overwrite and not (os.path.isdir(dest) and not os.listdir(dest)):
        raise StoreExistsError(f"{dest}: exists; pass {spell_option('overwrite=True', '--overwrite')} to replace "
                               "the store there, or choose another destination")
    partial = dest + PARTIAL_SUFFIX
    if os.path.lexists(partial):
        ours = os.path.isfile(os.path.join(partial, RAY_MARK))
        if not ours and not (overwrite and is_own_partial(partial)):
            raise StoreExistsError(f"{partial}: an unfinished ingest or write is here; finish it, or pass "
                                   f"{spell_option('overwrite=True', '--overwrite')} to discard it")
        shutil.rmtree(partial)
    os.makedirs(partial)
    atomic_write(os.path.join(partial, PARTIAL_MARK), b"")
    atomic_write(os.path.join(partial, RAY_MARK), json.dumps({"writer": "mmstore.ray", "version": __version__})
                 .encode("utf-8"))
    os.makedirs(os.path.join(partial, PARTS_DIR))
    fsync_dir(partial)
    return partial


def _commit_remote(dest: str, ids: list[str], provenance: dict[str, Any], label_names: Any,
                   overwrite: bool, staging: str | None, target: AppendTarget | None = None) -> tuple[dict, int]:
    loc = parse_url(dest)
    listing = Remote(loc).list()
    work = tempfile.mkdtemp(prefix="mmstore-commit-", dir=staging)
    try:
        present = {}
        books = []
        for pid in ids:
            part = Remote(f"{loc.url.rstrip('/')}/{PARTS_DIR}/{pid}")
            d = os.path.join(work, PARTS_DIR, pid)
            os.makedirs(d)
            raw_manifest = part.get_small(MANIFEST_FILE, MANIFEST_MAX_BYTES)  # sizes before bytes
            with open(os.path.join(d, MANIFEST_FILE), "wb") as f:
                f.write(raw_manifest)
            book = PartBook(pid, d)
            # no more than a part of this manifest's files can have (untrusted: a bucket is shared)
            raw_index = part.get_small(REMOTE_INDEX_FILE, index_max_bytes(book.manifest, raw_manifest))
            index = parse_index(raw_index, part.url)
            index.check_manifest(book.manifest, raw_manifest, part.url)
            for name in BOOKKEEPING_FILES[1:]:
                if name in book.manifest["files"]:
                    with open(os.path.join(d, name), "wb") as f:
                        f.write(part.get_small(name, index.files[name].size))
            for name in book.data_names:
                present[part_file(pid, name)] = index.files[name]
            books.append(book)
        if target is not None:  # appended to the store at the URL
            joined = target.join_remote(work, books, present, provenance["source"])
        else:
            joined = join_parts(work, books, provenance=provenance, where=loc.url, label_names=label_names)
        # the other attempts' parts, which the push deletes (and no object that is not this write's or the
        # previous store's: NOTE [what a push deletes] in mmstore/transfer/push.py)
        attempts = {n for n in listing if _attempt_object(n)}
        removed = len({n.split("/")[1] for n in attempts} - set(ids) - (target.old_parts() if target else set()))
        push(work, loc.url, overwrite=overwrite, present=present, vouched=attempts)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return joined, removed


def _attempt_object(name: str) -> bool:
    """``name`` (below a write's URL) is an object of a task attempt's part:
    ``parts/<task>-<attempt>/<file>``, as :meth:`_Job.write_part` names them."""
    parts = name.split("/")
    return len(parts) == 3 and parts[0] == PARTS_DIR and _ATTEMPT_ID.match(parts[1]) is not None


def _check_remote_dest(dest: str, overwrite: bool) -> None:
    check_destination(dest, _attempt_object)  # nothing that is not a store's own under the prefix
    remote = Remote(parse_url(dest))
    if remote.head(MANIFEST_FILE) is not None and not overwrite:
        raise StoreExistsError(f"{dest}: holds a store already; pass {spell_option('overwrite=True', '--overwrite')} "
                               "to replace it (it stays readable until the new store is committed), or write to "
                               "another URL")


class _Job:
    """One write: the destination and the options, checked once on the driver.

    A copy goes to every write task (:meth:`write_part`); the driver
    prepares the destination (:meth:`begin`), and commits the parts of the
    successful attempts (:meth:`commit`) or removes what the write left
    (:meth:`abort`)."""

    def __init__(self, dest: str | os.PathLike[str], size: Any, *, image: str, label: str | None, key: str | None,
                 path: str | None, root: str | os.PathLike[str] | None, label_names: Sequence[str] | None,
                 fields: Any, on_error: str, max_errors: str | int | None, overwrite: bool, backend: str,
                 codecs: Any, staging: str | os.PathLike[str] | None, part_rows: int | None, threads: int | None,
                 cpus: float, decode: Mapping[str, Any]) -> None:
        dest = os.fspath(dest)
        self.remote = is_url(dest)
        self.dest = dest if self.remote else os.path.abspath(dest)
        decode = dict(decode)
        sides = {k: decode.pop(k) for k in ("max_side", "short_side", "buckets") if k in decode}  # instead of size
        spec_kw, src_kw = split_options(decode)
        if src_kw:
            raise TypeError(f"options {sorted(src_kw)} are for file sources; give columns instead")
        self.spec = make_spec(size, **sides, **spec_kw)
        if self.spec is not None and self.spec.resize == "buckets" and self.spec.bucket_shapes is None:
            raise SourceError(f"buckets={sides['buckets']!r} chooses its shapes from the aspects of every image before "
                              "writing, which a Ray write (each task its own rows) cannot do: pass the shapes, "
                              "buckets=[(h, w), ...] (mmstore.decode.buckets.auto_buckets(sizes, N) chooses them from "
                              "a sample of (h, w) sizes as 'auto:N' would)")
        self.codecs = parse_codec_specs(codecs)
        self.limit = ErrorLimit(on_error, max_errors)  # a bad value fails here, before the job
        if threads is None:  # as many decode threads as the CPUs a write task asks Ray for
            threads = max(1, int(cpus))
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        if part_rows is not None and (isinstance(part_rows, bool) or not isinstance(part_rows, int)
                                      or part_rows < 1):
            raise ValueError(f"part_rows must be an integer >= 1 or None, got {part_rows!r}")
        self.columns = {"image": image, "label": label, "key": key, "path": path}
        self.root = os.fspath(root) if root is not None else None
        self.label_names = list(label_names) if label_names is not None else None
        self.fields, self.on_error, self.backend = fields, on_error, backend
        self.overwrite = overwrite
        self.staging = os.fspath(staging) if staging is not None else None
        self.part_rows, self.threads = part_rows, threads
        self.target: AppendTarget | None = None  # the store appended to (write(..., append=True))

    # -- in a write task -----------------------------------------------------------
    def write_part(self, blocks: Iterable[Any], task: int) -> dict[str, Any]:
        """Write the rows of ``blocks`` as one complete part; return what a
        commit needs of it (its id, rows, records and bad inputs)."""
        cols = _columns(blocks)
        if self.target is not None:
            cols = self.target.relabel(cols, self.columns["label"])
        if not cols:
            return {"task": task, "id": None, "rows": 0}
        pid = f"{task:06d}-{uuid.uuid4().hex[:12]}"
        c = self.columns
        src = RowsSource(cols, image=c["image"] or "image", label=c["label"], key=c["key"], path=c["path"],
                         root=self.root, label_names=self.label_names, fields=self.fields,
                         description={"engine": f"ray {ray.__version__}", "task": task})
        t0 = time.monotonic()
        if self.remote:
            base = self.staging or tempfile.gettempdir()
            os.makedirs(base, exist_ok=True)
            _remove_dead_staging(base)
            work = tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}-", dir=base)
            local = os.path.join(work, pid)
        else:
            work, local = None, os.path.join(self.dest + PARTIAL_SUFFIX, PARTS_DIR, pid)
        try:
            res = run_ingest(src, local, self.spec, workers=0, quiet=True, on_error=self.on_error,
                             backend=self.backend, codecs=self.codecs, part=True, threads=self.threads)
            if self.remote:
                push(local, f"{self.dest.rstrip('/')}/{PARTS_DIR}/{pid}")
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)
        return {"task": task, "id": pid, "rows": len(cols[next(iter(cols))]), "records": res.records,
                "columns": list(cols), "seconds": round(time.monotonic() - t0, 3), "reasons": dict(res.reasons)}

    # -- on the driver -------------------------------------------------------------
    def check_columns(self, columns: Sequence[str] | None) -> None:
        image = self.columns["image"]
        if columns is not None and image not in columns:
            raise SourceError(f"the dataset has no column {image!r} (columns: {list(columns)}); pass image= "
                              "the column that holds the images")

    def begin(self) -> int | None:
        """Check and prepare the destination; return the local writer lock's fd."""
        if self.remote:
            if self.target is not None:
                check_destination(self.dest, _attempt_object)
            else:
                _check_remote_dest(self.dest, self.overwrite)
            return None
        os.makedirs(os.path.dirname(self.dest) or ".", exist_ok=True)
        lock = acquire_lock(self.dest)
        try:
            if self.target is not None:
                self.target.prepare_local(json.dumps({"writer": "mmstore.ray", "version": __version__,
                                                      "append_to": self.target.store_id}).encode("utf-8"))
            else:
                _prepare_local(self.dest, self.overwrite)
        except BaseException:
            release_lock(self.dest, lock)
            raise
        return lock

    def commit(self, returns: Sequence[Any], started: float) -> RayWriteResult:
        """Join the parts of the successful attempts in ``returns`` (manifest last)."""
        returns = [r for r in returns if isinstance(r, dict)]
        ids = _committed(returns)
        done = [r for r in returns if r["id"] is not None and r["id"] in ids]
        holes: Counter = Counter()
        for r in done:
            holes.update(r.get("reasons") or {})
        rows = sum(int(r["rows"]) for r in done)
        if self.limit.exceeded(sum(holes.values()), rows):
            raise IngestError(f"{self.dest}: {self.limit.message(sum(holes.values()), holes)}; nothing was published")
        spec = self.spec
        columns: list[str] = next((r["columns"] for r in done if "columns" in r), [])
        provenance = {"engine": {"name": "ray", "version": ray.__version__, "tasks": len(ids)},
                      "source": {"kind": "ray", "rows": rows, "columns": columns},
                      "resize": spec.resize if spec is not None else None,
                      "decode": spec.to_dict() if spec is not None else None,  # every option: what an append checks
                      "size": list(spec.size) if spec is not None else None,
                      "tool": {"name": "mmstore", "version": __version__}}
        if self.remote:
            joined, removed = _commit_remote(self.dest, ids, provenance, self.label_names, self.overwrite,
                                             self.staging, self.target)
        elif self.target is not None:
            joined, removed = self.target.commit_local(ids, provenance["source"])
        else:
            joined, removed = commit_parts(self.dest, ids, provenance=provenance, label_names=self.label_names)
            if not is_store(self.dest):  # pragma: no cover - publish raises before this
                raise DestinationError(f"{self.dest}: was not published")
        return RayWriteResult(self.dest, joined["slots"], joined["records"], joined["slots"] - joined["records"],
                              len(ids), joined["reasons"], time.monotonic() - started, removed)

    def abort(self) -> None:
        """Remove what a failed write left at a local destination (nothing in it can be resumed)."""
        if not self.remote and os.path.isfile(os.path.join(self.dest + PARTIAL_SUFFIX, RAY_MARK)):
            shutil.rmtree(self.dest + PARTIAL_SUFFIX, ignore_errors=True)

    def end(self, lock: int | None) -> None:
        if lock is not None:
            release_lock(self.dest, lock)


def _write_task(job: _Job, task: int, slices: Sequence[tuple[int, int] | None], *blocks: Any) -> dict[str, Any]:
    """A write task of :func:`write`: the part of ``blocks`` (each cut to its slice)."""
    cut = [b if s is None else BlockAccessor.for_block(b).slice(s[0], s[1], copy=False)
           for b, s in zip(blocks, slices)]
    return job.write_part(cut, task)


def _entries(bundle: Any) -> Iterator[tuple[Any, int, tuple[int, int] | None]]:
    """A bundle's blocks as (ref, the block's rows, the slice of it or None),
    whichever shape its Ray version gives them (entries with ``ref`` and
    ``metadata``, or pairs)."""
    slices = getattr(bundle, "slices", None) or (None,) * len(bundle.blocks)
    for entry, cut in zip(bundle.blocks, slices):
        ref, meta = (entry.ref, entry.metadata) if hasattr(entry, "ref") else entry
        rows = int(meta.num_rows or 0)
        yield ref, max(rows, cut.end_offset if cut is not None else 0), (
            None if cut is None else (cut.start_offset, cut.end_offset))


def _slots(cpus: float, concurrency: int | None) -> int:
    """The write tasks the cluster runs at once."""
    slots = max(1, int(float(ray.cluster_resources().get("CPU", 1.0)) / max(cpus, 1e-9)))
    return min(slots, concurrency) if concurrency else slots


def _run_tasks(dataset: Any, job: _Job, args: dict[str, Any], slots: int, in_flight: int,
               quiet: bool) -> list[dict[str, Any]]:
    """The write tasks of :func:`write` over the dataset's blocks, in row order
    (cut into parts by :class:`PartPlan`); their returns (one per task). A
    task that fails after Ray's retries cancels the others and raises."""
    remote_fn = ray.remote(_write_task).options(**args)
    job_ref = ray.put(job)
    running: dict[Any, int] = {}
    returns: list[dict[str, Any]] = []
    bar = None
    if not quiet:
        from tqdm import tqdm

        bar = tqdm(desc="mmstore.ray.write", unit=" rows", file=sys.stderr, dynamic_ncols=True)

    def collect(block: bool) -> None:
        if not running:
            return
        done, _ = ray.wait(list(running), num_returns=1 if block else len(running), timeout=None if block else 0)
        for ref in done:
            running.pop(ref)
            r = ray.get(ref)
            returns.append(r)
            if bar is not None:
                bar.update(int(r["rows"]))

    def submit(part: Part) -> None:
        while len(running) >= in_flight:
            collect(True)
        task = len(returns) + len(running)
        running[remote_fn.remote(job_ref, task, [p.cut for p in part], *[p.ref for p in part])] = task
        collect(False)

    opts = dataset.context.execution_options
    before = opts.preserve_order
    opts.preserve_order = True  # the row order (see the module docstring)
    plan = PartPlan(job.part_rows, slots)
    try:
        for bundle in dataset.iter_internal_ref_bundles():
            for ref, rows, cut in _entries(bundle):
                for part in plan.add(ref, rows, cut):
                    submit(part)
        for part in plan.finish():
            submit(part)
        while running:
            collect(True)
    except BaseException:
        for ref in running:
            ray.cancel(ref, force=True)
        # a cancel is asked, not done: wait until every task has ended, so that none still writes into
        # the destination while the caller removes what the write left (bounded: a worker Ray killed ends)
        if running:
            ray.wait(list(running), num_returns=len(running), timeout=_CANCEL_WAIT_S)
        raise
    finally:
        opts.preserve_order = before
        if bar is not None:
            bar.close()
    return returns


def write(
    dataset: Any,
    dest: str | os.PathLike[str],
    size: Any = None,
    *,
    image: str = "image",
    label: str | None = "label",
    key: str | None = "key",
    path: str | None = "path",
    root: str | os.PathLike[str] | None = None,
    label_names: Sequence[str] | None = None,
    fields: Any = None,
    on_error: str = "skip",
    max_errors: str | int | None = None,
    overwrite: bool = False,
    backend: str | None = None,
    codecs: Any = None,
    append: bool = False,
    duplicate_keys: str = "error",
    concurrency: int | None = None,
    ray_remote_args: Mapping[str, Any] | None = None,
    staging: str | os.PathLike[str] | None = None,
    part_rows: int | None = 1000,
    threads: int | None = None,
    quiet: bool = False,
    **decode: Any,
) -> RayWriteResult:
    """Write ``dataset`` (a ``ray.data.Dataset``) as one store at ``dest``.

    Parameters
    ----------
    dataset
        Rows with an image column (encoded bytes, a local path, or pixels: see
        :mod:`mmstore.ingest.rows`) and optionally a label, a key, a path and
        more columns.
    dest
        A local path (seen by every node: a shared file system when the
        cluster has several nodes) or an object-storage URL
        (``s3://bucket/prefix/name.store``, see "A store in object storage").
    size, **decode
        The decode options of :func:`mmstore.ingest` (``resize``,
        ``channels``, ``layout``, ``bgr``, ``interp_up``, ``pad_value``,
        ``fast_decode``, ``max_pixels``, ``strict_jpeg``, ``alpha``,
        ``upscale``), with the same meaning; ``size`` (or, instead,
        ``max_side=N`` / ``short_side=N``: records of each image's own aspect;
        ``buckets=[(h, w), ...]``: aspect buckets, a list only)
        is needed for encoded images.
    image, label, key, path
        Column names: the images, the integer labels, the keys, the source
        paths (keys when there is no key column, made relative to ``root``).
        A column that the dataset lacks is none (but ``image``).
    label_names, fields
        The names of the labels; more columns to store, as a schema (as in
        :func:`mmstore.from_dataset`).
    on_error, max_errors
        As in :func:`mmstore.ingest`: ``"skip"`` makes a bad input a hole
        listed with its key and reason; ``"fail"`` fails the task that meets
        it, and so the job; ``max_errors`` is checked on the whole job's
        count before the commit (nothing is published past it).
    overwrite
        Replace a store at ``dest``.
    backend, codecs
        As in :func:`mmstore.ingest` (``backend`` None: memmap).
    append, duplicate_keys
        ``append=True``: add the rows to the store at ``dest`` as new parts,
        under the rules of :func:`mmstore.append`: the decode options, codecs
        and backend default to the store's and may only repeat them
        (``AppendMismatchError`` names a difference); ``label_names`` are
        merged into the store's (its numbers kept, a new name numbered after
        them, the rows' labels renumbered); a row whose key a record of the
        store has is refused (``DuplicateKeysError``) unless
        ``duplicate_keys="keep"``; the store is replaced in one atomic step
        (a store in object storage needs parts: see
        :mod:`mmstore.ray.append`).
    concurrency
        The most write tasks submitted at once (default: twice as many as the
        cluster's CPUs run at once, so that the next ones wait queued); the
        dataset's blocks wait for the writer past that.
    ray_remote_args
        The write tasks' Ray options (``num_cpus``, ``memory``, ``resources``,
        ...); the default retries a task up to 3 times, whatever it raised.
    threads
        The decode threads of one write task (default: the CPUs it asks Ray
        for, ``ray_remote_args["num_cpus"]``, 1 unless given). Fewer, wider
        tasks (``{"num_cpus": 4}``) write fewer parts.
    part_rows
        The rows of one part, one write task each (a task's setup and commit
        cost then spread over its rows, and a billion rows stay within a
        manifest's parts); the rows left at the end of the dataset are split
        evenly into smaller parts, so that the last tasks end together (see
        :mod:`mmstore.ray.plan`). None: one part per block.
    staging
        Where a task writes its part before uploading it (URL destinations;
        default: the temporary directory of the node).
    quiet
        No progress bar and no summary on stderr.

    Returns
    -------
    RayWriteResult
        Its ``summary()`` reads like ``mmstore ingest``'s.
    """
    t0 = time.monotonic()
    args = {"max_retries": 3, "retry_exceptions": True, **dict(ray_remote_args or {})}
    cpus = float(args.get("num_cpus", 1))
    target = None
    if append:
        if overwrite:
            raise TypeError("append=True adds to the store at dest; overwrite=True would replace it: pass one")
        where = os.fspath(dest)
        target = AppendTarget(where if is_url(where) else os.path.abspath(where), is_url(where), size, decode, codecs,
                              backend, label_names, duplicate_keys)
        size, decode, codecs, backend = target.size, target.decode, target.codecs, target.backend
        label_names = target.label_names
    job = _Job(dest, size, image=image, label=label, key=key, path=path, root=root, label_names=label_names,
               fields=fields, on_error=on_error, max_errors=max_errors, overwrite=overwrite,
               backend=backend or "memmap", codecs=codecs, staging=staging, part_rows=part_rows, threads=threads,
               cpus=cpus, decode=decode)
    job.target = target
    job.check_columns(dataset.columns())
    if concurrency is not None and (isinstance(concurrency, bool) or not isinstance(concurrency, int)
                                    or concurrency < 1):
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    lock = job.begin()
    try:
        slots = _slots(cpus, concurrency)
        returns = _run_tasks(dataset, job, args, slots, concurrency or 2 * slots, quiet)
        result = job.commit(returns, t0)
    except BaseException:
        job.abort()
        raise
    finally:
        job.end(lock)
    if not quiet:
        print(result.summary(), file=sys.stderr)
    return result


class MmstoreDatasink(Datasink):
    """The store writer as a Ray Data ``Datasink``, for a pipeline that ends
    in ``ds.write_datasink(MmstoreDatasink(dest, size, ...))``.

    It takes the options of :func:`write` (but ``concurrency``,
    ``ray_remote_args`` and ``quiet``, which go to ``write_datasink`` and
    Ray's own progress), prepares the destination when the write starts,
    writes a part per write task, and commits when the write completes
    (``result`` then holds the :class:`RayWriteResult`); a failed write
    leaves no store and nothing the next write does not remove. For the
    store to follow the dataset's row order, set
    ``DataContext.get_current().execution_options.preserve_order = True``
    first (:func:`write` does). Pass ``threads=`` the ``num_cpus`` given to
    ``write_datasink``'s ``ray_remote_args``."""

    def __init__(self, dest: str | os.PathLike[str], size: Any = None, *, image: str = "image",
                 label: str | None = "label", key: str | None = "key", path: str | None = "path",
                 root: str | os.PathLike[str] | None = None, label_names: Sequence[str] | None = None,
                 fields: Any = None, on_error: str = "skip", max_errors: str | int | None = None,
                 overwrite: bool = False, backend: str = "memmap", codecs: Any = None,
                 staging: str | os.PathLike[str] | None = None, part_rows: int | None = 1000,
                 threads: int | None = None, **decode: Any) -> None:
        self.job = _Job(dest, size, image=image, label=label, key=key, path=path, root=root,
                        label_names=label_names, fields=fields, on_error=on_error, max_errors=max_errors,
                        overwrite=overwrite, backend=backend, codecs=codecs, staging=staging, part_rows=part_rows,
                        threads=threads, cpus=1.0, decode=decode)
        self.result: RayWriteResult | None = None
        self._lock: int | None = None
        self._started = 0.0

    def __getstate__(self) -> dict[str, Any]:
        return {"job": self.job, "result": None, "_lock": None, "_started": 0.0}  # what a write task needs

    def get_name(self) -> str:
        return "mmstore"

    @property
    def min_rows_per_write(self) -> int | None:
        return self.job.part_rows

    def on_write_start(self, schema: Any = None) -> None:
        self._started = time.monotonic()
        if schema is not None and hasattr(schema, "names"):
            self.job.check_columns(list(schema.names))
        self._lock = self.job.begin()

    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        return self.job.write_part(blocks, int(ctx.task_idx))

    def on_write_complete(self, write_result: Any) -> None:
        try:
            self.result = self.job.commit(list(write_result.write_returns), self._started)
        except BaseException:
            self.job.abort()
            raise
        finally:
            self.job.end(self._lock)
            self._lock = None

    def on_write_failed(self, error: Exception) -> None:
        self.job.abort()
        self.job.end(self._lock)
        self._lock = None
