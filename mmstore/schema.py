"""Schemas: named fixed-shape fields, sample validation, record packing."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from .errors import FormatError, SchemaError
from .format import FIELD_NAME_RE, normalize_dtype

__all__ = ["Field", "Schema"]


class Field(NamedTuple):
    """One fixed-shape field of a record."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one entry of this field."""
        return int(self.dtype.itemsize * math.prod(self.shape))


class Schema:
    """An ordered set of fields; the order is the packing order.

    Parameters
    ----------
    fields
        ``{name: (dtype, shape)}``, or an iterable of :class:`Field` or of
        ``(name, dtype, shape)`` triples. Dtypes are normalised to explicit
        little-endian; shapes to tuples of ints (``()`` for a scalar).

    Raises
    ------
    SchemaError
        Bad names, duplicate names, unsupported dtypes, negative dims.
    """

    def __init__(self, fields: Mapping[str, Any] | Iterable[Any]) -> None:
        items: list[tuple[Any, Any, Any]] = []
        if isinstance(fields, Schema):
            items = [tuple(f) for f in fields.fields]
        elif isinstance(fields, Mapping):
            for name, spec in fields.items():
                if isinstance(spec, Field):
                    items.append((name, spec.dtype, spec.shape))
                    continue
                try:
                    dtype, shape = spec
                except (TypeError, ValueError):
                    raise SchemaError(
                        f"field {name!r}: expected (dtype, shape), found {spec!r}"
                    ) from None
                items.append((name, dtype, shape))
        else:
            for ent in fields:
                try:
                    name, dtype, shape = ent
                except (TypeError, ValueError):
                    raise SchemaError(f"expected (name, dtype, shape), found {ent!r}") from None
                items.append((name, dtype, shape))
        if not items:
            raise SchemaError("a schema needs at least one field")
        out: list[Field] = []
        seen: set[str] = set()
        for name, dtype, shape in items:
            if not isinstance(name, str) or not FIELD_NAME_RE.match(name):
                raise SchemaError(
                    f"field name {name!r} is not allowed: use 1-63 letters, digits and _, "
                    "starting with a letter"
                )
            if name in seen:
                raise SchemaError(f"field {name!r} appears twice")
            seen.add(name)
            try:
                dt = normalize_dtype(dtype, where=f"field {name!r}")
            except FormatError as exc:
                raise SchemaError(str(exc)) from None
            if isinstance(shape, (int, np.integer)):
                shape = (int(shape),)
            try:
                shp = tuple(int(d) for d in shape)
            except TypeError:
                raise SchemaError(f"field {name!r}: shape must be a tuple of ints, found {shape!r}") from None
            if any(d < 0 for d in shp):
                raise SchemaError(f"field {name!r}: negative dimension in shape {shp}")
            out.append(Field(name, dt, shp))
        self.fields: tuple[Field, ...] = tuple(out)
        self._by_name = {f.name: f for f in out}
        offs = [0]
        for f in out:
            offs.append(offs[-1] + f.nbytes)
        self.offsets: tuple[int, ...] = tuple(offs[:-1])
        self.record_bytes: int = offs[-1]

    # -- container protocol -------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> Field:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no field {name!r}; fields are {list(self.names)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[Field]:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        inner = ", ".join(f"{f.name}: {f.dtype.str}{list(f.shape)}" for f in self.fields)
        return f"Schema({inner})"

    # -- serialisation --------------------------------------------------------
    def to_json(self) -> list[dict[str, Any]]:
        """The manifest's ``schema`` list."""
        return [{"name": f.name, "dtype": f.dtype.str, "shape": list(f.shape)} for f in self.fields]

    def offset(self, name: str) -> int:
        """Byte offset of ``name`` inside a packed record."""
        return self.offsets[self.names.index(name)]

    # -- samples --------------------------------------------------------------
    def validate(self, sample: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Check ``sample`` against the schema; return C-contiguous arrays of
        the field dtypes.

        Values are converted only when the conversion is lossless (every value
        survives the round trip), so ``5`` fits a ``uint8`` field but ``300``
        or ``0.5`` do not.

        Raises
        ------
        SchemaError
            A missing or unknown field, a wrong shape, or a lossy cast.
        """
        if not isinstance(sample, Mapping):
            raise SchemaError(
                f"a sample must be a mapping of field name -> array, found {type(sample).__name__}"
            )
        extra = [k for k in sample if k not in self._by_name]
        if extra:
            raise SchemaError(f"unknown field(s) {extra}; the schema has {list(self.names)}")
        out: dict[str, np.ndarray] = {}
        for f in self.fields:
            if f.name not in sample:
                raise SchemaError(f"sample lacks field {f.name!r}; the schema has {list(self.names)}")
            out[f.name] = _coerce(f, sample[f.name])
        return out


def _coerce(f: Field, value: Any) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"field {f.name!r}: cannot make an array of {type(value).__name__} ({exc})") from None
    if arr.shape != f.shape:
        raise SchemaError(f"field {f.name!r}: expected shape {f.shape}, found {arr.shape}")
    if arr.dtype == f.dtype:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind not in "biufc":
        raise SchemaError(f"field {f.name!r}: expected {f.dtype.str}, found dtype {arr.dtype} values")
    if np.can_cast(arr.dtype, f.dtype, casting="safe"):
        return np.ascontiguousarray(arr, dtype=f.dtype)
    if arr.dtype.kind == "c" and f.dtype.kind != "c":
        raise SchemaError(f"field {f.name!r}: complex values do not fit {f.dtype.str}")
    with np.errstate(all="ignore"):
        cast = arr.astype(f.dtype)
        back = cast.astype(arr.dtype)
    same = np.array_equal(back, arr, equal_nan=arr.dtype.kind in "fc")
    if not same:
        raise SchemaError(
            f"field {f.name!r}: converting {arr.dtype} to {f.dtype.str} would change values "
            f"(e.g. range {arr.min()!r}..{arr.max()!r}); convert explicitly or widen the field's dtype"
        )
    return np.ascontiguousarray(cast)


def coerce_rows(f: Field, value: Any) -> np.ndarray:
    """Like ``_coerce`` for a block of rows: shape ``(n, *f.shape)``."""
    arr = np.asarray(value)
    if arr.shape[1:] != f.shape:
        raise SchemaError(f"field {f.name!r}: expected rows of shape {f.shape}, found {arr.shape[1:]}")
    return _coerce(Field(f.name, f.dtype, arr.shape), arr)
