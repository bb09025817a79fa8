"""List sources: a ``.csv``/``.tsv``/``.tab``/``.txt`` file naming one input
per row (a path column, an optional label column, optional tags and caption
columns), and the rules for its label cells (integers stay the integers they
are, names become classes, blank or bad cells are that row's error), its tag
cells and its captions (see :class:`ListSource` and :mod:`.tags`)."""

from __future__ import annotations

import csv
import itertools
import os
from array import array
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import xxhash

from ..errors import IngestError, LabelMappingError, MmstoreError, SourceError
from ..format.layout import decode_key, encode_key
from ._listing import Listing, Source, _Builder, _stat_key, none_found, read_file
from .classes import class_options, map_classes
from .tags import TagColumns

_BLANK = frozenset({"", "nan", "na", "<na>", "null", "none"})  # what a blank cell of an integer column may read
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _int_cell(s: str) -> int | None:
    """The integer a label cell holds (``7``, ``-3``, ``7.0``, ``7.``), else None."""
    t = s.strip()
    head, dot, tail = t.partition(".")
    if not head.lstrip("+-").isdigit() or head.count("-") + head.count("+") > 1 or (dot and tail.strip("0")):
        return None
    if not head.isascii():
        return None
    return int(head)


def _label_values(
    ids: dict[str, int], label_type: str, missing: str, column: str, path: str
) -> tuple[np.ndarray, list[str] | None, dict[int, str]]:
    """Stored label of each distinct cell (``remap[cell]``), the label names
    (None for an integer column) and the cells that make their rows holes."""
    ints = {c: _int_cell(c) for c in ids}
    is_int = {c for c, v in ints.items() if v is not None}
    blank_int = {c for c in ids if c.lower() in _BLANK and c not in is_int}
    other = [c for c in ids if c not in is_int and c not in blank_int and c != ""]
    kind = label_type
    if kind == "auto":
        if is_int and other:
            ex_i, ex_o = sorted(is_int)[:3], sorted(other)[:3]
            raise SourceError(
                f"{path}: label column {column!r} mixes integers ({len(is_int)} distinct, e.g. {ex_i}) and other "
                f"values ({len(other)} distinct, e.g. {ex_o}); nothing is renumbered silently: pass --label-type int "
                "(values that are not integers become holes listed in errors.jsonl) or --label-type names (every "
                "distinct value becomes a named class)"
            )
        kind = "int" if is_int else "names"
    remap = np.full(max(len(ids), 1), -1, np.int64)
    bad: dict[int, str] = {}
    names: list[str] | None = None
    blank = blank_int if kind == "int" else {""}
    if kind == "int" and missing == "class" and blank and any(ints[c] == -1 for c in is_int):
        raise SourceError(
            f"{path}: label column {column!r} already uses -1 as a label, and --missing-label class would give the "
            "blank cells that label too, merging them with it: pass --missing-label error (blank rows become "
            "holes listed in errors.jsonl), or give the blank rows a label of their own in the list"
        )
    if kind == "int":
        for c, k in ids.items():
            v = ints[c]
            if v is not None and _INT64[0] <= v <= _INT64[1]:
                remap[k] = v
            elif c in blank or c == "":
                if missing == "error":
                    bad[k] = f"bad-label: blank label cell ({c!r}) in integer column {column!r}"
            elif v is not None:
                bad[k] = f"bad-label: label {c!r} in column {column!r} does not fit a 64-bit integer"
            else:
                bad[k] = f"bad-label: label {c!r} in integer column {column!r} is not an integer"
    else:
        keep = sorted(c for c in ids if c not in blank or missing == "class")
        pos = {c: i for i, c in enumerate(keep)}
        names = keep
        for c, k in ids.items():
            if c in pos:
                remap[k] = pos[c]
            else:
                bad[k] = f"bad-label: blank label cell in column {column!r}"
    return remap, names, bad


