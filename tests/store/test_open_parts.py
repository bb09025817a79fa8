"""A store of more parts than a process may keep open (format 2.4, "The part
table"): every part read keeps descriptors (and mappings), so a reader keeps
at most a bounded number of parts open, closing the least recently used one
no read is using. These run in a child process whose open-files limit is
low (hard and soft), the way a store of a million parts meets the usual
limits of a few thousand."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.stores import write_many_parts

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = r"""
import os, resource, sys
path, limit, img = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
import numpy as np
import mmstore
from mmstore.check.verify import verify_store
from tests.support.stores import many_parts_img

s = mmstore.open(path)
n = len(s)
fields = ["idx", "img"] if img else ["idx"]

def check(i, rec):
    if int(rec["idx"]) != i:
        raise SystemExit(f"slot {i} read as record {int(rec['idx'])}")
    if img and not np.array_equal(rec["img"], many_parts_img(i, img)):
        raise SystemExit(f"slot {i}: wrong img bytes")

# every record, one at a time, in a shuffled order (the Dataset's path)
for i in np.random.default_rng(0).permutation(n).tolist():
    check(i, s[i])
print("items", n)
# one batch of every record (a read over every part at once)
got = s.read_batch(np.random.default_rng(1).permutation(n))
for j, i in enumerate(np.random.default_rng(1).permutation(n).tolist()):
    check(i, {f: got[f][j] for f in fields})
print("batch", n)
# a shuffled epoch of the threaded Loader: every record exactly once, each one right
from mmstore.torch import Loader
seen = []
for b in Loader(s, 64, fields=fields):
    for j, i in enumerate(b["idx"].numpy().tolist()):
        check(i, {f: b[f][j].numpy() for f in fields})
        seen.append(i)
if sorted(seen) != list(range(n)):
    raise SystemExit(f"the epoch gave {len(seen)} records, {len(set(seen))} distinct, of {n}")
print("epoch", len(seen))
print("verify", verify_store(path).ok)
print("on demand", s.slot_view.backend.parts_on_demand())
print("open files", len(os.listdir("/proc/self/fd")), "limit", limit)
"""


def _run_child(path: str, limit: int, img: int) -> list[str]:
    r = subprocess.run([sys.executable, "-c", _CHILD, path, str(limit), str(img)], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("img", [0, 2048])  # a small field (gathered out of mappings) and a big one (preadv)
def test_a_store_of_more_parts_than_the_process_may_open_reads_whole(tmp_path, img):
    """1,500 parts under a limit of 192 open files: each record read alone,
    all in one batch and by a threaded Loader epoch (every record exactly
    once) are the records written; verify passes. Before, the first read
    past the limit failed (a ``FormatError`` calling the store damaged, or a
    ``ResourceLimitError``)."""
    n = 1500
    write_many_parts(tmp_path / "s", n, per=1, img=img)
    lines = _run_child(str(tmp_path / "s"), 192, img)
    assert lines[:6] == [f"items {n}", f"batch {n}", f"epoch {n}", "verify True", "on demand True",
                         lines[5]] and lines[5].startswith("open files ")
    assert int(lines[5].split()[2]) < 192


def test_a_store_that_fits_keeps_its_parts_open(tmp_path):
    """The bound is for stores that need it: 1,200 parts of one field under a
    limit of 20,000 stay open once read (no part closed and made again)."""
    write_many_parts(tmp_path / "s", 1200, per=1)
    hard = _hard_limit()
    if hard < 4096:
        pytest.skip(f"the hard open-files limit here is {hard}: the store does not fit")
    lines = _run_child(str(tmp_path / "s"), min(hard, 20_000), 0)
    assert "on demand False" in lines


def _hard_limit() -> int:
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 20 if hard == resource.RLIM_INFINITY else int(hard)


_JSON_CHILD = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
import mmstore
from mmstore.errors import FormatError, ResourceLimitError
s = mmstore.open(sys.argv[1])
try:
    for i in range(len(s)):
        s[i]
    print("read all")
except ResourceLimitError as exc:
    print("limit", isinstance(exc, FormatError), exc)
"""


