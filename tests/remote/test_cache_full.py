"""A full disk under the cache of a store opened from a URL, or under a pull's destination, for
real: a small tmpfs mounted as the cache directory in a private mount namespace (``unshare
--mount``), a SeaweedFS server on loopback. The reader gets a typed ``CacheFullError`` that
names the cache directory, the bytes needed and ``cache_limit`` (never a bus error, never a bare
``OSError``), lives on, and what the message says to do works: a smaller ``cache_limit``, or
space freed. A pull gets a typed error naming the destination, and its rerun finishes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from remote.helpers import BLOCK, written_image_store
from support.proc import REPO, cli_env

import mmstore
from mmstore.remote.replica import open_replica
from mmstore.transfer import push

pytest.importorskip("obstore")

# What both scripts below start with: fill the disk (a file of every byte of the tmpfs, then
# `leave` given back), and the error a call raised, as a dict (None: it raised none).
_DISK = r"""
import errno, json, os, re, sys
import numpy as np
import mmstore

def fill(leave):
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"x" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))

def failure(call):
    try:
        call()
    except Exception as exc:
        return {"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "message": str(exc)}
    return None
"""

# The reader, in the mount namespace where its cache directory is a tmpfs of a few MB:
# open the URL, fill the disk, read (an epoch of a Loader, then read_batch), follow the
# message's advice, free the space, read again. Prints one JSON line of what it saw.
_READER = _DISK + r"""
from mmstore.order import OrderSpec
from mmstore.torch import Loader

url, cache, src = sys.argv[1:4]
want = mmstore.open(src).read_batch(np.arange(1500))
out = {}
filler = os.path.join(cache, "filler")

def epoch(store):
    got = {"image": [], "label": []}
    for batch in Loader(store, 100, OrderSpec("sequential")):
        for k in got:
            got[k].append(batch[k].numpy().copy())
    return all(np.array_equal(np.concatenate(got[k]), want[k]) for k in got)

s = mmstore.open(url, cache_dir=cache)
fill(0)
out["loader"] = failure(lambda: epoch(s))
fill(1_200_000)
out["read_batch"] = failure(lambda: [s.read_batch(np.arange(a, a + 100)) for a in range(0, 1500, 100)])
s.close()
out["read_batch_done"] = len(os.listdir(cache))
m = re.search(r"cache_limit of at most ([0-9.]+) (MB|kB)", (out["read_batch"] or {}).get("message", ""))
if m:
    limit = int(float(m.group(1)) * (1e6 if m.group(2) == "MB" else 1e3))
    limited = mmstore.open(url, cache_dir=cache, cache_limit=limit)
    parts = [limited.read_batch(np.arange(a, a + 100)) for a in range(0, 1500, 100)]
    out["with_the_limit"] = all(np.array_equal(np.concatenate([p[k] for p in parts]), want[k]) for k in want)
    limited.close()
os.unlink(filler)
out["after_freeing"] = epoch(mmstore.open(url, cache_dir=cache))
print(json.dumps(out), flush=True)
"""


# The same for a pull whose destination is on such a disk: with no byte left, then with less
# room than the store needs, then with the room freed.
_PULLER = _DISK + r"""
from mmstore.transfer import pull

url, disk, src = sys.argv[1:4]
dest = os.path.join(disk, "copy.store")
filler = os.path.join(disk, "filler")
out = {}

fill(0)
out["full"] = failure(lambda: pull(url, dest))
fill(1_200_000)
out["short"] = failure(lambda: pull(url, dest))
os.unlink(filler)
rep = pull(url, dest)
want = mmstore.open(src).read_batch(np.arange(1500))
got = mmstore.open(dest).read_batch(np.arange(1500))
out["after_freeing"] = rep["verified_records"] == 1500 and all(np.array_equal(got[k], want[k]) for k in want)
print(json.dumps(out), flush=True)
"""


def _in_a_small_tmpfs(cache: str, size: str, *argv: str, script: str = _READER) -> subprocess.CompletedProcess:
    """``python -c script argv...`` in a private mount namespace where ``cache`` is a tmpfs of ``size``."""
    os.makedirs(cache, exist_ok=True)
    mount = 'mount -t tmpfs -o size="$1" tmpfs "$2" && shift 2 && exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", size, cache,
           sys.executable, "-c", script, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=180)


def _can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                       capture_output=True)
    return r.returncode == 0


def test_a_full_cache_disk_is_a_typed_error_the_reader_survives(s3, tmp_path):
    if not _can_mount():
        pytest.skip("a tmpfs in a private mount namespace needs root and unshare(1)")
    src = written_image_store(tmp_path / "src.store", n=1500)  # 2.6 MB of images: 40 blocks of 64 KiB
    url = s3.url("full.store")
    push(src, url, block_bytes=BLOCK)
    cache = str(tmp_path / "cache")
    r = _in_a_small_tmpfs(cache, "6m", url, cache, src)
    assert r.returncode == 0, f"the reader died (code {r.returncode}): {r.stderr[-3000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for how in ("loader", "read_batch"):
        err = got[how]
        assert err is not None, f"{how}: no error on a full disk"
        assert err["type"] == "CacheFullError" and err["errno"] == 28, err
        msg = err["message"]
        assert cache in msg and url in msg and "cache_limit" in msg and "free space" in msg, msg
        assert "more were needed" in msg and "cache_dir" in msg, msg
    assert got.get("with_the_limit") is True, got  # the smaller cache_limit the message gave works
    assert got["after_freeing"] is True


def test_a_pull_onto_a_full_disk_is_a_typed_error_and_the_rerun_finishes(s3, tmp_path):
    if not _can_mount():
        pytest.skip("a tmpfs in a private mount namespace needs root and unshare(1)")
    src = written_image_store(tmp_path / "src.store", n=1500)  # 2.6 MB of images
    url = s3.url("pulled.store")
    push(src, url, block_bytes=BLOCK)
    disk = str(tmp_path / "disk")
    r = _in_a_small_tmpfs(disk, "6m", url, disk, src, script=_PULLER)
    assert r.returncode == 0, f"the pull's process died (code {r.returncode}): {r.stderr[-3000:]}"
    got = json.loads(r.stdout.strip().splitlines()[-1])
    dest = os.path.join(disk, "copy.store")
    for how in ("full", "short"):
        err = got[how]
        assert err is not None and err["type"] == "ResourceLimitError" and err["errno"] == 28, err
        assert dest in err["message"], err
    assert "run the same pull again" in got["full"]["message"], got["full"]  # a write failed: kept, resumed
    assert "free at least" in got["short"]["message"], got["short"]  # refused before its first request
    assert got["after_freeing"] is True


def test_the_cache_tables_take_their_disk_when_made(s3, tmp_path):
    """The tables written through shared mappings are allocated, not sparse: a write into them
    cannot fault for lack of space. A cache whose tables are sparse (made by an earlier
    version) has them allocated when it is opened."""
    src = str(tmp_path / "src.store")  # 540 blocks of 64 KiB: blocks.use spans two pages
    images = np.random.default_rng(3).integers(0, 255, (180, 256, 256, 3), dtype=np.uint8)
    mmstore.from_dataset([{"image": images[i]} for i in range(len(images))], src)
    url = s3.url("tables.store")
    push(src, url, block_bytes=BLOCK)
    rep = open_replica(url, cache_dir=tmp_path / "cache")
    paths = [os.path.join(rep.home, t) for t in ("blocks.map", "blocks.use")]
    for p in paths:
        st = os.stat(p)
        assert st.st_size > 0 and st.st_blocks * 512 >= st.st_size, (p, st.st_size, st.st_blocks)
    rep.close()
    for p in paths:  # as an earlier version made them: sparse (every block absent)
        size = os.path.getsize(p)
        os.truncate(p, 0)
        os.truncate(p, size)
        assert os.stat(p).st_blocks == 0
    os.unlink(os.path.join(rep.home, "acct.lock"))  # its sum is counted again from the states
    again = open_replica(url, cache_dir=tmp_path / "cache")
    for p in paths:
        st = os.stat(p)
        assert st.st_blocks * 512 >= st.st_size, p
    assert np.all(again.state[again.sticky] == 1)  # the headers, fetched again at the open
    again.close()
