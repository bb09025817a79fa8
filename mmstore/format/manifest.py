"""Reading a store's manifest: :func:`read_manifest` (the file, size capped,
with what to do when there is none) and :func:`parse_manifest` (untrusted
JSON -> typed values, or ``FormatError`` naming the key). The rules are the
specification's (:mod:`mmstore.format`); this module enforces them."""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import numpy as np

from ..errors import FormatError, SchemaError, VersionError
from . import layout as _fmt  # read at call time: the reader's limits (tests stand in an older reader)
from .codecs import RAW, codec_from_json
from .layout import (
    CHECKSUM_ALGORITHM,
    CHECKSUMS_FILE,
    FIELD_NAME_RE,
    FORMAT_NAME,
    HW_SUFFIX,
    KEYS_BLOB_FILE,
    KEYS_OFFSETS_FILE,
    MANIFEST_FILE,
    MANIFEST_MAX_BYTES,
    MAX_STORE_BYTES,
    PART_ID_RE,
    PART_TABLE_FEATURE,
    PART_TABLE_FILE,
    PART_TABLE_VERSION,
    PARTIAL_SUFFIX,
    PARTS_DIR,
    PARTS_FEATURE,
    PARTS_VERSION,
    RAGGED_FEATURE,
    RAGGED_VERSION,
    SHAPES_FEATURE,
    SHAPES_VERSION,
    SUPPORTED_BACKENDS,
    VARIABLE_VERSION,
    normalize_dtype,
    open_store_file,
    part_file,
)
from .parttable import PartTable, check_unique_ids, decode_part_table, part_data_names, part_table_max_bytes


def _parse_int(path: str, obj: dict[str, Any], key: str, minimum: int = 0) -> int:
    val = obj.get(key)
    if isinstance(val, bool) or not isinstance(val, int) or not minimum <= val <= MAX_STORE_BYTES:
        raise _fail(path, f"'{key}' must be an integer from {minimum} to {MAX_STORE_BYTES}, found {val!r}")
    return val


def _parse_schema(path: str, raw: object) -> list[tuple[str, np.dtype, tuple[int, ...], Any]]:
    if not isinstance(raw, list) or not raw:
        raise _fail(path, f"'schema' must be a non-empty list of fields, found {type(raw).__name__}")
    out: list[tuple[str, np.dtype, tuple[int, ...], Any]] = []
    seen: set[str] = set()
    for i, ent in enumerate(raw):
        if not isinstance(ent, dict):
            raise _fail(path, f"schema[{i}] must be an object")
        name, dts, shape = ent.get("name"), ent.get("dtype"), ent.get("shape")
        if not isinstance(name, str) or not FIELD_NAME_RE.match(name):
            raise _fail(path, f"schema[{i}].name {name!r} is not a valid field name (letters, digits, _)")
        if name in seen:
            raise _fail(path, f"field {name!r} appears twice in the schema")
        seen.add(name)
        if not isinstance(dts, str):
            raise _fail(path, f"schema[{i}].dtype must be a string, found {dts!r}")
        codec = codec_from_json(path, ent["codec"], name) if "codec" in ent else RAW
        if isinstance(shape, list) and shape[:2] == [None, None]:
            out.append(_parse_shaped(path, name, dts, shape, codec))
            continue
        if dts in ("str", "bytes") or (isinstance(shape, list) and shape[:1] == [None]):
            out.append(_parse_ragged(path, name, dts, shape, codec))
            continue
        try:
            dt = normalize_dtype(dts, where=f"{path}: field {name!r}")
        except FormatError:
            raise
        if dt.str != dts:
            raise _fail(path, f"field {name!r} dtype {dts!r} is not explicit; expected {dt.str!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 32
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)
        ):
            raise _fail(path, f"field {name!r} shape must be a list of ints >= 0, found {shape!r}")
        try:
            codec.check(dt, tuple(shape), where=f"{path}: field {name!r}")
        except SchemaError as exc:
            raise _fail(path, str(exc)) from None
        out.append((name, dt, tuple(shape), codec))
    _check_hw_fields(path, out)
    return out


