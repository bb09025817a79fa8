"""``DecodeSpec``: how every image becomes one record, of a fixed shape or of
its own aspect (the
policy the decoding in :mod:`mmstore.decode` and its pixel side apply; the
arithmetic is written out in that module's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np

__all__ = ["DecodeSpec"]


_RESIZE = ("center-crop", "stretch", "pad", "none", "max-side", "short-side", "buckets")
ASPECT_KEPT = ("max-side", "short-side")  # policies whose records keep each image's own aspect
_LAYOUT = ("hwc", "chw")
_INTERP = ("linear", "cubic")
_ALPHA = ("black", "white", "drop")
# the alpha rule of a spec whose dict has no "alpha": that of every store written before the option existed
_ALPHA_UNSTATED = "black"


@dataclass(frozen=True)
class DecodeSpec:
    """How every image becomes one record: of one fixed shape, or of its own
    aspect (``resize="max-side"`` / ``"short-side"``).

    Parameters
    ----------
    size : tuple of int
        Target ``(H, W)``.  With ``resize="none"`` it is the exact shape every
        source must already have.  With ``"max-side"`` / ``"short-side"`` it
        is ``(N, N)``: the long (short) side of every record is ``N``.
    resize : {"center-crop", "stretch", "pad", "none", "max-side", "short-side", "buckets"}
        Geometry policy; see the module docstring for the exact arithmetic.
    channels : {1, 3}
        Output channels.
    layout : {"hwc", "chw"}
        Output layout; ``hwc`` with one channel is ``(H, W, 1)``.
    bgr : bool
        Output BGR order instead of RGB (ignored with ``channels=1``).
    interp_up : {"linear", "cubic"}
        Kernel used when an axis is enlarged; shrinking uses ``INTER_AREA``.
    pad_value : int
        Fill value (0-255, all channels) of the ``pad`` letterbox.
    fast_decode : bool
        Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is small
        enough (approximate; see module docstring).
    max_pixels : int
        Reject sources with more than this many pixels; 0 means no limit.
    strict_jpeg : bool
        Reject JPEGs whose scan data libjpeg reports as corrupt.
    alpha : {"black", "white", "drop"}
        What a transparent source becomes: composited over black (default)
        or white, or its alpha ignored (Pillow's ``convert("RGB")``); see
        the module docstring.
    upscale : bool
        ``"max-side"`` / ``"short-side"`` only: enlarge an image whose side is
        below ``N`` to ``N`` too (default: it keeps its own size).
    buckets : tuple of (int, int), or AutoBuckets
        ``resize="buckets"`` only: the bucket shapes ``((h, w), ...)``
        (sorted from the tallest to the widest), or an
        :class:`~mmstore.decode.buckets.AutoBuckets` that the ingest replaces
        by the shapes it chooses from the data. ``size`` is then the largest
        height and the largest width of the buckets (``(N, N)`` for
        ``auto:N``); see "Aspect buckets" in :mod:`mmstore.decode`.

    The field defaults are the defaults of the ingest's decode options
    (``mmstore.ingest.options.SPEC_DEFAULTS``, the CLI's flags) too.
    """

    size: tuple[int, int]
    resize: str = "center-crop"
    channels: int = 3
    layout: str = "hwc"
    bgr: bool = False
    interp_up: str = "linear"
    pad_value: int = 0
    fast_decode: bool = False
    max_pixels: int = 178_956_970
    strict_jpeg: bool = True
    alpha: str = "black"
    upscale: bool = False
    buckets: Any = None

    def __post_init__(self) -> None:
        size = self.size
        if (
            not isinstance(size, (tuple, list))
            or len(size) != 2
            or not all(_is_int(v) and v > 0 for v in size)
        ):
            raise ValueError(f"size must be (H, W) with positive ints, got {size!r}")
        object.__setattr__(self, "size", (int(size[0]), int(size[1])))
        if self.resize not in _RESIZE:
            raise ValueError(f"resize must be one of {_RESIZE}, got {self.resize!r}")
        if self.channels not in (1, 3) or not _is_int(self.channels):
            raise ValueError(f"channels must be 1 or 3, got {self.channels!r}")
        if self.layout not in _LAYOUT:
            raise ValueError(f"layout must be one of {_LAYOUT}, got {self.layout!r}")
        if self.interp_up not in _INTERP:
            raise ValueError(f"interp_up must be one of {_INTERP}, got {self.interp_up!r}")
        if not _is_int(self.pad_value) or not 0 <= self.pad_value <= 255:
            raise ValueError(f"pad_value must be an int in 0..255, got {self.pad_value!r}")
        if self.alpha not in _ALPHA:
            raise ValueError(f"alpha must be one of {_ALPHA}, got {self.alpha!r}")
        if not _is_int(self.max_pixels) or self.max_pixels < 0:
            raise ValueError(f"max_pixels must be an int >= 0, got {self.max_pixels!r}")
        if self.resize in ASPECT_KEPT:
            if self.size[0] != self.size[1]:
                raise ValueError(f"resize={self.resize!r} takes size (N, N), the side N; got {self.size!r}")
            if self.layout != "hwc":
                raise ValueError(f"resize={self.resize!r} keeps each image's own shape, stored (h, w, C): "
                                 f"layout must be 'hwc', got {self.layout!r}")
        elif self.upscale:
            raise ValueError(f"upscale applies to resize='max-side' or 'short-side' only, got resize={self.resize!r}")
        if self.resize == "buckets":
            from .buckets import AutoBuckets, parse_buckets

            if self.buckets is None:
                raise ValueError("resize='buckets' needs buckets: ((h, w), ...) or AutoBuckets")
            b = self.buckets if isinstance(self.buckets, AutoBuckets) else parse_buckets(list(self.buckets),
                                                                                         self.channels)
            object.__setattr__(self, "buckets", b)
            if isinstance(b, AutoBuckets):
                object.__setattr__(self, "size", (b.side, b.side))
            else:
                object.__setattr__(self, "size", (max(h for h, _ in b), max(w for _, w in b)))
            if self.layout != "hwc":
                raise ValueError(f"resize='buckets' stores each record at its bucket's shape, (h, w, C): layout must "
                                 f"be 'hwc', got {self.layout!r}")
        elif self.buckets is not None:
            raise ValueError(f"buckets apply to resize='buckets' only, got resize={self.resize!r}")
        for name in ("bgr", "fast_decode", "strict_jpeg", "upscale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("channels", "pad_value", "max_pixels"):  # numpy ints -> int (JSON-able)
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def aspect_kept(self) -> bool:
        """True when every record keeps its image's own aspect (shape ``(None, None, C)``)."""
        return self.resize in ASPECT_KEPT

    @property
    def shaped(self) -> bool:
        """True when records have shapes of their own (aspect kept, or aspect
        buckets): the image field is ``(None, None, C)`` with ``image_hw``."""
        return self.resize in ASPECT_KEPT or self.resize == "buckets"

    @property
    def bucket_shapes(self) -> tuple[tuple[int, int], ...] | None:
        """The bucket shapes of ``resize="buckets"`` once chosen; None
        otherwise (also while ``auto`` has not chosen them)."""
        return self.buckets if isinstance(self.buckets, tuple) else None

    def record_shape(self) -> tuple[Any, ...]:
        """Shape of one record: ``(H, W, C)`` or ``(C, H, W)``; ``(None,
        None, C)`` when records keep their own aspect."""
        if self.shaped:
            return (None, None, self.channels)
        h, w = self.size
        if self.layout == "chw":
            return (self.channels, h, w)
        return (h, w, self.channels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description (for provenance and fingerprints).

        ``alpha`` is left out when it is ``"black"`` (the rule of every
        store written before the option existed), so their fingerprints and
        resumes stay valid; ``from_dict`` restores it.
        """
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["size"] = list(self.size)
        if d["alpha"] == _ALPHA_UNSTATED:
            del d["alpha"]
        if not d["upscale"]:  # as for alpha: the specs written before the option keep their fingerprints
            del d["upscale"]
        if d["buckets"] is None:  # likewise
            del d["buckets"]
        elif isinstance(d["buckets"], tuple):
            d["buckets"] = [list(b) for b in d["buckets"]]
        else:
            d["buckets"] = str(d["buckets"])  # "auto:N", before the ingest chose the shapes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeSpec:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DecodeSpec keys: {sorted(unknown)}")
        kw = dict(d)
        kw.setdefault("alpha", _ALPHA_UNSTATED)
        if "size" in kw and isinstance(kw["size"], list):
            kw["size"] = tuple(kw["size"])
        if isinstance(kw.get("buckets"), str):
            from .buckets import parse_buckets

            kw["buckets"] = parse_buckets(kw["buckets"])
        return cls(**kw)


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)
