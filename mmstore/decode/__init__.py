"""Decode an encoded image once, to a fixed shape or at its own aspect, pixel-exactly.

This module turns the bytes of one image file (or an already decoded array)
into one ``uint8`` record: of a fixed shape, or, with ``resize="max-side"``
/ ``"short-side"``, of its image's own aspect (*Aspect kept*).  It is pure (no global state that
changes results), torch-free, and imports OpenCV lazily: ``cv2`` is imported
inside the functions that need it, never at ``import mmstore`` time.  Worker
processes of the ingest pipeline call :func:`read_bytes` and
:func:`decode_image` once per file.

Every choice that can change an output byte is listed below; the tests rebuild
each record with plain ``cv2`` calls following these rules and compare bytes.
Records are byte-identical for a given OpenCV build (same input, same spec,
any worker count); another OpenCV or libjpeg-turbo version may round
differently, so provenance should record ``cv2.__version__``.

The steps, in order
-------------------
An encoded file (:func:`decode_image`) becomes a record in these steps; each
is specified in the section named after it.

1. The format is sniffed from the content; width and height are read from
   the header and checked against ``max_pixels`` (*Content, not extension*;
   *Limits and corrupt input*).
2. OpenCV decodes it to ``S``: a JPEG directly to RGB (or BGR, or gray) with
   its EXIF orientation applied; every other format unchanged, as stored
   (*Decoding*).
3. 16-bit samples become 8-bit: ``v >> 8``.
4. An alpha channel is composited over black or white, or dropped
   (``DecodeSpec.alpha``).
5. The EXIF orientation of the other formats (the EXIF block OpenCV
   returns: PNG, WebP; TIFF's is applied by its decoder in step 2) is
   applied, at source resolution.
6. ``channels=1`` from a colour source: converted to gray, at source
   resolution (a JPEG was decoded gray in step 2; *Channels and order*).
7. The geometry is planned on the oriented ``h x w`` source: the region cut
   (``box``), the size it is resampled to and where it lands (``dst``)
   (*Geometry*).
8. The region is resized once, ``INTER_AREA`` when no axis grows, else
   ``INTER_LINEAR`` (``INTER_CUBIC`` with ``interp_up="cubic"``); no resize
   when it already has its output size.
9. ``resize="pad"``: the result is bordered with ``pad_value`` to the target
   size.
10. ``channels=3`` from a gray source: the gray output is replicated to
    three channels.
11. Colour order: a BGR output of a non-JPEG decoder is swapped to RGB
    (unless ``bgr=True``), at output size.
12. Layout: ``(H, W, C)`` or a C-contiguous ``(C, H, W)``.

An array given to :func:`fit_array` (arrays ingested with a target size:
``.npy``/``.npz`` files, datasets, Ray rows of pixels) takes steps 3 (or, for a float array, the float rule
under *Decoding*), 4 and 6 to 12: it has no EXIF orientation and is read as
RGB. With ``fast_decode=True`` a JPEG may take another path (*Fast JPEG
decode*).

Content, not extension
----------------------
The format is decided by :func:`sniff_image` from the magic bytes; a PNG
named ``.jpg`` decodes as a PNG.  Data that matches no signature is
``not-an-image``.  HEIC and PSD are recognised but reported ``unsupported``
(OpenCV cannot decode them).  HDR, PFM and EXR are floating-point formats;
there is no tone-mapping policy, so they are ``unsupported`` too.

Decoding (how the source image ``S`` is obtained)
-------------------------------------------------
* **JPEG**: ``cv2.imdecode`` with ``IMREAD_COLOR_RGB`` (``IMREAD_COLOR_BGR``
  when ``bgr=True``) for 3 channels, ``IMREAD_GRAYSCALE`` for 1 channel and
  for single-component (grayscale) JPEGs.  OpenCV applies the EXIF
  orientation in these modes (tested for all 8 orientations against
  ``PIL.ImageOps.exif_transpose``).  ``channels=1`` output of a colour JPEG is
  therefore libjpeg's luma plane (the stored Y), not ``cvtColor`` of the
  decoded RGB; CMYK/YCCK JPEGs go through OpenCV's CMYK conversion (which
  may differ slightly from Pillow's).
* **Everything else** (PNG, WebP, TIFF, GIF, BMP, PNM, JPEG 2000, AVIF, Sun
  raster): ``cv2.imdecodeWithMetadata(..., IMREAD_UNCHANGED)``, so alpha and
  16-bit samples are visible and converted by the explicit rules below.
  ``IMREAD_UNCHANGED`` skips EXIF orientation, so mmstore reads the
  Orientation tag (0x0112) from the EXIF block OpenCV returns (PNG ``eXIf``,
  WebP ``EXIF``) and applies it with ``cv2.flip``/``cv2.transpose``/
  ``cv2.rotate`` at source resolution, before any resampling.  TIFF
  orientation is applied inside OpenCV's TIFF decoder even in unchanged mode.
  AVIF orientation (``irot``/``imir``) is not applied: OpenCV reports none.
* **Palette** images are expanded by the decoder (libpng, OpenCV's GIF
  decoder); a palette with a tRNS chunk arrives as 4 channels and follows the
  alpha rule.  A tRNS chunk on a gray or RGB (non-palette) PNG is ignored, as
  OpenCV ignores it.
* **16-bit** samples become 8-bit by dropping the low byte, exactly
  ``v >> 8`` (no rounding), matching what libpng's ``png_set_strip_16`` and
  OpenCV's own 8-bit conversion produce.  Done before everything else.
* **Alpha** (RGBA, gray + alpha, palette with transparency) follows
  ``DecodeSpec.alpha``, done after the 16-bit rule (8-bit colour, 8-bit
  alpha); the alpha channel is then dropped:

  - ``"black"`` (default): composited over black (premultiplied): every
    colour sample becomes ``round(c * a / 255)``, computed exactly in
    integers as ``t = c*a + 128; (t + (t >> 8)) >> 8`` (equal to
    ``(c*a + 127) // 255`` for all 8-bit ``c``, ``a``; ties cannot occur).
    So fully transparent pixels are always 0 whatever colour the encoder
    left under them (lossless WebP rewrites those colours, for example).
  - ``"white"``: composited over white, ``round((c*a + 255*(255 - a)) /
    255)``, computed as ``255 - black(255 - c, a)`` (exact: no ties).
    Fully transparent pixels are 255.
  - ``"drop"``: the colour samples as stored, alpha ignored: what Pillow's
    ``Image.convert("RGB")`` gives (and torchvision's ImageFolder loader).
    Fully transparent pixels keep whatever colour the encoder left there;
    except in a GIF: OpenCV's GIF decoder writes the background colour
    (logical screen) under transparent pixels where Pillow gives the
    transparent palette entry's colour (opaque pixels are equal).
* **First frame only**: animated GIF/WebP/PNG and multi-page TIFF give their
  first frame/page, which is what ``cv2.imdecode`` returns.
* Floating-point decoder output is ``unsupported``.
* **Float arrays** given to :func:`fit_array` (what ``ToTensor()`` makes)
  must hold values in ``[0, 1]``; they become ``uint8`` by
  :func:`float_to_uint8`: ``round(x * 255)`` with ties to even, computed in
  float64 (exact for float16/float32 input), done before everything else.
  Values outside ``[0, 1]`` (a normalised image: ``Normalize(mean, std)``
  gives negative values), NaN or infinity are refused (``unsupported``,
  with the dtype, minimum and maximum found).

Channels and order
------------------
* ``channels=1`` from a colour source: ``cv2.cvtColor(..., *2GRAY)`` on the
  8-bit, alpha-composited source at source resolution (JPEG: decoder luma, see
  above).  Gray sources stay 1-channel through the resize.
* ``channels=3`` from a gray source: the 1-channel result is resized and then
  replicated with ``cv2.COLOR_GRAY2RGB`` at output size.
* Colour order: JPEG is decoded directly in the requested order; other
  decoders give BGR, and the swap to RGB (``cv2.COLOR_BGR2RGB``) is done on the
  small output (resampling is per channel, so this is exact).
* ``layout="hwc"`` gives ``(H, W, C)``, also ``(H, W, 1)`` for one channel;
  ``layout="chw"`` gives a C-contiguous ``(C, H, W)``.

Geometry
--------
All arithmetic is in integers: ``S`` is ``h x w`` after orientation (and
after the gray conversion of ``channels=1``), the target is ``th x tw`` =
``DecodeSpec.size``, ``//`` is floor division.

* ``center-crop``: the largest centred region of the target's aspect ratio is
  cut from ``S`` and resized once (one resampling, not "resize shorter side
  then crop")::

      if w * th >= h * tw:          # source at least as wide as the target
          ch = h;  cw = min(w, max(1, (2*h*tw + th) // (2*th)))   # round(h*tw/th)
      else:
          cw = w;  ch = min(h, max(1, (2*w*th + tw) // (2*tw)))   # round(w*th/tw)
      x0 = (w - cw) // 2;  y0 = (h - ch) // 2
      out = cv2.resize(S[y0:y0+ch, x0:x0+cw], (tw, th), interpolation=...)

  ``box = (x0, y0, x0 + cw, y0 + ch)``, ``dst = (0, 0, tw, th)``.
* ``stretch``: ``cv2.resize(S, (tw, th))``; ``box = (0, 0, w, h)``.
* ``pad`` (letterbox): the whole source is resized to ``nh x nw`` and pasted
  centred into a ``pad_value`` canvas with ``cv2.copyMakeBorder``
  (``BORDER_CONSTANT``)::

      if w * th >= h * tw:  nw = tw;  nh = min(th, max(1, (2*h*tw + w) // (2*w)))
      else:                 nh = th;  nw = min(tw, max(1, (2*w*th + h) // (2*h)))
      ox = (tw - nw) // 2;  oy = (th - nh) // 2

  ``box = (0, 0, w, h)``, ``dst = (ox, oy, ox + nw, oy + nh)``.
* ``none``: ``S`` must already be ``th x tw``, else ``wrong-shape``.
* ``max-side`` / ``short-side``: the whole source, resized to its own
  aspect (*Aspect kept*); ``box = (0, 0, w, h)``, ``dst = (0, 0, nw, nh)``.
* ``buckets``: ``center-crop`` to the source's bucket (*Aspect buckets*).
* Interpolation: no resize call when the region already has the output size;
  ``INTER_AREA`` when neither axis grows (``out_h <= in_h`` and
  ``out_w <= in_w``); otherwise (either axis grows, including the mixed case
  where one axis shrinks) ``INTER_LINEAR`` or ``INTER_CUBIC`` per
  ``interp_up``.  In the mixed case the shrinking axis is interpolated, not
  area-averaged (it only happens with ``stretch`` to a very different aspect).
  The output size is ``th x tw``, or ``nh x nw`` for ``pad``, whose border
  is then added by ``cv2.copyMakeBorder(out, oy, th - oy - nh, ox,
  tw - ox - nw, BORDER_CONSTANT, value=pad_value)`` (on the gray image when
  the source is gray, before step 10).

Aspect kept
-----------
``resize="max-side"`` (``mmstore ingest --max-side N``) and ``"short-side"``
(``--short-side N``, LAION's convention) keep every image's own aspect: the
record is the whole oriented source ``S`` (``h x w``) resized once to ``nh x
nw``, with ``N = DecodeSpec.size[0]`` (``size`` is ``(N, N)``)::

    side = max(h, w)   # max-side;  min(h, w) for short-side
    if side == N or (side < N and not upscale):
        nh, nw = h, w                                    # kept as it is: no resize
    elif the side is h:                                  # h >= w (max-side), h <= w (short-side)
        nh = N;  nw = max(1, (2*w*N + h) // (2*h))       # round(w*N/h), half up
    else:
        nw = N;  nh = max(1, (2*h*N + w) // (2*w))       # round(h*N/w), half up

so the long (short) side is exactly ``N`` and the other is rounded half up,
at least 1 pixel: a 1 x 5000 image at ``max-side`` 256 gives 1 x 256, a 300
x 500 image gives 154 x 256 (153.6 rounds up). An image whose side is
already below ``N`` is not enlarged (a documented rule, not an error): it
is stored at its own size unless ``upscale=True`` (``--upscale``), which
enlarges it to ``N`` by the same formula. With ``upscale`` a record of more
than ``max_pixels`` pixels (when not 0) is refused (``too-large``), so a
1 x 5000 image at ``short-side`` 256 does not become 256 x 1,280,000
silently. The resize is step 8's: ``INTER_AREA`` when it shrinks,
``INTER_LINEAR`` (``INTER_CUBIC`` with ``interp_up="cubic"``) when it
enlarges; decoding, EXIF orientation, 16-bit, alpha, gray and colour order
are the steps above, unchanged. ``box = (0, 0, w, h)`` and ``dst = (0, 0, nw,
nh)``, so boxes and points map exactly as for a fixed shape (*Box
convention*). The layout is ``hwc``; the record's shape is ``(nh, nw, C)``
and the store keeps it in the field ``image_hw`` (the format's "Images of
their own shape"). ``fast_decode`` applies as for ``stretch`` (the whole
image is the region).

Aspect buckets
--------------
``resize="buckets"`` (``mmstore ingest --buckets 256x256,192x320,320x192``
or ``--buckets auto:N``) gives every record one of a few shapes, the
*buckets* ``(bh, bw)`` (``DecodeSpec.buckets``). The oriented ``h x w``
source goes to the bucket nearest its aspect in log-aspect: the one with
the smallest ``|log(w / h) - log(bw / bh)|``, which is also the bucket whose
crop cuts the smallest share of the picture (``1 - exp(-distance)``, before
rounding). It is computed exactly, in integers::

    p = w * bh;  q = h * bw
    distance = max(p, q) / min(p, q)     # compared as fractions: n1 * d2 < n2 * d1

A tie (the source's aspect exactly halfway, in log-aspect, between two
buckets) goes to the wider bucket (the larger ``bw / bh``). The record is
then exactly the ``center-crop`` of the source to that bucket (*Geometry*,
with ``th x tw = bh x bw``): the largest centred region of the bucket's
aspect, its size rounded half up, resized once, which is the least crop
that makes the picture cover the bucket. ``box`` is that region, ``dst =
(0, 0, bw, bh)``, ``orig_size`` the source's size, so boxes and points map
exactly as at a fixed size. A source smaller than its bucket is enlarged
(``INTER_LINEAR``, or ``INTER_CUBIC`` with ``interp_up="cubic"``), never
padded. An extreme aspect goes to the most extreme bucket and is cropped
like any other: a 1 x 5000 strip with the buckets above goes to 192 x 320
and keeps its centre 1 x 2 pixels (``cw = round(1 * 320 / 192) = 2``, ``x0
= 2499``), enlarged to 192 x 320; ``box`` says so, and ``inspect`` shows
the share each bucket's records lost. Decoding, EXIF orientation, 16-bit,
alpha, gray and colour order are the steps above, unchanged; ``fast_decode``
applies as for ``center-crop``. The layout is ``hwc``; the record's shape is
``(bh, bw, C)``, kept in ``image_hw``; the store lists the buckets in its
schema (the format's "Aspect buckets").

The bucket list: two positive ints per bucket, no bucket twice, no two
buckets of one aspect (an image would always go to the first), at most
1024 buckets, none larger than a record of its own shape may be (2 GiB);
stored from the tallest to the widest. ``auto:N`` (``auto`` is
``auto:256``) chooses them from the data, before anything is written:

1. A ladder of 17 candidate shapes, one per aspect ``r = 2 ** (k / 4)``,
   ``k = -8..8`` (1:4 to 4:1 in quarter-octave steps), each of about
   ``N * N`` pixels: ``w = N * sqrt(r)`` and ``h = N / sqrt(r)``, each
   rounded half up to a multiple of ``m`` (64 when ``N >= 512``, like
   SDXL's shapes; else 8), at least ``m``; a rung that rounds to the aspect
   of an earlier one is left out.
2. A first pass reads every input's oriented size from its header (no
   decode: the first 64 KiB of a file, the whole file only when its header
   is longer; a JPEG's, PNG's, WebP's or TIFF's EXIF orientation applied;
   the shape of an array or dataset item), over every input whatever the
   shard, so all parts choose the same shapes. It costs one open and one
   small read per file input (on a cold disk, a seek each) and no decode;
   a dataset's items are loaded once more.
3. Each size votes for its nearest ladder shape (the rule above). The
   shapes with at least 1% of the votes are kept, at most 9, the most voted
   first (a tie: the shape nearer to square, then the wider); none with 1%:
   the most voted. An image whose shape was not kept goes, like every
   image, to the nearest kept bucket.

Box convention
--------------
``Decoded.box = (x0, y0, x1, y1)`` are integer pixel *edges* in the oriented,
full-resolution source (``x1``/``y1`` exclusive); ``Decoded.dst`` are the edges
of the output rectangle that box was resampled into (the whole record except
for ``pad``).  OpenCV resamples with pixel centres at ``i + 0.5``, so a source
point ``(x, y)`` (continuous, edge coordinates) lands at::

    u = dst_x0 + (x - x0) * (dst_x1 - dst_x0) / (x1 - x0)
    v = dst_y0 + (y - y0) * (dst_y1 - dst_y0) / (y1 - y0)

and the inverse maps a record point back.  ``orig_size = (h, w)`` is the
source size after EXIF orientation.

Fast JPEG decode (``fast_decode=True``)
---------------------------------------
libjpeg can decode at 1/2, 1/4 or 1/8 scale in the DCT domain
(``IMREAD_REDUCED_COLOR_k`` / ``IMREAD_REDUCED_GRAYSCALE_k``), which skips most
of the IDCT and colour-conversion work.  It applies with a ``resize`` other
than ``none`` when the header gave the size: the geometry is planned on the
full-resolution oriented size (width and height swapped for EXIF
orientations 5 to 8), and mmstore uses the largest ``k`` in (8, 4, 2) for
which the source region (crop box, or whole image for ``pad`` /
``stretch``) is still at least ``k`` times the output region on both axes;
otherwise it takes the exact path.  A ``w x h`` JPEG decodes to
``ceil(w/k) x ceil(h/k)`` (``rw x rh``) with EXIF orientation applied (both
checked; if the decoder returns another shape the exact path is used).  The
crop box is mapped to reduced pixels by rounding half up::

    rx0 = (2*x0 + k) // (2*k);   ry0 = (2*y0 + k) // (2*k)
    rx1 = rw if x1 == w else min(rw, max(rx0 + 1, (2*x1 + k) // (2*k)))
    ry1 = rh if y1 == h else min(rh, max(ry0 + 1, (2*y1 + k) // (2*k)))

that region is resized with ``INTER_AREA`` (then steps 9 to 12), and
``box`` reports the region actually used in full-resolution pixels
(``(rx0*k, ry0*k, min(rx1*k, w), min(ry1*k, h))``), so it can differ from the
exact path's box by less than ``k`` pixels.  Pixels are *not* identical to
the exact path; it is off by default.

Limits and corrupt input
------------------------
Every problem raises :class:`DecodeError` whose ``reason`` starts with a stable
category word: ``empty``, ``not-an-image``, ``truncated``, ``corrupt``,
``too-large``, ``unreadable``, ``wrong-shape``, ``unsupported``.

* **Pixel limit** (``max_pixels``; the default 178,956,970 is the size at
  which Pillow raises ``DecompressionBombError``; 0 disables): width and
  height are read from the header (JPEG SOF, PNG IHDR, GIF screen, BMP DIB,
  WebP VP8/VP8L/VP8X, TIFF IFD0, PNM, JPEG 2000 ``ihdr``/SIZ, Sun raster,
  AVIF ``ispe``) and checked *before* decoding, so a 40000x40000 header is
  rejected without allocating.  For a format whose header cannot be read the
  check runs after decoding.  OpenCV has its own limit, read once from the
  ``OPENCV_IO_MAX_IMAGE_PIXELS`` environment variable (default 2**30) when
  OpenCV first needs it; set it before the process imports ``cv2`` to change
  it.
* **Truncated JPEG**: the data must contain an EOI marker (``FF D9``) after the
  first SOS segment.  Inside entropy-coded data ``FF`` is always followed by
  ``00`` or ``RSTn``, so an ``FF D9`` there *is* an EOI; the EXIF thumbnail's
  EOI lies before the SOS and does not count.  Data after the EOI (camera
  trailers, MPF secondary images) is allowed.
* **Corrupt JPEG scan data** (``strict_jpeg=True``): libjpeg does not fail on
  damaged entropy-coded data; it conceals it and prints one warning (only the
  first per image) with ``fprintf(stderr)``, invisible to OpenCV's API and to
  ``cv2.setLogLevel``.  mmstore therefore points file descriptor 2 at a
  private temporary file for the duration of the ``imdecode`` call and reads
  what libjpeg wrote.  A first line starting with ``Corrupt JPEG data`` (except
  ``bad ICC marker``), ``Premature end of JPEG file``, ``Invalid SOS
  parameters`` or ``Inconsistent progression`` makes it ``corrupt``; any
  other captured text is written back to the real stderr.  Limits, honestly:

  - damage that keeps the Huffman stream in sync (a flipped bit, a run of
    zero bytes) decodes to wrong pixels with no warning and is not detected;
  - only libjpeg's *first* warning is printed, so a benign first warning
    (e.g. an unknown JFIF revision) hides a later corruption warning;
  - a file whose only defect is padding before the EOI ("N extraneous bytes
    before marker 0xd9") decodes to correct pixels but is still rejected;
  - fd 2 is process-wide: the redirect is serialised by a lock, so threads
    in one process decode strict JPEGs one at a time (use processes, as the
    ingest does, or ``strict_jpeg=False``), and text that another thread
    writes to fd 2 during a decode is forwarded afterwards, slightly late
    (a libjpeg warning from unrelated code in another thread in that window
    would be misattributed).  With ``strict_jpeg=False`` nothing is
    redirected and libjpeg's warnings go to stderr as usual.
* **PNG**: OpenCV walks the chunks and libpng checks CRCs of critical chunks
  and the zlib stream; a truncated file, a CRC error or bad compressed data
  makes ``imdecode`` fail.  mmstore then walks the chunks itself to report
  ``truncated`` (chunk past the end, no IEND) or ``corrupt`` (CRC mismatch in
  a named chunk).  Ancillary-chunk CRC errors are ignored by libpng (the
  pixels are intact) and so accepted.
* Any other decoder failure is ``truncated`` when the data is shorter than
  the length the format declares (WebP RIFF size, BMP file size, AVIF box
  sizes, GIF trailer byte), ``unsupported`` when this OpenCV build has no
  codec for the format, and ``corrupt: <format> decoder failed`` otherwise.
  OpenCV and libpng print their own messages to stderr on such failures; set
  ``OPENCV_LOG_LEVEL=ERROR`` to quieten OpenCV's.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._os.stderr import imdecode_captured
from ..errors import DecodeError
from .pixels import _flatten_alpha, _gray, _orient, _plan, _render, _to_8bit
from .sniff import Header, diagnose_png, exif_orientation, jpeg_has_eoi, looks_truncated, probe, sniff_image
from .spec import DecodeSpec

__all__ = [
    "DecodeError",
    "DecodeSpec",
    "Decoded",
    "decode_image",
    "fit_array",
    "float_to_uint8",
    "read_bytes",
    "sniff_image",
]


@dataclass
class Decoded:
    """One decoded record and where it came from.

    Attributes
    ----------
    image : numpy.ndarray
        ``uint8`` array of ``spec.record_shape()`` (with ``resize="max-side"``
        / ``"short-side"``: ``(nh, nw, C)``, see *Aspect kept*), C-contiguous.
    orig_size : tuple of int
        ``(h, w)`` of the source after EXIF orientation.
    box : tuple of int
        ``(x0, y0, x1, y1)``: source region (pixel edges, end exclusive, in
        full-resolution oriented source pixels) that was resampled.
    dst : tuple of int
        ``(x0, y0, x1, y1)``: where ``box`` landed in the record; the whole
        record except with ``resize="pad"``.
    source_format : str or None
        Format from :func:`sniff_image`, or None for :func:`fit_array`.
    """

    image: np.ndarray
    orig_size: tuple[int, int]
    box: tuple[int, int, int, int]
    dst: tuple[int, int, int, int]
    source_format: str | None = None


# --------------------------------------------------------------------------
# reading files


def read_bytes(path: str | bytes | os.PathLike, *, max_bytes: int | None = None) -> np.ndarray:
    """Read a whole file into a ``uint8`` array (one copy, no decoding).

    ``cv2.imread`` is never used (it cannot open non-UTF-8 file names).  Like
    ``np.fromfile`` this is one ``read`` into a fresh array, but the file is
    opened ``O_NONBLOCK`` and checked to be a regular file first, so a FIFO or
    device in a data folder never blocks the ingest.

    Parameters
    ----------
    path : str, bytes or os.PathLike
        File to read; bytes paths may hold any non-UTF-8 name.
    max_bytes : int, optional
        Refuse (``too-large``) a file larger than this, before reading it.

    Returns
    -------
    numpy.ndarray
        1-D ``uint8`` array of the file's bytes (possibly empty).

    Raises
    ------
    DecodeError
        ``unreadable: [Errno N] ...`` for a missing file, broken symlink,
        symlink loop, directory, non-regular file or permission error;
        ``too-large: file of N bytes (limit M)`` above ``max_bytes``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        reason = f"unreadable: [Errno {e.errno}] {e.strerror}"
        try:
            if e.errno == errno.ENOENT and os.path.islink(path):
                reason += " (broken symlink)"
        except (OSError, ValueError):
            pass
        raise DecodeError(reason) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise DecodeError(f"unreadable: [Errno {errno.EISDIR}] {os.strerror(errno.EISDIR)}")
        if not stat.S_ISREG(st.st_mode):
            raise DecodeError("unreadable: not a regular file")
        size = st.st_size
        if max_bytes is not None and size > max_bytes:
            raise DecodeError(f"too-large: file of {size} bytes (limit {max_bytes})")
        buf = np.empty(size, np.uint8)
        mv = buf.data
        got = 0
        with io.FileIO(fd, "rb", closefd=False) as f:
            while got < size:
                n = f.readinto(mv[got:])
                if not n:
                    break
                got += n
            if got < size:  # the file shrank while we read it
                return buf[:got].copy()
            rest = f.read()  # or grew: take the rest too
        if rest:
            buf = np.concatenate([buf, np.frombuffer(rest, np.uint8)])
        return buf
    except OSError as e:
        raise DecodeError(f"unreadable: [Errno {e.errno}] {e.strerror}") from None
    finally:
        os.close(fd)


