"""The child process of verify's LMDB pass (see :mod:`mmstore.tools.verify_lmdb`).

A damaged LMDB page can make liblmdb read outside its mapping, which kills
the process with SIGBUS or SIGSEGV: no Python code can catch that. So verify
never maps an LMDB file itself; it runs this script with ``python -c`` and
reads what it reports on stdout. If the child dies, verify knows the last
record it reported and carries on from there.

Self-contained on purpose (standard library, ``lmdb`` and ``xxhash`` only; it
is not imported by mmstore), so each start costs milliseconds.

Usage: ``MODE READAHEAD FILE [LO HI]``, where MODE is

``stat``  report the number of entries, the last page number in use and
          the page size;
``walk``  report every key in ``[LO, HI)`` in key order (a cursor walk; LO or
          HI of -1: from the first key, to the last one);
``get``   report slots ``LO .. HI-1`` one by one (a lookup each), flushing
          after each, so a crash names the slot that caused it.

Output, binary: ``S`` + u64 entries, last page, page size; ``R`` + u16 key length + key + u32 value
length + u64 xxh3_64 of the value; ``N`` + u64 slot (``get``: no such key);
``X`` + u32 length + UTF-8 message (an error LMDB reported); ``D`` (done).
"""

import os
import struct
import sys


def _write(buf):
    mv = memoryview(buf)
    while mv:
        mv = mv[os.write(1, mv):]


def _record(key, value, h3):
    return b"R" + struct.pack("<H", len(key)) + bytes(key) + struct.pack("<IQ", len(value), h3(value))


def main(argv):
    mode, readahead, path = argv[0], argv[1] == "1", argv[2]
    lo, hi = (int(argv[3]), int(argv[4])) if len(argv) > 4 else (-1, -1)
    import lmdb
    import xxhash

    h3 = xxhash.xxh3_64_intdigest
    try:
        env = lmdb.open(path, subdir=False, readonly=True, lock=False, readahead=readahead,
                        meminit=False, max_dbs=0)
        with env.begin(buffers=True) as txn:
            if mode == "stat":
                info, st = env.info(), txn.stat()
                _write(b"S" + struct.pack("<QQQ", st["entries"], info["last_pgno"], st["psize"]))
            elif mode == "get":
                for s in range(lo, hi):
                    v = txn.get(s.to_bytes(8, "big"))
                    _write(b"N" + struct.pack("<Q", s) if v is None else _record(s.to_bytes(8, "big"), v, h3))
            else:
                cur = txn.cursor()
                ok = cur.first() if lo < 0 else cur.set_range(lo.to_bytes(8, "big"))
                stop = None if hi < 0 else hi.to_bytes(8, "big")
                buf = bytearray()
                while ok:
                    k = cur.key()
                    if stop is not None and bytes(k) >= stop:
                        break
                    buf += _record(k, cur.value(), h3)
                    if len(buf) >= 16384:
                        _write(buf)
                        buf.clear()
                    ok = cur.next()
                _write(buf)
    except lmdb.Error as exc:
        msg = str(exc).encode("utf-8", "backslashreplace")
        _write(b"X" + struct.pack("<I", len(msg)) + msg)
    _write(b"D")


if __name__ == "__main__":
    main(sys.argv[1:])