def _parse_shaped(path: str, name: str, dts: str, shape: list[Any],
                  codec: Any) -> tuple[str, Any, tuple[Any, ...], Any]:
    """A shaped schema entry (see "Images of their own shape"): ``[null,
    null]`` or ``[null, null, C]``, ``C`` from 1 to 4, a codec that stores
    images of that dtype and channels."""
    if len(shape) not in (2, 3) or (len(shape) == 3 and (isinstance(shape[2], bool) or not isinstance(shape[2], int)
                                                        or not 1 <= shape[2] <= 4)):
        raise _fail(path, f"field {name!r}: an image of its own shape has shape [null, null] or [null, null, C] "
                    f"with C from 1 to 4, found {shape!r}")
    dt = normalize_dtype(dts, where=f"{path}: field {name!r}")
    if dt.str != dts:
        raise _fail(path, f"field {name!r} dtype {dts!r} is not explicit; expected {dt.str!r}")
    try:
        codec.check(dt, (1, 1, *shape[2:]), where=f"{path}: field {name!r}")
    except SchemaError as exc:
        raise _fail(path, str(exc)) from None
    return (name, dt, (None, None, *shape[2:]), codec)


def _check_hw_fields(path: str, schema: list[Any]) -> None:
    """Each shaped field ``F`` has its companion ``F_hw``: ``<u4``, ``[2]``, raw."""
    by_name = {ent[0]: ent for ent in schema}
    for name, _, shape, _ in schema:
        if shape[:2] != (None, None):
            continue
        hw = by_name.get(name + HW_SUFFIX)
        if hw is None or hw[1] != np.dtype("<u4") or hw[2] != (2,) or not hw[3].raw:
            raise _fail(path, f"field {name!r} is an image of its own shape: the schema must have its companion "
                        f"field {name + HW_SUFFIX!r} ({{\"dtype\": \"<u4\", \"shape\": [2]}}, raw), found "
                        f"{'none' if hw is None else [str(hw[1]), list(hw[2]), str(hw[3])]}")


def _parse_classes(path: str, raw: object, schema: list[tuple[str, Any, tuple[Any, ...], Any]]) -> dict[str, Any]:
    """The schema entries' optional ``classes`` (see "Class names of a field"),
    checked, as ``{field: ((id, name), ...)}``."""
    from .schema import Field, normalize_classes  # schema imports format: at call time

    out: dict[str, Any] = {}
    for ent, (name, dt, shape, codec) in zip(raw, schema):  # type: ignore[call-overload]
        if "classes" not in ent:
            continue
        kind = dt if isinstance(dt, str) else "array"
        fld = Field(name, np.dtype("|u1") if isinstance(dt, str) else dt, shape, codec, kind)
        cls = ent["classes"]
        if not isinstance(cls, list) or not all(isinstance(p, list) and len(p) == 2 for p in cls):
            raise _fail(path, f"field {name!r}: 'classes' must be a list of [id, name] pairs")
        try:
            norm = normalize_classes(fld, cls)
        except SchemaError as exc:
            raise _fail(path, str(exc)) from None
        if [list(p) for p in norm] != cls:
            raise _fail(path, f"field {name!r}: 'classes' must be sorted by id")
        out[name] = norm
    return out


