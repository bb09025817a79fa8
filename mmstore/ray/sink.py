"""The Ray Data ``Datasink`` that writes one mmstore store, and :func:`write`.

Order. The store's slots follow the dataset's row order: :func:`write` runs
the write with ``preserve_order`` (Ray then hands the write tasks their
blocks in order and numbers the tasks in that order), each task writes its
rows in the order it got them, and the driver joins the parts by task index.
So the store is the same whatever the number of blocks, tasks or retries,
and it equals, record for record and checksum for checksum, ``mmstore
ingest`` of the same inputs listed in the same order (for a folder: rows
sorted as the folder scan sorts them, see ``mmstore.ingest.sources``).

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
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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
from ..format.layout import MANIFEST_FILE, PARTIAL_SUFFIX, PARTS_DIR, REMOTE_INDEX_FILE, part_file
from ..ingest.options import ErrorLimit, make_spec, split_options
from ..ingest.parts import BOOKKEEPING_FILES, PartBook, commit_parts, join_parts
from ..ingest.pipeline import run_ingest
from ..ingest.rows import RowsSource
from ..remote.client import Remote
from ..remote.index import parse_index
from ..remote.url import is_url, parse_url
from ..store.dest import PARTIAL_MARK, RAY_MARK, check_dest, is_own_partial, is_store
from ..transfer.push import push

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
            lines.append("details (slot, key, reason): errors.jsonl of the store (mmstore show STORE --errors)")
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


class MmstoreDatasink(Datasink):
    """A ``Datasink`` writing one part per task (see the module docstring);
    :func:`write` is the way to use it (it sets the row order and commits)."""

    def __init__(self, dest: str, spec: Any, *, image: str, label: str | None, key: str | None, path: str | None,
                 root: str | None, label_names: Sequence[str] | None, fields: Any, on_error: str, backend: str,
                 codecs: Any, staging: str | None, part_rows: int | None = None, threads: int = 1) -> None:
        self.dest, self.spec = dest, spec
        self.remote = is_url(dest)
        self.columns = {"image": image, "label": label, "key": key, "path": path}
        self.root, self.label_names, self.fields = root, label_names, fields
        self.on_error, self.backend, self.codecs = on_error, backend, codecs
        self.staging = staging
        self.part_rows = part_rows
        self.threads = threads
        self.returns: list[dict[str, Any]] = []

    def get_name(self) -> str:
        return "mmstore"

    @property
    def min_rows_per_write(self) -> int | None:
        return self.part_rows

    # -- in a write task -----------------------------------------------------------
    def write(self, blocks: Iterable[Any], ctx: Any) -> dict[str, Any]:
        cols = _columns(blocks)
        task = int(ctx.task_idx)
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
                "seconds": round(time.monotonic() - t0, 3), "reasons": dict(res.reasons)}

    # -- on the driver -------------------------------------------------------------
    def on_write_complete(self, write_result: Any) -> None:
        self.returns = [r for r in write_result.write_returns if isinstance(r, dict)]


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
                   overwrite: bool, staging: str | None) -> tuple[dict, int]:
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
            raw_index = part.get(REMOTE_INDEX_FILE)
            raw_manifest = part.get(MANIFEST_FILE)
            with open(os.path.join(d, MANIFEST_FILE), "wb") as f:
                f.write(raw_manifest)
            book = PartBook(pid, d)
            index = parse_index(raw_index, part.url)
            index.check_manifest(book.manifest, raw_manifest, part.url)
            for name in BOOKKEEPING_FILES[1:]:
                if name in book.manifest["files"]:
                    with open(os.path.join(d, name), "wb") as f:
                        f.write(part.get(name))
            for name in book.data_names:
                present[part_file(pid, name)] = index.files[name]
            books.append(book)
        joined = join_parts(work, books, provenance=provenance, where=loc.url, label_names=label_names)
        # the other attempts' parts, which the push deletes with everything else the store does not list
        removed = len({n.split("/")[1] for n in listing if n.startswith(PARTS_DIR + "/") and n.count("/") == 2}
                      - set(ids))
        push(work, loc.url, overwrite=overwrite, present=present)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return joined, removed


def _check_remote_dest(dest: str, overwrite: bool) -> None:
    remote = Remote(parse_url(dest))
    if remote.head(MANIFEST_FILE) is not None and not overwrite:
        raise StoreExistsError(f"{dest}: holds a store already; pass {spell_option('overwrite=True', '--overwrite')} "
                               "to replace it (it stays readable until the new store is committed), or write to "
                               "another URL")


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
    backend: str = "memmap",
    codecs: Any = None,
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
        ``fast_decode``, ``max_pixels``, ``strict_jpeg``, ``alpha``), with the
        same meaning; ``size`` is needed for encoded images.
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
        As in :func:`mmstore.ingest`.
    concurrency, ray_remote_args
        Passed to ``Dataset.write_datasink`` (the write tasks' concurrency
        and their Ray options; the default retries a task up to 3 times,
        whatever it raised).
    threads
        The decode threads of one write task (default: the CPUs it asks Ray
        for, ``ray_remote_args["num_cpus"]``, 1 unless given). Fewer, wider
        tasks (``{"num_cpus": 4}``) decode as fast and write fewer parts.
    part_rows
        The rows of one part: Ray bundles the blocks so that each write task
        gets at least this many (a task's setup and commit cost then spread
        over its rows, and a billion rows stay within a manifest's parts);
        None: one part per block Ray hands the writer.
    staging
        Where a task writes its part before uploading it (URL destinations;
        default: the temporary directory of the node).
    quiet
        No summary on stderr.

    Returns
    -------
    RayWriteResult
        Its ``summary()`` reads like ``mmstore ingest``'s.
    """
    t0 = time.monotonic()
    dest = os.fspath(dest)
    remote = is_url(dest)
    if not remote:
        dest = os.path.abspath(dest)
    spec_kw, src_kw = split_options(decode)
    if src_kw:
        raise TypeError(f"options {sorted(src_kw)} are for file sources; give columns instead")
    spec = make_spec(size, **spec_kw)
    codec_map = parse_codec_specs(codecs)
    limit = ErrorLimit(on_error, max_errors)  # a bad value fails here, before the job
    if image not in dataset.columns():
        raise SourceError(f"the dataset has no column {image!r} (columns: {dataset.columns()}); pass image= the "
                          "column that holds the images")
    staging_dir = os.fspath(staging) if staging is not None else None
    args = {"max_retries": 3, "retry_exceptions": True, **dict(ray_remote_args or {})}
    if threads is None:  # as many decode threads as the CPUs a write task asks Ray for
        threads = max(1, int(float(args.get("num_cpus", 1))))
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    sink = MmstoreDatasink(dest, spec, image=image, label=label, key=key, path=path,
                           root=os.fspath(root) if root is not None else None, label_names=label_names,
                           fields=fields, on_error=on_error, backend=backend, codecs=codec_map, staging=staging_dir,
                           part_rows=part_rows, threads=threads)
    lock = None
    if remote:
        _check_remote_dest(dest, overwrite)
    else:
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        lock = acquire_lock(dest)
    try:
        if not remote:
            _prepare_local(dest, overwrite)
        opts = dataset.context.execution_options
        before = opts.preserve_order
        opts.preserve_order = True  # the row order (see the module docstring)
        try:
            dataset.write_datasink(sink, ray_remote_args=args, concurrency=concurrency)
        finally:
            opts.preserve_order = before
        ids = _committed(sink.returns)
        returned = [r for r in sink.returns if r["id"] is not None]
        holes: Counter = Counter()
        for r in returned:
            if r["id"] in ids:
                holes.update(r.get("reasons") or {})
        rows = sum(int(r["rows"]) for r in returned if r["id"] in ids)
        if limit.exceeded(sum(holes.values()), rows):
            raise IngestError(f"{dest}: {limit.message(sum(holes.values()), holes)}; nothing was published")
        provenance = {"engine": {"name": "ray", "version": ray.__version__, "tasks": len(ids)},
                      "source": {"kind": "ray", "rows": rows, "columns": list(dataset.columns())},
                      "resize": spec.resize if spec is not None else None,
                      "size": list(spec.size) if spec is not None else None,
                      "tool": {"name": "mmstore", "version": __version__}}
        if remote:
            joined, removed = _commit_remote(dest, ids, provenance, label_names, overwrite, staging_dir)
        else:
            joined, removed = commit_parts(dest, ids, provenance=provenance,
                                               label_names=list(label_names) if label_names is not None else None)
    except BaseException:
        if not remote and os.path.isfile(os.path.join(dest + PARTIAL_SUFFIX, RAY_MARK)):
            shutil.rmtree(dest + PARTIAL_SUFFIX, ignore_errors=True)  # nothing in it can be resumed
        raise
    finally:
        if lock is not None:
            release_lock(dest, lock)
    if not remote and not is_store(dest):  # pragma: no cover - publish raises before this
        raise DestinationError(f"{dest}: was not published")
    result = RayWriteResult(dest, joined["slots"], joined["records"], joined["slots"] - joined["records"], len(ids),
                            joined["reasons"], time.monotonic() - t0, removed)
    if not quiet:
        import sys

        print(result.summary(), file=sys.stderr)
    return result