def _label_notes(ids: dict[str, int], cells: np.ndarray, bad: dict[int, str], missing: str,
                 is_int: bool) -> dict[str, int]:
    """Summary lines (``note: N ...``) saying what happened to odd label cells."""
    notes: dict[str, int] = {}
    if bad:
        n = int(np.isin(cells, np.fromiter(bad, np.int64, len(bad))).sum())
        notes["inputs skipped for a blank or invalid label (reason bad-label in errors.jsonl; "
              "--missing-label class keeps blank ones as a class)"] = n
    if missing == "class":
        blank = [k for c, k in ids.items() if (c.lower() in _BLANK if is_int else c == "") and _int_cell(c) is None]
        n = int(np.isin(cells, np.array(blank, np.int64)).sum()) if blank else 0
        if n:
            notes["inputs with a blank label kept as a class of their own (--missing-label class: "
                  + ("label -1)" if is_int else "the class named '')")] = n
    return notes


class _Lines:
    """The lines of ``fh`` for ``csv.reader``, remembering when they ran out."""

    def __init__(self, fh: Any) -> None:
        self.fh = fh
        self.eof = False

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = self.fh.readline()
        if not line:
            self.eof = True
            raise StopIteration
        return line


MAX_CELL_CHARS = 64 << 20  # the longest cell of a list (a caption, a path): 64 Mi characters


def _csv_rows(fh: Any, path: str, delimiter: str, where: list[int] | None = None) -> Iterator[list[str]]:
    """The rows of the CSV text ``fh``; a row the csv module cannot parse (a
    cell over :data:`MAX_CELL_CHARS`, a NUL byte, a quote left open to the end
    of the file) is an ``IngestError`` naming its line. ``where[0]`` is set to
    the line the row yielded starts on (a quoted cell may hold line breaks).
    The csv module's cell limit (128 Ki characters by default, process-wide)
    is raised while the rows are read, so a long caption is a caption."""
    lines = _Lines(fh)
    reader = csv.reader(lines, delimiter=delimiter)
    old = csv.field_size_limit(MAX_CELL_CHARS)
    try:
        yield from _rows(reader, lines, path, where)
    finally:
        csv.field_size_limit(old)


def _rows(reader: Any, lines: _Lines, path: str, where: list[int] | None) -> Iterator[list[str]]:
    while True:
        start = reader.line_num + 1
        if where is not None:
            where[0] = start
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise SourceError(
                f"{path}:{reader.line_num}: not a CSV row the reader can parse ({e}); fix the list (a cell may "
                f"hold at most {MAX_CELL_CHARS:,} characters)"
            ) from None
        if lines.eof:  # a complete row ends at its line's end: this one needed the end of the file
            raise SourceError(
                f"{path}:{start}: a quote (\") opened in this row is never closed, so every line after it "
                f"(to line {reader.line_num}) would be one cell; nothing was created: fix the list"
            )
        yield row


