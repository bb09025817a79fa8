"""A store file truncated while a batch is copied out of its
mapping is a StoreChangedError naming the file, never SIGBUS, on a plain and
on a merged store. The size check before each batch is switched off here, so
the truncation lands where it would in the race that check cannot close: the
copy itself. Each case runs in its own interpreter (a SIGBUS would kill it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mmstore._os.safecopy import safe_copy_available

pytestmark = pytest.mark.skipif(not safe_copy_available(), reason="needs process_vm_readv (Linux)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = r"""
import os, sys
import numpy as np
import mmstore
from mmstore.store.backends.memmap import MemmapBackend
from mmstore.errors import StoreChangedError
from support.stores import write_parts, write_store

root, merged = sys.argv[1], sys.argv[2] == "merged"
BIG = {"image": ("|u1", (32, 32, 3)), "label": ("<i8", ())}  # 3 KiB entries: the kernel-copy path
N = 64

def make(i):
    rng = np.random.default_rng(i)
    return {"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "label": np.int64(i)}

if merged:
    from mmstore.ingest.merge import merge
    path = merge(write_parts(os.path.join(root, "parts"), N, [N // 2], schema=BIG, make=make), os.path.join(root, "s"))
else:
    path = write_store(os.path.join(root, "s"), N, schema=BIG, make=make)
store = mmstore.open(path)
idx = np.arange(N)
got = store.read_batch(idx)  # mapped, and read exactly
assert np.array_equal(got["image"], np.stack([make(i)["image"] for i in idx]))
files = sorted(os.path.join(dp, f) for dp, _, fs in os.walk(path) for f in fs if f.startswith("image"))
MemmapBackend.check_mapped = lambda self, name: None  # the race's window: no size check before the copy
for f in files:
    os.truncate(f, 4096)  # the header and about one entry stay
try:
    store.read_batch(idx)
except StoreChangedError as exc:
    print("typed:", exc)
    sys.exit(0)
print("no error")
sys.exit(1)
"""


@pytest.mark.parametrize("kind", ["plain", "merged"])
def test_truncated_during_the_copy_is_a_typed_error_not_sigbus(tmp_path, kind):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    p = subprocess.run([sys.executable, "-c", CASE, str(tmp_path), kind], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr[-3000:])  # -7 would be SIGBUS
    assert "modified in use" in p.stdout and "image" in p.stdout, p.stdout
