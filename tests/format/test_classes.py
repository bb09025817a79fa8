"""Class names of an integer field (format.py, "Class names of a field"):
the schema carries them, the manifest keeps them, readers check them, and
convert / merge keep or compare them."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.faults import edit_manifest

import mmstore
from mmstore.check.convert import convert_store
from mmstore.errors import FormatError, IngestError, SchemaError
from mmstore.format.schema import Schema
from mmstore.ingest.merge import merge

FIELDS = {"image": ("|u1", (4, 4, 3)), "category": ("<i8", (None,)), "tags": ("<i2", (None,))}


def _write(path, classes, backend="memmap"):
    schema = Schema(FIELDS, classes=classes)
    with mmstore.StoreWriter(path, schema, backend=backend) as w:
        for i in range(3):
            w.append({"image": np.full((4, 4, 3), i, np.uint8), "category": [1, 3][: i], "tags": [i]})
    return schema


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_classes_round_trip_through_the_manifest(tmp_path, backend):
    schema = _write(tmp_path / "s", {"category": {90: "toothbrush", 1: "person", 3: "car"}, "tags": ["a", "b"]},
                    backend)
    store = mmstore.open(tmp_path / "s")
    assert store.schema == schema
    assert store.schema["category"].classes == ((1, "person"), (3, "car"), (90, "toothbrush"))
    assert store.schema["category"].class_names == {1: "person", 3: "car", 90: "toothbrush"}
    assert store.schema["tags"].class_names == {0: "a", 1: "b"}
    assert store.schema["image"].classes is None and store.schema["image"].class_names == {}
    with open(tmp_path / "s" / "manifest.json", encoding="utf-8") as fh:
        raw = {f["name"]: f for f in json.load(fh)["schema"]}
    assert raw["category"]["classes"] == [[1, "person"], [3, "car"], [90, "toothbrush"]]
    assert "classes" not in raw["image"]
    np.testing.assert_array_equal(store[2]["category"], [1, 3])


@given(st.dictionaries(st.integers(-(2**15), 2**15 - 1), st.text(max_size=8), max_size=20))
@settings(max_examples=60, deadline=None)
def test_any_valid_classes_survive_json(classes):
    s = Schema(FIELDS, classes={"tags": classes})
    assert s["tags"].class_names == classes
    assert Schema.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"tags": {2**15: "x"}}, "fits <i2"),
        ({"tags": {True: "x"}}, "not an integer"),
        ({"tags": {1: 5}}, "must be a string"),
        ({"tags": [[1, "a"], [1, "b"]]}, "appears twice"),
        ({"tags": 3}, "list of names"),
        ({"nope": ["a"]}, "unknown field"),
    ],
)
def test_bad_classes_are_refused(bad, match):
    with pytest.raises(SchemaError, match=match):
        Schema(FIELDS, classes=bad)


def test_only_integer_fields_have_classes():
    for fields in ({"x": ("<f4", (None, 4))}, {"x": (str, None)}, {"x": ("|b1", ())}):
        with pytest.raises(SchemaError, match="integer field"):
            Schema(fields, classes={"x": ["a"]})


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda e: e.update(classes=[[3, "car"], [1, "person"]]), "sorted by id"),
        (lambda e: e.update(classes=[[1, "a"], [1, "b"]]), "appears twice"),
        (lambda e: e.update(classes={"1": "a"}), "list of \\[id, name\\] pairs"),
        (lambda e: e.update(classes=[[1.0, "a"]]), "not an integer"),
        (lambda e: e.update(classes=[[1, None]]), "must be a string"),
        (lambda e: e.update(classes=[[2**63, "a"]]), "fits <i8"),
    ],
)
def test_a_damaged_classes_entry_is_refused_at_open(tmp_path, edit, match):
    _write(tmp_path / "s", {"category": {1: "person", 3: "car"}})

    def change(m):
        edit(next(f for f in m["schema"] if f["name"] == "category"))

    edit_manifest(tmp_path / "s", change)
    with pytest.raises(FormatError, match=match):
        mmstore.open(tmp_path / "s")


def test_a_float_field_with_classes_in_the_manifest_is_refused(tmp_path):
    with mmstore.StoreWriter(tmp_path / "s", {"x": ("<f4", (2,))}) as w:
        w.append({"x": [1, 2]})
    edit_manifest(tmp_path / "s", lambda m: m["schema"][0].update(classes=[[0, "a"]]))
    with pytest.raises(FormatError, match="integer field"):
        mmstore.open(tmp_path / "s")


def test_convert_keeps_the_classes_and_merge_compares_them(tmp_path):
    classes = {"category": {1: "person", 3: "car"}}
    schema = _write(tmp_path / "a", classes)
    convert_store(tmp_path / "a", tmp_path / "b", "lmdb", codecs={"tags": "zstd:3"})
    assert mmstore.open(tmp_path / "b").schema["category"].classes == schema["category"].classes
    _write(tmp_path / "c", classes)
    merge([tmp_path / "a", tmp_path / "c"], tmp_path / "ac")
    assert mmstore.open(tmp_path / "ac").schema == schema
    _write(tmp_path / "d", {"category": {1: "person", 3: "truck"}})
    with pytest.raises(IngestError, match="schema"):
        merge([tmp_path / "a", tmp_path / "d"], tmp_path / "ad")
    assert not os.path.exists(tmp_path / "ad")
