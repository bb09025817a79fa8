"""``mmstore.open`` while another process overwrites the store at the same
path (``ingest --overwrite`` publishes through ``StoreWriter(...,
overwrite=True)``): every open returns one complete store, whose manifest,
data, keys and checksums all belong to the same version, or raises
``StoreChangedError``; never a mix, never a bare ``OSError``.

And an overwrite that is killed at any point of its publish leaves a
complete store at the path (the old or the new one), plus leftovers that
the next overwrite removes.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import xxhash
from support.faults import CRASHED

import mmstore
from mmstore._os import crash as _crash
from mmstore.errors import IncompleteStoreError, StoreChangedError

SCHEMA = {"image": ("|u1", (6, 4, 3)), "label": ("<i8", ())}
# A and B have the same size (a mix of the two passes every size check);
# C has fewer records and holes (other file sizes, an index, errors.jsonl)
VARIANTS = {"A": (300, 1, ()), "B": (300, 2, ()), "C": (200, 3, (5, 17, 150))}
SECONDS = 1.5  # of overwrites per backend
KEY_STRIDE = 10
REPLACED_INFIX = ".replaced-"  # where a publish puts a store aside (format.py, "Replacing a store")


def _write(dest, which, backend):
    """Write version ``which`` at ``dest`` over what is there: what ``ingest
    --overwrite`` does at its end (``StoreWriter(..., overwrite=True)``)."""
    n, label, holes = VARIANTS[which]
    images = np.full((n, 6, 4, 3), (np.arange(n) * 7 + label * 50)[:, None, None, None] % 256, np.uint8)
    images[:, 0, 0, 0] = ord(which)
    with mmstore.StoreWriter(dest, SCHEMA, slots=n, backend=backend, overwrite=True,
                             provenance={"which": which}) as w:
        w.write_batch(0, {"image": images, "label": np.full(n, label, np.int64)},
                      keys=[f"{which}/{s:05d}" for s in range(n)])
        for s in holes:
            w.skip(s, f"{which}/{s:05d}", "test hole")
    return dest


# the child: the versions in turn, each one published over the previous one
CHILD = f"""
import sys, time
import numpy as np
import mmstore

SCHEMA = {SCHEMA!r}
VARIANTS = {VARIANTS!r}

{inspect.getsource(_write)}

dest, backend, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
order, done, end = "BCA", 0, time.monotonic() + seconds
while time.monotonic() < end:
    _write(dest, order[done % 3], backend)
    done += 1
print(done)
"""


def _child_env() -> dict[str, str]:
    """This environment, with the mmstore this test imported first on the path."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(mmstore.__file__)))
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _expected(tmp_path, backend):
    """What each variant reads as: records, data, keys, checksums (from a
    store of its own, opened when nothing else writes it)."""
    out = {}
    for which in VARIANTS:
        with mmstore.open(_write(str(tmp_path / f"ref-{which}"), which, backend)) as s:
            batch = s.read_batch(np.arange(len(s)))
            out[which] = {"records": len(s), "slots": s.slots, "image": batch["image"], "label": batch["label"],
                          "keys": [s.key(i) for i in range(0, len(s), KEY_STRIDE)],
                          "checksums": np.array(s.slot_view.checksums()),
                          "digest": s.manifest["checksum"]["digest"]}
    return out


def _check_one(s, want) -> None:
    """``s`` is exactly the version its manifest names, or a typed error."""
    w = want[s.provenance["which"]]
    assert (s.records, s.slots) == (w["records"], w["slots"]), "manifest of one version, counts of another"
    ck = np.array(s.slot_view.checksums())
    assert xxhash.xxh3_64_hexdigest(ck.tobytes()) == s.manifest["checksum"]["digest"] == w["digest"], \
        "the manifest's checksum digest does not match the checksums read"
    batch = s.read_batch(np.arange(len(s)))
    np.testing.assert_array_equal(batch["label"], w["label"], "labels of another version")
    np.testing.assert_array_equal(batch["image"], w["image"], "images of another version")
    np.testing.assert_array_equal(ck, w["checksums"], "checksums of another version")
    slots = np.arange(s.slots) if s.slot_view.index is None else np.asarray(s.slot_view.index)
    for i, slot in enumerate(slots.tolist()):  # every record against the store's own checksum
        packed = batch["image"][i].tobytes() + batch["label"][i].tobytes()
        assert xxhash.xxh3_64_intdigest(packed) == int(ck[slot]), f"record {i}: its checksum is another store's"
    # every key names its version: a sample shows whose key files these are
    assert [s.key(i) for i in range(0, len(s), KEY_STRIDE)] == w["keys"], "keys of another version"


