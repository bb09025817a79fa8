"""Names that are not valid UTF-8: the one escaping, implemented once.

A file name is bytes; any byte string the file system allows is a valid name.
Inside Python mmstore holds names as ``str`` decoded from UTF-8 with the
``surrogateescape`` error handler (PEP 383, what ``os.fsdecode`` does on
Linux): a byte that is not part of valid UTF-8, say ``0xE9``, becomes the lone
surrogate ``U+DCE9``, and ``os.fsencode`` gives back the exact bytes.

* Keys (``_keys.bin``) hold the original bytes (``format.encode_key``).
* JSON that mmstore writes (``manifest.json``: label names and provenance;
  ``errors.jsonl``; every ``--json`` report) is UTF-8 in which each lone
  surrogate is written as the JSON escape ``\\udcXX`` (:func:`json_text`).
  Any JSON parser reads it; Python's ``json.loads`` gives back the lone
  surrogate, so ``os.fsencode(name)`` is again the original bytes.
* Text for people (``inspect``, ``show`` captions, messages) writes such a
  byte as ``\\xXX`` (``caf\\xe9``) and other unprintable characters as Python
  escapes (:func:`printable`). That form is for reading only.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["ascii_text", "json_bytes", "json_text", "printable"]

_SURROGATE = re.compile("[\ud800-\udfff]")


def json_text(obj: Any, **kw: Any) -> str:
    """``json.dumps(obj, ensure_ascii=False, **kw)`` with every lone surrogate
    written as a ``\\uXXXX`` escape, so the text encodes to valid UTF-8 and
    loads back to the same strings."""
    text = json.dumps(obj, ensure_ascii=False, **kw)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def json_bytes(obj: Any, **kw: Any) -> bytes:
    """:func:`json_text` as UTF-8 bytes."""
    return json_text(obj, **kw).encode("utf-8")


def _escape(ch: str) -> str:
    o = ord(ch)
    if 0xDC80 <= o <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{o - 0xDC00:02x}"
    return ch.encode("unicode_escape").decode("ascii")


def printable(text: Any, keep_newlines: bool = False) -> str:
    """``text`` safe to print on any terminal: bytes that were not UTF-8 as
    ``\\xXX``, control and other unprintable characters as Python escapes
    (newlines kept when ``keep_newlines``)."""
    s = str(text)
    if s.isprintable():
        return s
    out = []
    for ch in s:
        if ch.isprintable() or (keep_newlines and ch == "\n"):
            out.append(ch)
        else:
            out.append(_escape(ch))
    return "".join(out)


def ascii_text(text: str) -> str:
    """``text`` as printable ASCII, for drawing (OpenCV's ``putText`` draws
    ASCII only, and crashes on some non-ASCII input). Printable ASCII stays
    as it is (a backslash is doubled); a byte that is not valid UTF-8 (a lone
    surrogate of ``surrogateescape``) becomes ``\\xNN``, its byte; any other
    character ``\\uNNNN`` or ``\\UNNNNNNNN``, its code point: ``caf\\xe9`` is
    the Latin-1 byte, ``caf\\u00e9`` the UTF-8 name ``café``."""
    out = []
    for ch in text:
        c = ord(ch)
        if ch == "\\":
            out.append("\\\\")
        elif 32 <= c < 127:
            out.append(ch)
        elif 0xDC80 <= c <= 0xDCFF:
            out.append(f"\\x{c - 0xDC00:02x}")
        elif c < 0x10000:
            out.append(f"\\u{c:04x}")
        else:
            out.append(f"\\U{c:08x}")
    return "".join(out)