def _sci(n: int) -> str:
    m, e = f"{n:.1e}".split("e")
    return f"{m}e{int(e)}"


def _check_pixels(w: int, h: int, limit: int) -> None:
    if limit and w * h > limit:
        raise DecodeError(
            f"too-large: {w}x{h} = {_sci(w * h)} pixels > limit {limit} (DecodeSpec.max_pixels)"
        )


_CODEC_EXT = {"webp": ".webp", "jp2": ".jp2", "avif": ".avif", "tiff": ".tiff", "gif": ".gif"}
_codec_cache: dict[str, bool] = {}


def _codec_available(fmt: str) -> bool:
    """Whether this OpenCV build has a codec for an optional format (failure path only)."""
    ext = _CODEC_EXT.get(fmt)
    if ext is None:
        return True
    if fmt not in _codec_cache:
        import cv2

        try:
            ok, _ = cv2.imencode(ext, np.zeros((64, 64, 3), np.uint8))
        except cv2.error:
            ok = False
        _codec_cache[fmt] = bool(ok)
    return _codec_cache[fmt]


# --------------------------------------------------------------------------
# pixels (the conversions themselves are in pixels.py)


def _finish(
    img: np.ndarray, order: str, spec: DecodeSpec, cv2: Any, fmt: str | None, private: bool
) -> Decoded:
    """Shared tail: channel reduction, geometry, resize (img is 8-bit, no alpha)."""
    if spec.channels == 1 and img.ndim == 3:
        img = _gray(img, order, cv2)
        private = True
    h, w = img.shape[:2]
    box, out_hw, dst = _plan(h, w, spec)
    x0, y0, x1, y1 = box
    region = img if (x1 - x0, y1 - y0) == (w, h) else img[y0:y1, x0:x1]
    out = _render(region, order, out_hw, dst, spec, cv2, private and region is img)
    return Decoded(out, (h, w), box, dst, fmt)