def _parse_buckets(path: str, raw: object, schema: list[tuple[str, Any, tuple[Any, ...], Any]]) -> dict[str, Any]:
    """The schema entries' optional ``buckets`` (see "Aspect buckets"),
    checked, as ``{field: ((h, w), ...)}``: only on a shaped field, a
    non-empty list of distinct ``[h, w]`` pairs of positive ints, no two of
    one aspect, listed from the tallest to the widest."""
    from .schema import Field, normalize_buckets  # schema imports format: at call time

    out: dict[str, Any] = {}
    for ent, (name, dt, shape, codec) in zip(raw, schema):  # type: ignore[call-overload]
        if "buckets" not in ent:
            continue
        if shape[:2] != (None, None):
            raise _fail(path, f"field {name!r}: 'buckets' belongs to an image field of its own shape (shape [null, "
                        f"null, C]), but its shape is {list(shape)}")
        got = ent["buckets"]
        if not isinstance(got, list) or not all(isinstance(p, list) and len(p) == 2 for p in got):
            raise _fail(path, f"field {name!r}: 'buckets' must be a non-empty list of [h, w] pairs of positive ints, "
                        f"found {str(got)[:100]}")
        try:
            norm = normalize_buckets(Field(name, dt, shape, codec), got)
        except SchemaError as exc:
            raise _fail(path, str(exc)) from None
        if [list(p) for p in norm] != got:
            raise _fail(path, f"field {name!r}: 'buckets' must be listed from the tallest to the widest (w / h "
                        "ascending)")
        out[name] = norm
    return out


def _parse_ragged(path: str, name: str, dts: str, shape: Any, codec: Any) -> tuple[str, Any, tuple[Any, ...], Any]:
    """A ragged schema entry (see "Ragged fields"): ``(name, dtype or "str" /
    "bytes", (None, *row), codec)``."""
    if (
        not isinstance(shape, list)
        or not 1 <= len(shape) <= 32
        or shape[0] is not None
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape[1:])
    ):
        raise _fail(path, f"field {name!r}: a ragged field's shape must be [null, ints >= 0...], found {shape!r}")
    if codec.name not in ("raw", "zstd"):
        raise _fail(path, f"field {name!r}: a ragged field is stored raw or with zstd, not {codec}")
    if dts in ("str", "bytes"):
        if shape != [None]:
            raise _fail(path, f"field {name!r}: a {dts} field has shape [null], found {shape!r}")
        return (name, dts, (None,), codec)
    dt = normalize_dtype(dts, where=f"{path}: field {name!r}")
    if dt.str != dts:
        raise _fail(path, f"field {name!r} dtype {dts!r} is not explicit; expected {dt.str!r}")
    if dt.itemsize * math.prod(shape[1:]) == 0:
        raise _fail(path, f"field {name!r}: a ragged field's rows must have at least one byte, found {shape!r}")
    if dt.itemsize * math.prod(shape[1:]) > MAX_STORE_BYTES:
        raise _fail(path, f"field {name!r} rows of shape {shape[1:]} are larger than any store can hold")
    return (name, dt, (None, *shape[1:]), codec)


def _parse_requires(path: str, obj: dict[str, Any], ver: list[int], schema: list[Any]) -> list[str]:
    """``requires``: features this reader must know (see "Ragged fields")."""
    req = obj.get("requires", [])
    if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
        raise _fail(path, f"'requires' must be a list of feature names, found {req!r}")
    unknown = [r for r in req if r not in _fmt.KNOWN_FEATURES]
    if unknown:
        raise VersionError(
            f"{path}: the store requires feature(s) {unknown}, which this mmstore does not know (it knows "
            f"{', '.join(_fmt.KNOWN_FEATURES)}); upgrade mmstore (pip install -U mmstore) to read it"
        )
    shaped = [f[0] for f in schema if f[2][:2] == (None, None)]
    if shaped and (SHAPES_FEATURE not in req or tuple(ver) < SHAPES_VERSION):
        raise _fail(path, f"field(s) {shaped} of images of their own shape need format version "
                    f"{SHAPES_VERSION[0]}.{SHAPES_VERSION[1]} and 'requires': [{SHAPES_FEATURE!r}]; the manifest says "
                    f"{ver[0]}.{ver[1]}, requires {req}")
    ragged = [f[0] for f in schema if f[2][:1] == (None,) and f[2][:2] != (None, None)]
    if ragged and (RAGGED_FEATURE not in req or tuple(ver) < RAGGED_VERSION):
        raise _fail(path, f"ragged field(s) {ragged} need format version {RAGGED_VERSION[0]}.{RAGGED_VERSION[1]} "
                    f"and 'requires': [{RAGGED_FEATURE!r}]; the manifest says {ver[0]}.{ver[1]}, requires {req}")
    return req