class ListSource(Source):
    """A CSV/TSV list of paths or ids, with an optional label column.

    Parameters
    ----------
    path
        The list file (``.tsv`` and ``.tab`` are tab-separated, anything else
        comma-separated unless ``delimiter`` is given).
    header
        Whether the first row is a header. ``None`` (default): yes, unless the
        path column is not named and the first row's path cell is an existing
        file (a plain list of paths, e.g. a ``.txt``), in which case columns
        are numbered from 0 and there are no labels unless ``label_column``
        names one by index.
    root
        Directory relative paths are resolved against (default: the list
        file's directory).
    path_column
        Column name or 0-based index of the path/id (default: the first of
        ``path, file, filename, filepath, image, image_path, id, image_id``
        present, else column 0).
    label_column
        Column name or index of the label; default ``label`` if present, else
        none. ``""`` means no labels.
    label_type
        ``"auto"`` (default): a column whose every non-blank cell is an
        integer (``7``, ``-3``, or a pandas float export such as ``7.0``) is
        an *integer* column and its labels stay the integers they are (no
        names); a column with no integer cell is a *named* column: its
        distinct values are sorted (by code point) and numbered from 0, and
        the names saved as ``label_names``. A column that mixes both is
        refused with counts and examples (no guessing): choose ``"int"``
        (cells that are not integers become holes, reason ``bad-label``) or
        ``"names"`` (every distinct value is a named class).
    missing_label
        What a blank cell (empty; in an integer column also ``nan``, ``NA``,
        ``<NA>``, ``null``, ``None``) means: ``"error"`` (default): that
        input becomes a hole with reason ``bad-label``, listed in
        ``errors.jsonl`` and counted in the summary; ``"class"``: a class of
        its own: label ``-1`` in an integer column, the class named ``""``
        in a named column.
    path_template
        ``str.format`` template turning the id into a relative path, with the
        id as ``{id}`` (``{id[0]}`` is its first character), e.g.
        ``"{id[0]}/{id[1]}/{id[2]}/{id}.jpg"`` for Google Landmarks 2020.
    tags_column, tags_sep, tag_names
        Column name or index of multi-label tags (``cat;animal``): each row's
        tags, split at ``tags_sep`` (default ``";"``), become the ragged
        field ``tags`` (``<i4 (None,)``, the tag ids in the order written)
        whose ``classes`` are the tag names. See :class:`.tags.TagColumns`
        for the numbering, blank and repeated tags, and ``tag_names`` (a
        mapping file or a store, so train and val number tags alike).
    text_column
        Column name or index of a caption: each row's text, exactly as
        written, becomes the ``str`` field ``text``.

    The key of each record is the path column's value as written in the list.
    """

    kind = "list"
    _PATH_NAMES = ("path", "file", "filename", "filepath", "image", "image_path", "id", "image_id")

    def __init__(
        self,
        path: str,
        root: str | None = None,
        path_column: str | int | None = None,
        label_column: str | int | None = None,
        path_template: str | None = None,
        delimiter: str | None = None,
        header: bool | None = None,
        label_type: str = "auto",
        missing_label: str = "error",
        classes: list[str] | None = None,
        new_classes: str | None = None,
        classes_from: str | None = None,
        tags_column: str | int | None = None,
        tags_sep: str | None = None,
        text_column: str | int | None = None,
        tag_names: Any = None,
    ) -> None:
        super().__init__(path)
        self.tags = TagColumns(tags_column, tags_sep, text_column, tag_names, new_classes)
        if self.tags.mapping is not None and classes is None:
            new_classes = None  # --new-classes applies to the tag mapping alone
        self.classes, self.new_classes = class_options(classes, new_classes, classes_from)
        self.classes_from = classes_from
        if label_type not in ("auto", "int", "names"):
            raise ValueError(f"label_type must be auto, int or names, got {label_type!r}")
        if missing_label not in ("error", "class"):
            raise ValueError(f"missing_label must be error or class, got {missing_label!r}")
        self.label_type = label_type
        self.missing_label = missing_label
        self.header = header
        self.root = os.path.abspath(root if root is not None else (os.path.dirname(path) or "."))
        self.path_column = path_column
        self.label_column = label_column
        self.path_template = path_template
        if delimiter is None:
            delimiter = "\t" if path.lower().endswith((".tsv", ".tab")) else ","
        self.delimiter = delimiter
        if path_template is not None:
            try:
                path_template.format("x" * 64, id="x" * 64)
            except (KeyError, IndexError, ValueError, AttributeError) as exc:
                raise ValueError(f"--path-template {path_template!r}: {exc!r}; use {{id}}, {{id[0]}}, ...") from None

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d.update(
            root=self.root,
            path_column=self.path_column,
            label_column=self.label_column,
            path_template=self.path_template,
            delimiter=self.delimiter,
            header=self.header,
            label_type=self.label_type,
            missing_label=self.missing_label,
        )
        if self.classes is not None:
            d.update(classes_from=self.classes_from, new_classes=self.new_classes)
        d.update(self.tags.describe())
        return d

    def _mapped(
        self, names: list[str] | None, remap: np.ndarray, column: str, notes: dict[str, int]
    ) -> tuple[list[str], np.ndarray]:
        """The named classes of the label column relabelled by the given mapping (``map_classes``)."""
        if names is None:
            raise LabelMappingError(
                f"{self.path}: label column {column!r} holds integer labels, which stay as they are; a class mapping "
                "(--classes-from/--label-names) applies to named classes: pass --label-type names"
            )
        names, ids = map_classes(names, self.classes or [], self.new_classes, self.classes_from or "the label names",
                                 self.path, notes, what="class name(s) in the list")
        ids_a = np.asarray(ids, np.int64)
        return names, np.where(remap >= 0, ids_a[np.maximum(remap, 0)] if len(ids_a) else -1, -1)

    @staticmethod
    def _col(header: list[str], want: str | int | None, what: str) -> int:
        if isinstance(want, int) or (isinstance(want, str) and want.isdigit() and want not in header):
            k = int(want)
            if not 0 <= k < len(header):
                raise SourceError(f"{what} {k} is out of range: the header has {len(header)} columns")
            return k
        if want not in header:
            raise SourceError(f"{what} {want!r} not found; the header is {header}")
        return header.index(want)

    def _has_header(self, row: list[str]) -> bool:
        """Header rule: a row is data (no header) when ``header=False``, or, with
        ``header=None`` (auto), when the path column is not given by name and
        the first row's path cell names an existing file."""
        if self.header is not None:
            return bool(self.header)
        pc = self.path_column
        if isinstance(pc, str) and not pc.isdigit():
            return True
        k = int(pc) if pc is not None else 0
        if k >= len(row) or not row[k]:
            return True
        try:
            return not os.path.exists(self._resolve(encode_key(row[k])))
        except (ValueError, KeyError, IndexError):
            return True

    def scan(self) -> Listing:
        try:
            fh = open(self.path, encoding="utf-8", errors="surrogateescape", newline="")
        except OSError as e:
            raise IngestError(f"{self.path}: cannot read the list ({e.strerror})") from None
        with fh:
            where = [1]  # the line the current row starts on (rows may span lines)
            reader = _csv_rows(fh, self.path, self.delimiter, where)
            header = next(reader, None)
            if header is None:
                raise SourceError(f"{self.path}: the list is empty (no header row)")
            header = [h.strip().lstrip("\ufeff") for h in header]
            first_data: list[list[str]] = []
            if not self._has_header(header):
                # a plain list of paths: the first row is data; columns are numbered
                first_data = [header]
                header = [str(k) for k in range(len(header))]
                if self.label_column is None:
                    self.label_column = ""
            if self.path_column is None:
                pc = next((header.index(n) for n in self._PATH_NAMES if n in header), 0)
            else:
                pc = self._col(header, self.path_column, "--path-column")
            if self.label_column is None:
                lc = header.index("label") if "label" in header else None
            elif self.label_column == "":
                lc = None
            else:
                lc = self._col(header, self.label_column, "--label-column")
            self.path_column_name = header[pc]
            tags = self.tags.start(header, self._col)
            if self.label_column is None and lc is not None and lc in (tags.tc, tags.xc):
                lc = None  # the default label column is the tags or text column: it is not a label too
            need = max(pc, lc if lc is not None else -1, tags.last_column)
            b = _Builder("list", lc is not None)
            ids: dict[str, int] = {}
            for row in itertools.chain(first_data, reader):
                if not row or (len(row) == 1 and not row[0].strip()):
                    continue
                if need >= len(row):
                    raise SourceError(f"{self.path}:{where[0]}: row has {len(row)} columns, expected {len(header)}")
                tags.add(row)
                key = row[pc]
                lab = -1
                if lc is not None:
                    lab = ids.setdefault(row[lc].strip(), len(ids))
                kb = encode_key(key)
                size, mtime = _stat_key(self._resolve(kb))
                b.add(kb, size, mtime, lab)
        missing = none_found(b, self.path,
                             self._resolve(bytes(b.blob[: b.offsets[1]])) if len(b.offsets) > 1 else b"",
                             f"its paths are resolved against the folder {self.root} (--root)"
                             + (f" through --path-template {self.path_template!r}" if self.path_template else "")
                             + ": check them")
        label_names = None
        bad: dict[int, str] = {}  # distinct cell number -> hole reason
        notes: dict[str, int] = {}
        if lc is None and self.classes is not None:
            raise LabelMappingError(f"{self.path}: a class mapping (--classes-from/--label-names) was given but the "
                                    "list has no label column; pass --label-column"
                                    + ("; a tags column is numbered by --tag-names"
                                       if self.tags.tc is not None else ""))
        if lc is not None:
            # distinct cell number of each row (a builder made with a label column collects them)
            cells = np.frombuffer(cast("array[int]", b.labels), dtype=np.int64)
            remap, label_names, bad = _label_values(ids, self.label_type, self.missing_label, header[lc], self.path)
            if self.classes is not None:
                label_names, remap = self._mapped(label_names, remap, header[lc], notes)
            labels = remap[cells] if len(cells) else np.zeros(0, np.int64)
            b.labels = array("q", labels.tobytes())
            notes.update(_label_notes(ids, cells, bad, self.missing_label, label_names is None))
        extra = repr((pc, lc, self.path_template, label_names, self.label_type, self.missing_label))
        self.listing = b.finish(label_names, extra=extra, warnings=notes)
        self.listing.none_found = missing
        if lc is not None:
            errs: np.ndarray | list[int] = (np.flatnonzero(np.isin(cells, np.fromiter(bad, np.int64, len(bad))))
                                            if bad else [])
            self.listing.label_errors = {int(i): bad[int(cells[i])] for i in errs}
            # the labels as stored (and which rows are holes) are part of the inputs
            self.listing.fingerprint = xxhash.xxh3_128(
                self.listing.fingerprint.encode() + labels.tobytes()
                + repr(sorted(bad.items())).encode("utf-8", "surrogateescape")
            ).hexdigest()
        self.fields = tags.finish(self.path, self.listing)
        return self.listing

    def record_fields(self, i: int, decoded: Any = None) -> dict[str, Any]:
        """The fields of input ``i`` beside its image and label (``tags``,
        ``text``; ``decoded`` is not needed); taken by
        :class:`mmstore.ingest.records.RecordJob`."""
        return self.tags.values(i)

    def _resolve(self, key: bytes) -> bytes:
        k = decode_key(key)
        rel = self.path_template.format(k, id=k) if self.path_template else k
        return os.path.join(os.fsencode(self.root), os.fsencode(rel))

    def load(self, i: int) -> Any:
        return read_file(self._resolve(self.listing.key(i)))

    def input_path(self, i: int) -> bytes:
        """The file of input ``i`` (``load`` reads it)."""
        return self._resolve(self.listing.key(i))


