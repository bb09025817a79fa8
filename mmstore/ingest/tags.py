"""A list's tags and caption columns (``--tags-column``, ``--text-column``).

Tags
    A tags cell names any number of tags separated by ``tags_sep`` (default
    ``";"``): ``cat;animal``. Whitespace around each tag is trimmed; an empty
    cell is a record with zero tags (valid); an empty piece between two
    separators (``cat;;dog``, a trailing ``;``) names no tag and is dropped,
    counted in a note (a whitespace separator, ``" "`` as in ``haze primary``
    or a tab, is allowed: a run of it is one separator, not counted); a tag
    written twice in one cell is kept once (where it first appears), counted
    in a note. The tag ids of a record are stored
    in the order the cell writes them, as the ragged field ``tags``
    (``<i4``, shape ``(None,)``) whose ``classes`` name every tag.

    Ids are numbered like the names of a named label column: the distinct
    tag names of the whole list sorted by code point, from 0. A list whose
    tags are all plain non-negative integers (``3;17``, at most
    :data:`MAX_INTEGER_TAG`) keeps them as the ids, like an integer label
    column (nothing renumbered): the tag names are ``"0"`` .. the largest
    (every id up to it named, so a mapping of them reads back as one; larger
    integers are numbered as names, with a note). Another list (a validation
    split) numbers its own tags; to give a tag the same id in
    both, pass ``tag_names`` (CLI ``--tag-names``): a store (its ``tags``
    field's classes, e.g. the training store) or a text file of one tag per
    line (line k names id k, the format of ``--label-names``). A tag not in
    that mapping is refused unless ``new_classes="append"`` (the ids after
    the mapping's); the mapping's tags that the list lacks keep their ids.
    ``--classes-from`` / ``--label-names`` apply to the label column only;
    a tags (or text) column named ``label`` is not also read as the default
    label column.

Captions
    A text cell is stored exactly as written (not trimmed; empty allowed) as
    the ``str`` field ``text``.

Bad cells
    The list is read as UTF-8 with ``surrogateescape``: a tags or text cell
    that is not valid UTF-8 makes its input a hole with reason ``bad-tags``
    or ``bad-text`` (in ``errors.jsonl``, counted in the summary).

The tag ids, the text and the hole reasons of every row are part of the
inputs' fingerprint, so ``--resume`` refuses a list whose tags or captions
changed.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from ..errors import LabelMappingError, MmstoreError

__all__ = ["TagColumns", "load_tag_names"]

DEFAULT_TAGS_SEP = ";"


def load_tag_names(tag_names: Any) -> tuple[list[str], str]:
    """The tag mapping ``tag_names`` gives (``names[k]`` is tag id ``k``) and
    where it came from: a store directory (its ``tags`` field's classes), a
    text file (one tag per line), or a list of names."""
    from .classes import check_class_names, load_class_names

    if isinstance(tag_names, (str, os.PathLike)) and os.path.isdir(tag_names):
        from ..format.manifest import read_manifest

        path = os.fspath(tag_names)
        try:
            pairs = (read_manifest(path).get("classes") or {}).get("tags")
        except MmstoreError as e:
            raise type(e)(f"--tag-names {path}: expected a finished store made by mmstore ingest with a tags "
                          f"field, or a text file of one tag per line; found: {e}") from None
        if not pairs:
            raise LabelMappingError(f"--tag-names {path}: that store has no tags field with tag names (it was not "
                                    "ingested with --tags-column); pass a text file of one tag per line instead")
        pairs = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
        if [p[0] for p in pairs] != list(range(len(pairs))):
            raise LabelMappingError(f"--tag-names {path}: the store's tag ids are not 0 .. {len(pairs) - 1}; "
                                    "pass a text file of one tag per line instead")
        return check_class_names([p[1] for p in pairs], f"--tag-names {path}"), os.path.abspath(path)
    try:
        got = load_class_names(label_names=tag_names)
    except LabelMappingError as e:  # same rules and messages as --label-names, for this flag
        raise LabelMappingError(str(e).replace("--label-names", "--tag-names", 1)) from None
    if got is None:
        raise LabelMappingError("tag_names: expected a store, a file or a list of tag names, found None")
    names, origin = got
    return names, origin if origin != "label_names" else "tag_names"


MAX_INTEGER_TAG = 65535  # integer tags above this are named (sorted by code point), not kept as ids


def _integer_tags(found: list[str]) -> bool | None:
    """True: every tag a plain non-negative decimal integer (``0``, ``17``;
    not ``07``, ``+1``, ``1.0``) no larger than :data:`MAX_INTEGER_TAG`;
    None: plain integers, but one is larger; False: not all integers."""
    if not found or not all(t.isascii() and t.isdigit() and (t == "0" or t[0] != "0") for t in found):
        return False
    return True if max(len(t) for t in found) <= 5 and max(int(t) for t in found) <= MAX_INTEGER_TAG else None


class TagColumns:
    """The tags and text columns of one :class:`~.lists.ListSource`: options,
    then the rows of a scan (:meth:`start`, :meth:`add`, :meth:`finish`),
    then each input's values (:meth:`values`)."""

    def __init__(self, tags_column: str | int | None, tags_sep: str | None, text_column: str | int | None,
                 tag_names: Any, new_classes: str | None) -> None:
        if tags_column is None and (tags_sep is not None or tag_names is not None):
            raise ValueError("tags_sep / tag_names (--tags-sep / --tag-names) apply with a tags column "
                             "(tags_column=, CLI --tags-column)")
        sep = DEFAULT_TAGS_SEP if tags_sep is None else tags_sep
        if not isinstance(sep, str) or not sep or (sep != sep.strip() and not sep.isspace()) or "\n" in sep \
                or "\r" in sep:
            raise ValueError(f"tags_sep must be a separator such as ';', '|', ' ' or a tab (not text with spaces "
                             f"around it, not a line break), got {tags_sep!r}")
        self.tags_column, self.sep, self.text_column = tags_column, sep, text_column
        self.mapping: list[str] | None = None
        self.mapping_from: str | None = None
        if tag_names is not None:
            self.mapping, self.mapping_from = load_tag_names(tag_names)
        self.new_classes = new_classes or "error"
        self.tc: int | None = None
        self.xc: int | None = None
        self.last_column = -1

    def describe(self) -> dict[str, Any]:
        """The options as the provenance records them (none when unused)."""
        d: dict[str, Any] = {}
        if self.tags_column is not None:
            d.update(tags_column=self.tags_column, tags_sep=self.sep)
            if self.mapping is not None:
                d.update(tag_names=self.mapping_from, new_classes=self.new_classes)
        if self.text_column is not None:
            d["text_column"] = self.text_column
        return d

    def start(self, header: list[str], col: Callable[[list[str], Any, str], int]) -> TagColumns:
        """Resolve the columns against ``header`` and start a scan."""
        self.tc = col(header, self.tags_column, "--tags-column") if self.tags_column is not None else None
        self.xc = col(header, self.text_column, "--text-column") if self.text_column is not None else None
        self.last_column = max(-1 if self.tc is None else self.tc, -1 if self.xc is None else self.xc)
        self.names: dict[str, int] = {}  # tag -> provisional id (first seen)
        self.tag_off = array("q", [0])
        self.tag_ids = array("i")
        self.text_off = array("q", [0])
        self.text = bytearray()
        self.errors: dict[int, str] = {}
        self.counts = {"dup": 0, "blank": 0, "none": 0}
        return self

    def add(self, row: list[str]) -> None:
        """Take one data row (input ``len(self.tag_off) - 1``)."""
        i = len(self.tag_off) - 1
        if self.tc is not None:
            self._add_tags(i, row[self.tc])
        if self.xc is not None:
            self._add_text(i, row[self.xc])

    def _add_tags(self, i: int, cell: str) -> None:
        try:
            cell.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.errors[i] = (f"bad-tags: the tags cell is not valid UTF-8 (byte 0x{ord(cell[exc.start]) & 0xFF:02x} "
                              f"at character {exc.start})")
            cell = ""
        seen: set[int] = set()
        blank = dup = False
        for piece in cell.split(self.sep) if cell.strip() else ():
            t = piece.strip()
            if not t:
                blank = blank or not self.sep.isspace()  # a run of a whitespace separator is one separator
                continue
            k = self.names.setdefault(t, len(self.names))
            if k in seen:
                dup = True
                continue
            seen.add(k)
            self.tag_ids.append(k)
        self.tag_off.append(len(self.tag_ids))
        self.counts["blank"] += blank
        self.counts["dup"] += dup
        self.counts["none"] += not seen and i not in self.errors

    def _add_text(self, i: int, cell: str) -> None:
        try:
            self.text += cell.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.errors.setdefault(i, f"bad-text: the text cell is not valid UTF-8 (byte "
                                      f"0x{ord(cell[exc.start]) & 0xFF:02x} at character {exc.start})")
        self.text_off.append(len(self.text))

    def finish(self, path: str, listing: Any) -> list[Any] | None:
        """Number the tags, add the holes and notes to ``listing`` and the
        tags and text to its fingerprint; the fields to store (or None)."""
        from ..format.schema import Schema
        from .classes import map_classes

        if self.tc is None and self.xc is None:
            return None
        notes = listing.warnings
        spec: dict[str, Any] = {}
        classes = None
        h = xxhash.xxh3_128(listing.fingerprint.encode())
        h.update(repr((self.tc, self.sep, self.xc)).encode())
        if self.tc is not None:
            found = sorted(self.names)  # by code point
            names = found
            final = np.arange(len(found), dtype=np.int64)
            if self.mapping is not None:
                names, ids = map_classes(found, self.mapping, self.new_classes, self.mapping_from or "tag_names",
                                         path, notes, what="tag(s) in the list")
                final = np.asarray(ids, np.int64)
            elif (whole := _integer_tags(found)) is not False:
                if whole:  # like an integer label column: nothing renumbered
                    final = np.array([int(t) for t in found], np.int64)
                    names = [str(k) for k in range(int(final.max()) + 1)]
                    notes[f"distinct tags, all integers: each tag's id is its value (tag names '0' .. "
                          f"'{len(names) - 1}')"] = len(found)
                else:  # said, as the ids are not the values
                    notes[f"distinct tags, all integers but some over {MAX_INTEGER_TAG}: numbered as names (sorted "
                          "by code point; store.schema['tags'].class_names maps id -> tag)"] = len(found)
            rank = np.empty(len(found), np.int64)  # provisional id -> position in ``found``
            rank[[self.names[t] for t in found]] = np.arange(len(found))
            prov = np.frombuffer(self.tag_ids, np.int32) if len(self.tag_ids) else np.zeros(0, np.int32)
            self.flat = final[rank[prov]].astype("<i4") if len(prov) else np.zeros(0, "<i4")
            self.offsets = np.frombuffer(self.tag_off, np.int64).copy()
            del self.names, self.tag_ids, self.tag_off
            spec["tags"] = ("<i4", (None,))
            classes = {"tags": dict(enumerate(names))}
            h.update(repr(names).encode("utf-8", "surrogateescape"))
            h.update(self.offsets.tobytes())
            h.update(self.flat.tobytes())
            c = self.counts
            if c["dup"]:
                notes["inputs whose tags cell repeats a tag (kept once, where it first appears)"] = c["dup"]
            if c["blank"]:
                notes[f"inputs whose tags cell has an empty tag ({self.sep!r} twice or at an end; it names no "
                      "tag and was dropped)"] = c["blank"]
            if c["none"]:
                notes["inputs with an empty tags cell (stored with zero tags)"] = c["none"]
        if self.xc is not None:
            self.text_offsets = np.frombuffer(self.text_off, np.int64).copy()
            self.text_blob = bytes(self.text)
            del self.text, self.text_off
            spec["text"] = str
            h.update(self.text_offsets.tobytes())
            h.update(self.text_blob)
        for i, reason in self.errors.items():
            listing.label_errors.setdefault(i, reason)
        h.update(repr(sorted(self.errors.items())).encode("utf-8", "surrogateescape"))
        listing.fingerprint = h.hexdigest()
        return list(Schema(spec, classes=classes))

    def values(self, i: int) -> dict[str, Any]:
        """The ``tags`` (int32 ids) and ``text`` of input ``i``."""
        out: dict[str, Any] = {}
        if self.tc is not None:
            out["tags"] = self.flat[int(self.offsets[i]) : int(self.offsets[i + 1])]
        if self.xc is not None:
            out["text"] = self.text_blob[int(self.text_offsets[i]) : int(self.text_offsets[i + 1])].decode("utf-8")
        return out