def _parse_version(path: str, ver: Any) -> list[int]:
    if (
        not isinstance(ver, list)
        or len(ver) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ver)
    ):
        raise _fail(path, f"'version' must be [major, minor], found {ver!r}")
    if ver[0] not in _fmt.READ_MAJORS:
        raise VersionError(
            f"{path}: store format version {ver[0]}.{ver[1]}, but this mmstore reads "
            f"{' and '.join(f'{m}.x' for m in _fmt.READ_MAJORS)}; upgrade mmstore (pip install -U mmstore) or "
            "re-create the store with this version"
        )
    return ver


def _check_field_sizes(path: str, schema: list[Any], slots: int, ver: list[int]) -> None:
    """Every field's data is representable (``MAX_STORE_BYTES``); codecs need 2.x."""
    for name, dt, shape, codec in schema:
        if shape[:1] == (None,):  # ragged: checked by _parse_ragged; its offsets must be representable
            if 8 * (slots + 1) > MAX_STORE_BYTES:
                raise _fail(path, f"field {name!r} over {slots} slots is larger than any store can hold")
            continue
        entry = dt.itemsize * math.prod(shape)
        if not codec.raw:
            if ver[0] < VARIABLE_VERSION[0]:
                raise _fail(path, f"field {name!r} has codec {codec}, which needs format version "
                            f"{VARIABLE_VERSION[0]}.{VARIABLE_VERSION[1]}; the manifest says {ver[0]}.{ver[1]}")
            # entries have any size (bounded by the data file's listed size);
            # the decoded entry and the offsets file must still be representable
            if max(entry, 8 * (slots + 1)) > MAX_STORE_BYTES:
                raise _fail(path, f"field {name!r} of shape {list(shape)} over {slots} slots is larger than any "
                            f"store can hold ({MAX_STORE_BYTES})")
            continue
        if max(entry, slots * entry) > MAX_STORE_BYTES:
            raise _fail(path, f"field {name!r} of shape {list(shape)} needs {slots * entry} bytes over {slots} "
                        f"slots, more than any store can hold ({MAX_STORE_BYTES})")


def _safe_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\x00" not in name and name != MANIFEST_FILE)


def _parse_files(path: str, files: Any, parts: list[str] | None) -> dict[str, int]:
    """``files``: plain names of the store's directory, and with ``parts``
    ``parts/<id>/<name>`` of a listed part (nothing else: no other directory,
    no ``..``)."""
    if not isinstance(files, dict):
        raise _fail(path, f"'files' must be an object of file sizes, found {type(files).__name__}")
    known = set(parts or ())
    for name, size in files.items():
        bits = name.split("/") if isinstance(name, str) else []
        in_part = len(bits) == 3 and bits[0] == PARTS_DIR and bits[1] in known and _safe_name(bits[2])
        if not (in_part or _safe_name(name)):
            raise _fail(path, f"'files' names an unsafe file {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_STORE_BYTES:
            raise _fail(path, f"'files'[{name!r}] must be a size >= 0, found {size!r}")
    return files


def _parse_segments(path: str, segments: Any, slots: int, ver: list[int]) -> list[int] | None:
    if segments is None:
        return None
    if (
        not isinstance(segments, list)
        or not segments
        or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in segments)
    ):
        raise _fail(path, f"'segments' must be a non-empty list of slot counts >= 0, found {segments!r}")
    if sum(segments) != slots:
        raise _fail(path, f"'segments' add up to {sum(segments)} slots, but 'slots' is {slots}")
    if tuple(ver) < (1, 1):
        raise _fail(path, f"'segments' needs format version 1.1, the manifest says {ver[0]}.{ver[1]}")
    return segments