def list_fields_for_repair(prov: dict[str, Any], schema: Any) -> Callable[[bytes, int], dict[str, bytes]] | None:
    """For ``verify --repair``: a function ``(key, slot) -> {field: stored
    entry}`` giving the tags and text entries of a list record again, read
    from the list the provenance names (``provenance.source``, scanned once,
    at the first call) with the store's own tag names (so the ids are the
    stored ones) and encoded with the store's codecs; None when the list had
    no tags or text column. Row ``range[0] + slot`` (the shard's first input,
    ``provenance.ingest.range``) must still hold the key, else ``ValueError``
    (the list changed); a list that cannot be read again, or now names a tag
    the store lacks, is a ``ValueError`` for every record. The checksum then
    proves the re-derived record (``mmstore.check.repair``)."""
    from ..format.schema import coerce_ragged

    src = prov.get("source") if isinstance(prov, dict) else None
    if not isinstance(src, dict) or src.get("kind") != "list":
        return None
    if src.get("tags_column") is None and src.get("text_column") is None:
        return None
    ing = prov.get("ingest")
    rng = ing.get("range") if isinstance(ing, dict) else None
    lo = rng[0] if isinstance(rng, list) and rng and isinstance(rng[0], int) and rng[0] >= 0 else 0
    state: dict[str, Any] = {}

    def scanned() -> Any:
        if "list" not in state:
            names = None
            if src.get("tags_column") is not None and "tags" in schema and schema["tags"].classes is not None:
                pairs = schema["tags"].classes
                names = [n for _, n in pairs] if [i for i, _ in pairs] == list(range(len(pairs))) else None
            opts: dict[str, Any] = {k: src.get(k) for k in ("root", "path_column", "path_template", "delimiter",
                                                            "header", "tags_column", "tags_sep", "text_column")}
            try:
                ls = ListSource(src["path"], label_column="", tag_names=names, **opts)
                ls.scan()
                state["list"] = ls
            except (MmstoreError, OSError, ValueError, TypeError, KeyError, IndexError) as exc:
                state["list"] = None
                state["error"] = f"the list's tags/text cannot be derived again ({str(exc)[:300]})"
        if state["list"] is None:
            raise ValueError(state["error"])
        return state["list"]

    def fields(key: bytes, slot: int) -> dict[str, bytes]:
        ls = scanned()
        i = lo + int(slot)
        if not 0 <= i < len(ls.listing) or ls.listing.key(i) != bytes(key):
            raise ValueError("the list no longer has this record's row at its place (it changed since the ingest)")
        if i in ls.listing.label_errors:
            raise ValueError(f"the list's row of this record is now a hole ({ls.listing.label_errors[i]})")
        return {n: schema[n].codec.encode(coerce_ragged(schema[n], v))
                for n, v in ls.record_fields(i).items() if n in schema}

    return fields
