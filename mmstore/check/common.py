"""Shared helpers of the checking tools: report serialisation, tables,
byte/rate formatting, and finding the image and label fields of a schema."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._os.io import fmt_bytes  # noqa: F401 - re-exported: the tools format sizes with it
from ..errors import MmstoreError, SchemaError
from ..format.schema import Field, Schema

__all__ = [
    "FieldArgumentError",
    "UsageError",
    "check_output",
    "write_output",
    "find_image_field",
    "find_label_field",
    "fmt_bytes",
    "fmt_rate",
    "fmt_seconds",
    "image_layout",
    "table",
    "to_jsonable",
]


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, numpy scalars/arrays, tuples -> plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name in getattr(obj, "_json_extra", ()):
            out[name] = to_jsonable(getattr(obj, name))
        return out
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return to_jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, float):
        if math.isnan(obj) or math.isinf(obj):
            return None
        return obj
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    return str(obj)


def dumps(obj: Any) -> str:
    from ..format.names import json_text  # names that are not UTF-8 become \udcXX escapes

    return json_text(to_jsonable(obj), indent=1)


class UsageError(MmstoreError, ValueError):
    """A bad argument found by a tool (the CLI's exit code 2)."""

    usage_error = True


class FieldArgumentError(UsageError, SchemaError):
    """A field named on the command line is not in the store or does not fit
    its role."""


def fmt_rate(bytes_per_s: float | None) -> str:
    if bytes_per_s is None:
        return "unknown"
    return f"{bytes_per_s / 1e6:,.0f} MB/s"


def fmt_seconds(s: float | None) -> str:
    if s is None or (isinstance(s, float) and (math.isnan(s) or math.isinf(s))):
        return "n/a"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def table(rows: Sequence[Sequence[Any]], header: Sequence[str] | None = None, indent: str = "  ") -> str:
    """A plain left/right aligned text table (numbers right-aligned)."""
    all_rows = [list(map(str, header))] if header else []
    all_rows += [[str(c) for c in r] for r in rows]
    if not all_rows:
        return ""
    ncol = max(len(r) for r in all_rows)
    for r in all_rows:
        r += [""] * (ncol - len(r))
    widths = [max(len(r[c]) for r in all_rows) for c in range(ncol)]

    def is_num(s: str) -> bool:
        t = s.replace(",", "").replace("%", "").replace("x", "").strip()
        try:
            float(t.split()[0] if t else "x")
            return True
        except ValueError:
            return False

    lines = []
    for k, r in enumerate(all_rows):
        cells = [
            (r[c].rjust(widths[c]) if (is_num(r[c]) and not (header and k == 0)) else r[c].ljust(widths[c]))
            for c in range(ncol)
        ]
        lines.append(indent + "  ".join(cells).rstrip())
        if header and k == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def image_layout(f: Field) -> str | None:
    """``"hwc"`` / ``"chw"`` when ``f`` is a uint8 image field (1 or 3
    channels), else None. ``(H, W)`` uint8 counts as a 1-channel ``"hw"``."""
    if f.dtype != np.dtype("|u1"):
        return None
    s = f.shape
    if f.shaped:  # images of their own shape: (None, None, C) or (None, None)
        return "hwc" if len(s) == 3 and s[2] in (1, 3) else "hw" if len(s) == 2 else None
    if len(s) == 3 and s[2] in (1, 3) and s[0] > 0 and s[1] > 0:
        return "hwc"
    if len(s) == 3 and s[0] in (1, 3) and s[1] > 3 and s[2] > 3:
        return "chw"
    if len(s) == 2 and s[0] > 1 and s[1] > 1:
        return "hw"
    return None


def find_image_field(schema: Schema, name: str | None = None) -> tuple[Field, str] | None:
    """The image field: ``name`` if given, else one named ``image``/``img``,
    else the first uint8 field of image shape."""
    if name is not None:
        f = _named_field(schema, name)
        lay = image_layout(f)
        if lay is None:
            raise FieldArgumentError(
                f"field {name!r} ({f.dtype.str} {list(f.shape)}) is not a uint8 image of shape "
                "(H, W, 1|3), (1|3, H, W) or (H, W)"
            )
        return f, lay
    cands = [(f, lay) for f in schema if (lay := image_layout(f)) is not None]
    for f, lay in cands:
        if f.name.lower() in ("image", "img", "images", "pixels"):
            return f, lay
    for f, lay in cands:
        if lay != "hw":
            return f, lay
    return cands[0] if cands else None


def find_label_field(schema: Schema, name: str | None = None) -> Field | None:
    """The label field: ``name``, else one named ``label``/``labels``/``target``/
    ``class``, else None. Must be an integer scalar."""
    if name is not None:
        f = _named_field(schema, name)
        if f.shape != () or f.dtype.kind not in "iub":
            raise FieldArgumentError(f"field {name!r} ({f.dtype.str} {list(f.shape)}) is not a label: "
                                     "a label is an integer scalar")
        return f
    for f in schema:
        if (f.name.lower() in ("label", "labels", "target", "targets", "class", "y") and f.shape == ()
                and f.dtype.kind in "iub"):
            return f
    return None


def _named_field(schema: Schema, name: str) -> Field:
    if name not in schema:
        raise FieldArgumentError(f"the store has no field {name!r}; its fields are {', '.join(schema.names)}")
    return schema[name]


def to_hwc(arr: np.ndarray, layout: str) -> np.ndarray:
    """Image(s) in ``layout`` -> (..., H, W, C)."""
    if layout == "hwc":
        return arr
    if layout == "chw":
        return np.moveaxis(arr, -3, -1)
    return arr[..., None]


def sample_indices(n: int, k: int, seed: int = 0) -> np.ndarray:
    """``min(n, k)`` distinct sorted random indices of ``range(n)``."""
    k = min(int(n), int(k))
    if k <= 0:
        return np.zeros(0, np.int64)
    rng = np.random.default_rng(seed)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


def check_output(store: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    """A file a checking command writes (``show -o``, ``bench --plot``) goes
    to an existing folder outside the store: a command never writes into a
    store it only reads (see :func:`write_output` for links)."""
    out = os.path.abspath(os.fspath(output))
    folder = os.path.dirname(out)
    if not os.path.isdir(folder):
        raise UsageError(f"{os.fspath(output)}: the folder {folder} does not exist; create it or write elsewhere")
    real_store = os.path.realpath(os.fspath(store))
    real_folder = os.path.realpath(folder)
    if real_folder == real_store or real_folder.startswith(real_store + os.sep):
        raise UsageError(f"{os.fspath(output)}: is inside the store {os.fspath(store)}; write it elsewhere")
    if os.path.isdir(out):
        raise UsageError(f"{os.fspath(output)}: is a folder; name a file")


def write_output(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path`` as a new file: a temporary file in the same
    folder (created exclusively), then renamed over ``path``. The rename
    replaces whatever directory entry ``path`` is, so a symbolic link or a
    hard link there (to a store's ``manifest.json``, say) is replaced, never
    written through. Returns the absolute path."""
    out = os.path.abspath(os.fspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mmstore-", suffix=".tmp", dir=os.path.dirname(out))
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; an image for people to open
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return out

