"""Helpers of the remote tests: small image stores, epochs as plain arrays, the objects
of a bucket, and child processes that read a store from its URL."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from support.proc import REPO, cli_env
from support.stores import write_store

import mmstore

BLOCK = 64 << 10  # pushes in small blocks: a small store has many
SHAPE = (32, 32, 3)  # 3 KiB a record: about 21 records a block


def image_store(path, n: int = 600, seed: int = 7) -> str:
    """A memmap store of ``n`` random images with ``label`` = the record's index."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 255, (n, *SHAPE), dtype=np.uint8)
    mmstore.from_dataset([{"image": images[i], "label": i} for i in range(n)], path)
    return os.fspath(path)


def written_image_store(path, n: int, shape: tuple[int, ...] = (24, 24, 3), *, seed: int = 7, classes: int = 13,
                        holes=()) -> str:
    """A store written by ``StoreWriter`` (``support.stores.write_store``): ``n`` random images of
    ``shape``, ``label`` = the record's index modulo ``classes``, the slots ``holes`` left empty."""
    schema = {"image": ("|u1", shape), "label": ("<i8", ())}
    base = np.random.default_rng(seed).integers(0, 255, (n, *shape), dtype=np.uint8)
    return write_store(path, n, schema=schema, holes=holes,
                       make=lambda i: {"image": base[i], "label": np.int64(i % classes)})


def same_files(a: str, b: str) -> None:
    """Directories ``a`` and ``b`` hold the same names with byte-identical contents."""
    names = sorted(os.listdir(a))
    assert names == sorted(os.listdir(b))
    for n in names:
        assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n


def push_then_pull(path: str, url: str, dest, block_bytes: int = BLOCK) -> dict[str, Any]:
    """Push ``path`` to ``url`` (all of it), push again (nothing to do), pull into ``dest``
    (byte-identical, every record verified), pull again (up to date); the first pull's report."""
    from mmstore.transfer import pull, push

    rep = push(path, url, block_bytes=block_bytes)
    assert not rep["up_to_date"] and rep["uploaded_bytes"] == rep["bytes"]
    assert push(path, url, block_bytes=block_bytes)["up_to_date"]  # the same store again: nothing uploaded
    got = pull(url, dest)
    assert got["verified_records"] == len(mmstore.open(path))
    same_files(path, os.fspath(dest))
    assert pull(url, dest)["up_to_date"]
    return got


def batches(loader) -> list[dict[str, np.ndarray]]:
    """One epoch of ``loader``, each batch copied out of the loader's buffers."""
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader]


def assert_same_epoch(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    """Batch for batch the same fields and the same values."""
    assert len(got) == len(want), (len(got), len(want))
    for i, (x, y) in enumerate(zip(got, want)):
        assert x.keys() == y.keys(), i
        for k in x:
            assert np.array_equal(x[k], y[k]), f"batch {i}, field {k!r} differs"


def objects(bucket) -> dict[str, int]:
    """Every object of ``bucket`` (a ``support.s3.Bucket``): key -> size, read past the proxy."""
    import obstore

    store = bucket.store(endpoint=bucket.server.endpoint)
    return {str(m["path"]): int(m["size"]) for chunk in obstore.list(store) for m in chunk}


def wait_for(what: str, cond: Callable[[], Any], proc: subprocess.Popen | None = None,
             timeout: float = 60.0) -> Any:
    """Poll ``cond`` until it gives something true; fail when ``proc`` ends first or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr is not None else b""
            raise AssertionError(f"the child ended (code {proc.returncode}) before {what}: {err[-2000:]!r}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.01)


def kill9(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (by its own pid) and reap it."""
    proc.kill()
    proc.communicate(timeout=30)
    assert proc.returncode == -9, proc.returncode


def python_child(code: str, *args: str, env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """``python -c code args...`` from this checkout, in its own session, output piped."""
    return subprocess.Popen([sys.executable, "-c", code, *args], env=cli_env(**(env or {})), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kw)


def finish(proc: subprocess.Popen, timeout: float = 180.0) -> tuple[bytes, bytes]:
    """The output of ``proc`` once it has ended; after ``timeout`` it is killed and the test fails.
    Whatever it started in its session (a hung worker) is killed with it."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the child did not end within {timeout:.0f} s: {err[-3000:]!r}") from None
    finally:
        try:
            os.killpg(proc.pid, 9)  # its own session (python_child): only what it started
        except (ProcessLookupError, PermissionError):
            pass
    return out, err


def json_lines(text: bytes | str) -> list[Any]:
    """The JSON objects printed one a line."""
    if isinstance(text, bytes):
        text = text.decode()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]