# --------------------------------------------------------------------------
# public decode entry points


def _as_buffer(data: Any) -> tuple[memoryview, np.ndarray]:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8:
            raise TypeError(f"encoded data must be uint8, got {data.dtype}")
        buf = np.ascontiguousarray(data).reshape(-1)
        return buf.data, buf
    mv = memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv, np.frombuffer(mv, np.uint8)


def decode_image(data: bytes | bytearray | memoryview | np.ndarray, spec: DecodeSpec) -> Decoded:
    """Decode encoded image bytes into one fixed-shape record.

    Parameters
    ----------
    data : bytes-like or numpy.ndarray
        The whole encoded file (e.g. from :func:`read_bytes`); not copied.
    spec : DecodeSpec
        Target shape and policies.

    Returns
    -------
    Decoded
        ``image`` of ``spec.record_shape()`` plus ``orig_size``, ``box``,
        ``dst`` and ``source_format``.

    Raises
    ------
    DecodeError
        For empty, non-image, truncated, corrupt, too-large, wrong-shape or
        unsupported input (see the module docstring).
    """
    mv, buf = _as_buffer(data)
    if len(mv) == 0:
        raise DecodeError("empty: zero bytes")
    fmt = sniff_image(mv[:64])
    if fmt is None:
        raise DecodeError(f"not-an-image: unrecognised content starting {bytes(mv[:16])!r}")
    if fmt in ("heic", "psd"):
        raise DecodeError(f"unsupported: {fmt} (OpenCV cannot decode it)")
    if fmt in ("hdr", "pfm", "exr"):
        raise DecodeError(f"unsupported: {fmt} is floating-point (no tone-mapping policy)")
    hd = probe(mv, fmt)
    if hd.width is not None and hd.height is not None:
        if hd.width == 0 or hd.height == 0:
            raise DecodeError(f"corrupt: {fmt} header says {hd.width}x{hd.height}")
        _check_pixels(hd.width, hd.height, spec.max_pixels)

    import cv2

    if fmt == "jpeg":
        if not jpeg_has_eoi(mv, hd.sos_end):
            raise DecodeError("truncated: jpeg has no end-of-image marker after its scan data")
        return _decode_jpeg(buf, hd, spec, cv2)
    return _decode_other(mv, buf, fmt, hd, spec, cv2)


