"""The pixel side of decoding (:mod:`mmstore.decode`, whose docstring gives the
rules): bit depth to uint8, alpha flattening, EXIF orientation, the
crop/resize/pad plan of a ``DecodeSpec`` and its rendering, gray output.
Private: ``decode`` is the public entry."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DecodeError
from .spec import DecodeSpec


def _to_8bit(img: np.ndarray) -> np.ndarray:
    if img.dtype == np.uint8:
        return img
    if img.dtype == np.uint16:
        return (img >> 8).astype(np.uint8)
    raise DecodeError(f"unsupported: {img.dtype} pixels (no conversion policy)")


def _premultiply(colour: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """round(c * a / 255), exactly, for uint8 ``colour`` and ``alpha`` (..., 1)."""
    t = colour * alpha.astype(np.uint16)  # uint16: at most 255 * 255
    t += 128
    t += t >> 8
    t >>= 8
    return t.astype(np.uint8)


def _flatten_alpha(img: np.ndarray, mode: str) -> np.ndarray:
    """Drop the last (alpha) channel by ``DecodeSpec.alpha`` (module docstring)."""
    colour, a = img[..., :-1], img[..., -1:]
    if mode == "black":
        out = _premultiply(colour, a)
    elif mode == "white":
        out = 255 - _premultiply(255 - colour, a)
    else:  # "drop"
        out = np.ascontiguousarray(colour)
    return out[..., 0] if out.shape[-1] == 1 else out


def _orient(img: np.ndarray, o: int, cv2: Any) -> np.ndarray:
    if o == 2:
        return cv2.flip(img, 1)
    if o == 3:
        return cv2.flip(img, -1)
    if o == 4:
        return cv2.flip(img, 0)
    if o == 5:
        return cv2.transpose(img)
    if o == 6:
        return cv2.rotate(img, cv2.ROTATE_90_CLOCKWISE)
    if o == 7:
        return cv2.flip(cv2.transpose(img), -1)
    if o == 8:
        return cv2.rotate(img, cv2.ROTATE_90_COUNTERCLOCKWISE)
    return img


def _plan(h: int, w: int, spec: DecodeSpec):
    """Return (box, out_hw, dst) for an ``h x w`` source; see the module docstring."""
    th, tw = spec.size
    policy = spec.resize
    if policy in ("max-side", "short-side"):
        nh, nw = aspect_size(h, w, th, policy == "short-side", spec.upscale)
        if spec.max_pixels and nh * nw > spec.max_pixels:
            raise DecodeError(f"too-large: a {w}x{h} image enlarged to {nw}x{nh} ({nh * nw:,} pixels) under "
                              f"resize={policy!r} would pass max_pixels ({spec.max_pixels:,})")
        return (0, 0, w, h), (nh, nw), (0, 0, nw, nh)
    if policy == "none":
        if (h, w) != (th, tw):
            raise DecodeError(f"wrong-shape: expected WxH {tw}x{th}, found {w}x{h}")
        return (0, 0, w, h), (th, tw), (0, 0, tw, th)
    if policy == "stretch":
        return (0, 0, w, h), (th, tw), (0, 0, tw, th)
    if policy == "buckets":  # the centre crop to the image's bucket
        shapes = spec.bucket_shapes
        if shapes is None:
            raise ValueError("buckets='auto' has not chosen its shapes yet (the ingest does, from the data)")
        from .buckets import nearest_bucket

        th, tw = shapes[nearest_bucket(h, w, shapes)]
        policy = "center-crop"
    wide = w * th >= h * tw
    if policy == "center-crop":
        if wide:
            ch, cw = h, min(w, max(1, (2 * h * tw + th) // (2 * th)))
        else:
            cw, ch = w, min(h, max(1, (2 * w * th + tw) // (2 * tw)))
        x0, y0 = (w - cw) // 2, (h - ch) // 2
        return (x0, y0, x0 + cw, y0 + ch), (th, tw), (0, 0, tw, th)
    # pad
    if wide:
        nw, nh = tw, min(th, max(1, (2 * h * tw + w) // (2 * w)))
    else:
        nh, nw = th, min(tw, max(1, (2 * w * th + h) // (2 * h)))
    ox, oy = (tw - nw) // 2, (th - nh) // 2
    return (0, 0, w, h), (nh, nw), (ox, oy, ox + nw, oy + nh)


def aspect_size(h: int, w: int, n: int, short: bool = False, upscale: bool = False) -> tuple[int, int]:
    """The ``(h, w)`` an ``h x w`` image keeps under ``resize="max-side"``
    (``short=False``: its long side becomes ``n``) or ``"short-side"`` (its
    short side becomes ``n``); the other side rounded half up, at least 1.
    Without ``upscale`` an image whose side is already at most ``n`` keeps
    its size. See the module docstring of ``mmstore.decode``, *Aspect kept*."""
    side = min(h, w) if short else max(h, w)
    if side == n or (side < n and not upscale):
        return h, w
    if h >= w if not short else h <= w:  # h is the side that becomes n
        return n, max(1, (2 * w * n + h) // (2 * h))
    return max(1, (2 * h * n + w) // (2 * w)), n


def _render(
    region: np.ndarray,
    order: str,
    out_hw: tuple[int, int],
    dst: tuple[int, int, int, int],
    spec: DecodeSpec,
    cv2: Any,
    private: bool,
) -> np.ndarray:
    """Resize ``region`` (HxW or HxWx3 uint8, in ``order``) into the record.

    ``private`` says ``region`` belongs to us (may be returned without a copy
    if it is a whole, contiguous array).
    """
    oh, ow = out_hw
    rh, rw = region.shape[:2]
    if (rh, rw) != (oh, ow):
        if oh <= rh and ow <= rw:
            interp = cv2.INTER_AREA
        else:
            interp = cv2.INTER_CUBIC if spec.interp_up == "cubic" else cv2.INTER_LINEAR
        img = cv2.resize(region, (ow, oh), interpolation=interp)
        fresh = True
    else:
        img = region
        fresh = False
    th, tw = spec.size
    if (oh, ow) != (th, tw) and spec.resize == "pad":
        x0, y0, x1, y1 = dst
        v = spec.pad_value
        img = cv2.copyMakeBorder(img, y0, th - y1, x0, tw - x1, cv2.BORDER_CONSTANT, value=(v, v, v, v))
        fresh = True
    swap = False
    if spec.channels == 3:
        if img.ndim == 2:
            img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
            fresh = True
        elif order != ("bgr" if spec.bgr else "rgb"):
            swap = True
    if spec.layout == "chw" and spec.channels == 3:
        # one copy does the (optional) channel swap and the transpose
        return np.array((img[..., ::-1] if swap else img).transpose(2, 0, 1), order="C")
    if swap:
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
        fresh = True
    if spec.layout == "chw":
        out = img[None]
    else:
        out = img[..., None] if img.ndim == 2 else img
    if not fresh:
        # a view of the source: keep it only if the source is ours and whole
        out = np.ascontiguousarray(out) if private else np.array(out, order="C")
    return out


def _gray(img: np.ndarray, order: str, cv2: Any) -> np.ndarray:
    if img.ndim == 2:
        return img
    return cv2.cvtColor(img, cv2.COLOR_BGR2GRAY if order == "bgr" else cv2.COLOR_RGB2GRAY)