def _parse_part_table(path: str, obj: dict[str, Any], ver: list[int], req: list[str]) -> dict[str, Any] | None:
    """``part_table`` (2.4): ``{"file": PART_TABLE_FILE, "parts": N}``, in
    place of ``parts`` and ``segments`` (see "The part table")."""
    pt = obj.get("part_table")
    if pt is None:
        if PART_TABLE_FEATURE in req:
            raise _fail(path, f"'requires' lists {PART_TABLE_FEATURE!r} but there is no 'part_table'")
        return None
    n = pt.get("parts") if isinstance(pt, dict) else None
    if (not isinstance(pt, dict) or set(pt) != {"file", "parts"} or pt.get("file") != PART_TABLE_FILE
            or isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_STORE_BYTES):
        raise _fail(path, f"'part_table' must be {{\"file\": {PART_TABLE_FILE!r}, \"parts\": an integer >= 1}}, "
                    f"found {str(pt)[:200]}")
    if "parts" in obj or "segments" in obj:
        raise _fail(path, "a store with a 'part_table' lists its parts and segments there: 'parts' and 'segments' "
                    "must be absent")
    if PART_TABLE_FEATURE not in req or PARTS_FEATURE not in req or tuple(ver) < PART_TABLE_VERSION:
        raise _fail(path, f"'part_table' needs format version {PART_TABLE_VERSION[0]}.{PART_TABLE_VERSION[1]} and "
                    f"'requires': [{PARTS_FEATURE!r}, {PART_TABLE_FEATURE!r}]; the manifest says {ver[0]}.{ver[1]}, "
                    f"requires {req}")
    return {"file": PART_TABLE_FILE, "parts": n}


def _parse_parts(path: str, parts: Any, segments: list[int] | None, ver: list[int], req: list[str],
                 table: bool = False) -> list[str] | None:
    """``parts``: one id per segment, each matching ``PART_ID_RE``, unique
    (see "Parts" in the specification)."""
    if parts is None:
        if PARTS_FEATURE in req and not table:
            raise _fail(path, f"'requires' lists {PARTS_FEATURE!r} but there is no 'parts'")
        return None
    if (not isinstance(parts, list) or any(not isinstance(p, str) or not PART_ID_RE.match(p) for p in parts)
            or len(set(parts)) != len(parts)):
        raise _fail(path, "'parts' must be a list of distinct part ids (letters, digits, '_', '.', '-'; up to 128 "
                    f"characters, not starting with '.', '_' or '-'), found {str(parts)[:200]}")
    if segments is None or len(parts) != len(segments):
        raise _fail(path, f"'parts' has {len(parts)} ids, but 'segments' "
                    + ("is absent" if segments is None else f"has {len(segments)} counts") + "; they pair up")
    if PARTS_FEATURE not in req or tuple(ver) < PARTS_VERSION:
        raise _fail(path, f"'parts' needs format version {PARTS_VERSION[0]}.{PARTS_VERSION[1]} and 'requires': "
                    f"[{PARTS_FEATURE!r}]; the manifest says {ver[0]}.{ver[1]}, requires {req}")
    return parts