def _decode_other(mv: memoryview, buf: np.ndarray, fmt: str, hd: Header, spec: DecodeSpec, cv2: Any) -> Decoded:
    """Every format but JPEG: OpenCV decodes with metadata, then 8-bit, alpha,
    channels and EXIF orientation as the module docstring says."""
    try:
        if hasattr(cv2, "imdecodeWithMetadata"):
            img, mtypes, mdata = cv2.imdecodeWithMetadata(buf, cv2.IMREAD_UNCHANGED)
        else:  # pragma: no cover - OpenCV < 4.12
            img, mtypes, mdata = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED), (), ()
    except cv2.error as e:
        img, mtypes, mdata = None, (), ()
        err = str(e).strip().splitlines()[-1][:120] if str(e).strip() else "cv2.error"
        if not _codec_available(fmt):
            raise DecodeError(f"unsupported: no {fmt} codec in this OpenCV build") from None
        raise DecodeError(f"corrupt: {fmt} decoder error ({err})") from None
    if img is None or img.size == 0:
        if fmt == "png":
            raise DecodeError(diagnose_png(mv))
        if looks_truncated(mv, fmt):
            raise DecodeError(f"truncated: {fmt} data ends before its declared end")
        if not _codec_available(fmt):
            raise DecodeError(f"unsupported: no {fmt} codec in this OpenCV build")
        raise DecodeError(f"corrupt: {fmt} decoder failed")

    if hd.width is None or hd.height is None:
        _check_pixels(img.shape[1], img.shape[0], spec.max_pixels)
    img = _to_8bit(img)
    if img.ndim == 3:
        c = img.shape[2]
        if c in (2, 4):
            img = _flatten_alpha(img, spec.alpha)
        elif c == 1:
            img = img[..., 0]
        elif c != 3:
            raise DecodeError(f"unsupported: {c}-channel image")
    orientation = 1
    if fmt != "tiff":
        for t, m in zip(mtypes, mdata):
            if t == cv2.IMAGE_METADATA_EXIF:
                orientation = exif_orientation(np.asarray(m, np.uint8).reshape(-1).tobytes())
                break
    img = _orient(img, orientation, cv2)
    return _finish(img, "bgr", spec, cv2, fmt, private=True)


