"""One-time ingest: turn a folder, a list, an LMDB, arrays or any Dataset into a store.

Library API
-----------
``ingest(source, dest, size=(224, 224), ...)``
    SOURCE is recognised from what it is (see :func:`detect_source`): an image
    folder (flat or ImageFolder), a ``.csv``/``.tsv`` list, an LMDB directory
    of encoded images, a ``.npy``/``.npz`` file, a COCO instances ``.json``
    (images under ``root=``; boxes, categories, polygons: see ``coco.py``),
    WebDataset tar shards named by a pattern (``"shards/{00000..00099}.tar"``,
    a glob; see ``webdataset.py``).
``from_dataset(ds, dest, size=None, ...)``
    Freeze any map-style dataset (items: arrays, tensors, PIL images or
    ``(image, label)``) into a store in one call.
``from_hf(ds, dest, size=None, ...)``
    A Hugging Face ``datasets.Dataset``, read as Arrow (see ``hf.py``);
    Parquet files (img2dataset's, Hugging Face's exports) are a path kind
    (``"data/*.parquet"``, see ``parquet.py``).
``merge(parts, dest)``
    Join the stores written by ``--shard K/N`` jobs into one store.

Stored fields: ``image`` (``|u1``, ``spec.record_shape()``; with
``max_side`` / ``short_side`` each image at its own aspect, ``(None, None,
C)``, and its ``(h, w)`` in ``image_hw`` (``<u4`` ``(2,)``); with
``buckets`` the same, each record at the shape of its bucket), ``label``
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
from .hf import HFSource, hf_options, is_hf_dataset
from .merge import merge
from .options import RUN_DEFAULTS, SOURCE_OPTIONS, SPEC_OPTIONS, ResumeHint, make_spec, parse_shard, split_options
from .parquet import ParquetSource
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
    WebDatasetSource,
    detect_source,
)
from .webdataset import WebDatasetRows

__all__ = [
    "IMAGE_EXTENSIONS",
    "ArraySource",
    "CocoSource",
    "DatasetSource",
    "FolderSource",
    "HFSource",
    "IngestResult",
    "LmdbSource",
    "ListSource",
    "ParquetSource",
    "Source",
    "WebDatasetRows",
    "WebDatasetSource",
    "detect_source",
    "from_dataset",
    "from_hf",
    "ingest",
    "make_spec",
    "merge",
]

_OPTION_NAMES = frozenset(SPEC_OPTIONS) | frozenset(SOURCE_OPTIONS)


def check_source_arg(source: Any, what: str) -> None:
    """Refuse, before any work, a ``source`` that no ingest source takes.

    Raises
    ------
    SourceError
        ``source`` is not a path, a :class:`~mmstore.ingest.Source` or a
        Hugging Face ``datasets.Dataset``.
    """
    if isinstance(source, (str, bytes, os.PathLike, Source)) or is_hf_dataset(source):
        return
    raise SourceError(
        f"{what}: the source is a {type(source).__name__}; it takes a path (a folder, a CSV/TSV list, an LMDB, "
        "a .npy/.npz, a COCO .json, WebDataset .tar shards, Parquet files), a Hugging Face datasets.Dataset or "
        "an mmstore.ingest.Source. A Python dataset (a list, a torch Dataset) is written with "
        "mmstore.from_dataset(dataset, DEST, ...)")


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
    max_side: int | None = None,
    short_side: int | None = None,
    buckets: Any = None,
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
    upscale: bool | None = None,
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
    json_keys: str | Sequence[str] | None = None,
    image_column: str | None = None,
    caption_column: str | None = None,
    columns: str | Sequence[str] | None = None,
) -> IngestResult:
    """Decode SOURCE once into a store at DEST.

    Parameters
    ----------
    source
        A Hugging Face ``datasets.Dataset`` (see :func:`from_hf`), or a path
        (kind recognised by :func:`detect_source`: a folder of images, a
        ``.csv``/``.tsv`` list, an LMDB directory, a ``.npy``/``.npz`` file, a
        COCO ``.json``, WebDataset ``.tar`` shards: one file, a brace pattern
        such as ``"shards/{00000..00099}.tar"`` or a glob) or a :class:`Source`.
    dest
        The store directory to create (work happens in ``DEST.partial``).
    size
        The target size: an ``(H, W)`` pair of positive ints, ``"HxW"``
        (``"224x224"``), or one int ``N`` (or ``"N"``) for ``N x N``; required
        for encoded images, None for arrays stored as they are. Excludes
        ``max_side`` and ``short_side``.
    max_side
        Instead of ``size``: every record keeps its image's own aspect, the
        long side resized to ``N`` (never enlarged unless ``upscale``): an
        image of its own shape, stored with its size in the field
        ``image_hw`` (format 2.3; "Aspect kept" in :mod:`mmstore.decode`).
    short_side
        Instead of ``size``: as ``max_side``, the short side becomes ``N``
        (LAION's convention).
    buckets
        Instead of ``size``: aspect buckets. A list of ``(h, w)`` shapes
        (``[(256, 256), (192, 320), (320, 192)]``, or the text
        ``"256x256,192x320,320x192"``), or ``"auto"`` / ``"auto:N"``: up to 9
        shapes of about ``N x N`` pixels (``auto``: 256) chosen from the
        aspects of the inputs, read from their headers in a first pass. Each
        image goes to the bucket nearest its aspect, is resized to cover it
        and centre-cropped by the least amount; the crop is in ``box`` /
        ``dst``. Stored as an image of its own shape whose schema lists the
        buckets (format 2.3; "Aspect buckets" in :mod:`mmstore.decode`).
    workers
        Decoder processes; None: the usable CPU cores; 0: decode in this
        process.
    on_error
        ``"skip"``: a bad input becomes a hole, listed with its reason in
        ``errors.jsonl``; ``"fail"``: stop at the first.
    max_errors
        Stop once more inputs than this failed: a count ``N`` or a share
        ``"P%"``; None: no limit. A stopped run keeps ``DEST.partial``.
    resume
        Continue ``DEST.partial`` if present (refused when inputs or
        parameters differ: ``ResumeMismatchError``, naming each change).
    overwrite
        Replace ``DEST`` if it is an mmstore store (and discard a
        ``DEST.partial`` of an earlier run); anything else at ``DEST``, or a
        ``DEST`` that is, contains or lies inside the source, is refused.
    shard
        ``(K, N)`` or ``"K/N"``: ingest only the K-th (from 0) of N contiguous
        parts of the sorted inputs; ``"auto"``: K and N from the launcher
        (see :func:`mmstore.ingest.options.shard_from_env`). Join the parts
        with :func:`merge`.
    quiet
        Show no progress on stderr (a bar on a terminal, else a line every
        ``progress_interval`` seconds).
    backend
        The store's backend: ``"memmap"`` (one ``.npy`` per field) or
        ``"lmdb"``.
    codecs
        How fields are stored: ``{"image": "jpeg:90"}`` or ``["image=jpeg:90"]``
        (CLI: ``--codec image=jpeg:90``, repeatable); see :mod:`mmstore.format.codecs`.
        None: every field raw. Entries are encoded in the workers from the
        decoded, resized pixels (the geometry ``raw`` would store); a codec
        that does not fit its field is refused before any work.
    chunk
        Inputs handed to a worker at a time; None: chosen by the run (about
        32 MB of records, at least 16 chunks per worker). The records do not
        depend on it.
    progress_interval
        Seconds between two progress lines when stderr is not a terminal.
    resume_hint
        How a stopped run's message says to resume: a text, or a function
        of the options the resume must change (``{}``, or after a
        ``max_errors`` stop a raised limit such as ``{"max_errors": "10"}``)
        that returns it (the command line gives its resume command). None:
        "rerun the same ingest with ``resume=True``".
    resize
        How a source becomes the target size: ``"center-crop"``,
        ``"stretch"``, ``"pad"`` or ``"none"`` (the exact arithmetic: "Resize,
        crop and decode" in the concepts, :mod:`mmstore.decode`). None:
        ``"center-crop"``.
    channels
        Output channels, 1 or 3. None: 3.
    layout
        Record layout, ``"hwc"`` or ``"chw"``. None: ``"hwc"``.
    bgr
        Store BGR instead of RGB. None: False.
    interp_up
        Kernel when an axis is enlarged, ``"linear"`` or ``"cubic"``
        (shrinking uses ``INTER_AREA``). None: ``"linear"``.
    pad_value
        The fill (0-255, every channel) of ``resize="pad"``. None: 0.
    fast_decode
        Let libjpeg decode at 1/2, 1/4 or 1/8 scale when the target is small
        enough (faster; pixels differ from the exact path). None: False.
    max_pixels
        Refuse a source with more pixels than this (read from its header
        before decoding); 0: no limit. None: 178,956,970 (Pillow's limit).
    strict_jpeg
        Refuse a JPEG whose scan data libjpeg reports as corrupt. None: True.
    alpha
        What a transparent source becomes: ``"black"`` (composited over
        black), ``"white"``, or ``"drop"`` (the alpha ignored, as Pillow's
        ``convert("RGB")``). None: ``"black"``.
    upscale
        With ``max_side`` / ``short_side``: also enlarge an image whose side
        is below ``N`` (default False: it keeps its own size).
    labels
        A folder: ``"folders"`` (class sub-folders give the labels),
        ``"none"``, or ``"auto"`` (decided from the layout). None: ``"auto"``.
    root
        A list or a COCO ``.json``: the directory relative paths start from
        (default: the list's directory).
    path_column
        A list: the column (name or 0-based index) of the path or id.
    label_column
        A list: the column of the label (default: ``"label"`` if present;
        ``""`` for none).
    path_template
        A list: an id to a relative path, e.g. ``"{id[0]}/{id[1]}/{id}.jpg"``.
    delimiter
        A list: the field separator (default: a tab for ``.tsv``, else a
        comma).
    header
        A list: whether the first row is a header (default: a header unless
        its path cell is a file).
    label_type
        A list: ``"auto"``, ``"int"`` or ``"names"``, see :class:`ListSource`.
    missing_label
        A list: a blank label cell makes its input a hole (``"error"``, the
        default) or a class of its own (``"class"``).
    image_key
        A ``.npz``: the name of the image array.
    label_key
        A ``.npz``: the name of the label array.
    classes_from
        A folder or a list of class names: label the classes by the class ->
        id mapping of an existing store (its ``label_names``), so that both
        stores agree (see :mod:`mmstore.ingest.classes`).
    label_names
        As ``classes_from``, from a mapping: a text file of one class name per
        line (line k, from 0, is label k), a list, or a dict name -> label
        such as torchvision's ``class_to_idx``.
    new_classes
        With ``classes_from`` or ``label_names``: a class not in the mapping
        raises ``LabelMappingError`` (``"error"``, the default) or gets the
        next ids after the mapping's (``"append"``); the mapping's classes
        with no folder are listed in the result's ``warnings``.
    min_box_size
        A COCO ``.json``: drop a box narrower or lower than this many stored
        pixels once clipped to the picture (default 1; see
        :mod:`mmstore.ingest.coco`).
    tags_column
        A list: the column of multi-label tags (``cat;animal``), stored as the
        ragged field ``tags`` (see :mod:`mmstore.ingest.tags`).
    tags_sep
        A list: the separator of the tags in a cell (default ``";"``).
    text_column
        A list: the column of a caption, stored as the str field ``text``.
    tag_names
        A list: number the tags by a store's tag names or a file of one tag
        per line, so that two stores give a tag the same id.
    json_keys
        WebDataset shards: keys of each sample's ``.json`` stored as fields
        (``"width,height,similarity"`` or a list; numbers numeric, strings
        text; a sample lacking one is a hole, see
        :mod:`mmstore.ingest.webdataset`).
    image_column
        Parquet files, a Hugging Face dataset: the column of the images
        (encoded bytes, a ``{bytes, path}`` struct or a path; default: the
        ``Image`` column, else ``jpg``, ``png``, ``webp`` or ``image``; see
        :mod:`mmstore.ingest.parquet`).
    caption_column
        Parquet files, a Hugging Face dataset: a string column stored in the
        str field ``text``.
    columns
        Parquet files, a Hugging Face dataset: more columns stored as fields
        of their name (``"similarity,width"`` or a list; numbers, booleans,
        strings, lists of numbers). ``label_column`` and ``root`` apply to
        these sources too.

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
    check_source_arg(source, "ingest")
    src: Source
    if is_hf_dataset(source):
        src = HFSource(source, **hf_options(src_kw))
    elif isinstance(source, Source):
        if src_kw:
            raise TypeError(f"source options {sorted(src_kw)} need a source path, not a Source object")
        src = source
    else:
        src = detect_source(os.fspath(source), **resolve_class_options(src_kw))
    from ..format.codecs import parse_codec_specs

    codec_map = parse_codec_specs(codecs)  # a typo fails here, before the scan
    spec = make_spec(size, max_side=max_side, short_side=short_side, buckets=buckets, **spec_kw)
    if spec is None and not src.decoded:
        raise SourceError(f"{src.path}: encoded images need a target size: pass "
                          f"{spell_option('size=(H, W)', '--size HxW')} (or "
                          f"{spell_option('size=N', '--size N')} for N x N), or "
                          f"{spell_option('max_side=N', '--max-side N')} to keep each image's own aspect")
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
    stored too; with ``max_side=N`` (or ``short_side=N``) instead of
    ``size`` each keeps its own aspect, with ``buckets`` each goes to its
    aspect bucket (see :func:`ingest`). ``label_names`` defaults to ``ds.classes`` when present.

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


def from_hf(
    ds: Any,
    dest: str | os.PathLike[str],
    size: Any = None,
    *,
    image_column: str | None = None,
    caption_column: str | None = None,
    label_column: str | None = None,
    columns: str | Sequence[str] | None = None,
    **kwargs: Any,
) -> IngestResult:
    """Decode a Hugging Face ``datasets.Dataset`` once into a store at ``dest``.

    The rows are read as Arrow (never decoded to PIL images by the
    dataset): an ``Image`` column's bytes (or the files its paths name) are
    decoded by the same rules as the files of a folder, at ``size`` (or
    ``max_side``, ``short_side``, ``buckets``: see :func:`ingest`). Input
    ``i`` is ``ds[i]``, its key ``"i"``.

    Parameters
    ----------
    ds
        A ``datasets.Dataset`` (one split; a ``DatasetDict`` is refused with
        the splits it holds). Needs ``pip install 'mmstore[hf]'``.
    dest
        The store directory to create.
    size
        The target size, as for :func:`ingest`.
    image_column
        The column of the images; default: the first ``Image`` feature.
    caption_column
        A string column stored in the str field ``text``.
    label_column
        The label column; default: the first ``ClassLabel`` feature, whose
        names become the store's ``label_names``; ``""``: no labels. A
        string column is numbered by its sorted names.
    columns
        More columns stored as fields of their name (numbers, booleans,
        strings, lists of numbers).
    **kwargs
        The other keyword options of :func:`ingest` (``workers``,
        ``resume``, ``codecs``, decode options ...), and ``root``: the
        directory that relative image paths start from.

    Returns
    -------
    IngestResult
        As :func:`ingest`'s. A null image or value, or a corrupt image, is a
        hole listed with its row in ``errors.jsonl`` (see
        :mod:`mmstore.ingest.hf`).
    """
    src = HFSource(ds, image_column=image_column, caption_column=caption_column, label_column=label_column,
                   columns=columns, root=kwargs.pop("root", None))
    return ingest(src, dest, size, **kwargs)