def test_out_of_descriptors_is_a_limit_not_damage(tmp_path):
    """A store of 200 parts in the manifest's JSON (every part kept open)
    read under a limit of 64: a ``ResourceLimitError`` that says how to raise
    the limit, not a ``FormatError`` calling the store damaged."""
    write_many_parts(tmp_path / "s", 200, per=1, table=False)
    r = subprocess.run([sys.executable, "-c", _JSON_CHILD, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    out = r.stdout.strip()
    assert out.startswith("limit False ") and "ulimit -n" in out and "damaged" not in out, out


def test_parts_read_by_many_threads_are_never_closed_under_a_read(tmp_path):
    """Eight threads reading random batches of a store whose open parts are
    bounded (a limit of 128 files: a few dozen parts open of 1,200), each
    batch checked record by record: a part closed while a thread read it
    would give a wrong or failed read."""
    write_many_parts(tmp_path / "s", 1200, per=1, img=2048)
    child = r"""
import resource, sys, threading
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import numpy as np
import mmstore
from tests.support.stores import many_parts_img
s = mmstore.open(sys.argv[1])
errors = []
def work(seed):
    rng = np.random.default_rng(seed)
    try:
        for _ in range(40):
            slots = rng.choice(len(s), int(rng.integers(1, 80)), replace=False)
            got = s.read_batch(slots)
            for j, i in enumerate(slots.tolist()):
                if int(got["idx"][j]) != i or not np.array_equal(got["img"][j], many_parts_img(i, 2048)):
                    errors.append(f"slot {i} wrong")
            for i in rng.choice(len(s), 20).tolist():
                if int(s[i]["idx"]) != i:
                    errors.append(f"item {i} wrong")
    except Exception as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=work, args=(k,)) for k in range(8)]
[t.start() for t in ts]
[t.join() for t in ts]
print("errors", len(errors), errors[:3])
"""
    r = subprocess.run([sys.executable, "-c", child, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "errors 0 []", r.stdout


_WARM_CHILD = r"""
import os, resource, subprocess, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import mmstore
from mmstore._os import cache
from mmstore.errors import ResourceLimitError
s = mmstore.open(sys.argv[1])
for p in s.data_paths():
    cache.evict(p, sync=True)
r = s.warm()
print("warmed", r.complete, r.bytes_read == r.bytes_total > 0, len(r.paths) == len(s.data_paths()))
print("resident", all(cache.resident_bytes(p)[0] == os.path.getsize(p) for p in s.data_paths()))
cli = subprocess.run([sys.executable, "-m", "mmstore", "warm", sys.argv[1]], capture_output=True, text=True)
print("cli", cli.returncode, cli.stderr.strip()[-200:])
held = []
try:  # no descriptor left at all: the one the pass needs is refused, typed
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    s.warm()
    print("no limit hit")
except ResourceLimitError as exc:
    print("limit", "ulimit -n" in str(exc))
"""


def test_warming_more_files_than_the_process_may_open(tmp_path):
    """``warm`` (``Store.warm``, ``mmstore warm``, what ``mmstore bench`` runs first) holds one file open at a
    time: 1,500 parts under a limit of 128 open files are all read into the page cache (before, it opened every
    file first and stopped at the limit). With no descriptor left at all, the error is typed and says which
    limit to raise."""
    write_many_parts(tmp_path / "s", 1500, per=1, img=2048)
    r = subprocess.run([sys.executable, "-c", _WARM_CHILD, str(tmp_path / "s")], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["warmed True True True", "resident True", "cli 0 ", "limit True"], r.stdout


_SEGMENTS_CHILD = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
import mmstore
s = mmstore.open(sys.argv[1])
b = s.slot_view.backend
wrong = [k for k, part in enumerate(b.segment_backends()) if int(part.array("idx")[0]) != k]
print("wrong", len(wrong), "open files", len(os.listdir("/proc/self/fd")))
"""


def test_every_segment_listed_is_readable_with_the_parts_bounded(tmp_path):
    """``segment_backends()`` of a store whose parts are opened on demand: each part, mapped as it comes,
    holds the right record, and the descriptors stay bounded (the list made every part and kept them all
    open before: an untyped EMFILE at the 118th of 1,500 parts under a limit of 128)."""
    write_many_parts(tmp_path / "s", 1500, per=1)
    r = subprocess.run([sys.executable, "-c", _SEGMENTS_CHILD, str(tmp_path / "s")], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert words[:2] == ["wrong", "0"] and int(words[4]) < 128, r.stdout


_MANY_STORES_CHILD = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
import numpy as np
import mmstore
from tests.support.stores import many_parts_img
stores = [mmstore.open(p) for p in sys.argv[1:]]
for s in stores:
    s[0]  # every store's first read while few descriptors are open
bad, peak = 0, 0
rng = np.random.default_rng(0)
for i in rng.permutation(1100).tolist():  # then the stores read by turns
    for s in stores:
        r = s[i]
        bad += int(r["idx"]) != i or not np.array_equal(r["img"], many_parts_img(i, 2048))
    peak = max(peak, len(os.listdir("/proc/self/fd")))
print("bad", bad, "peak", peak)
"""


def test_several_stores_of_many_parts_share_the_process_limits(tmp_path):
    """Six stores of 1,100 parts of two fields, each read once, then read by turns in one process under a
    limit of 256 files: every record right, the descriptors below the limit (each store took half of
    what was free at its first read before, and together they ran out)."""
    paths = []
    for k in range(6):
        write_many_parts(tmp_path / f"s{k}", 1100, per=1, img=2048)
        paths.append(str(tmp_path / f"s{k}"))
    r = subprocess.run([sys.executable, "-c", _MANY_STORES_CHILD, *paths], capture_output=True, text=True,
                       timeout=240, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    words = r.stdout.split()
    assert words[:2] == ["bad", "0"] and int(words[3]) < 256, r.stdout
