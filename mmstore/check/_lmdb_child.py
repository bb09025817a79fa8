"""The child process of verify's LMDB pass (see :mod:`mmstore.check.verify_lmdb`).

A damaged LMDB page can make liblmdb read outside its mapping, which kills
the process with SIGBUS or SIGSEGV: no Python code can catch that. So verify
never maps an LMDB file itself; it runs this script with ``python -c`` and
reads what it reports on stdout. If the child dies, verify knows the last
record it reported and carries on from there.

Self-contained on purpose (standard library, ``lmdb`` and ``xxhash`` only; it
is not imported by mmstore), so each start costs milliseconds.

Usage: ``MODE READAHEAD FILE [LO HI [LAYOUT]]``, where MODE is

``stat``  report the number of entries, the last page number in use and
          the page size;
``walk``  report every key in ``[LO, HI)`` in key order (a cursor walk; LO or
          HI of -1: from the first key, to the last one);
``get``   report slots ``LO .. HI-1`` one by one (a lookup each), flushing
          after each, so a crash names the slot that caused it.

and LAYOUT, for a store with variable-size fields (format 2.0), is the schema
as comma-separated items in schema order, ``f<bytes>`` for a raw field and
``v`` for a variable-size one: the checksum is then taken over the record's
checksummed bytes (format.py, "Checksums") rebuilt from the value, whose
layout (lengths adding up to its size) is checked before any slicing.

Output, binary: ``S`` + u64 entries, last page, page size; ``R`` + u16 key length + key + u32 value
length + u64 xxh3_64 of the value (LAYOUT: of the record's checksummed bytes);
``B`` + u16 key length + key + u32 value length (LAYOUT: the value's size does not
match the layout); ``N`` + u64 slot (``get``: no such key);
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
    if _LAYOUT:
        h = _layout_hash(value)
        if h is None:
            return b"B" + struct.pack("<H", len(key)) + bytes(key) + struct.pack("<I", len(value))
        return b"R" + struct.pack("<H", len(key)) + bytes(key) + struct.pack("<IQ", len(value), h)
    return b"R" + struct.pack("<H", len(key)) + bytes(key) + struct.pack("<IQ", len(value), h3(value))


_LAYOUT: list[tuple[bool, int]] = []  # [(is_variable, raw bytes)] in schema order (format 2.0), else empty


def _layout_hash(value):
    """xxh3_64 of a 2.0 value's checksummed bytes, or None when the value's
    size is not raw bytes + 8 per variable field + the lengths it holds."""
    import xxhash

    raw = sum(n for var, n in _LAYOUT if not var)
    nvar = sum(1 for var, _ in _LAYOUT if var)
    head = raw + 8 * nvar
    if len(value) < head:
        return None
    lens = struct.unpack_from(f"<{nvar}Q", value, raw)
    if head + sum(lens) != len(value):
        return None
    h = xxhash.xxh3_64()
    fixed, entry, k = 0, head, 0
    for var, n in _LAYOUT:
        if var:
            n = lens[k]
            k += 1
            h.update(struct.pack("<Q", n))
            h.update(value[entry : entry + n])
            entry += n
        else:
            h.update(value[fixed : fixed + n])
            fixed += n
    return h.intdigest()


def main(argv):
    mode, readahead, path = argv[0], argv[1] == "1", argv[2]
    lo, hi = (int(argv[3]), int(argv[4])) if len(argv) > 4 else (-1, -1)
    if len(argv) > 5 and argv[5]:
        _LAYOUT.extend((item == "v", 0 if item == "v" else int(item[1:])) for item in argv[5].split(","))
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
