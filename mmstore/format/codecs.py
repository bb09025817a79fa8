"""Per-field codecs: how one entry of a field is stored (format.py, "Encoded fields").

A codec turns one entry (an array of the field's exact dtype and shape) into
bytes and back. ``raw`` is the fixed-size layout of format 1.x; every other
codec makes the field *variable-size* (an offsets index beside the data).

========  ==========================================  ===================================
name      fields it accepts                           parameter (``NAME:PARAM``)
========  ==========================================  ===================================
raw       any                                         none
jpeg      uint8, shape (H, W), (H, W, 1) or (H, W, 3)  quality 1-100 (default 90); lossy
png       uint8/uint16, (H, W) or (H, W, 1|3|4)        zlib level 0-9 (default 1); lossless
zstd      any                                         level 1-19 (default 3); lossless
========  ==========================================  ===================================

Why these (compared on real photographs, see the README's "Compact records"):
JPEG at quality 90 is many times smaller than raw and decodes fast with
simplejpeg (libjpeg-turbo, GIL released, decodes into the caller's buffer).
Of the lossless image codecs WebP lossless was smaller than PNG but far too
slow to encode for a large ingest, and QOI decoded faster but needs a second
large package. PNG is readable everywhere and comes with OpenCV, which
mmstore already needs. zstd is the general lossless codec for any array.

JPEG decode options: this module uses the accurate DCT with fancy
upsampling. libjpeg-turbo's fast DCT (FFCV's flag) and fast upsampling each
save a little decode CPU but change pixels (the fast DCT most of them, by a
few levels; fast upsampling by many levels at colour edges); OpenCV's
imdecode is no faster (its own output array, BGR). Neither fast mode is
used: a stored
entry decodes to one reference image everywhere (``store[i]``, the Loader,
``verify --decode``, repair's proof), and the gain is below the noise of a
shared machine. Chroma subsampling at encode: 4:2:0 (used) against 4:4:4
gives smaller entries and faster decodes for a lower PSNR.

Encoders are deterministic for a given library version, so the same inputs
give byte-identical stores; :func:`library_versions` goes into the
provenance. Decoders raise :class:`~mmstore.errors.EntryDecodeError` (never
return garbage) and check the decoded dtype and shape against the field.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EntryDecodeError, FormatError, SchemaError

__all__ = [
    "CODEC_NAMES",
    "RAW",
    "Codec",
    "codec_from_json",
    "library_versions",
    "parse_codec",
    "parse_codec_specs",
]

CODEC_NAMES = ("raw", "jpeg", "png", "zstd")
# name -> (JSON key of the parameter, default, lowest, highest)
_PARAMS: dict[str, tuple[str, int, int, int]] = {
    "jpeg": ("quality", 90, 1, 100),
    "png": ("level", 1, 0, 9),
    "zstd": ("level", 3, 1, 19),
}
_JPEG_MAX_SIDE = 65500  # libjpeg's limit


@dataclass(frozen=True)
class Codec:
    """A codec and its parameter (``None`` for ``raw``)."""

    name: str
    param: int | None = None

    # -- naming ----------------------------------------------------------------
    @property
    def raw(self) -> bool:
        return self.name == "raw"

    @property
    def lossless(self) -> bool:
        return self.name != "jpeg"

    @property
    def spec(self) -> str:
        """``"jpeg:90"``, ``"zstd:3"``, ``"raw"``: what ``--codec`` takes."""
        return self.name if self.param is None else f"{self.name}:{self.param}"

    def __str__(self) -> str:
        return self.spec

    def to_json(self) -> dict[str, Any]:
        """The schema entry's ``codec`` object, e.g. ``{"name": "jpeg", "quality": 90}``."""
        if self.param is None:
            return {"name": self.name}
        return {"name": self.name, _PARAMS[self.name][0]: self.param}

    # -- fields ------------------------------------------------------------------
    def check(self, dtype: Any, shape: tuple[int, ...], where: str = "field") -> None:
        """Raise :class:`SchemaError` when this codec cannot store ``dtype`` x ``shape``."""
        dt = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        if self.name in ("raw", "zstd"):
            return
        if self.name == "jpeg":
            ok_dtype = dt == np.uint8
            ok_shape = len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3))
            what = "uint8 images of shape (H, W), (H, W, 1) or (H, W, 3)"
        else:  # png
            ok_dtype = dt in (np.dtype(np.uint8), np.dtype("<u2"))
            ok_shape = len(shape) == 2 or (len(shape) == 3 and shape[2] in (1, 3, 4))
            what = "uint8 or uint16 images of shape (H, W) or (H, W, 1|3|4)"
        if not (ok_dtype and ok_shape):
            raise SchemaError(
                f"{where}: codec {self.spec} stores {what}; the field is {dt.str} {list(shape)}. "
                "Use zstd (any array, lossless) or raw for this field"
            )
        if not all(1 <= d <= _JPEG_MAX_SIDE for d in shape[:2]):
            raise SchemaError(
                f"{where}: codec {self.spec} needs height and width from 1 to {_JPEG_MAX_SIDE}, "
                f"the field is {list(shape)}"
            )

    # -- bytes ---------------------------------------------------------------------
    def encode(self, arr: np.ndarray) -> bytes:
        """The stored bytes of one entry (``arr`` has the field's dtype and shape)."""
        arr = np.ascontiguousarray(arr)
        if self.name == "raw":
            return arr.tobytes()
        if self.name == "jpeg":
            return _jpeg_encode(arr, int(self.param or 90))
        if self.name == "png":
            return _png_encode(arr, int(self.param if self.param is not None else 1))
        return _zstd_compressor(int(self.param or 3)).compress(arr.tobytes())

    def decode_into(self, data: Any, out: np.ndarray) -> None:
        """Decode one stored entry into ``out`` (the field's dtype and shape).

        Raises :class:`EntryDecodeError` with the reason when ``data`` is not a
        valid entry of this field (the caller adds index, slot and key).
        """
        if self.name == "raw":
            src = np.frombuffer(data, np.uint8)
            if src.nbytes != out.nbytes:
                raise EntryDecodeError(f"raw entry of {src.nbytes} bytes, expected {out.nbytes}")
            _fill(out, src)
            return
        if len(data) == 0:
            raise EntryDecodeError(f"empty {self.name} entry")
        if self.name == "jpeg":
            _jpeg_decode(data, out)
        elif self.name == "png":
            _png_decode(data, out)
        else:
            _zstd_decode(data, out)

    def decode(self, data: Any, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        """Decode one entry into a new array."""
        out = np.empty(shape, dtype)
        self.decode_into(data, out)
        return out


RAW = Codec("raw")


def _fill(out: np.ndarray, src: np.ndarray) -> None:
    """Copy the entry bytes ``src`` (uint8, exactly ``out.nbytes``) into ``out``,
    also a strided view (whose ``reshape`` would be a copy, not ``out``)."""
    if out.flags.c_contiguous:
        out.reshape(-1).view(np.uint8)[:] = src
    else:
        out[...] = src.view(out.dtype).reshape(out.shape)


def parse_codec(spec: Any, where: str = "codec") -> Codec:
    """``"jpeg:90"`` / ``"jpeg"`` / ``"zstd:5"`` / ``"raw"`` / a :class:`Codec` -> :class:`Codec`.

    Raises :class:`SchemaError` naming the valid choices.
    """
    if isinstance(spec, Codec):
        return spec
    if spec is None:
        return RAW
    if not isinstance(spec, str):
        raise SchemaError(f"{where}: expected a codec such as 'jpeg:90', found {spec!r}")
    name, sep, param = spec.strip().partition(":")
    name = name.strip().lower()
    if name not in CODEC_NAMES:
        raise SchemaError(f"{where}: unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    if name == "raw":
        if sep:
            raise SchemaError(f"{where}: codec raw takes no parameter, found {spec!r}")
        return RAW
    key, default, lo, hi = _PARAMS[name]
    if not sep:
        return Codec(name, default)
    try:
        value = int(param)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise SchemaError(f"{where}: {name} {key} must be an integer from {lo} to {hi}, found {param!r}")
    return Codec(name, value)


def parse_codec_specs(specs: Any) -> dict[str, Codec]:
    """``["image=jpeg:90", ...]`` or ``{"image": "jpeg:90"}`` -> ``{field: Codec}``."""
    if specs is None:
        return {}
    if isinstance(specs, dict):
        items = list(specs.items())
    else:
        items = []
        for s in [specs] if isinstance(specs, str) else list(specs):
            field, sep, codec = str(s).partition("=")
            if not sep or not field.strip():
                raise SchemaError(f"--codec expects FIELD=CODEC[:PARAM] such as image=jpeg:90, found {s!r}")
            items.append((field.strip(), codec))
    out: dict[str, Codec] = {}
    for field, codec in items:
        if field in out:
            raise SchemaError(f"--codec names field {field!r} twice")
        out[field] = parse_codec(codec, where=f"field {field!r}")
    return out


def codec_from_json(path: str, raw: Any, field: str) -> Codec:
    """Parse a manifest's ``schema[i].codec`` (untrusted) or raise :class:`FormatError`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise FormatError(f"{path}: field {field!r} codec must be an object with a 'name', found {raw!r}")
    name = raw["name"]
    if name not in CODEC_NAMES:
        raise FormatError(
            f"{path}: field {field!r} uses codec {name!r}, which this mmstore does not know "
            f"(it knows {', '.join(CODEC_NAMES)}); upgrade mmstore to read this store"
        )
    if name == "raw":
        return RAW
    key, _, lo, hi = _PARAMS[name]
    val = raw.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or not lo <= val <= hi:
        raise FormatError(f"{path}: field {field!r} codec {name} needs '{key}' from {lo} to {hi}, found {val!r}")
    return Codec(name, val)


def library_versions(codecs: Any) -> dict[str, str]:
    """The encoder library and version of each non-raw codec, for the provenance."""
    out: dict[str, str] = {}
    for c in codecs:
        c = parse_codec(c)
        if c.name == "jpeg":
            import simplejpeg

            out["jpeg"] = f"simplejpeg {simplejpeg.__version__}"
        elif c.name == "png":
            import cv2

            out["png"] = f"opencv {cv2.__version__}"
        elif c.name == "zstd":
            import zstandard

            out["zstd"] = f"zstandard {zstandard.__version__} (libzstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})"
    return out


# An entry is exactly one encoded object: bytes after its end are refused (the
# offsets index or the data file is damaged), found without decoding and
# without a scan of the entry: a PNG's IEND chunk from its chunk lengths, a
# JPEG's end-of-image marker as its last two bytes (a scan for the first
# FF D9 cost 16 us per 15 KB entry, 5 % of its decode; an entry that is two
# whole JPEGs back to back passes this check and decodes to the first one;
# verify's checksums catch it), zstd's frame from the library.
_JPEG_EOI = b"\xff\xd9"


def _ends_wrong(what: str, end: str, data: Any, at: int | None) -> str:
    found = "" if at is None else ("; found no end" if at < 0 else f"; found its end at byte {at:,}")
    return (f"{what} entry of {len(data):,} bytes must end with {end}{found}: "
            "truncated, or trailing bytes after the image (a damaged offsets index or data file)")


def _png_end(data: Any) -> int:
    """Byte position just past the IEND chunk, from the chunk lengths, or -1."""
    n, i = len(data), 8
    mv = memoryview(data).cast("B") if not isinstance(data, bytes) else data
    while i + 8 <= n:
        length = int.from_bytes(mv[i : i + 4], "big")
        kind = bytes(mv[i + 4 : i + 8])
        i += 12 + length
        if kind == b"IEND":
            return i if i <= n else -1
    return -1


# -- jpeg (simplejpeg: libjpeg-turbo; releases the GIL; decodes into a buffer) ---------


def _jpeg_encode(arr: np.ndarray, quality: int) -> bytes:
    import simplejpeg

    if arr.ndim == 2:
        arr = arr[:, :, None]
    gray = arr.shape[2] == 1
    return bytes(
        simplejpeg.encode_jpeg(
            arr, quality=quality, colorspace="GRAY" if gray else "RGB",
            colorsubsampling="Gray" if gray else "420", fastdct=False,
        )
    )


def _jpeg_decode(data: Any, out: np.ndarray) -> None:
    import simplejpeg

    gray = out.ndim == 2 or out.shape[2] == 1
    if bytes(data[-2:]) != _JPEG_EOI:
        raise EntryDecodeError(_ends_wrong("JPEG", "its end-of-image marker FF D9", data, None))
    try:
        h, w, _, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError as exc:
        raise EntryDecodeError(f"not a JPEG ({exc})") from None
    if (h, w) != out.shape[:2]:
        raise EntryDecodeError(f"JPEG of {h}x{w} pixels, the field is {out.shape[0]}x{out.shape[1]}")
    target = out if out.flags.c_contiguous else np.empty(out.shape, np.uint8)
    try:
        res = simplejpeg.decode_jpeg(
            data, colorspace="GRAY" if gray else "RGB", fastdct=False, fastupsample=False,
            buffer=target, strict=True,
        )
    except (ValueError, RuntimeError) as exc:
        raise EntryDecodeError(f"corrupt JPEG ({exc})") from None
    if res.shape[:2] != out.shape[:2] or res.size != out.size:
        raise EntryDecodeError(f"JPEG decoded to {list(res.shape)}, the field is {list(out.shape)}")
    if res.ctypes.data != target.ctypes.data:  # the library did not use the buffer
        target.reshape(res.shape)[...] = res
    if target is not out:
        out[...] = target


# -- png (OpenCV: releases the GIL; stored in the standard RGB(A) channel order) -------


def _png_encode(arr: np.ndarray, level: int) -> bytes:
    import cv2

    img = arr[:, :, ::-1] if arr.ndim == 3 and arr.shape[2] in (3, 4) else arr
    if arr.ndim == 3 and arr.shape[2] == 4:
        img = arr[:, :, [2, 1, 0, 3]]
    ok, buf = cv2.imencode(".png", np.ascontiguousarray(img), [cv2.IMWRITE_PNG_COMPRESSION, level])
    if not ok:
        raise SchemaError(f"OpenCV could not encode a {arr.dtype} {list(arr.shape)} array as PNG")
    return buf.tobytes()


def _png_decode(data: Any, out: np.ndarray) -> None:
    import cv2

    end = _png_end(data)
    if end != len(data):
        raise EntryDecodeError(_ends_wrong("PNG", "its IEND chunk", data, end))
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    except cv2.error as exc:
        raise EntryDecodeError(f"corrupt PNG ({str(exc).strip()[:200]})") from None
    if img is None:
        raise EntryDecodeError("not a decodable PNG")
    if img.dtype != out.dtype:
        raise EntryDecodeError(f"PNG of {img.dtype} samples, the field is {out.dtype}")
    if img.ndim == 3 and img.shape[2] == 3:
        img = img[:, :, ::-1]
    elif img.ndim == 3 and img.shape[2] == 4:
        img = img[:, :, [2, 1, 0, 3]]
    if img.size != out.size or img.shape[:2] != out.shape[:2]:
        raise EntryDecodeError(f"PNG decoded to {list(img.shape)}, the field is {list(out.shape)}")
    out[...] = img.reshape(out.shape)


# -- zstd (python-zstandard: releases the GIL; one frame with its content size) --------

_ZSTD = threading.local()


def _zstd_compressor(level: int) -> Any:
    import zstandard

    key = f"c{level}"
    comp = getattr(_ZSTD, key, None)
    if comp is None:  # compressors are not thread-safe: one per thread and level
        comp = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        setattr(_ZSTD, key, comp)
    return comp


def _zstd_decode(data: Any, out: np.ndarray) -> None:
    import zstandard

    dec = getattr(_ZSTD, "d", None)
    if dec is None:
        dec = _ZSTD.d = zstandard.ZstdDecompressor()
    try:
        size = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise EntryDecodeError(f"not a zstd frame ({exc})") from None
    if size != out.nbytes:
        raise EntryDecodeError(f"zstd frame of {size} bytes, the field's entry is {out.nbytes}")
    try:
        raw = dec.decompress(data, max_output_size=out.nbytes, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise EntryDecodeError(f"corrupt zstd frame ({exc})") from None
    if len(raw) != out.nbytes:
        raise EntryDecodeError(f"zstd frame decoded to {len(raw)} bytes, expected {out.nbytes}")
    _fill(out, np.frombuffer(raw, np.uint8))
