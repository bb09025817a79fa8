"""One-time ingest: turn a folder, a list, an LMDB, arrays or any Dataset into a store.

Library API
-----------
``ingest(source, dest, size=(224, 224), ...)``
    SOURCE is recognised from what it is (see :func:`detect_source`): an image
    folder (flat or ImageFolder), a ``.csv``/``.tsv`` list, an LMDB directory
    of encoded images, a ``.npy``/``.npz`` file, a COCO instances ``.json``
    (images under ``root=``; boxes, categories, polygons: see ``coco.py``).
``from_dataset(ds, dest, size=None, ...)``
    Freeze any map-style dataset (items: arrays, tensors, PIL images or
    ``(image, label)``) into a store in one call.
``merge(parts, dest)``
    Join the stores written by ``--shard K/N`` jobs into one store.

Stored fields: ``image`` (``|u1``, ``spec.record_shape()``), ``label``
(``<i8``, when there are labels), ``orig_size`` (``<i4`` ``(2,)``: source
``(h, w)`` after EXIF orientation), ``box`` (``<i4`` ``(4,)``: source
region ``(x0, y0, x1, y1)``, end exclusive, that was resampled; see
``mmstore.decode``) and ``dst`` (``<i4`` ``(4,)``: the record rectangle it
landed in; ``mmstore.decode.geometry`` maps points and boxes with the two).
Arrays stored without a target size keep their own dtype and shape and have
only ``image`` (and ``label``).

Crash safety and resume: see ``resume.py`` (commit log) and ``pipeline.py``
(the run and how its pieces fit: ``options``, ``plan``, ``records``,
``workers``, ``schedule``, ``committer``, ``progress``). Resume rule: pass ``resume=True`` (CLI ``--resume``); it
continues ``DEST.partial`` when there is one and starts a fresh run when there
is none, so an always-``--resume`` command line is safe to requeue. Without
it, an existing ``DEST.partial`` is an error that says to add ``--resume``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import SourceError, spell_option
from .classes import resolve_class_options
from .merge import merge
from .options import RUN_DEFAULTS, SOURCE_OPTIONS, SPEC_OPTIONS, ResumeHint, make_spec, parse_shard, split_options
from .pipeline import IngestResult, run_ingest
from .sources import (
    IMAGE_EXTENSIONS,
    ArraySource,
    CocoSource,
    DatasetSource,
    FolderSource,
    ListSource,
    LmdbSource,
    Source,
    detect_source,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArraySource",
    "CocoSource",
    "DatasetSource",
    "FolderSource",
    "IngestResult",
    "LmdbSource",
    "ListSource",
    "Source",
    "detect_source",
    "from_dataset",
    "ingest",
    "make_spec",
    "merge",
]

_OPTION_NAMES = frozenset(SPEC_OPTIONS) | frozenset(SOURCE_OPTIONS)


def ingest(
    source: str | os.PathLike[str] | Source,
    dest: str | os.PathLike[str],
    size: Any = None,
    *,
    workers: int | None = RUN_DEFAULTS["workers"],
    on_error: str = RUN_DEFAULTS["on_error"],
    max_errors: str | int | None = RUN_DEFAULTS["max_errors"],
    resume: bool = RUN_DEFAULTS["resume"],
    overwrite: bool = RUN_DEFAULTS["overwrite"],
    shard: Any = RUN_DEFAULTS["shard"],
    quiet: bool = RUN_DEFAULTS["quiet"],
    backend: str = RUN_DEFAULTS["backend"],
    codecs: Any = RUN_DEFAULTS["codecs"],
    chunk: int | None = RUN_DEFAULTS["chunk"],
    progress_interval: float = RUN_DEFAULTS["progress_interval"],
    resume_hint: ResumeHint = RUN_DEFAULTS["resume_hint"],
    # decode options (mmstore.decode.DecodeSpec; None: its default)
    resize: str | None = None,
    channels: int | None = None,
    layout: str | None = None,
    bgr: bool | None = None,
    interp_up: str | None = None,
    pad_value: int | None = None,
    fast_decode: bool | None = None,
    max_pixels: int | None = None,
    strict_jpeg: bool | None = None,
    alpha: str | None = None,
    # source options (None: not given; each applies to the kinds of source named below)
    labels: str | None = None,
    root: str | os.PathLike[str] | None = None,
    path_column: str | int | None = None,
    label_column: str | int | None = None,
    path_template: str | None = None,
    delimiter: str | None = None,
    header: bool | None = None,
    label_type: str | None = None,
    missing_label: str | None = None,
    image_key: str | None = None,
    label_key: str | None = None,
    classes_from: str | os.PathLike[str] | None = None,
    label_names: str | os.PathLike[str] | Sequence[str] | Mapping[str, int] | None = None,
    new_classes: str | None = None,
    min_box_size: float | None = None,
    tags_column: str | int | None = None,
    tags_sep: str | None = None,
    text_column: str | int | None = None,
    tag_names: str | os.PathLike[str] | Sequence[str] | None = None,
) -> IngestResult:
    """Decode SOURCE once into a store at DEST.

    Parameters
    ----------
    source
        A path (kind recognised by :func:`detect_source`) or a :class:`Source`.
    dest
        The store directory to create (work happens in ``DEST.partial``).
    size
        Target ``(H, W)`` or ``"HxW"``; required for encoded images.
    workers
        Decoder processes (default: the usable CPU cores; 0 = in this process).
    on_error, max_errors
        ``"skip"`` (default) leaves a hole per bad input; ``"fail"`` stops at
        the first. ``max_errors`` (``N`` or ``"P%"``) stops once more inputs
        than that failed. A stopped run keeps ``DEST.partial``.
    resume
        Continue ``DEST.partial`` if present (refused when inputs or
        parameters differ: ``ResumeMismatchError``, naming each change).
    resume_hint
        How a stopped run's message says to resume: a text, or a function
        of the options the resume must change (``{}``, or after a
        ``max_errors`` stop a raised limit such as ``{"max_errors": "10"}``)
        that returns it (the command line gives its resume command).
    shard
        ``(K, N)`` or ``"K/N"``: ingest only the K-th (from 0) of N contiguous
        parts of the sorted inputs; join the parts with :func:`merge`.
    codecs
        How fields are stored: ``{"image": "jpeg:90"}`` or ``["image=jpeg:90"]``
        (CLI: ``--codec image=jpeg:90``, repeatable); see :mod:`mmstore.format.codecs`.
        Default: every field raw. Entries are encoded in the workers from the
        decoded, resized pixels (the geometry ``raw`` would store); a codec
        that does not fit its field is refused before any work.
    resize, channels, layout, bgr, interp_up, pad_value, fast_decode, max_pixels, strict_jpeg, alpha
        Decode options (``resize``, ``channels``, ``layout``, ``bgr``,
        ``interp_up``, ``pad_value``, ``fast_decode``, ``max_pixels``,
        ``strict_jpeg``, ``alpha``: ``"black"`` (default), ``"white"`` or
        ``"drop"``, see :mod:`mmstore.decode`; None: ``DecodeSpec``'s default).
    labels, root, path_column, label_column, path_template, delimiter, header, label_type, missing_label, \
image_key, label_key, classes_from, label_names, new_classes, min_box_size, tags_column, tags_sep, \
text_column, tag_names
        Source options (None: not given; ``labels`` for folders; ``root``,
        ``path_column``, ``label_column``, ``path_template``, ``delimiter``,
        ``header``, ``label_type``, ``missing_label`` for lists, see
        :class:`ListSource`; ``image_key``, ``label_key`` for .npz;
        ``root``, ``min_box_size`` for a COCO .json, see
        :mod:`mmstore.ingest.coco`).
        Class folders can be labelled by an existing mapping so that stores
        agree: ``classes_from`` (a store path: its ``label_names``) or
        ``label_names`` (a text file, one class name per line, line k = label
        k, or a list, or a dict name -> label such as torchvision's
        ``class_to_idx``); a class folder not in the mapping raises
        ``LabelMappingError`` unless ``new_classes="append"`` (ids after the
        mapping's), and the mapping's classes with no folder are listed in
        the result's ``warnings`` (see :mod:`mmstore.ingest.classes`).
        A list's ``tags_column`` (``tags_sep``, ``tag_names``) and
        ``text_column`` give the fields ``tags`` and ``text`` (multi-label
        tags and captions, see :mod:`mmstore.ingest.tags`).

    Returns
    -------
    IngestResult
        Counts, reasons of the skipped inputs, timing; ``summary()`` renders it.

    Raises
    ------
    AllInputsFailedError
        At least one input, and every one failed (no record): the message
        gives the count, the most common reason with its count and an input
        that failed for it. Nothing is published (a store already at DEST,
        replaced with ``overwrite``, is unchanged); ``DEST.partial`` is kept
        with ``errors.jsonl`` listing every failure; rerun with
        ``overwrite=True`` once the inputs are fixed. One of several shards
        is published instead, with a note in ``warnings`` (the merge needs
        its slots; :func:`merge` raises this error when no part holds a
        record). A source with no inputs at all raises
        :class:`~mmstore.errors.IngestError` ("no inputs found"), and
        nothing is created.
    """
    # the decode and source options given (None: not given), by name: the signature lists them
    given = {k: v for k, v in locals().items() if k in _OPTION_NAMES and v is not None}
    spec_kw, src_kw = split_options(given)
    if isinstance(source, Source):
        if src_kw:
            raise TypeError(f"source options {sorted(src_kw)} need a source path, not a Source object")
        src = source
    else:
        src = detect_source(os.fspath(source), **resolve_class_options(src_kw))
    from ..format.codecs import parse_codec_specs

    codec_map = parse_codec_specs(codecs)  # a typo fails here, before the scan
    spec = make_spec(size, **spec_kw)
    if spec is None and not src.decoded:
        raise SourceError(f"{src.path}: encoded images need a target size: pass "
                          f"{spell_option('size=(H, W)', '--size HxW')}")
    return run_ingest(
        src,
        os.fspath(dest),
        spec,
        workers=workers,
        chunk=chunk,
        on_error=on_error,
        max_errors=max_errors,
        resume=resume,
        overwrite=overwrite,
        shard=parse_shard(shard),
        quiet=quiet,
        backend=backend,
        codecs=codec_map,
        progress_interval=progress_interval,
        resume_hint=resume_hint,
    )


def from_dataset(
    ds: Any,
    dest: str | os.PathLike[str],
    size: Any = None,
    *,
    label_names: list[str] | None = None,
    workers: int | None = None,
    fields: Any = None,
    **kwargs: Any,
) -> IngestResult:
    """Freeze a map-style dataset into a store at ``dest``.

    ``ds`` needs ``len(ds)`` and ``ds[i]`` (an ``IterableDataset``, a
    generator or another iterator is refused with a
    :class:`~mmstore.errors.SourceError` that says what to pass); items are numpy arrays, torch
    tensors (``CHW`` 3-D tensors are made ``HWC``), PIL images, ``(image,
    label)`` pairs or ``{"image": ..., "label": ...}`` dicts. Without ``size``
    every image must have the shape and dtype of item 0 and is stored as is
    (only ``image`` and ``label``; a float image stays float, 4 bytes a
    value); with ``size`` each is fitted like a decoded file (``resize``
    policy etc.), stored as ``uint8``, and ``orig_size``/``box``/``dst`` are
    stored too. ``label_names`` defaults to ``ds.classes`` when present.

    Float images with ``size`` (what ``ToTensor()`` gives: a float32 tensor,
    ``CHW``, values in ``[0, 1]``; a numpy float array ``HWC`` or ``CHW``):
    converted to ``uint8`` as ``round(x * 255)`` (ties to even, computed in
    float64, so ``ToTensor()`` of a uint8 image gives back its exact pixels),
    before any resize (see :func:`mmstore.decode.float_to_uint8`). A 3-D
    array is ``CHW`` when its first axis is 1, 3 or 4 and its last is not 1
    to 4. Values outside ``[0, 1]`` (after ``Normalize(mean, std)``), NaN or
    infinity are refused: in the first item (of the shard) before any work
    (``SchemaError``: dtype, min and max found, and what to pass instead),
    in a later item as a hole with that reason. Pass the dataset without its
    ``Normalize`` (normalise batch-wise at training time), or give uint8
    images.

    ``fields``: more fields of dict items, stored as they are, as a schema
    (``{"boxes": ("<f4", (None, 4)), "tokens": ("<i8", (None,)), "caption":
    "str"}``; ragged fields take lists or arrays of any length, also empty).
    An item lacking one, or whose value does not fit (another row shape, a
    lossy cast), becomes a hole whose reason names the field.

    Workers are forked processes that inherit ``ds`` (nothing is pickled);
    pass ``workers=0`` for a dataset that must stay in this process. Other
    keyword arguments are those of :func:`ingest`; when every item fails it
    raises :class:`~mmstore.errors.AllInputsFailedError` as :func:`ingest`
    does.
    """
    src = DatasetSource(ds, label_names=label_names, fields=fields)
    return ingest(src, dest, size, workers=workers, **kwargs)
