"""Class-name -> label mappings shared between stores (``--classes-from``, ``--label-names``).

A training store and its validation store must give a class the same label.
``ingest(..., classes_from="train.store")`` takes the mapping from an existing
store's manifest (``label_names``: label ``k`` is ``label_names[k]``);
``label_names="classes.txt"`` (or a list, or a dict ``name -> label`` such as
torchvision's ``class_to_idx``) gives it directly, one class name per line,
line ``k`` (from 0) being label ``k`` (UTF-8, a byte that is not UTF-8
kept as in folder names, see ``mmstore.format.names``; a byte order mark, ``\r\n``
line ends and blank lines after the last name are ignored; a blank line
before it is refused, as id ``k`` would have no name). The class folders of the source
are then labelled by name through the mapping instead of by their sorted
position (see :func:`map_classes` for folders the mapping lacks and classes
the folder lacks). The stored ``label_names`` is the whole mapping, so it is in
the manifest, the provenance and the resume fingerprint.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import LabelMappingError, MmstoreError, spell_option
from ..format.names import printable

__all__ = ["check_class_names", "class_options", "load_class_names", "map_classes", "resolve_class_options"]

_MAX_NAMES_FILE = 64 << 20


def load_class_names(classes_from: Any = None, label_names: Any = None) -> tuple[list[str], str] | None:
    """The mapping given by ``classes_from`` (a store path) or ``label_names``
    (a text file path or a list of names), and where it came from; None when
    neither is given."""
    if classes_from is not None and label_names is not None:
        raise ValueError(f"pass {spell_option('classes_from=', '--classes-from')} or "
                         f"{spell_option('label_names=', '--label-names')}, not both")
    if classes_from is not None:
        from ..format.manifest import read_manifest

        path = os.fspath(classes_from)
        try:
            names = read_manifest(path).get("label_names")
        except MmstoreError as e:
            # same type, but say which option named it and what it must be
            raise type(e)(f"--classes-from {path}: expected a finished store made by mmstore ingest (usually the "
                          f"training store) to take the class names from, found: {e}; or pass --label-names "
                          "FILE (one class name per line)") from None
        if not names:
            raise LabelMappingError(f"--classes-from {path}: that store has no label names (it was not ingested "
                                    "from class folders or named labels); pass --label-names FILE instead")
        return check_class_names(names, f"--classes-from {path}"), os.path.abspath(path)
    if label_names is None:
        return None
    if isinstance(label_names, (str, os.PathLike)):
        path = os.fspath(label_names)
        try:
            with open(path, "rb") as fh:
                raw = fh.read(_MAX_NAMES_FILE + 1)
        except OSError as e:
            raise LabelMappingError(f"--label-names {path}: cannot read it ({e.strerror}); expected a text file "
                                    "with one class name per line") from None
        if len(raw) > _MAX_NAMES_FILE:
            raise LabelMappingError(f"--label-names {path}: larger than {_MAX_NAMES_FILE >> 20} MiB; expected one "
                                    "class name per line")
        # a byte that is not UTF-8 is kept as os.fsdecode keeps it in a folder name,
        # so a names file listing such folders (ls > classes.txt) matches them
        text = raw.decode("utf-8", "surrogateescape")
        text = text.removeprefix("\ufeff")  # a byte order mark (Windows editors) is not part of the first name
        lines = [ln.removesuffix("\r") for ln in text.split("\n")]
        while lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last line; blank lines after the last name name no id
        if not lines:
            raise LabelMappingError(f"--label-names {path}: the file holds no class name; expected one class name "
                                    "per line, line k (from 0) naming label k")
        blank = [k for k, n in enumerate(lines) if not n]
        if blank:
            raise LabelMappingError(f"--label-names {path}: line(s) {[k + 1 for k in blank[:10]]} are blank, so "
                                    f"label(s) {blank[:10]} would have no name; remove the blank line(s) or name "
                                    "the label(s)")
        return check_class_names(lines, f"--label-names {path}"), os.path.abspath(path)
    return check_class_names(label_names, "label_names"), "label_names"


def class_options(classes: Any, new_classes: str | None, origin: str | None) -> tuple[list[str] | None, str]:
    """A source's checked ``classes`` mapping and ``new_classes`` rule."""
    if new_classes not in (None, "error", "append"):
        raise ValueError(f"new_classes must be error or append, got {new_classes!r}")
    if new_classes is not None and classes is None:
        raise ValueError(f"{spell_option('new_classes', '--new-classes')} applies with a class mapping "
                         f"({spell_option('classes_from=', '--classes-from')} or "
                         f"{spell_option('label_names=', '--label-names')})")
    if classes is None:
        return None, "error"
    return check_class_names(classes, origin or "label_names"), new_classes or "error"


