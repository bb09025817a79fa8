"""The ingest's per-record check (``records.checked``) makes exactly what ``Schema.validate`` makes, or
refuses with its message, whatever a source hands it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmstore.errors import SchemaError
from mmstore.format.schema import Schema
from mmstore.ingest.records import checked

SCHEMA = Schema({"image": ("|u1", (4, 3, 3)), "label": ("<i8", ()), "score": ("<f4", (2,)), "text": (str, None),
                 "raw": (bytes, None), "points": ("<f4", (None, 2))})

_VALUES = {
    "image": st.sampled_from([np.zeros((4, 3, 3), np.uint8), np.ones((4, 3, 3), np.int64),
                              np.zeros((4, 3, 3), np.uint8)[:, ::-1], np.zeros((3, 3, 3), np.uint8), "x"]),
    "label": st.sampled_from([np.array(3, "<i8"), 3, np.int32(-2), 2.0, 2.5, "7", np.array([1], "<i8")]),
    "score": st.sampled_from([np.array([0.5, 1], "<f4"), [0.5, 1.0], np.array([0.1, 0.2]), np.zeros(3, "<f4")]),
    "text": st.sampled_from(["a caption", "", "\ud800 lone surrogate", b"bytes", 5, np.array([1], np.uint8), None]),
    "raw": st.sampled_from([b"\x00\xff", bytearray(b"ab"), memoryview(b"cd"), "text", 3]),
    "points": st.sampled_from([np.zeros((0, 2), "<f4"), [[1, 2], [3, 4]], [], np.zeros((2, 3), "<f4"), "x",
                               np.array([[1.5, 2]], "<f8"), [[0.1, 0.2]]]),
}


def _outcome(f, rec):
    try:
        return f(dict(rec))
    except SchemaError as exc:
        return str(exc)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_checked_equals_validate(data):
    names = data.draw(st.lists(st.sampled_from([*SCHEMA.names, "extra"]), unique=True))
    rec = {n: data.draw(_VALUES[n]) if n in _VALUES else 1 for n in names}
    want = _outcome(SCHEMA.validate, rec)
    got = _outcome(lambda r: checked(SCHEMA, r), rec)
    if isinstance(want, str):
        assert got == want
        return
    assert not isinstance(got, str), got
    assert set(got) == set(want)
    for k, v in want.items():  # the same bytes (validate makes a scalar's array 1-d: ascontiguousarray)
        assert isinstance(got[k], np.ndarray) and got[k].dtype == v.dtype and got[k].flags.c_contiguous
        assert got[k].size == v.size and got[k].tobytes() == v.tobytes()
        assert got[k].shape == v.shape or (got[k].shape == () and v.shape == (1,))


def test_a_text_that_is_not_utf8_is_refused_with_validates_message():
    rec = {"image": np.zeros((4, 3, 3), np.uint8), "label": np.array(1, "<i8"), "score": np.zeros(2, "<f4"),
           "text": "\udcff", "raw": b"", "points": np.zeros((0, 2), "<f4")}
    with pytest.raises(SchemaError, match="text is not encodable as UTF-8"):
        checked(SCHEMA, rec)