def _race(tmp_path, backend, child_code):
    """Open the store in a loop while ``child_code`` overwrites it; assert
    each open is one whole version or a ``StoreChangedError``."""
    want = _expected(tmp_path, backend)
    path = _write(str(tmp_path / "s"), "A", backend)
    child = subprocess.Popen([sys.executable, "-c", child_code, path, backend, str(SECONDS)],
                             stdout=subprocess.PIPE, text=True, env=_child_env())
    seen = {k: 0 for k in VARIANTS}
    changed = changed_after_open = opens = 0
    bad: list[str] = []
    deadline = time.monotonic() + SECONDS + 60
    try:
        while child.poll() is None and time.monotonic() < deadline:
            opens += 1
            try:
                s = mmstore.open(path)
            except StoreChangedError:
                changed += 1  # replaced again and again while it opened: typed, says to retry
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is the bug
                bad.append(f"open raised {type(exc).__name__}: {exc}")
                continue
            try:
                _check_one(s, want)
                seen[s.provenance["which"]] += 1
            except AssertionError as exc:
                bad.append(f"a mix ({s.provenance['which']}): {str(exc).splitlines()[0]}")
            except StoreChangedError:
                changed_after_open += 1  # replaced between the open and the reads: typed, not a mix
            except Exception as exc:  # noqa: BLE001
                bad.append(f"a read raised {type(exc).__name__}: {exc}")
            finally:
                s.close()
    finally:
        if child.poll() is None:
            child.kill()
        out, _ = child.communicate()
    assert child.returncode == 0, "the overwriting child failed"
    swaps = int(out.split()[-1])
    assert not bad, f"{len(bad)} of {opens} opens went wrong during {swaps} overwrites, e.g. {bad[:3]}"
    assert swaps >= 6 and sum(seen.values()) >= 20 and sum(v > 0 for v in seen.values()) >= 2, (
        f"too little happened to test anything: {swaps} overwrites, opens {seen}")
    # a retried open almost always succeeds: a typed failure is the exception
    assert changed <= opens // 4, f"{changed} of {opens} opens gave up ({seen}, {changed_after_open} after open)"
    assert not [n for n in os.listdir(tmp_path) if REPLACED_INFIX in n], "an old store was left aside"


def test_open_in_a_loop_while_overwritten_sees_one_store_or_a_typed_error(tmp_path, backend):
    _race(tmp_path, backend, CHILD)


def test_open_while_overwritten_by_two_renames_waits_for_the_publish(tmp_path):
    """A file system that cannot exchange two names: the publish is two
    renames, with a moment of no store between them; opens wait it out."""
    no_exchange = CHILD.replace("import mmstore\n", "import mmstore\nimport mmstore.store.writer\n"
                                "mmstore.store.writer._exchange = lambda a, b: False\n", 1)
    assert no_exchange != CHILD
    _race(tmp_path, "memmap", no_exchange)


def test_open_between_the_two_renames_of_a_publish_says_so(tmp_path):
    """No store, only a finished ``.partial``: a publish is under way (or
    was stopped between its renames); the open says so, and what to do."""
    path = str(tmp_path / "s")
    os.rename(_write(str(tmp_path / "new"), "B", "memmap"), path + ".partial")
    with pytest.raises(IncompleteStoreError, match="finished store waiting to be published") as err:
        mmstore.open(path)
    assert "--resume" in str(err.value) and "open the store again in a moment" in str(err.value)


# -- a killed overwrite ----------------------------------------------------------------------

def _killed_at(k, path, backend) -> int:
    """Overwrite ``path`` with version B in a forked child armed to die
    just before its k-th rename; its exit code."""
    pid = os.fork()
    if pid == 0:  # child
        rc = 99
        try:
            _crash.arm(f"rename:{k}")
            _write(path, "B", backend)
            rc = 0
        finally:
            os._exit(rc)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_killed_overwrite_leaves_the_old_or_the_new_store_and_the_next_run_cleans(tmp_path, backend):
    want = _expected(tmp_path, backend)
    outcomes, left = set(), set()
    k = 1
    while True:
        root = tmp_path / f"k{k}"
        root.mkdir()
        path = _write(str(root / "s"), "A", backend)
        rc = _killed_at(k, path, backend)
        with mmstore.open(path) as s:  # never a missing or half-swapped store
            _check_one(s, want)
            outcomes.add(s.provenance["which"])
        if rc == 0:
            break
        assert rc == CRASHED, f"rename:{k}: exit {rc}"
        left.update(n.replace(n[-8:], "X" * 8) if REPLACED_INFIX in n else n for n in os.listdir(root))
        _write(path, "C", backend)  # the next overwrite publishes, and removes what the killed one left
        assert sorted(os.listdir(root)) == ["s"], f"rename:{k}: left behind {sorted(os.listdir(root))}"
        with mmstore.open(path) as s:
            _check_one(s, want)
        k += 1
        assert k < 50
    assert outcomes == {"A", "B"}, outcomes
    assert left >= {"s", "s.partial", "s.replaced-XXXXXXXX"}, left  # the kills did leave things to clean
