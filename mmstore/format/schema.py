"""Schemas: named fields, their codecs, sample validation, record packing.

A field is *fixed* (codec ``raw``: fixed-size entries at fixed offsets, format
1.x) or *variable-size* (any other codec: each entry is its encoded bytes,
found through an offsets index; format.py, "Encoded fields"). A fixed-shape
field decodes to exactly its dtype and shape. A *ragged* field (format.py,
"Ragged fields") has a variable leading dimension, shape ``(None, *row)``,
or is ``str`` (UTF-8 text) or ``bytes``: always variable-size, each entry
its own number of rows. A *shaped* field (format.py, "Images of their own
shape") is an image of its own height and width, shape ``(None, None)`` or
``(None, None, C)``: a variable-size field that always comes with its
companion fixed field ``<name>_hw`` (``<u4``, ``(2,)``: each record's
``(h, w)``), added by :class:`Schema` when not given and filled from the
image when a sample lacks it. A shaped field may list its *buckets*
(format.py, "Aspect buckets"): the only ``(h, w)`` its records have.
``record_bytes`` and ``offsets`` are
about the fixed fields only (:attr:`Schema.fixed_fields`): the packed part of
a record that sits at fixed positions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, cast

import numpy as np

from ..errors import FormatError, SchemaError
from .codecs import RAW, Codec, codec_from_json, parse_codec
from .layout import FIELD_NAME_RE, HW_SUFFIX, SHAPED_MAX_BYTES, normalize_dtype

__all__ = ["Field", "Schema"]


TEXT_KINDS = ("str", "bytes")  # ragged fields of bytes: UTF-8 text, or bytes as they are
HW_DTYPE = np.dtype("<u4")  # the companion field of a shaped field: (h, w) per record


class Field(NamedTuple):
    """One field of a record: its name, the dtype and shape every entry
    decodes to, and how an entry is stored (``codec``, default raw).

    A ragged field's shape starts with ``None`` (any number of rows);
    ``kind`` is ``"str"`` or ``"bytes"`` for text and byte fields (dtype
    ``|u1``, shape ``(None,)``), else ``"array"``. ``classes`` names the
    values of an integer field that holds class ids (a detection field's
    category per box, a tag list): ``((id, name), ...)`` sorted by id, or
    None (format.py, "Class names of a field"). ``buckets``: the shapes
    ``((h, w), ...)`` of a shaped field with aspect buckets, from the
    tallest to the widest, every record's ``<name>_hw`` one of them; None
    for any other field (format.py, "Aspect buckets")."""

    name: str
    dtype: np.dtype
    shape: tuple[Any, ...]
    codec: Codec = RAW
    kind: str = "array"
    classes: tuple[tuple[int, str], ...] | None = None
    buckets: tuple[tuple[int, int], ...] | None = None

    @property
    def class_names(self) -> dict[int, str]:
        """``{id: name}`` of ``classes`` (empty when the field has none)."""
        return dict(self.classes or ())

    @property
    def ragged(self) -> bool:
        """True for a variable leading dimension (also ``str`` / ``bytes``)."""
        return self.shape[:1] == (None,)

    @property
    def shaped(self) -> bool:
        """True for an image of its own height and width: shape ``(None,
        None)`` or ``(None, None, C)`` (also :attr:`ragged`, as its first
        dimension varies; its size is in the companion field ``<name>_hw``)."""
        return self.shape[:2] == (None, None)

    @property
    def hw_name(self) -> str:
        """The companion field of a shaped field: ``<name>_hw``."""
        return self.name + HW_SUFFIX

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row of a ragged field (``shape[1:]``); of one pixel
        of a shaped field (``shape[2:]``)."""
        if self.shaped:
            return cast("tuple[int, ...]", tuple(self.shape[2:]))
        return tuple(self.shape[1:]) if self.ragged else tuple(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of a ragged field (of the whole entry otherwise)."""
        return int(self.dtype.itemsize * math.prod(self.row_shape))

    @property
    def nbytes(self) -> int:
        """Bytes of one decoded entry of this field (``dtype x shape``); 0 for
        a ragged field, whose entries have no one size."""
        if self.ragged:
            return 0
        return int(self.dtype.itemsize * math.prod(self.shape))

    @property
    def variable(self) -> bool:
        """True when entries are stored behind an offsets index, each of its
        own size (an encoded or a ragged field)."""
        return not self.codec.raw or self.ragged

    @property
    def dtype_name(self) -> str:
        """The manifest's ``dtype``: ``"str"``, ``"bytes"`` or e.g. ``"<f4"``."""
        return self.kind if self.kind in TEXT_KINDS else self.dtype.str


class Schema:
    """An ordered set of fields; the order is the packing order.

    Parameters
    ----------
    fields
        ``{name: (dtype, shape)}`` or ``{name: (dtype, shape, codec)}``, or an
        iterable of :class:`Field` or of ``(name, dtype, shape[, codec])``.
        Dtypes are normalised to explicit little-endian; shapes to tuples of
        ints (``()`` for a scalar). A codec is a :class:`~mmstore.format.codecs.Codec`
        or a spec such as ``"jpeg:90"`` (None: raw).
    codecs
        ``{field: codec spec}`` (or ``["image=jpeg:90", ...]``): sets the
        codecs of the named fields, overriding the ones in ``fields``.
    classes
        ``{field: names}``: the class names of integer fields that hold class
        ids, as ``{id: name}`` or a list of names (ids 0, 1, ...); overrides
        the ones the fields carry. Kept in the manifest, compared by merge.
    buckets
        ``{field: [(h, w), ...]}``: the aspect buckets of shaped fields
        (format.py, "Aspect buckets"); overrides the ones the fields carry.
        Kept in the manifest; a sample of another size is refused.
    label_names
        A store's top-level ``label_names`` (the names of its ``label``
        field, format.py "Class names of a field"): ``schema["label"]``
        then reports them as its ``classes`` / ``class_names`` when the field
        carries none itself, so ``schema[name].class_names`` names the
        classes of every field that has them. They stay the store's own key:
        not part of ``fields``, ``to_json``, equality or a copy of the schema.

    Raises
    ------
    SchemaError
        Bad names, duplicate names, unsupported dtypes, negative dims, a codec
        that does not fit its field (e.g. jpeg on a float field).
    """

    def __init__(
        self,
        fields: Mapping[str, Any] | Iterable[Any],
        *,
        codecs: Mapping[str, Any] | None = None,
        classes: Mapping[str, Any] | None = None,
        buckets: Mapping[str, Any] | None = None,
        label_names: Iterable[str] | None = None,
    ) -> None:
        items = _entries(fields)
        if not items:
            raise SchemaError("a schema needs at least one field")
        names = [it[0] for it in items]
        extra = {}
        if codecs:
            from .codecs import parse_codec_specs

            extra = parse_codec_specs(codecs)
            unknown = [k for k in extra if k not in names]
            if unknown:
                raise SchemaError(f"codecs name unknown field(s) {unknown}; the schema has {names}")
        out: list[Field] = []
        seen: set[str] = set()
        for name, dtype, shape, codec, _, _ in items:
            if not isinstance(name, str) or not FIELD_NAME_RE.match(name):
                raise SchemaError(
                    f"field name {name!r} is not allowed: use 1-63 letters, digits and _, "
                    "starting with a letter"
                )
            if name in seen:
                raise SchemaError(f"field {name!r} appears twice")
            seen.add(name)
            cod = extra.get(name, None) or parse_codec(codec, where=f"field {name!r}")
            out.append(_make_field(name, dtype, shape, cod))
        out = _with_hw_fields(out)
        seen = {f.name for f in out}
        given = {it[0]: it[4] for it in items if it[4] is not None}  # field -> classes the fields given carry
        given.update(classes or {})
        unknown = [k for k in given if k not in seen]
        if unknown:
            raise SchemaError(f"classes name unknown field(s) {unknown}; the schema has {[f.name for f in out]}")
        out = [f._replace(classes=normalize_classes(f, given[f.name])) if f.name in given else f for f in out]
        sizes = {it[0]: it[5] for it in items if it[5] is not None}  # field -> buckets the fields given carry
        sizes.update(buckets or {})
        unknown = [k for k in sizes if k not in seen]
        if unknown:
            raise SchemaError(f"buckets name unknown field(s) {unknown}; the schema has {[f.name for f in out]}")
        out = [f._replace(buckets=normalize_buckets(f, sizes[f.name])) if f.name in sizes else f for f in out]
        self.fields: tuple[Field, ...] = tuple(out)
        self._by_name = {f.name: f for f in out}
        self._named: dict[str, Field] = {}  # what __getitem__ shows: the label field with label_names
        lab = self._by_name.get("label")
        if label_names is not None and lab is not None and lab.classes is None and lab.kind == "array" \
                and lab.dtype.kind in "iu":
            self._named["label"] = lab._replace(classes=tuple((i, str(n)) for i, n in enumerate(label_names)))
        self.fixed_fields: tuple[Field, ...] = tuple(f for f in out if not f.variable)
        """The raw fields, in schema order: stored at fixed offsets (``offsets``)."""
        self.variable_fields: tuple[Field, ...] = tuple(f for f in out if f.variable)
        """The encoded and ragged fields, in schema order: entries of any size, behind an offsets index."""
        self.ragged_fields: tuple[Field, ...] = tuple(f for f in out if f.ragged)
        """The ragged fields (a variable leading dimension, ``str``, ``bytes``), in schema order."""
        self.shaped_fields: tuple[Field, ...] = tuple(f for f in out if f.shaped)
        """The shaped fields (images of their own height and width), in schema order; also in ``ragged_fields``."""
        offs = [0]
        for f in self.fixed_fields:
            offs.append(offs[-1] + f.nbytes)
        self.offsets: tuple[int, ...] = tuple(offs[:-1])
        """Byte offset of each of ``fixed_fields`` inside the packed fixed part."""
        self.record_bytes: int = offs[-1]
        """Bytes of the fixed fields of one record (all fields when none is variable)."""

    @classmethod
    def from_json(cls, raw: list[dict[str, Any]], path: str = "schema") -> Schema:
        """The schema of a manifest's (or a writer state's) ``schema`` list."""
        return cls([(f["name"], f["dtype"], tuple(f["shape"]) if f.get("shape") is not None else None,
                     codec_from_json(path, f["codec"], f["name"]) if "codec" in f else RAW,
                     f.get("classes"), f.get("buckets")) for f in raw])

    @property
    def has_variable(self) -> bool:
        """True when some field is variable-size (the store is format 2.x)."""
        return bool(self.variable_fields)

    @property
    def has_ragged(self) -> bool:
        """True when some field is ragged (the store is format 2.1)."""
        return bool(self.ragged_fields)

    @property
    def has_shaped(self) -> bool:
        """True when some field is shaped (the store is format 2.3)."""
        return bool(self.shaped_fields)

    def shaped_of(self, name: str) -> Field | None:
        """The shaped field whose companion ``<name>_hw`` field ``name`` is, or None."""
        for f in self.shaped_fields:
            if f.hw_name == name:
                return f
        return None

    # -- container protocol -------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def __getitem__(self, name: str) -> Field:
        try:
            return self._named.get(name) or self._by_name[name]
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
        inner = ", ".join(f"{f.name}: {f.dtype_name}{list(f.shape)}" + ("" if f.codec.raw else f" {f.codec}")
                          + ("" if f.classes is None else f" ({len(f.classes)} classes)")
                          + ("" if f.buckets is None else f" (buckets {', '.join(f'{h}x{w}' for h, w in f.buckets)})")
                          for f in self.fields)
        return f"Schema({inner})"

    # -- serialisation --------------------------------------------------------
    def to_json(self) -> list[dict[str, Any]]:
        """The manifest's ``schema`` list."""
        out: list[dict[str, Any]] = []
        for f in self.fields:
            ent: dict[str, Any] = {"name": f.name, "dtype": f.dtype_name, "shape": list(f.shape)}
            if not f.codec.raw:
                ent["codec"] = f.codec.to_json()
            if f.classes is not None:
                ent["classes"] = [[i, n] for i, n in f.classes]
            if f.buckets is not None:
                ent["buckets"] = [[h, w] for h, w in f.buckets]
            out.append(ent)
        return out

    def offset(self, name: str) -> int:
        """Byte offset of fixed field ``name`` inside the packed fixed part."""
        f = self[name]
        if f.variable:
            raise KeyError(f"field {name!r} is variable-size ({f.codec}): it has no fixed offset")
        return self.offsets[self.fixed_fields.index(self._by_name[name])]

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
        hws = {f.hw_name: f for f in self.shaped_fields}
        for f in self.fields:
            if f.name in hws and f.name not in sample:
                continue  # filled from its image below
            if f.name not in sample:
                raise SchemaError(f"sample lacks field {f.name!r}; the schema has {list(self.names)}")
            out[f.name] = coerce_ragged(f, sample[f.name]) if f.ragged else _coerce(f, sample[f.name])
        for name, f in hws.items():
            hw = np.array(out[f.name].shape[:2], HW_DTYPE)
            if f.buckets is not None and out[f.name].shape[:2] not in f.buckets:
                raise SchemaError(f"field {f.name!r}: an image of {hw[0]} x {hw[1]} pixels (h x w), which is none of "
                                  f"the field's buckets {[list(b) for b in f.buckets]}; resize it to one of them")
            if name in out and not np.array_equal(out[name], hw):
                raise SchemaError(f"field {name!r} says {out[name].tolist()}, but the image of field {f.name!r} "
                                  f"is {hw.tolist()} (h, w); leave {name!r} out, it is filled from the image")
            out[name] = hw
        return {f.name: out[f.name] for f in self.fields}


MAX_CLASSES = 1 << 20  # class names one field may carry (the manifest holds them)


def normalize_classes(f: Field, classes: Any) -> tuple[tuple[int, str], ...]:
    """``classes`` (``{id: name}``, a list of names, or ``[[id, name], ...]``
    as in a manifest) as ``((id, name), ...)`` sorted by id, checked: the
    field holds integers, each id fits its dtype and appears once, each
    name is a string.

    Raises
    ------
    SchemaError
        Another kind of field, or bad ids or names.
    """
    where = f"field {f.name!r}: classes"
    if f.kind != "array" or f.dtype.kind not in "iu":
        raise SchemaError(f"{where} name the values of an integer field, but {f.name!r} is {f.dtype_name}")
    if isinstance(classes, Mapping):
        pairs = list(classes.items())
    elif isinstance(classes, (list, tuple)) and all(isinstance(c, str) for c in classes):
        pairs = list(enumerate(classes))
    elif isinstance(classes, (list, tuple)):
        pairs = [tuple(p) if isinstance(p, (list, tuple)) and len(p) == 2 else (None, None) for p in classes]
    else:
        raise SchemaError(f"{where} must be {{id: name}} or a list of names, found {type(classes).__name__}")
    if len(pairs) > MAX_CLASSES:
        raise SchemaError(f"{where}: {len(pairs)} names, more than the {MAX_CLASSES} a field may carry")
    info = np.iinfo(f.dtype)
    out: dict[int, str] = {}
    for i, n in pairs:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not info.min <= int(i) <= info.max:
            raise SchemaError(f"{where}: id {i!r} is not an integer that fits {f.dtype.str}")
        if not isinstance(n, str):
            raise SchemaError(f"{where}: the name of id {i} must be a string, found {n!r}")
        if int(i) in out:
            raise SchemaError(f"{where}: id {int(i)} appears twice ({out[int(i)]!r} and {n!r})")
        out[int(i)] = n
    return tuple(sorted(out.items()))


def normalize_buckets(f: Field, buckets: Any) -> tuple[tuple[int, int], ...]:
    """``buckets`` (``[(h, w), ...]``) of shaped field ``f`` as ``((h, w),
    ...)`` from the tallest to the widest (``w / h`` ascending), checked
    (:func:`~mmstore.format.shaped.bucket_problem`).

    Raises
    ------
    SchemaError
        ``f`` is not an image field of its own shape, or a bad list.
    """
    from .shaped import bucket_problem, sort_buckets

    if not f.shaped:
        raise SchemaError(f"field {f.name!r}: buckets are the shapes of an image field of its own shape (shape "
                          f"(None, None, C)), but {f.name!r} has shape {f.shape}")
    if isinstance(buckets, (list, tuple)):
        buckets = [tuple(b) if isinstance(b, (list, tuple)) else b for b in buckets]
    why = bucket_problem(buckets, f.dtype.itemsize * math.prod(f.shape[2:]))
    if why is not None:
        raise SchemaError(f"field {f.name!r}: buckets: {why}")
    return sort_buckets(buckets)


def _as_entry(f: Field) -> tuple[Any, ...]:
    return (f.name, f.kind if f.kind in TEXT_KINDS else f.dtype, f.shape, f.codec, f.classes, f.buckets)


def _entries(fields: Mapping[str, Any] | Iterable[Any]) -> list[tuple[Any, ...]]:
    """The fields given to :class:`Schema`, in any of its forms, as
    ``(name, dtype, shape, codec, classes, buckets)`` entries (not yet checked)."""
    if isinstance(fields, Schema):
        return [_as_entry(f) for f in fields.fields]
    out: list[tuple[Any, ...]] = []
    if isinstance(fields, Mapping):
        for name, spec in fields.items():
            if isinstance(spec, Field):
                out.append((name, *_as_entry(spec)[1:]))
                continue
            if spec in (str, bytes, "str", "bytes"):
                spec = (spec, None)
            if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
                raise SchemaError(f"field {name!r}: expected (dtype, shape) or (dtype, shape, codec), found {spec!r}")
            out.append((name, spec[0], spec[1], spec[2] if len(spec) == 3 else None, None, None))
        return out
    for ent in fields:
        if isinstance(ent, Field):
            ent = _as_entry(ent)
        if not isinstance(ent, (tuple, list)) or len(ent) not in (3, 4, 5, 6):
            raise SchemaError(f"expected (name, dtype, shape[, codec[, classes[, buckets]]]), found {ent!r}")
        out.append((*ent, *(None,) * (6 - len(ent))))
    return out


def _make_field(name: str, dtype: Any, shape: Any, cod: Codec) -> Field:
    """One checked field: its dtype normalised, its shape ints (a ragged
    field's first ``None``), the codec fitting it."""
    kind = ("str" if dtype is str else "bytes" if dtype is bytes else dtype) if isinstance(dtype, (type, str)) else None
    if kind in TEXT_KINDS:
        if shape not in (None, (), [], (None,), [None]):
            raise SchemaError(f"field {name!r}: a {kind} field has no shape (or (None,)), found {shape!r}")
        _check_ragged_codec(name, cod)
        return Field(name, np.dtype("|u1"), (None,), cod, str(kind))
    try:
        dt = normalize_dtype(dtype, where=f"field {name!r}")
    except FormatError as exc:
        raise SchemaError(str(exc)) from None
    if isinstance(shape, (int, np.integer)) or shape is None:
        shape = (shape,)
    if tuple(shape)[:2] == (None, None):
        return _make_shaped(name, dt, tuple(shape), cod)
    try:
        shp = tuple(None if (k == 0 and d is None) else int(d) for k, d in enumerate(shape))
    except TypeError:
        raise SchemaError(f"field {name!r}: shape must be a tuple of ints (the first may be None), "
                          f"found {shape!r}") from None
    if any(d is not None and d < 0 for d in shp):
        raise SchemaError(f"field {name!r}: negative dimension in shape {shp}")
    if shp[:1] == (None,):
        _check_ragged_codec(name, cod)
        if dt.itemsize * math.prod(cast("tuple[int, ...]", shp[1:])) == 0:  # only the first dimension is None
            raise SchemaError(f"field {name!r}: the rows of a ragged field must have at least one byte, "
                              f"found shape {shp} of {dt.str}")
    else:
        cod.check(dt, cast("tuple[int, ...]", shp), where=f"field {name!r}")  # no dimension is None
    return Field(name, dt, shp, cod)


MAX_CHANNELS = 4  # a shaped field's channels: gray (none, or 1), RGB, RGBA; 2 for gray with alpha


def _make_shaped(name: str, dt: np.dtype, shape: tuple[Any, ...], cod: Codec) -> Field:
    """A shaped field (format.py, "Images of their own shape"): ``(None,
    None)`` or ``(None, None, C)``, ``C`` from 1 to 4, any codec that stores
    an image of that dtype and channels."""
    if len(shape) not in (2, 3) or (len(shape) == 3 and (isinstance(shape[2], bool) or not isinstance(
            shape[2], (int, np.integer)) or not 1 <= int(shape[2]) <= MAX_CHANNELS)):
        raise SchemaError(f"field {name!r}: an image of its own shape has shape (None, None) or (None, None, C) "
                          f"with C from 1 to {MAX_CHANNELS}, found {shape!r}")
    if len(name) + len(HW_SUFFIX) > 63:
        raise SchemaError(f"field {name!r}: the name of an image of its own shape has at most {63 - len(HW_SUFFIX)} "
                          f"characters (its companion field {name + HW_SUFFIX!r} must be a field name too)")
    shp: tuple[Any, ...] = (None, None, *(int(d) for d in shape[2:]))
    cod.check(dt, (1, 1, *shp[2:]), where=f"field {name!r}")  # dtype and channels; any height and width
    return Field(name, dt, shp, cod)


def _with_hw_fields(fields: list[Field]) -> list[Field]:
    """``fields`` with each shaped field's companion ``<name>_hw`` (``<u4``,
    ``(2,)``, raw) right after it unless given; a given one is checked."""
    by_name = {f.name: f for f in fields}
    out: list[Field] = []
    for f in fields:
        if f.name.endswith(HW_SUFFIX) and f.name[: -len(HW_SUFFIX)] in by_name \
                and by_name[f.name[: -len(HW_SUFFIX)]].shaped:
            if f.dtype != HW_DTYPE or f.shape != (2,) or not f.codec.raw or f.kind != "array":
                raise SchemaError(f"field {f.name!r} is the companion of the image field {f.name[:-3]!r}: it must be "
                                  f"{HW_DTYPE.str} of shape (2,), raw, found {f.dtype_name} {list(f.shape)} {f.codec}")
            continue  # placed after its image field
        out.append(f)
        if f.shaped:
            out.append(by_name.get(f.hw_name) or Field(f.hw_name, HW_DTYPE, (2,)))
    return out


def coerce_shaped(f: Field, value: Any) -> np.ndarray:
    """One image of shaped field ``f`` as a C-contiguous array of its dtype:
    ``(h, w)`` or ``(h, w, C)`` as the field's shape says (a ``(h, w)``
    array is taken for ``C == 1``), ``h`` and ``w`` at least 1. Casts as
    ``_coerce``.

    Raises
    ------
    SchemaError
        Another number of dimensions or channels, an empty image, a lossy cast.
    """
    arr = _as_array(f, value)
    if len(f.shape) == 3 and f.shape[2] == 1 and arr.ndim == 2:
        arr = arr[:, :, None]
    want = "(h, w)" if len(f.shape) == 2 else f"(h, w, {f.shape[2]})"
    if arr.ndim != len(f.shape) or arr.shape[2:] != tuple(f.shape[2:]):
        raise SchemaError(f"field {f.name!r}: expected an image of shape {want}, found an array of shape {arr.shape}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise SchemaError(f"field {f.name!r}: an image has at least 1 x 1 pixels, found shape {arr.shape}")
    if arr.size * f.dtype.itemsize > SHAPED_MAX_BYTES:
        raise SchemaError(f"field {f.name!r}: an image of shape {arr.shape} is larger than the {SHAPED_MAX_BYTES:,} "
                          "bytes a record of an image field of its own shape may hold; resize it first")
    if not f.codec.raw and f.codec.name != "zstd":
        try:
            f.codec.check(f.dtype, arr.shape, where=f"field {f.name!r}")
        except SchemaError as exc:
            raise SchemaError(f"{exc} (this record)") from None
    return _coerce(Field(f.name, f.dtype, arr.shape), arr)


def _check_ragged_codec(name: str, codec: Codec) -> None:
    if codec.name not in ("raw", "zstd"):
        raise SchemaError(f"field {name!r}: a ragged (variable-length, str or bytes) field is stored raw or with "
                          f"zstd, not {codec.spec}")


def coerce_ragged(f: Field, value: Any) -> np.ndarray:
    """One entry of ragged field ``f`` as a C-contiguous array of ``(n,
    *row)`` of its dtype (``|u1`` bytes for ``str``, UTF-8, and ``bytes``).
    An empty list or array is an entry of zero rows. Casts as ``_coerce``.

    Raises
    ------
    SchemaError
        Another row shape, a lossy cast, a ``str`` field given bytes (or a
        ``bytes`` field given text), text that is not encodable as UTF-8.
    """
    if f.shaped:
        return coerce_shaped(f, value)
    if f.kind == "str":
        if not isinstance(value, str):
            raise SchemaError(f"field {f.name!r}: expected str, found {type(value).__name__}")
        try:
            raw = value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SchemaError(f"field {f.name!r}: text is not encodable as UTF-8 ({exc})") from None
        return np.frombuffer(raw, np.uint8)
    if f.kind == "bytes":
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise SchemaError(f"field {f.name!r}: expected bytes, found {type(value).__name__}")
        return np.frombuffer(bytes(value), np.uint8)
    if isinstance(value, (str, bytes)):
        raise SchemaError(f"field {f.name!r}: expected rows of {list(f.row_shape)} numbers, found "
                          f"{type(value).__name__}")
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"field {f.name!r}: cannot make an array of {type(value).__name__} ({exc}); rows of "
                          f"a ragged field must all have shape {f.row_shape}") from None
    if arr.size == 0 and arr.ndim <= 1 + len(f.row_shape) and arr.dtype.kind in "biufc":
        arr = arr.reshape((0, *f.row_shape))  # [] or np.zeros((0, 4)): zero rows
    if arr.ndim != len(f.shape) or arr.shape[1:] != f.row_shape:
        raise SchemaError(f"field {f.name!r}: expected rows of shape {f.row_shape} (an array of shape "
                          f"(n, {', '.join(map(str, f.row_shape))})), found an array of shape {arr.shape}")
    return _coerce(Field(f.name, f.dtype, arr.shape), arr)


def _as_array(f: Field, value: Any) -> np.ndarray:
    """``value`` (an array, a torch tensor, a nested sequence) as a numpy array, as it is."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # torch.Tensor, without importing torch
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"field {f.name!r}: cannot make an array of {type(value).__name__} ({exc})") from None


def _coerce(f: Field, value: Any) -> np.ndarray:
    arr = _as_array(f, value)
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
    """Like ``_coerce`` for a block of rows: shape ``(n, *f.shape)``; a
    ragged field's block is a list of entries."""
    if f.ragged:
        return [coerce_ragged(f, v) for v in value]  # type: ignore[return-value]
    arr = np.asarray(value)
    if arr.shape[1:] != f.shape:
        raise SchemaError(f"field {f.name!r}: expected rows of shape {f.shape}, found {arr.shape[1:]}")
    return _coerce(Field(f.name, f.dtype, arr.shape), arr)