def parse_manifest(raw: bytes, path: str = MANIFEST_FILE) -> dict[str, Any]:
    """See :func:`mmstore.format.parse_manifest`."""
    if len(raw) > _fmt.MANIFEST_MAX_BYTES:
        raise _fail(path, f"size {len(raw)} bytes exceeds the {_fmt.MANIFEST_MAX_BYTES}-byte limit")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: > 4,300-digit integers
        raise _fail(path, f"not valid UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"expected a JSON object, found {type(obj).__name__}")
    if obj.get("format") != FORMAT_NAME:
        raise _fail(path, f"'format' must be {FORMAT_NAME!r}, found {obj.get('format')!r}")
    ver = _parse_version(path, obj.get("version"))
    store_id = obj.get("store_id")
    if not isinstance(store_id, str) or not re.fullmatch(r"[0-9a-f]{32}", store_id):
        raise _fail(path, f"'store_id' must be 32 hex digits, found {store_id!r}")
    backend = obj.get("backend")
    if backend not in SUPPORTED_BACKENDS:
        raise _fail(path, f"'backend' must be one of {SUPPORTED_BACKENDS}, found {backend!r}")
    records = _parse_int(path, obj, "records")
    slots = _parse_int(path, obj, "slots")
    if records > slots:
        raise _fail(path, f"'records' ({records}) exceeds 'slots' ({slots})")
    _parse_requires(path, obj, ver, [])  # an unknown feature first: the schema may use it
    schema = _parse_schema(path, obj.get("schema"))
    classes = _parse_classes(path, obj["schema"], schema)
    buckets = _parse_buckets(path, obj["schema"], schema)
    _check_field_sizes(path, schema, slots, ver)
    requires = _parse_requires(path, obj, ver, schema)
    ck = obj.get("checksum")
    if (
        not isinstance(ck, dict)
        or ck.get("algorithm") != CHECKSUM_ALGORITHM
        or not isinstance(ck.get("digest"), str)
        or not re.fullmatch(r"[0-9a-f]{16}", ck["digest"])
    ):
        raise _fail(path, f"'checksum' must be {{'algorithm': '{CHECKSUM_ALGORITHM}', 'digest': 16 hex}}, found {ck!r}")
    table = _parse_part_table(path, obj, ver, requires)
    segments = _parse_segments(path, obj.get("segments"), slots, ver)
    parts = _parse_parts(path, obj.get("parts"), segments, ver, requires, table is not None)
    files = _parse_files(path, obj.get("files"), parts)
    digests = obj.get("digests", {})
    if not isinstance(digests, dict) or any(
        n not in files or not isinstance(d, str) or not re.fullmatch(r"[0-9a-f]{16}", d) for n, d in digests.items()
    ):
        raise _fail(path, "'digests' must map files listed in 'files' to 16 hex digits")
    if table is not None:
        most = part_table_max_bytes(table["parts"], len(part_data_names(backend, schema)))
        size = files.get(PART_TABLE_FILE)
        if size is None or PART_TABLE_FILE not in digests or size > most:
            raise _fail(path, f"a store with a part table lists {PART_TABLE_FILE!r} in 'files' (at most {most} bytes "
                        f"for {table['parts']} parts) and in 'digests', found size {size!r}, digest "
                        f"{digests.get(PART_TABLE_FILE)!r}")
    labels = obj.get("label_names")
    if labels is not None and (not isinstance(labels, list) or not all(isinstance(s, str) for s in labels)):
        raise _fail(path, "'label_names' must be a list of strings or null")
    prov = obj.get("provenance", {})
    if not isinstance(prov, dict):
        raise _fail(path, "'provenance' must be an object")
    out = dict(obj)
    out.update(
        version=tuple(ver),
        records=records,
        slots=slots,
        schema=schema,
        classes=classes,
        buckets=buckets,
        checksum_digest=ck["digest"],
        files=dict(files),
        digests=dict(digests),
        label_names=labels,
        provenance=prov,
        segments=list(segments) if segments is not None else None,
        parts=list(parts) if parts is not None else None,
        requires=list(requires),
        part_table=table,
    )
    return out


def part_table_limit(manifest: dict[str, Any]) -> int:
    """The bytes of the part table of a (parsed) manifest with one: the size
    its ``files`` lists, which parsing bounded by the most its parts can take."""
    return int(manifest["files"][PART_TABLE_FILE])


def expand_manifest(manifest: dict[str, Any], raw_table: bytes | bytearray, path: str) -> dict[str, Any]:
    """A (parsed) manifest of a store with a part table, with its parts in
    the 2.2 form that whole-store tools use: ``parts`` and ``segments``
    lists, and each part's data files in ``files`` (``parts/<id>/<name>``).
    ``raw_table``: the bytes of ``_parts.bin``, checked whole here (digest,
    every rule, ids appearing once; ``path`` names it in errors). A manifest
    without a part table is returned as it is."""
    table = manifest.get("part_table")
    if table is None:
        return manifest
    names = part_data_names(manifest["backend"], manifest["schema"])
    t = decode_part_table(raw_table, parts=table["parts"], files_per_part=len(names), slots=manifest["slots"],
                          digest=manifest["digests"][PART_TABLE_FILE], path=path)
    return expand_with_table(manifest, t, path)


def expand_with_table(manifest: dict[str, Any], t: PartTable, path: str) -> dict[str, Any]:
    """:func:`expand_manifest` with the part table already decoded (``t``);
    its ids are checked to appear once here."""
    names = part_data_names(manifest["backend"], manifest["schema"])
    ids = check_unique_ids(t, path)
    out = dict(manifest)
    files = dict(manifest["files"])
    for pid, row in zip(ids, t.sizes.tolist()):
        for name, size in zip(names, row):
            files[part_file(pid, name)] = int(size)
    out.update(parts=ids, segments=t.counts(), files=files)
    return out


def read_part_table(store_dir: str, manifest: dict[str, Any], *, dir_fd: int | None = None,
                    ident: dict[str, tuple[int, int, int, int]] | None = None) -> bytearray:
    """The bytes of the part table of the store in ``store_dir`` whose
    (parsed) manifest is ``manifest``: no more than its listed size is read,
    and a file of another size is refused (``FormatError``)."""
    from .layout import note_identity

    path = os.path.join(store_dir, PART_TABLE_FILE)
    want = part_table_limit(manifest)
    fd = open_store_file(path, missing=f"{path}: missing, but the manifest lists it; the store is damaged: restore "
                         "the file from a copy or write the store again", dir_fd=dir_fd, ident=ident)
    try:
        st = os.fstat(fd)
        note_identity(ident, path, st)
        if st.st_size != want:
            raise FormatError(f"{path}: expected {want} bytes (the manifest's size), found {st.st_size}: the file "
                              "was truncated or extended; restore the store from a copy or write it again")
        raw = bytearray(want)
        view = memoryview(raw)
        got = 0
        while got < want:  # into one buffer: no copy of a table of tens of MB
            n = os.preadv(fd, [view[got : got + (1 << 26)]], got)
            if not n:
                break
            got += n
    finally:
        os.close(fd)
    if got != want:
        raise FormatError(f"{path}: read {got} of its {want} bytes: the file was truncated while being read")
    return raw


def _fail(path: str, what: str) -> FormatError:
    return FormatError(f"{path}: {what}; the manifest is damaged or not an mmstore manifest")


def _unfinished(store_dir: str) -> str:
    """Why there is only ``STORE.partial``, and how to finish it: what made
    it (an ingest, a merge or a ``StoreWriter``) says which."""
    partial = store_dir + PARTIAL_SUFFIX
    head = f"{store_dir}: no store here, but {partial} exists: "
    if os.path.isfile(os.path.join(partial, MANIFEST_FILE)):
        return (head + "it holds a finished store waiting to be published (renamed to "
                f"{os.path.basename(store_dir)}): a writer is publishing it right now (open the store again in a "
                "moment) or was stopped just before; to publish it, rerun the same `mmstore ingest ... --resume` "
                "command (Python: ingest(..., resume=True)), or rerun the merge")
    if os.path.isfile(os.path.join(partial, "_ingest.json")):
        return (head + "an ingest into it did not finish; rerun the same `mmstore ingest ... --resume` command "
                "(Python: the same ingest(..., resume=True) call) to complete it")
    if os.path.isfile(os.path.join(partial, "_merging")):
        return head + "a merge into it did not finish; rerun the same `mmstore merge` command (it starts over)"
    return (head + "a StoreWriter writing it was not closed (an error inside its `with` block, or the process "
            "stopped); continue it with StoreWriter(path, <the same schema and slots>, resume=True) (what was "
            "written keeps its bytes: mark_written() the slots you synced, write the others, then close()), or "
            "start over with overwrite=True")


def _no_manifest(store_dir: str) -> str:
    """Why directory ``store_dir`` (no manifest) cannot be opened, and what to
    do: a store that lost its manifest, or a plain folder (of images, say)
    that was never ingested. Looks at no more than 10,000 names."""
    import itertools
    import shlex

    marks = {CHECKSUMS_FILE, KEYS_OFFSETS_FILE, KEYS_BLOB_FILE}
    try:
        with os.scandir(store_dir) as it:
            found = sorted(e.name for e in itertools.islice(it, 10_000) if e.name in marks)
    except OSError:
        found = []
    if found:
        return (f"{store_dir}: no {MANIFEST_FILE}, but store files ({', '.join(found)}): this is not a finished "
                "mmstore store; its manifest was deleted or not copied (copy the store again, or re-create it)")
    return (f"{store_dir}: no {MANIFEST_FILE}: a plain folder, not an mmstore store; to make a store from the "
            f"files in it: mmstore ingest {shlex.quote(store_dir)} DEST.store")


def read_manifest(store_dir: str, *, dir_fd: int | None = None, expand: bool = True) -> dict[str, Any]:
    """Read and validate ``store_dir/manifest.json`` (size capped first).

    ``dir_fd``: a descriptor of the directory ``store_dir`` named when the
    caller opened it; the manifest is read from that directory even if
    ``store_dir`` names another one by now (see "Replacing a store").
    ``expand``: a store with a part table is returned with its parts listed
    as in 2.2 (:func:`expand_manifest`, after reading and checking the whole
    table); False: as written, its ``part_table`` only (what a reader that
    reads parts lazily wants)."""
    from ..errors import IncompleteStoreError

    path = os.path.join(store_dir, MANIFEST_FILE)
    if dir_fd is None and os.path.exists(store_dir) and not os.path.isdir(store_dir):
        raise IncompleteStoreError(f"{store_dir}: is a file, not a store (a store is a directory)")
    try:
        fd = open_store_file(path, dir_fd=dir_fd)
    except FileNotFoundError:
        if os.path.isdir(store_dir + PARTIAL_SUFFIX) and not os.path.isdir(store_dir):
            raise IncompleteStoreError(_unfinished(store_dir)) from None
        if os.path.isdir(store_dir):
            raise IncompleteStoreError(_no_manifest(store_dir)) from None
        raise IncompleteStoreError(f"{store_dir}: no such store (directory not found)") from None
    except NotADirectoryError:
        raise IncompleteStoreError(f"{store_dir}: not a store (a path component is a file)") from None
    try:
        size = os.fstat(fd).st_size
        if size > MANIFEST_MAX_BYTES:
            raise _fail(path, f"size {size} bytes exceeds the {MANIFEST_MAX_BYTES}-byte limit")
        chunks = []
        while True:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            if sum(map(len, chunks)) > MANIFEST_MAX_BYTES:
                raise _fail(path, f"larger than the {MANIFEST_MAX_BYTES}-byte limit")
    finally:
        os.close(fd)
    m = parse_manifest(b"".join(chunks), path)
    if expand and m["part_table"] is not None:
        raw = read_part_table(store_dir, m, dir_fd=dir_fd)
        m = expand_manifest(m, raw, os.path.join(store_dir, PART_TABLE_FILE))
    return m