def _imdecode_jpeg(buf: np.ndarray, flags: int, spec: DecodeSpec, cv2: Any) -> np.ndarray:
    try:
        if spec.strict_jpeg:
            img, warning = imdecode_captured(cv2, buf, flags)
            if warning is not None:
                detail = warning.split(": ", 1)[1] if warning.startswith("Corrupt JPEG data: ") else warning
                raise DecodeError(f"corrupt: jpeg data ({detail})")
        else:
            img = cv2.imdecode(buf, flags)
    except cv2.error as e:
        msg = str(e).strip().splitlines()[-1][:120] if str(e).strip() else "cv2.error"
        raise DecodeError(f"corrupt: jpeg decoder error ({msg})") from None
    if img is None or img.size == 0:
        raise DecodeError("corrupt: jpeg decoder failed")
    return img


def _decode_jpeg(buf: np.ndarray, hd: Header, spec: DecodeSpec, cv2: Any) -> Decoded:
    gray = spec.channels == 1 or hd.ncomp == 1
    if gray:
        flags, order = cv2.IMREAD_GRAYSCALE, "gray"
    else:
        flags, order = (cv2.IMREAD_COLOR_BGR, "bgr") if spec.bgr else (cv2.IMREAD_COLOR_RGB, "rgb")

    if spec.fast_decode and spec.resize != "none" and hd.width is not None and hd.height is not None:
        w, h = hd.width, hd.height
        if hd.orientation >= 5:
            w, h = h, w
        box, out_hw, dst = _plan(h, w, spec)
        x0, y0, x1, y1 = box
        oh, ow = out_hw
        for k in (8, 4, 2):
            if x1 - x0 >= k * ow and y1 - y0 >= k * oh:
                break
        else:
            k = 1
        if k > 1:
            rflags = {
                (2, True): cv2.IMREAD_REDUCED_GRAYSCALE_2,
                (4, True): cv2.IMREAD_REDUCED_GRAYSCALE_4,
                (8, True): cv2.IMREAD_REDUCED_GRAYSCALE_8,
                (2, False): cv2.IMREAD_REDUCED_COLOR_2,
                (4, False): cv2.IMREAD_REDUCED_COLOR_4,
                (8, False): cv2.IMREAD_REDUCED_COLOR_8,
            }[(k, gray)]
            small = _imdecode_jpeg(buf, rflags, spec, cv2)
            rh, rw = -(-h // k), -(-w // k)
            if small.shape[:2] == (rh, rw):
                rx0, ry0 = (2 * x0 + k) // (2 * k), (2 * y0 + k) // (2 * k)
                rx1 = rw if x1 == w else min(rw, max(rx0 + 1, (2 * x1 + k) // (2 * k)))
                ry1 = rh if y1 == h else min(rh, max(ry0 + 1, (2 * y1 + k) // (2 * k)))
                region = small[ry0:ry1, rx0:rx1]
                out = _render(region, "gray" if gray else "bgr", out_hw, dst, spec, cv2, False)
                rbox = (rx0 * k, ry0 * k, min(rx1 * k, w), min(ry1 * k, h))
                return Decoded(out, (h, w), rbox, dst, "jpeg")
            # decoder disagreed with our reading of the header: exact path

    img = _imdecode_jpeg(buf, flags, spec, cv2)
    if hd.height is None:  # height from a DNL marker: check after decoding
        _check_pixels(img.shape[1], img.shape[0], spec.max_pixels)
    if img.ndim == 3 and img.shape[2] == 1:
        img = img[..., 0]
    return _finish(img, order, spec, cv2, "jpeg", private=True)


def fit_array(img: np.ndarray, spec: DecodeSpec) -> Decoded:
    """Fit an already decoded array into one record (same rules as decoding).

    Parameters
    ----------
    img : numpy.ndarray
        ``(H, W)`` or ``(H, W, C)`` with C in 1, 2 (gray + alpha), 3 (RGB) or
        4 (RGBA); ``uint8``, ``uint16`` (reduced by ``>> 8``), or float with
        values in ``[0, 1]`` (see :func:`float_to_uint8`).  Not modified and
        never aliased by the result.
    spec : DecodeSpec
        Target shape and policies (``fast_decode``, ``strict_jpeg`` and
        ``max_pixels`` do not apply).

    Returns
    -------
    Decoded
        With ``box`` in ``img`` pixels and ``source_format=None``.

    Raises
    ------
    DecodeError
        ``wrong-shape`` (policy ``none``, or an array that is not an image)
        or ``unsupported`` (dtype; float values outside ``[0, 1]``).
    """
    import cv2

    img = np.asarray(img)
    if img.ndim == 3 and img.shape[2] in (1, 2, 3, 4):
        pass
    elif img.ndim != 2:
        raise DecodeError(f"wrong-shape: expected (H, W) or (H, W, C) image array, found {img.shape}")
    if img.shape[0] == 0 or img.shape[1] == 0:
        raise DecodeError(f"empty: array of shape {img.shape}")
    private = False
    if img.dtype != np.uint8:
        img = float_to_uint8(img) if img.dtype.kind == "f" else _to_8bit(img)
        private = True
    if img.ndim == 3:
        c = img.shape[2]
        if c in (2, 4):
            img = _flatten_alpha(img, spec.alpha)
            private = True
        elif c == 1:
            img = img[..., 0]
    return _finish(img, "rgb", spec, cv2, None, private=private)


def float_to_uint8(img: np.ndarray) -> np.ndarray:
    """Float pixels with values in ``[0, 1]`` as ``uint8``, exactly.

    Each value ``x`` becomes ``round(x * 255)``, ties to even, computed in
    float64 (``numpy.rint(x.astype(float64) * 255)``): for float16 and
    float32 input the product is exact, so a ``ToTensor()`` image
    (``k / 255`` in float32) gives back ``k``.  The result is a new array of
    the same shape.

    Raises
    ------
    DecodeError
        ``unsupported``: a value outside ``[0, 1]``, NaN or infinity (a
        normalised image, a float image in 0..255); the message gives the
        dtype, minimum and maximum and what to pass instead.
    """
    img = np.asarray(img)
    if img.dtype.kind != "f":
        raise TypeError(f"float_to_uint8 needs a float array, got {img.dtype}")
    if img.size:
        lo, hi = img.min(), img.max()
        if not (lo >= 0 and hi <= 1):  # also False when there is a NaN
            raise DecodeError(_float_range_reason(img))
    return np.rint(np.asarray(img, np.float64, order="C") * 255).astype(np.uint8)


def _float_range_reason(img: np.ndarray) -> str:
    finite = np.isfinite(img)
    hint = "pass the image with values in [0, 1] (clip it if a transform overshot), or convert it to uint8 yourself"
    if finite.all():
        lo, hi = float(img.min()), float(img.max())
        found = f"min {lo:.6g}, max {hi:.6g}"
        if lo < 0:
            hint = ("negative values look normalised (Normalize(mean, std)): pass the image before normalising "
                    "(ToTensor() gives [0, 1]), or convert it to uint8 yourself")
        elif 2 < hi <= 255:
            hint = "values up to 255 look like 0..255 pixels: pass them as uint8, or divide by 255"
    else:
        vals = img[finite]
        found = f"{img.size - vals.size} NaN or infinite value(s)" + (
            f", finite min {float(vals.min()):.6g}, max {float(vals.max()):.6g}" if vals.size else "")
    return (f"unsupported: {img.dtype} pixels outside [0, 1] ({found}); a float image is stored as "
            f"uint8 round(x * 255) only from [0, 1]: {hint}")