def resolve_class_options(src_kw: dict[str, Any]) -> dict[str, Any]:
    """Source options with ``classes_from`` / ``label_names`` turned into the
    ``classes`` list (and its origin) that a source takes."""
    kw = dict(src_kw)
    got = load_class_names(kw.pop("classes_from", None), kw.pop("label_names", None))
    if got is not None:
        kw["classes"], kw["classes_from"] = got
    return kw


def check_class_names(names: Any, origin: str) -> list[str]:
    """A class mapping (``names[k]`` has label ``k``) as a list of distinct one-line strings (``''`` is
    the class of ``--missing-label class``; a names file refuses blank lines itself)."""
    if isinstance(names, dict):
        names = _names_of_ids(names, origin)
    if isinstance(names, (str, bytes)) or not all(isinstance(n, str) for n in names):
        raise LabelMappingError(f"{origin}: class names must be a list of strings (names[k] is label k) or a "
                                f"dict name -> label, got {type(names).__name__}")
    names = list(names)
    # '' is a name (the class of --missing-label class); a line break is not
    bad = [k for k, n in enumerate(names) if n != n.replace("\n", "").replace("\r", "")]
    if bad:
        raise LabelMappingError(f"{origin}: class name(s) at id(s) {bad[:10]} hold a line break; a class name "
                                "is one line")
    seen: dict[str, int] = {}
    dup = [(n, seen[n], k) for k, n in enumerate(names) if seen.setdefault(n, k) != k]
    if dup:
        ex = ", ".join(f"{_q(n)} (ids {a} and {b})" for n, a, b in dup[:5])
        raise LabelMappingError(f"{origin}: class names must be distinct; repeated: {ex}")
    return names


def _q(name: str) -> str:
    """A class name quoted for people: a byte that is not UTF-8 as ``\\xNN`` (README "Names")."""
    return f"'{printable(name)}'"


def _names_of_ids(mapping: dict[Any, Any], origin: str) -> list[Any]:
    """The list ``names[k]`` of a dict ``name -> label k`` (torchvision's
    ``class_to_idx``), whose labels must be exactly ``0 .. n - 1``."""
    ids = list(mapping.values())
    if not all(isinstance(k, int) and not isinstance(k, bool) for k in ids) or sorted(ids) != list(range(len(ids))):
        shown = sorted(ids, key=repr)[:10]
        raise LabelMappingError(f"{origin}: a dict of class names must map each name to its label, the labels being "
                                f"0 .. {len(ids) - 1} once each; found labels {shown}; pass a list (names[k] is "
                                "label k) instead")
    names: list[Any] = [None] * len(ids)
    for n, k in mapping.items():
        names[k] = n
    return names


def map_classes(
    found: list[str], classes: list[str], new_classes: str, origin: str, path: str, warnings: dict[str, int],
    what: str = "class folder(s)",
) -> tuple[list[str], list[int]]:
    """Labels of the classes ``found`` in a source (folders, or the names of a
    list's label column) under a given mapping ``classes``.

    A class not in the mapping is refused (``LabelMappingError`` listing
    them) or, with ``new_classes="append"``, given the next ids in the order
    found (sorted). Classes of the mapping not found here keep their ids and
    are listed in a note of the summary. Returns (label_names, label of each
    found class).
    """
    ids = {n: k for k, n in enumerate(classes)}
    extra = [n for n in found if n not in ids]
    if extra and new_classes != "append":
        shown = ", ".join(_q(n) for n in extra[:20]) + (f" (and {len(extra) - 20} more)" if len(extra) > 20 else "")
        near = {n.strip(): n for n in classes}
        close = [f"{_q(n)} ~ {_q(near[n.strip()])}" for n in extra if n.strip() in near][:5]
        if close:
            shown += f" (differing only in surrounding spaces from the mapping's: {', '.join(close)})"
        raise LabelMappingError(
            f"{path}: {len(extra)} {what} not in {origin} ({len(classes)} classes): {shown}; nothing was "
            "created. Fix the names, add the classes to the mapping, or pass --new-classes append "
            "(new_classes='append') to give them the ids after the existing ones"
        )
    names = list(classes) + extra
    for n in extra:
        ids[n] = len(ids)
    missing = sorted(set(classes) - set(found))
    if missing:
        shown = ", ".join(_q(n) for n in missing[:20]) + (" ..." if len(missing) > 20 else "")
        warnings[f"class(es) of {origin} not found here (their ids stay reserved): {shown}"] = len(missing)
    if extra:
        warnings[f"{what} not in {origin} appended after its ids (--new-classes append): "
                 + ", ".join(_q(n) for n in extra[:20])] = len(extra)
    return names, [ids[n] for n in found]
