"""Image header sniffing and parsing: format from magic bytes, dimensions, EXIF orientation, truncation checks."""

from __future__ import annotations

import struct

import numpy as np

from ..errors import DecodeError

__all__ = [
    "Header", "diagnose_png", "exif_orientation", "jpeg_has_eoi", "looks_truncated", "probe", "sniff_image",
]


def sniff_image(head: bytes | bytearray | memoryview | np.ndarray) -> str | None:
    """Name an image format from its first bytes.

    Parameters
    ----------
    head : bytes-like
        The start of the data; 64 bytes are enough for every format.

    Returns
    -------
    str or None
        One of ``"jpeg"``, ``"png"``, ``"gif"``, ``"bmp"``, ``"webp"``,
        ``"tiff"``, ``"pnm"``, ``"pfm"``, ``"jp2"``, ``"exr"``, ``"hdr"``,
        ``"sunras"``, ``"avif"``, ``"heic"``, ``"psd"``; None if the bytes are not
        a recognised image.
    """
    if isinstance(head, np.ndarray):
        head = head[:64].tobytes()
    h = bytes(head[:64])
    if h[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if h[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if h[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if h[:4] == b"RIFF" and h[8:12] == b"WEBP":
        return "webp"
    if h[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "tiff"
    if h[:2] == b"BM" and len(h) >= 18:
        if struct.unpack_from("<I", h, 14)[0] in (12, 16, 40, 52, 56, 64, 108, 124):
            return "bmp"
        return None
    if len(h) >= 3 and h[0:1] == b"P" and h[2:3] in b" \t\r\n":
        if h[1:2] in b"1234567":
            return "pnm"
        if h[1:2] in (b"F", b"f"):
            return "pfm"
    if h[:12] == b"\x00\x00\x00\x0cjP  \r\n\x87\n" or h[:4] == b"\xff\x4f\xff\x51":
        return "jp2"
    if h[:4] == b"\x76\x2f\x31\x01":
        return "exr"
    if h.startswith((b"#?RADIANCE", b"#?RGBE")):
        return "hdr"
    if h[:4] == b"\x59\xa6\x6a\x95":
        return "sunras"
    if h[4:8] == b"ftyp" and len(h) >= 12:
        n = min(struct.unpack_from(">I", h, 0)[0], len(h))
        brands = {h[i : i + 4] for i in range(8, max(n, 12), 4)}
        if brands & {b"avif", b"avis"}:
            return "avif"
        if brands & {b"heic", b"heix", b"hevc", b"heim", b"heis", b"mif1", b"msf1"}:
            return "heic"
    if h[:4] == b"8BPS":
        return "psd"
    return None


class Header:
    """What mmstore reads from a header before decoding (stored orientation)."""

    __slots__ = ("width", "height", "ncomp", "orientation", "sos_end")

    def __init__(self) -> None:
        self.width: int | None = None
        self.height: int | None = None
        self.ncomp = 0
        self.orientation = 1
        self.sos_end = -1


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _parse_jpeg(mv: memoryview) -> Header:
    hd = Header()
    n = len(mv)
    pos = 2
    while True:
        # skip to the next marker; fill bytes (FF FF ...) are allowed and, like
        # libjpeg, stray bytes are skipped (libjpeg warns about those, and the
        # strict check turns that warning into "corrupt")
        while pos < n and mv[pos] != 0xFF:
            pos += 1
        while pos < n and mv[pos] == 0xFF:
            pos += 1
        if pos >= n:
            raise DecodeError("truncated: jpeg ends inside its header")
        m = mv[pos]
        pos += 1
        if m in (0x00, 0x01, 0xD8) or 0xD0 <= m <= 0xD7:  # stuffed byte, standalone markers
            continue
        if m == 0xD9:
            raise DecodeError("corrupt: jpeg has no image data (EOI before SOS)")
        if pos + 2 > n:
            raise DecodeError("truncated: jpeg ends inside its header")
        (seglen,) = struct.unpack_from(">H", mv, pos)
        if seglen < 2:
            raise DecodeError(f"corrupt: jpeg segment 0x{m:02X} has length {seglen}")
        end = pos + seglen
        if end > n:
            raise DecodeError("truncated: jpeg ends inside its header")
        if m in _SOF and hd.width is None:
            if seglen < 8:
                raise DecodeError("corrupt: jpeg SOF segment too short")
            _prec, hgt, wid, nc = struct.unpack_from(">BHHB", mv, pos + 2)
            if wid == 0:
                raise DecodeError("corrupt: jpeg SOF width is 0")
            hd.width, hd.ncomp = wid, nc
            hd.height = hgt or None  # 0 means "defined by a DNL marker"
        elif m == 0xE1 and hd.orientation == 1 and bytes(mv[pos + 2 : pos + 8]) == b"Exif\x00\x00":
            hd.orientation = exif_orientation(mv[pos + 8 : end])
        elif m == 0xDA:
            if hd.width is None:
                raise DecodeError("corrupt: jpeg has no SOF segment before its scan")
            hd.sos_end = end
            return hd
        pos = end


def exif_orientation(blob: memoryview | bytes) -> int:
    """EXIF Orientation (tag 0x0112 in IFD0) of a TIFF-structured blob; 1 if absent/invalid."""
    try:
        if len(blob) < 8:
            return 1
        bo = bytes(blob[:2])
        e = "<" if bo == b"II" else ">" if bo == b"MM" else None
        if e is None or struct.unpack_from(e + "H", blob, 2)[0] != 42:
            return 1
        (ifd,) = struct.unpack_from(e + "I", blob, 4)
        (count,) = struct.unpack_from(e + "H", blob, ifd)
        for i in range(min(count, 512)):
            p = ifd + 2 + 12 * i
            tag, typ = struct.unpack_from(e + "HH", blob, p)
            if tag == 0x0112:
                if typ == 3:
                    (v,) = struct.unpack_from(e + "H", blob, p + 8)
                elif typ == 4:
                    (v,) = struct.unpack_from(e + "I", blob, p + 8)
                else:
                    return 1
                return v if 1 <= v <= 8 else 1
    except (struct.error, IndexError, ValueError):
        pass
    return 1


def _parse_tiff_dims(mv: memoryview) -> tuple[int | None, int | None]:
    e = "<" if bytes(mv[:2]) == b"II" else ">"
    big = struct.unpack_from(e + "H", mv, 2)[0] == 43
    if big:
        (ifd,) = struct.unpack_from(e + "Q", mv, 8)
        (count,) = struct.unpack_from(e + "Q", mv, ifd)
        base, step, cfmt = ifd + 8, 20, e + "HHQ"
        voff = 12
    else:
        (ifd,) = struct.unpack_from(e + "I", mv, 4)
        (count,) = struct.unpack_from(e + "H", mv, ifd)
        base, step, cfmt = ifd + 2, 12, e + "HHI"
        voff = 8
    w = h = None
    for i in range(min(count, 4096)):
        p = base + step * i
        tag, typ, _cnt = struct.unpack_from(cfmt, mv, p)
        if tag in (256, 257):
            if typ == 3:
                (v,) = struct.unpack_from(e + "H", mv, p + voff)
            elif typ == 4:
                (v,) = struct.unpack_from(e + "I", mv, p + voff)
            elif typ == 16:
                (v,) = struct.unpack_from(e + "Q", mv, p + voff)
            else:
                continue
            if tag == 256:
                w = v
            else:
                h = v
    return w, h


def _parse_pnm_dims(mv: memoryview) -> tuple[int | None, int | None]:
    head = bytes(mv[:4096])
    if head[1:2] == b"7":  # PAM: WIDTH/HEIGHT lines
        vals = {}
        for line in head.split(b"\n")[1:]:
            parts = line.split()
            if parts and parts[0] in (b"WIDTH", b"HEIGHT") and len(parts) > 1:
                vals[parts[0]] = int(parts[1])
            if parts[:1] == [b"ENDHDR"]:
                break
        return vals.get(b"WIDTH"), vals.get(b"HEIGHT")
    tokens: list[int] = []
    lines = head[2:].split(b"\n")
    for line in lines:
        line = line.split(b"#", 1)[0]
        for t in line.split():
            tokens.append(int(t))
            if len(tokens) == 2:
                return tokens[0], tokens[1]
    return None, None


def _parse_jp2_dims(mv: memoryview) -> tuple[int | None, int | None]:
    n = len(mv)
    if bytes(mv[:4]) == b"\xff\x4f\xff\x51":  # raw codestream: SIZ
        xs, ys, xo, yo = struct.unpack_from(">IIII", mv, 8)
        return xs - xo, ys - yo

    def boxes(start: int, stop: int):
        p = start
        while p + 8 <= stop:
            ln, typ = struct.unpack_from(">I4s", mv, p)
            hl = 8
            if ln == 1:
                (ln,) = struct.unpack_from(">Q", mv, p + 8)
                hl = 16
            elif ln == 0:
                ln = stop - p
            if ln < hl:
                return
            yield typ, p + hl, min(p + ln, stop)
            p += ln

    for typ, a, b in boxes(0, n):
        if typ == b"jp2h":
            for t2, a2, _b2 in boxes(a, b):
                if t2 == b"ihdr":
                    hgt, wid = struct.unpack_from(">II", mv, a2)
                    return wid, hgt
    return None, None


def _parse_hdr_dims(mv: memoryview) -> tuple[int | None, int | None]:
    head = bytes(mv[:8192])
    for line in head.split(b"\n")[1:64]:
        parts = line.split()
        if len(parts) == 4 and parts[0] in (b"-Y", b"+Y", b"-X", b"+X"):
            a, b = int(parts[1]), int(parts[3])
            return (b, a) if parts[0][1:] == b"Y" else (a, b)
    return None, None


def _parse_avif_dims(mv: memoryview) -> tuple[int | None, int | None]:
    head = bytes(mv[: 1 << 16])
    best = (None, None)
    i = head.find(b"ispe")
    while 0 <= i and i + 16 <= len(head):
        wid, hgt = struct.unpack_from(">II", head, i + 8)
        if best[0] is None or wid * hgt > best[0] * best[1]:
            best = (wid, hgt)
        i = head.find(b"ispe", i + 4)
    return best


def probe(mv: memoryview, fmt: str) -> Header:
    """Read header dimensions (stored orientation); raise for broken headers."""
    if fmt == "jpeg":
        return _parse_jpeg(mv)
    hd = Header()
    try:
        if fmt == "png":
            if len(mv) < 33 or bytes(mv[12:16]) != b"IHDR":
                if len(mv) < 33:
                    raise DecodeError("truncated: png ends inside its header")
                raise DecodeError("corrupt: png does not start with an IHDR chunk")
            hd.width, hd.height = struct.unpack_from(">II", mv, 16)
        elif fmt == "gif":
            hd.width, hd.height = struct.unpack_from("<HH", mv, 6)
        elif fmt == "bmp":
            (dib,) = struct.unpack_from("<I", mv, 14)
            if dib == 12:
                hd.width, hd.height = struct.unpack_from("<HH", mv, 18)
            else:
                w, h = struct.unpack_from("<ii", mv, 18)
                hd.width, hd.height = abs(w), abs(h)
        elif fmt == "webp":
            chunk = bytes(mv[12:16])
            if chunk == b"VP8 ":
                w, h = struct.unpack_from("<HH", mv, 26)
                hd.width, hd.height = w & 0x3FFF, h & 0x3FFF
            elif chunk == b"VP8L":
                (bits,) = struct.unpack_from("<I", mv, 21)
                hd.width, hd.height = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            elif chunk == b"VP8X":
                b = bytes(mv[24:30])
                hd.width = int.from_bytes(b[:3], "little") + 1
                hd.height = int.from_bytes(b[3:], "little") + 1
        elif fmt == "tiff":
            hd.width, hd.height = _parse_tiff_dims(mv)
        elif fmt in ("pnm", "pfm"):
            hd.width, hd.height = _parse_pnm_dims(mv)
        elif fmt == "jp2":
            hd.width, hd.height = _parse_jp2_dims(mv)
        elif fmt == "hdr":
            hd.width, hd.height = _parse_hdr_dims(mv)
        elif fmt == "sunras":
            hd.width, hd.height = struct.unpack_from(">II", mv, 4)
        elif fmt == "avif":
            hd.width, hd.height = _parse_avif_dims(mv)
    except (struct.error, ValueError, IndexError):
        # unreadable header fields: leave the dimensions unknown and let the
        # decoder judge (and the post-decode pixel check apply)
        hd.width = hd.height = None
    return hd


def jpeg_has_eoi(mv: memoryview, start: int) -> bool:
    n = len(mv)
    lo = max(start, n - 4096)
    if bytes(mv[lo:]).rfind(b"\xff\xd9") >= 0:
        return True
    if lo <= start:
        return False
    return bytes(mv[start : lo + 1]).rfind(b"\xff\xd9") >= 0


def diagnose_png(mv: memoryview) -> str:
    import zlib

    n = len(mv)
    pos = 8
    while True:
        if pos + 8 > n:
            return "truncated: png has no IEND chunk"
        ln, typ = struct.unpack_from(">I4s", mv, pos)
        name = typ.decode("latin-1")
        if pos + 12 + ln > n:
            return f"truncated: png ends inside chunk {name}"
        (crc,) = struct.unpack_from(">I", mv, pos + 8 + ln)
        if zlib.crc32(mv[pos + 4 : pos + 8 + ln]) != crc:
            return f"corrupt: png CRC mismatch in chunk {name}"
        if typ == b"IEND":
            return "corrupt: png decoder failed (bad compressed data?)"
        pos += 12 + ln


def looks_truncated(mv: memoryview, fmt: str) -> bool:
    """Cheap size checks for formats that declare their length (failure path only)."""
    n = len(mv)
    try:
        if fmt == "webp":
            return struct.unpack_from("<I", mv, 4)[0] + 8 > n
        if fmt == "bmp":
            return struct.unpack_from("<I", mv, 2)[0] > n
        if fmt == "gif":
            return mv[n - 1] != 0x3B  # no trailer
        if fmt == "avif":
            pos = 0
            while pos + 8 <= n:
                ln = struct.unpack_from(">I", mv, pos)[0]
                if ln == 1:
                    ln = struct.unpack_from(">Q", mv, pos + 8)[0]
                elif ln == 0:
                    return False
                if ln < 8:
                    return False
                pos += ln
            return pos > n
    except (struct.error, IndexError):
        return True
    return False
