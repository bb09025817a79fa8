"""``schema[name].class_names`` names the classes of every field that has
them, the ``label`` field of a classification store included (its names are
the manifest's top-level ``label_names``)."""

from __future__ import annotations

import numpy as np

import mmstore
from mmstore.format.schema import Schema


def test_label_field_class_names_are_the_store_label_names(tmp_path):
    images = np.zeros((3, 4, 4, 3), np.uint8)
    ds = [(images[i], i % 2) for i in range(3)]
    dest = str(tmp_path / "s")
    mmstore.from_dataset(ds, dest, label_names=["cat", "dog"], workers=0, quiet=True)
    s = mmstore.open(dest)
    assert s.label_names == ["cat", "dog"]
    assert s.schema["label"].class_names == {0: "cat", 1: "dog"} == dict(enumerate(s.label_names))
    assert s.schema["image"].class_names == {}
    # the names stay the manifest's own key: the schema written and compared is unchanged
    assert "classes" not in next(e for e in s.schema.to_json() if e["name"] == "label")
    assert s.schema == Schema.from_json(s.schema.to_json())
    assert Schema(s.schema)["label"].classes is None
    assert s.schema.offset("label") == s.schema.offsets[s.schema.names.index("label")]


def test_a_store_without_label_names_has_none():
    sch = Schema({"image": ("|u1", (2, 2)), "label": ("<i8", ())}, label_names=None)
    assert sch["label"].class_names == {}
    named = Schema({"image": ("|u1", (2, 2)), "label": ("<i8", ())}, label_names=["a", "b", "c"])
    assert named["label"].class_names == {0: "a", 1: "b", 2: "c"}
    assert named == sch and named.to_json() == sch.to_json()
